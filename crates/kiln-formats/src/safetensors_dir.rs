//! A Hugging Face model directory: `config.json`, an optional
//! `generation_config.json`, and the weights in `model.safetensors` or in the
//! shards that `model.safetensors.index.json` lists.
//!
//! Every weight file is memory-mapped and its header validated at open: each
//! tensor's byte span lies inside the file and, for dtypes of known size,
//! equals the dtype size times the element count. So a truncated or corrupt
//! file gives a [`FormatError`] naming the file and tensor, never a panic, and
//! [`SafetensorsDir::load_f32`](WeightSource::load_f32) can slice without
//! further checks.
//!
//! A multimodal checkpoint (a `config.json` with a `text_config`, such as
//! `Gemma3ForConditionalGeneration` or `Gemma4ForConditionalGeneration`) is
//! read as its text decoder: [`SafetensorsDir::config`] is the text config
//! (with the wrapper's token ids and tying where it has none of its own) and
//! the tensors are the language model's, named as the causal-LM class names
//! them (`model.language_model.X` and `language_model.model.X` as `model.X`,
//! `language_model.lm_head.X` as `lm_head.X`); the vision and audio towers
//! are left out.
//!
//! The safetensors layout: an 8-byte little-endian header length `n`, `n`
//! bytes of JSON mapping each tensor name to `{dtype, shape, data_offsets}`
//! (offsets relative to the end of the header), an optional `__metadata__`
//! entry, then the data.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use kiln_quant::{QuantFormat, QuantMatrix, SharedBytes};
use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::Value;

use crate::error::{FormatError, Result};
use crate::safetensors_write::SafetensorsDtype;
use crate::weights::{HostTensor, StoredTensor, WeightSource};

pub const CONFIG_FILE: &str = "config.json";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// The largest header we accept (the safetensors crate uses the same limit).
const MAX_HEADER_LEN: u64 = 100_000_000;

/// Bytes per element of a safetensors dtype, where the element is whole bytes.
fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        _ => return None,
    })
}

/// A quantized checkpoint's scheme, the matrices it makes (`X.weight` →
/// `[out, in]`) and the stored parts they hide.
struct Quantized {
    scheme: crate::quantized_st::Scheme,
    logical: BTreeMap<String, Vec<usize>>,
    hidden: std::collections::BTreeSet<String>,
}

/// One tensor of a weight file, with absolute byte offsets into its mapping.
#[derive(Debug, Clone)]
struct Entry {
    shard_idx: usize,
    dtype: String,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    mmap: Arc<Mmap>,
}

/// An open Hugging Face model directory.
pub struct SafetensorsDir {
    dir: PathBuf,
    config: Value,
    generation_config: Option<Value>,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, Entry>,
    /// `quantization_config`'s matrices, read dequantized.
    quant: Option<Quantized>,
}

impl std::fmt::Debug for SafetensorsDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsDir")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl SafetensorsDir {
    /// Open a model directory. `model.safetensors` is preferred when both it
    /// and an index exist, as transformers does.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config = read_json(&dir.join(CONFIG_FILE))?;
        if !config.is_object() {
            return Err(FormatError::Invalid {
                path: dir.join(CONFIG_FILE),
                what: "expected a JSON object".into(),
            });
        }
        let gen_path = dir.join(GENERATION_CONFIG_FILE);
        let generation_config = if gen_path.is_file() {
            Some(read_json(&gen_path)?)
        } else {
            None
        };
        let single = dir.join(SINGLE_WEIGHTS_FILE);
        let index = dir.join(WEIGHTS_INDEX_FILE);
        let (shards, tensors) = if single.is_file() {
            open_single(single)?
        } else if index.is_file() {
            open_sharded(&dir, &index)?
        } else {
            return Err(FormatError::Invalid {
                path: dir,
                what: format!("no {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}"),
            });
        };
        // A base-model checkpoint (`Gemma3TextModel`, as EmbeddingGemma
        // ships) names its tensors without the `model.` prefix the
        // causal-LM classes add; Kiln addresses weights by the latter.
        let (config, tensors) = match text_decoder(&config) {
            Some(text) => (text, language_model_tensors(tensors)),
            None => (config, tensors),
        };
        let tensors = if tensors.contains_key("embed_tokens.weight")
            && !tensors.keys().any(|k| k.starts_with("model."))
        {
            tensors
                .into_iter()
                .map(|(k, e)| (format!("model.{k}"), e))
                .collect()
        } else {
            tensors
        };
        let quant = match crate::quantized_st::scheme(&config) {
            Ok(None) => None,
            Ok(Some(scheme)) => {
                let shapes = tensors
                    .iter()
                    .map(|(k, e)| (k.clone(), (e.dtype.clone(), e.shape.clone())))
                    .collect();
                let (logical, hidden) = crate::quantized_st::logical(&scheme, &shapes);
                Some(Quantized {
                    scheme,
                    logical,
                    hidden,
                })
            }
            Err(what) => {
                return Err(FormatError::Invalid {
                    path: dir.join(CONFIG_FILE),
                    what: format!("quantization_config: Kiln does not read {what}"),
                })
            }
        };
        Ok(SafetensorsDir {
            dir,
            config,
            generation_config,
            shards,
            tensors,
            quant,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`.
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// `generation_config.json`, when the directory has one.
    pub fn generation_config(&self) -> Option<&Value> {
        self.generation_config.as_ref()
    }

    /// The weight files, in the order they were opened.
    pub fn weight_files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).map_err(|e| FormatError::io(path, e))?;
    serde_json::from_slice(&bytes).map_err(|source| FormatError::Json {
        path: path.to_path_buf(),
        source,
    })
}

fn map_file(path: &Path) -> std::io::Result<Mmap> {
    let file = File::open(path)?;
    // SAFETY: the map is read-only; Kiln never writes model files it has open.
    unsafe { Mmap::map(&file) }
}

/// The text decoder's config of a multimodal wrapper (`text_config`),
/// completed from the wrapper's keys it lacks (token ids, tying).
fn text_decoder(config: &Value) -> Option<Value> {
    let mut text = config.get("text_config")?.as_object()?.clone();
    text.get("model_type")?.as_str()?;
    for key in [
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ] {
        if let Some(v) = config.get(key) {
            text.entry(key).or_insert_with(|| v.clone());
        }
    }
    Some(Value::Object(text))
}

/// A multimodal checkpoint's language-model tensors under the causal-LM
/// names; every other tensor (vision and audio towers, projectors) dropped.
fn language_model_tensors(tensors: BTreeMap<String, Entry>) -> BTreeMap<String, Entry> {
    tensors
        .into_iter()
        .filter_map(|(k, e)| {
            let name = if let Some(rest) = k.strip_prefix("model.language_model.") {
                format!("model.{rest}")
            } else if let Some(rest) = k.strip_prefix("language_model.model.") {
                format!("model.{rest}")
            } else if let Some(rest) = k.strip_prefix("language_model.lm_head.") {
                format!("lm_head.{rest}")
            } else if k.starts_with("lm_head.") {
                k
            } else {
                return None;
            };
            Some((name, e))
        })
        .collect()
}

type Opened = (Vec<Shard>, BTreeMap<String, Entry>);

fn open_single(path: PathBuf) -> Result<Opened> {
    let mmap = map_file(&path).map_err(|e| FormatError::io(&path, e))?;
    let tensors = parse_header(&path, &mmap, 0)?.into_iter().collect();
    Ok((
        vec![Shard {
            path,
            mmap: Arc::new(mmap),
        }],
        tensors,
    ))
}

fn open_sharded(dir: &Path, index: &Path) -> Result<Opened> {
    let value = read_json(index)?;
    let invalid = |what: String| FormatError::Invalid {
        path: index.to_path_buf(),
        what,
    };
    let weight_map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("no \"weight_map\" object".into()))?;
    // Shard file name -> tensors the index places there.
    let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (name, file) in weight_map {
        let file = file
            .as_str()
            .ok_or_else(|| invalid(format!("weight_map[{name:?}] is not a file name")))?;
        let plain = Path::new(file).file_name().and_then(|f| f.to_str()) == Some(file);
        if !plain || file == ".." || file == "." {
            return Err(invalid(format!(
                "weight_map[{name:?}] = {file:?} is not a plain file name in the directory"
            )));
        }
        by_file.entry(file).or_default().push(name);
    }
    let mut shards = Vec::with_capacity(by_file.len());
    let mut tensors = BTreeMap::new();
    for (file, names) in by_file {
        let path = dir.join(file);
        let mmap = map_file(&path).map_err(|source| FormatError::MissingShard {
            index: index.to_path_buf(),
            shard: path.clone(),
            tensor: names[0].to_string(),
            source,
        })?;
        let mut in_file: BTreeMap<String, Entry> = parse_header(&path, &mmap, shards.len())?
            .into_iter()
            .collect();
        for name in names {
            let entry = in_file
                .remove(name)
                .ok_or_else(|| FormatError::MissingTensor {
                    path: path.clone(),
                    tensor: format!("{name} (listed in {WEIGHTS_INDEX_FILE})"),
                })?;
            tensors.insert(name.to_string(), entry);
        }
        shards.push(Shard {
            path,
            mmap: Arc::new(mmap),
        });
    }
    Ok((shards, tensors))
}

/// Parse and validate one file's header against the file's length.
fn parse_header(path: &Path, buf: &[u8], shard_idx: usize) -> Result<Vec<(String, Entry)>> {
    let corrupt = |offset: u64, what: String| FormatError::Corrupt {
        path: path.to_path_buf(),
        offset,
        what,
    };
    let file_len = buf.len() as u64;
    let Some(len_bytes) = buf.get(..8) else {
        return Err(corrupt(
            0,
            format!("file is {file_len} bytes, too short for the 8-byte header length"),
        ));
    };
    let header_len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes; this is a bug"));
    if header_len > MAX_HEADER_LEN {
        return Err(corrupt(
            0,
            format!("header length {header_len} exceeds the limit of {MAX_HEADER_LEN} bytes"),
        ));
    }
    let header_end = 8 + header_len;
    if header_end > file_len {
        return Err(corrupt(
            8,
            format!(
                "header of {header_len} bytes runs past the end of the file ({file_len} bytes): truncated?"
            ),
        ));
    }
    let header = &buf[8..header_end as usize];
    let map: serde_json::Map<String, Value> = serde_json::from_slice(header)
        .map_err(|e| corrupt(8, format!("header is not a JSON object: {e}")))?;
    let data_len = file_len - header_end;
    let mut out = Vec::with_capacity(map.len());
    for (name, info) in map {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: &str| corrupt(8, format!("tensor {name}: {what}"));
        let dtype = info
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no string \"dtype\""))?
            .to_string();
        let shape = info
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| bad("\"shape\" is not an array of non-negative integers"))?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| match a.as_slice() {
                [s, e] => Some((s.as_u64()?, e.as_u64()?)),
                _ => None,
            })
            .ok_or_else(|| bad("\"data_offsets\" is not [start, end]"))?;
        let (start, end) = offsets;
        if start > end || end > data_len {
            return Err(corrupt(
                header_end.saturating_add(start),
                format!(
                    "tensor {name}: data_offsets [{start}, {end}] lie outside the data section of \
                     {data_len} bytes: truncated?"
                ),
            ));
        }
        if let Some(size) = dtype_size(&dtype) {
            let expected = shape
                .iter()
                .try_fold(size, |acc, &d| acc.checked_mul(d as u64));
            if expected != Some(end - start) {
                let expected = expected.map_or("more than 2^64".to_string(), |e| e.to_string());
                return Err(corrupt(
                    header_end + start,
                    format!(
                        "tensor {name}: {dtype} with shape {shape:?} needs {expected} bytes, but \
                         data_offsets [{start}, {end}] span {}",
                        end - start
                    ),
                ));
            }
        }
        let entry = Entry {
            shard_idx,
            dtype,
            shape,
            start: (header_end + start) as usize,
            end: (header_end + end) as usize,
        };
        out.push((name, entry));
    }
    Ok(out)
}

/// Convert little-endian `bytes` of `dtype` to f32, in parallel chunks.
fn to_f32(dtype: SafetensorsDtype, bytes: &[u8]) -> Vec<f32> {
    const CHUNK: usize = 1 << 16;
    let size = dtype.size();
    let mut out = vec![0f32; bytes.len() / size];
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(CHUNK * size))
        .for_each(|(o, b)| match dtype {
            SafetensorsDtype::F32 => {
                for (y, x) in o.iter_mut().zip(b.chunks_exact(4)) {
                    *y = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                }
            }
            SafetensorsDtype::F16 => {
                for (y, x) in o.iter_mut().zip(b.chunks_exact(2)) {
                    *y = f16::from_le_bytes([x[0], x[1]]).to_f32();
                }
            }
            SafetensorsDtype::BF16 => {
                for (y, x) in o.iter_mut().zip(b.chunks_exact(2)) {
                    *y = bf16::from_le_bytes([x[0], x[1]]).to_f32();
                }
            }
        });
    out
}

impl SafetensorsDir {
    /// A stored tensor's dtype, shape and bytes, for `quantized_st`.
    fn stored(&self, name: &str) -> Option<crate::quantized_st::Stored<'_>> {
        self.tensors.get(name).map(|e| crate::quantized_st::Stored {
            dtype: &e.dtype,
            shape: &e.shape,
            bytes: &self.shards[e.shard_idx].mmap[e.start..e.end],
        })
    }

    /// The `[out, in]` shape of `name` when it is a quantized matrix.
    fn logical(&self, name: &str) -> Option<&Vec<usize>> {
        self.quant.as_ref()?.logical.get(name)
    }

    /// A quantized matrix dequantized from its stored parts.
    fn dequantized(&self, name: &str, shape: &[usize]) -> Result<HostTensor> {
        let q = self
            .quant
            .as_ref()
            .ok_or_else(|| FormatError::MissingTensor {
                path: self.dir.clone(),
                tensor: name.to_string(),
            })?;
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let fetch = |n: &str| self.stored(n);
        let dims = [shape[0], shape[1]];
        let data =
            crate::quantized_st::dequantize(&q.scheme, base, dims, &fetch).map_err(|what| {
                FormatError::Invalid {
                    path: self.dir.clone(),
                    what,
                }
            })?;
        Ok(HostTensor::new(shape.to_vec(), data))
    }
}

impl SafetensorsDir {
    /// A quantized matrix as Q4_0 or Q4_Z blocks where its layout is
    /// exactly that (`quantized_st::as_blocks`).
    fn int4_blocks(&self, name: &str, shape: &[usize]) -> Result<Option<QuantMatrix>> {
        let Some(q) = self.quant.as_ref() else {
            return Ok(None);
        };
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let fetch = |n: &str| self.stored(n);
        let invalid = |what: String| FormatError::Invalid {
            path: self.dir.clone(),
            what,
        };
        let Some((format, bytes)) =
            crate::quantized_st::as_blocks(&q.scheme, base, [shape[0], shape[1]], &fetch)
                .map_err(invalid)?
        else {
            return Ok(None);
        };
        QuantMatrix::new(format, shape[0], shape[1], SharedBytes::from_vec(bytes))
            .map(Some)
            .map_err(invalid)
    }
}

impl WeightSource for SafetensorsDir {
    fn path(&self) -> &Path {
        &self.dir
    }

    fn tensors(&self) -> Vec<StoredTensor> {
        let hidden = |n: &str| self.quant.as_ref().is_some_and(|q| q.hidden.contains(n));
        let mut out: Vec<StoredTensor> = self
            .tensors
            .iter()
            .filter(|(name, _)| !hidden(name))
            .map(|(name, e)| StoredTensor {
                name: name.clone(),
                shape: e.shape.clone(),
                dtype: e.dtype.clone(),
                num_bytes: (e.end - e.start) as u64,
            })
            .collect();
        if let Some(q) = &self.quant {
            for (name, shape) in &q.logical {
                let base = name.strip_suffix(".weight").unwrap_or(name);
                let num_bytes = self
                    .tensors
                    .iter()
                    .filter(|(k, _)| {
                        q.hidden.contains(*k) && k.rsplit_once('.').map(|p| p.0) == Some(base)
                    })
                    .map(|(_, e)| (e.end - e.start) as u64)
                    .sum();
                // The block format it loads as (Q4_0, Q4_Z), else the scheme.
                let fetch = |n: &str| self.stored(n);
                let dtype = match shape.as_slice() {
                    &[o, i] => crate::quantized_st::block_format(&q.scheme, base, [o, i], &fetch),
                    _ => None,
                }
                .map_or_else(|| format!("{:?}", q.scheme), |f| f.name().to_string());
                out.push(StoredTensor {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype,
                    num_bytes,
                });
            }
        }
        out
    }

    fn contains(&self, name: &str) -> bool {
        self.logical(name).is_some() || self.tensors.contains_key(name)
    }

    fn load_f32(&self, name: &str) -> Result<HostTensor> {
        if let Some(shape) = self.logical(name) {
            return self.dequantized(name, shape);
        }
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| FormatError::MissingTensor {
                path: self.dir.clone(),
                tensor: name.to_string(),
            })?;
        let shard = &self.shards[e.shard_idx];
        let dtype =
            SafetensorsDtype::from_name(&e.dtype).ok_or_else(|| FormatError::UnsupportedDtype {
                path: shard.path.clone(),
                tensor: name.to_string(),
                dtype: format!("{} (supported: F32, F16, BF16)", e.dtype),
            })?;
        // Spans were checked against the file length and dtype size at open.
        let data = to_f32(dtype, &shard.mmap[e.start..e.end]);
        Ok(HostTensor::new(e.shape.clone(), data))
    }

    fn load_bf16(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<u16>)>> {
        if self.logical(name).is_some() {
            return Ok(None);
        }
        let Some(e) = self.tensors.get(name) else {
            return Ok(None);
        };
        if SafetensorsDtype::from_name(&e.dtype) != Some(SafetensorsDtype::BF16) {
            return Ok(None);
        }
        const CHUNK: usize = 1 << 16;
        let bytes = &self.shards[e.shard_idx].mmap[e.start..e.end];
        let mut out = vec![0u16; bytes.len() / 2];
        out.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK * 2))
            .for_each(|(o, b)| {
                for (y, x) in o.iter_mut().zip(b.chunks_exact(2)) {
                    *y = u16::from_le_bytes([x[0], x[1]]);
                }
            });
        Ok(Some((e.shape.clone(), out)))
    }

    fn load_bytes(&self, name: &str) -> Result<Option<(String, Vec<usize>, Vec<u8>)>> {
        if self.logical(name).is_some() {
            return Ok(None);
        }
        let Some(e) = self.tensors.get(name) else {
            return Ok(None);
        };
        let bytes = self.shards[e.shard_idx].mmap[e.start..e.end].to_vec();
        Ok(Some((e.dtype.clone(), e.shape.clone(), bytes)))
    }

    /// F16 and BF16 matrices, in place.
    fn load_blocks(&self, name: &str) -> Result<Option<QuantMatrix>> {
        if let Some(shape) = self.logical(name) {
            return self.int4_blocks(name, shape);
        }
        let Some(e) = self.tensors.get(name) else {
            return Ok(None);
        };
        let format = match SafetensorsDtype::from_name(&e.dtype) {
            Some(SafetensorsDtype::BF16) => QuantFormat::BF16,
            Some(SafetensorsDtype::F16) => QuantFormat::F16,
            _ => return Ok(None),
        };
        let &[rows, cols] = e.shape.as_slice() else {
            return Ok(None);
        };
        let shard = &self.shards[e.shard_idx];
        let corrupt = |what: String| FormatError::Corrupt {
            path: shard.path.clone(),
            offset: e.start as u64,
            what: format!("{name}: {what}"),
        };
        let bytes = SharedBytes::mapped(shard.mmap.clone(), e.start..e.end)
            .ok_or_else(|| corrupt("span outside the file".into()))?;
        QuantMatrix::new(format, rows, cols, bytes)
            .map(Some)
            .map_err(corrupt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.resize(v.len() + data_len, 0);
        v
    }

    fn parse(bytes: &[u8]) -> Result<Vec<(String, Entry)>> {
        parse_header(Path::new("x.safetensors"), bytes, 0)
    }

    #[test]
    fn header_spans_are_absolute_and_checked() {
        let h = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]}}"#;
        let entries = parse(&file(h, 12)).unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].1.start, 8 + h.len());
        assert_eq!(entries[0].1.end, 8 + h.len() + 12);

        let err = parse(&file(h, 11)).unwrap_err().to_string();
        assert!(err.contains("tensor a") && err.contains("[0, 12]"), "{err}");

        let h = r#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,12]}}"#;
        let err = parse(&file(h, 12)).unwrap_err().to_string();
        assert!(
            err.contains("needs 24 bytes") && err.contains("span 12"),
            "{err}"
        );
    }

    #[test]
    fn unknown_dtypes_open_but_are_only_bounds_checked() {
        let h = r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}"#;
        let entries = parse(&file(h, 2)).unwrap();
        assert_eq!(entries[0].1.dtype, "F4");
    }

    #[test]
    fn conversions_match_half() {
        let xs = [1.0f32, -2.5, 65504.0, 1e-3];
        let f32_bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(to_f32(SafetensorsDtype::F32, &f32_bytes), xs);
        let bf: Vec<u8> = xs
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        let want: Vec<f32> = xs.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        assert_eq!(to_f32(SafetensorsDtype::BF16, &bf), want);
        let h: Vec<u8> = xs
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect();
        let want: Vec<f32> = xs.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        assert_eq!(to_f32(SafetensorsDtype::F16, &h), want);
    }
}
