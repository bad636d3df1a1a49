//! Writing safetensors files and Hugging Face model directories.
//!
//! Files are written to a temporary name in the target directory and renamed
//! into place, so a reader never sees a half-written file. A model directory
//! is written tensor by tensor: each tensor is loaded from its
//! [`WeightSource`], encoded and written before the next is loaded, so memory
//! holds one tensor at a time, not the model.

use std::borrow::Borrow;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use serde_json::{json, Map, Value};

use crate::error::{FormatError, Result};
use crate::safetensors_dir::{
    CONFIG_FILE, GENERATION_CONFIG_FILE, SINGLE_WEIGHTS_FILE, WEIGHTS_INDEX_FILE,
};
use crate::weights::{HostTensor, WeightSource};

/// The float types Kiln writes (and converts from when reading).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SafetensorsDtype {
    F32,
    F16,
    BF16,
}

impl SafetensorsDtype {
    /// The name in a safetensors header.
    pub fn name(self) -> &'static str {
        match self {
            SafetensorsDtype::F32 => "F32",
            SafetensorsDtype::F16 => "F16",
            SafetensorsDtype::BF16 => "BF16",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "F32" => Some(SafetensorsDtype::F32),
            "F16" => Some(SafetensorsDtype::F16),
            "BF16" => Some(SafetensorsDtype::BF16),
            _ => None,
        }
    }

    /// The name in `config.json`'s `torch_dtype`.
    pub fn torch_name(self) -> &'static str {
        match self {
            SafetensorsDtype::F32 => "float32",
            SafetensorsDtype::F16 => "float16",
            SafetensorsDtype::BF16 => "bfloat16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            SafetensorsDtype::F32 => 4,
            SafetensorsDtype::F16 | SafetensorsDtype::BF16 => 2,
        }
    }

    /// Append `xs` in this dtype, little-endian, rounding to nearest even.
    fn encode(self, xs: &[f32], out: &mut Vec<u8>) {
        match self {
            SafetensorsDtype::F32 => out.extend(xs.iter().flat_map(|x| x.to_le_bytes())),
            SafetensorsDtype::F16 => {
                out.extend(xs.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()))
            }
            SafetensorsDtype::BF16 => {
                out.extend(xs.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()))
            }
        }
    }
}

/// Shard size above which [`write_hf_dir`] starts a new file.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 2 << 30;

/// A tensor to be written: its name and the shape its data must have.
#[derive(Debug, Clone)]
struct Planned {
    name: String,
    shape: Vec<usize>,
}

impl Planned {
    fn num_bytes(&self, dtype: SafetensorsDtype) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
    }
}

/// Write `tensors` to one safetensors file at `path`, converted to `dtype`.
pub fn write_safetensors(
    path: impl AsRef<Path>,
    tensors: &[(String, &HostTensor)],
    dtype: SafetensorsDtype,
) -> Result<()> {
    let path = path.as_ref();
    let mut planned: Vec<Planned> = tensors
        .iter()
        .map(|(name, t)| Planned {
            name: name.clone(),
            shape: t.shape.clone(),
        })
        .collect();
    planned.sort_by(|a, b| a.name.cmp(&b.name));
    let by_name: std::collections::BTreeMap<&str, &HostTensor> =
        tensors.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    if by_name.len() != tensors.len() {
        let dup = planned
            .windows(2)
            .find(|w| w[0].name == w[1].name)
            .map(|w| w[0].name.clone())
            .unwrap_or_default();
        return Err(FormatError::Invalid {
            path: path.to_path_buf(),
            what: format!("tensor {dup} is given twice"),
        });
    }
    write_file(path, &planned, dtype, |p| Ok(by_name[p.name.as_str()]))
}

/// How [`write_hf_dir_with`] writes a directory.
#[derive(Clone, Copy)]
pub struct HfDirOptions<'a> {
    pub dtype: SafetensorsDtype,
    /// A new shard starts when the next tensor would take the current one past
    /// this many bytes; a single larger tensor gets a shard of its own.
    pub max_shard_bytes: u64,
    /// Write only the tensors whose Hugging Face name passes; all when `None`.
    pub filter: Option<&'a dyn Fn(&str) -> bool>,
}

impl HfDirOptions<'_> {
    pub fn new(dtype: SafetensorsDtype) -> Self {
        HfDirOptions {
            dtype,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            filter: None,
        }
    }
}

/// Write a Hugging Face model directory from `weights`: `config.json`,
/// `generation_config.json` when given, and the weights in `dtype`, sharded
/// over [`DEFAULT_MAX_SHARD_BYTES`]. Returns the weight files written.
pub fn write_hf_dir(
    dir: impl AsRef<Path>,
    config: &Value,
    generation_config: Option<&Value>,
    weights: &dyn WeightSource,
    dtype: SafetensorsDtype,
) -> Result<Vec<PathBuf>> {
    write_hf_dir_with(
        dir,
        config,
        generation_config,
        weights,
        &HfDirOptions::new(dtype),
    )
}

/// [`write_hf_dir`] with a shard size and a tensor filter.
///
/// `lm_head.weight` is left out when `config` says `tie_word_embeddings`.
/// `config.json` gets `torch_dtype` set to the dtype written, and is written
/// last, so its presence marks a complete directory. A stale
/// `model.safetensors` (when sharding) or index (when not) is removed, since a
/// reader would otherwise pick it.
pub fn write_hf_dir_with(
    dir: impl AsRef<Path>,
    config: &Value,
    generation_config: Option<&Value>,
    weights: &dyn WeightSource,
    opts: &HfDirOptions<'_>,
) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|e| FormatError::io(dir, e))?;
    let tied = config.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true);
    let planned: Vec<Planned> = weights
        .tensors()
        .into_iter()
        .filter(|t| !(tied && t.name == "lm_head.weight"))
        .filter(|t| opts.filter.is_none_or(|f| f(&t.name)))
        .map(|t| Planned {
            name: t.name,
            shape: t.shape,
        })
        .collect();

    // Group into shards in the source's order (embeddings, then layer by layer).
    let mut shards: Vec<Vec<Planned>> = Vec::new();
    let mut shard_bytes = 0u64;
    let mut total_bytes = 0u64;
    for p in planned {
        let bytes = p
            .num_bytes(opts.dtype)
            .ok_or_else(|| FormatError::Invalid {
                path: weights.path().to_path_buf(),
                what: format!("tensor {}: shape {:?} overflows", p.name, p.shape),
            })?;
        total_bytes = total_bytes.saturating_add(bytes);
        match shards.last_mut() {
            Some(current) if shard_bytes.saturating_add(bytes) <= opts.max_shard_bytes => {
                current.push(p);
                shard_bytes += bytes;
            }
            _ => {
                shards.push(vec![p]);
                shard_bytes = bytes;
            }
        }
    }
    if shards.is_empty() {
        shards.push(Vec::new());
    }

    let n = shards.len();
    let mut files = Vec::with_capacity(n);
    let mut weight_map = Map::new();
    for (i, mut shard) in shards.into_iter().enumerate() {
        let file_name = if n == 1 {
            SINGLE_WEIGHTS_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        shard.sort_by(|a, b| a.name.cmp(&b.name));
        let path = dir.join(&file_name);
        write_file(&path, &shard, opts.dtype, |p| weights.load_f32(&p.name))?;
        for p in &shard {
            weight_map.insert(p.name.clone(), json!(file_name));
        }
        files.push(path);
    }
    let index_path = dir.join(WEIGHTS_INDEX_FILE);
    if n == 1 {
        remove_if_present(&index_path)?;
    } else {
        let index = json!({
            "metadata": {"total_size": total_bytes},
            "weight_map": weight_map,
        });
        write_json(&index_path, &index)?;
        remove_if_present(&dir.join(SINGLE_WEIGHTS_FILE))?;
    }
    if let Some(g) = generation_config {
        write_json(&dir.join(GENERATION_CONFIG_FILE), g)?;
    }
    let mut config = config.clone();
    if let Some(obj) = config.as_object_mut() {
        obj.insert("torch_dtype".into(), json!(opts.dtype.torch_name()));
    }
    write_json(&dir.join(CONFIG_FILE), &config)?;
    Ok(files)
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(FormatError::io(path, e)),
        _ => Ok(()),
    }
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let mut bytes =
        serde_json::to_vec_pretty(value).expect("a Value always serializes; this is a bug");
    bytes.push(b'\n');
    write_atomic(path, |w| {
        w.write_all(&bytes).map_err(|e| FormatError::io(path, e))
    })
}

/// Write through `fill` into a temporary file beside `path`, then rename it
/// into place. The temporary file is removed on error.
fn write_atomic(path: &Path, fill: impl FnOnce(&mut BufWriter<File>) -> Result<()>) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let file_name =
        path.file_name()
            .and_then(|f| f.to_str())
            .ok_or_else(|| FormatError::Invalid {
                path: path.to_path_buf(),
                what: "not a file path".into(),
            })?;
    let tmp = path.with_file_name(format!(
        ".{file_name}.tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let file = File::create(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        fill(&mut w)?;
        let file = w
            .into_inner()
            .map_err(|e| FormatError::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| FormatError::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| FormatError::io(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Write one safetensors file holding `planned` (sorted by name), fetching
/// each tensor's data through `load` just before it is written.
fn write_file<T: Borrow<HostTensor>>(
    path: &Path,
    planned: &[Planned],
    dtype: SafetensorsDtype,
    mut load: impl FnMut(&Planned) -> Result<T>,
) -> Result<()> {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for p in planned {
        let bytes = p.num_bytes(dtype).ok_or_else(|| FormatError::Invalid {
            path: path.to_path_buf(),
            what: format!("tensor {}: shape {:?} overflows", p.name, p.shape),
        })?;
        header.insert(
            p.name.clone(),
            json!({"dtype": dtype.name(), "shape": p.shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut header = serde_json::to_vec(&Value::Object(header))
        .expect("a Value always serializes; this is a bug");
    // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
    header.resize(header.len().next_multiple_of(8), b' ');

    write_atomic(path, |w| {
        let io = |e| FormatError::io(path, e);
        w.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&header).map_err(io)?;
        let mut buf = Vec::new();
        for p in planned {
            let tensor = load(p)?;
            let tensor = tensor.borrow();
            if tensor.shape != p.shape {
                return Err(FormatError::ShapeMismatch {
                    path: path.to_path_buf(),
                    tensor: p.name.clone(),
                    found: tensor.shape.clone(),
                    expected: p.shape.clone(),
                });
            }
            let n: usize = p.shape.iter().product();
            if tensor.data.len() != n {
                return Err(FormatError::Invalid {
                    path: path.to_path_buf(),
                    what: format!(
                        "tensor {}: shape {:?} holds {n} elements, but the data has {}",
                        p.name,
                        p.shape,
                        tensor.data.len()
                    ),
                });
            }
            for chunk in tensor.data.chunks(1 << 16) {
                buf.clear();
                dtype.encode(chunk, &mut buf);
                w.write_all(&buf).map_err(io)?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_padded_sorted_and_offsets_contiguous() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a = HostTensor::new(vec![3], vec![1.0, 2.0, 3.0]);
        let b = HostTensor::new(vec![1, 2], vec![4.0, 5.0]);
        write_safetensors(
            &path,
            &[("b".to_string(), &b), ("a".to_string(), &a)],
            SafetensorsDtype::BF16,
        )
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(header["__metadata__"]["format"], "pt");
        assert_eq!(header["a"]["data_offsets"], json!([0, 6]));
        assert_eq!(header["b"]["data_offsets"], json!([6, 10]));
        assert_eq!(header["b"]["shape"], json!([1, 2]));
        assert_eq!(bytes.len(), 8 + n + 10);
        // bf16(1.0) = 0x3F80, little-endian.
        assert_eq!(&bytes[8 + n..8 + n + 2], &[0x80, 0x3F]);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn inconsistent_tensor_is_an_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let bad = HostTensor {
            shape: vec![2, 2],
            data: vec![1.0; 3],
        };
        let err = write_safetensors(&path, &[("w".into(), &bad)], SafetensorsDtype::F32)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor w") && err.contains("4 elements"),
            "{err}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

        let ok = HostTensor::new(vec![1], vec![0.0]);
        let err = write_safetensors(
            &path,
            &[("w".into(), &ok), ("w".into(), &ok)],
            SafetensorsDtype::F32,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("tensor w is given twice"), "{err}");
    }
}
