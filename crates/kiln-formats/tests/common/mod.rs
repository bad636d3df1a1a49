//! Helpers shared by kiln-formats' integration tests: the real models, the
//! committed fixtures, a tiny GGUF writer and an in-memory weight source.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_formats::{FormatError, GgmlType, HostTensor, Result, StoredTensor, WeightSource};

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A real model fetched by `scripts/fetch-models.sh`. Tests never skip when
/// it is missing: they fail and say how to get it.
pub fn model_path(file: &str) -> PathBuf {
    let p = repo_root().join("models").join(file);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch-models.sh from the workspace root first",
        p.display()
    );
    p
}

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn read_f32_le(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The GGML type with this name (`Q4_K`, `BF16`, ...).
pub fn ggml_type(name: &str) -> GgmlType {
    (0..64)
        .filter_map(GgmlType::from_u32)
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("no GGML type named {name}"))
}

/// Assert `result` is an error whose message contains every needle.
#[track_caller]
pub fn expect_err<T: std::fmt::Debug>(result: Result<T>, needles: &[&str]) -> FormatError {
    let err = result.expect_err("expected an error");
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not contain {n:?}");
    }
    err
}

/// GGUF metadata value types, as the format numbers them.
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    StrArray(Vec<String>),
    /// Any type id with raw payload bytes, for malformed files.
    Raw(u32, Vec<u8>),
}

pub struct GgufTensor {
    pub name: String,
    pub ne: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
}

/// A minimal GGUF writer: header, metadata, tensor infos, aligned data.
pub struct GgufBuilder {
    pub magic: [u8; 4],
    pub version: u32,
    pub meta: Vec<(String, Meta)>,
    pub tensors: Vec<GgufTensor>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufBuilder {
    pub fn new() -> Self {
        GgufBuilder {
            magic: *b"GGUF",
            version: 3,
            meta: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// A `llama` file with 2 heads and the given tensors' metadata.
    pub fn llama() -> Self {
        let mut b = Self::new();
        b.meta("general.architecture", Meta::Str("llama".into()));
        b.meta("llama.attention.head_count", Meta::U32(2));
        b.meta("llama.attention.head_count_kv", Meta::U32(1));
        b
    }

    pub fn meta(&mut self, key: &str, v: Meta) -> &mut Self {
        self.meta.push((key.to_string(), v));
        self
    }

    pub fn tensor(&mut self, name: &str, ne: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensor_raw(name, ne, ty.to_u32(), data)
    }

    pub fn tensor_raw(&mut self, name: &str, ne: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push(GgufTensor {
            name: name.to_string(),
            ne: ne.to_vec(),
            ggml_type: ty,
            data,
        });
        self
    }

    /// An f32 tensor; `ne` lists the fastest dimension first, as GGUF does.
    pub fn f32_tensor(&mut self, name: &str, ne: &[u64], values: &[f32]) -> &mut Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, ne, GgmlType::F32, data)
    }

    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(self.magic);
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.meta.len() as u64).to_le_bytes());
        for (key, v) in &self.meta {
            put_str(&mut out, key);
            match v {
                Meta::U32(x) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Meta::F32(x) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(x.to_le_bytes());
                }
                Meta::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Meta::StrArray(a) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((a.len() as u64).to_le_bytes());
                    for s in a {
                        put_str(&mut out, s);
                    }
                }
                Meta::Raw(ty, bytes) => {
                    out.extend(ty.to_le_bytes());
                    out.extend(bytes);
                }
            }
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).next_multiple_of(32);
        }
        out.resize(out.len().next_multiple_of(32), 0);
        let data_start = out.len();
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off as usize, 0);
            out.extend(&t.data);
        }
        out
    }

    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.build()).unwrap();
        p
    }
}

/// Tensors held in memory, as a [`WeightSource`] for the writers.
pub struct MemWeights {
    pub path: PathBuf,
    pub tensors: BTreeMap<String, HostTensor>,
}

impl MemWeights {
    pub fn new(tensors: Vec<(&str, HostTensor)>) -> Self {
        MemWeights {
            path: PathBuf::from("<memory>"),
            tensors: tensors
                .into_iter()
                .map(|(n, t)| (n.to_string(), t))
                .collect(),
        }
    }
}

impl WeightSource for MemWeights {
    fn path(&self) -> &Path {
        &self.path
    }

    fn tensors(&self) -> Vec<StoredTensor> {
        self.tensors
            .iter()
            .map(|(n, t)| StoredTensor {
                name: n.clone(),
                shape: t.shape.clone(),
                dtype: "F32".into(),
                num_bytes: 4 * t.data.len() as u64,
            })
            .collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn load_f32(&self, name: &str) -> Result<HostTensor> {
        self.tensors
            .get(name)
            .cloned()
            .ok_or_else(|| FormatError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })
    }
}

/// Deterministic pseudo-random f32 values (SplitMix64), spanning signs and
/// magnitudes, for tensors whose exact values matter only for comparison.
pub fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let unit = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let exp = ((z >> 8) % 16) as i32 - 8;
            (unit - 0.5) * 2f32.powi(exp)
        })
        .collect()
}
