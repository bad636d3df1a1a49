//! GGUF v2/v3 reader: metadata, tensor table, and memory-mapped tensor bytes.
//!
//! Layout (all little-endian): magic `GGUF`, version u32, tensor count u64,
//! metadata count u64, the metadata key/values, the tensor infos, padding to
//! `general.alignment` (default 32), then the tensor data. Tensor shapes list
//! the fastest-varying dimension first (`ne0`); [`GgufTensorInfo::shape`]
//! reverses them into the row-major order the rest of Kiln uses.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_quant::SharedBytes;
use memmap2::Mmap;

use crate::dtype::GgmlType;
use crate::error::{FormatError, Result};

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is any integer type and non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The metadata key/value table of one GGUF file, with typed getters that
/// name the file and key in their errors.
#[derive(Debug, Clone, Default)]
pub struct GgufMetadata {
    pub path: PathBuf,
    pub entries: BTreeMap<String, MetaValue>,
}

impl GgufMetadata {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.entries.get(key)
    }

    fn err(&self, key: &str, what: impl Into<String>) -> FormatError {
        FormatError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            what: what.into(),
        }
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a string, found {v:?}"))),
        }
    }

    pub fn u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected an unsigned integer, found {v:?}"))),
        }
    }

    pub fn f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a number, found {v:?}"))),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a bool, found {v:?}"))),
        }
    }

    /// A required unsigned integer.
    pub fn req_u64(&self, key: &str) -> Result<u64> {
        self.u64(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    pub fn str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(key, "expected an array of strings"))?;
        arr.iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| self.err(key, "expected an array of strings"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn i64_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(key, "expected an array of integers"))?;
        arr.iter()
            .map(|x| {
                x.as_i64()
                    .ok_or_else(|| self.err(key, "expected an array of integers"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn f64_array(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.err(key, "expected an array of numbers"))?;
        arr.iter()
            .map(|x| {
                x.as_f64()
                    .ok_or_else(|| self.err(key, "expected an array of numbers"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// `general.architecture`, which prefixes most other keys.
    pub fn architecture(&self) -> Result<&str> {
        self.str("general.architecture")?
            .ok_or_else(|| self.err("general.architecture", "missing"))
    }
}

/// Where one tensor's bytes lie and how to read them.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    pub name: String,
    /// GGUF order: fastest-varying dimension first.
    pub ne: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Row-major shape (slowest dimension first), as Hugging Face writes it.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn num_elements(&self) -> u64 {
        self.ne.iter().product()
    }
}

/// An open GGUF file: metadata, tensor table and the mapped bytes.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: GgufMetadata,
    pub tensors: Vec<GgufTensorInfo>,
    by_name: BTreeMap<String, usize>,
    data_offset: u64,
    mmap: Arc<Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Upper bounds that keep a corrupt header from asking for absurd allocations.
const MAX_STRING_LEN: u64 = 1 << 30;
const MAX_ARRAY_LEN: u64 = 1 << 28;
const MAX_DIMS: u32 = 8;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, what: impl Into<String>) -> FormatError {
        FormatError::Corrupt {
            path: self.path.to_path_buf(),
            offset: self.pos as u64,
            what: what.into(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.corrupt(format!("file ends inside {what} ({n} bytes wanted)")))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > MAX_STRING_LEN {
            return Err(self.corrupt(format!("{what}: string length {len} is implausible")));
        }
        let bytes = self.take(len as usize, what)?;
        // Some converters write vocab entries that are not valid UTF-8; keep them lossy
        // rather than refuse the file.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(what)?[0]),
            1 => MetaValue::I8(self.array::<1>(what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => MetaValue::Bool(self.array::<1>(what)?[0] != 0),
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth > 2 {
                    return Err(self.corrupt(format!("{what}: arrays nested too deep")));
                }
                let elem_ty = self.u32(what)?;
                let n = self.u64(what)?;
                if n > MAX_ARRAY_LEN {
                    return Err(self.corrupt(format!("{what}: array length {n} is implausible")));
                }
                // Every element takes at least one byte: refuse lengths the file cannot hold.
                if n as usize > self.buf.len() - self.pos {
                    return Err(self.corrupt(format!("{what}: array of {n} overruns the file")));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem_ty, what, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(self.corrupt(format!("{what}: unknown value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Open and validate a GGUF file. Tensor bytes are mapped, not read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| FormatError::io(&path, e))?;
        // SAFETY: the map is read-only; Kiln never writes model files it has open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| FormatError::io(&path, e))?;
        Self::parse(path, mmap)
    }

    fn parse(path: PathBuf, mmap: Mmap) -> Result<Self> {
        let mut c = Cursor {
            buf: &mmap[..],
            pos: 0,
            path: &path,
        };
        let magic: [u8; 4] = c.array("magic")?;
        if &magic != b"GGUF" {
            return Err(FormatError::BadMagic {
                path: path.clone(),
                found: magic,
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(FormatError::UnsupportedVersion {
                path: path.clone(),
                version,
            });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        if n_tensors > 1 << 20 || n_kv > 1 << 20 {
            return Err(c.corrupt(format!(
                "implausible counts: {n_tensors} tensors, {n_kv} keys"
            )));
        }
        let mut entries = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            entries.insert(key, value);
        }
        let metadata = GgufMetadata {
            path: path.clone(),
            entries,
        };
        // Each tensor info takes at least 32 bytes: do not let a corrupt count
        // reserve more than the file could describe.
        let mut tensors = Vec::with_capacity((n_tensors as usize).min((mmap.len() - c.pos) / 32));
        let mut by_name = BTreeMap::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("the name of tensor {i} of {n_tensors}"))?;
            let n_dims = c.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(c.corrupt(format!("tensor {name}: {n_dims} dimensions")));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(c.u64(&name)?);
            }
            let raw_type = c.u32(&name)?;
            let ggml_type =
                GgmlType::from_u32(raw_type).ok_or_else(|| FormatError::UnsupportedDtype {
                    path: path.clone(),
                    tensor: name.clone(),
                    dtype: format!("ggml type {raw_type}"),
                })?;
            let offset = c.u64(&name)?;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(c.corrupt(format!("tensor {name} appears twice")));
            }
            tensors.push(GgufTensorInfo {
                name,
                ne,
                ggml_type,
                offset,
            });
        }
        let alignment = metadata.u64("general.alignment")?.unwrap_or(32).max(1);
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = mmap.len() as u64;
        for t in &tensors {
            let bytes = t
                .ggml_type
                .bytes_for(&t.ne)
                .ok_or_else(|| FormatError::Corrupt {
                    path: path.clone(),
                    offset: t.offset,
                    what: format!(
                        "tensor {}: shape {:?} does not fit {}'s block size {}",
                        t.name,
                        t.ne,
                        t.ggml_type.name(),
                        t.ggml_type.block_size()
                    ),
                })?;
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(bytes));
            if end.is_none_or(|e| e > file_len) {
                return Err(FormatError::Corrupt {
                    path: path.clone(),
                    offset: data_offset.saturating_add(t.offset),
                    what: format!(
                        "tensor {} ({} bytes at data offset {}) runs past the end of the file ({} bytes): truncated?",
                        t.name, bytes, t.offset, file_len
                    ),
                });
            }
        }
        Ok(GgufFile {
            path,
            version,
            metadata,
            tensors,
            by_name,
            data_offset,
            mmap: Arc::new(mmap),
        })
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw (possibly quantized) bytes of a tensor; bounds were checked at open.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        let len =
            info.ggml_type
                .bytes_for(&info.ne)
                .expect("tensor sizes were validated at open; this is a bug") as usize;
        &self.mmap[start..start + len]
    }

    /// The bytes of a tensor, shared with the mapping (bounds were checked
    /// at open).
    pub fn tensor_shared(&self, info: &GgufTensorInfo) -> SharedBytes {
        let start = (self.data_offset + info.offset) as usize;
        let len = self.tensor_bytes(info).len();
        SharedBytes::mapped(self.mmap.clone(), start..start + len)
            .expect("tensor spans were validated at open; this is a bug")
    }

    /// Bytes `range` of a tensor's data (one expert of a stacked 3-D
    /// tensor), shared with the mapping; `None` when the range runs past it.
    pub fn tensor_part_shared(
        &self,
        info: &GgufTensorInfo,
        range: std::ops::Range<usize>,
    ) -> Option<SharedBytes> {
        let start = (self.data_offset + info.offset) as usize;
        if range.end > self.tensor_bytes(info).len() || range.start > range.end {
            return None;
        }
        SharedBytes::mapped(self.mmap.clone(), start + range.start..start + range.end)
    }

    /// Dequantize a tensor to f32, in row-major order.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| FormatError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        crate::dequant::dequantize(
            info.ggml_type,
            self.tensor_bytes(info),
            info.num_elements() as usize,
        )
        .map_err(|what| FormatError::UnsupportedDtype {
            path: self.path.clone(),
            tensor: name.to_string(),
            dtype: what,
        })
    }
}
