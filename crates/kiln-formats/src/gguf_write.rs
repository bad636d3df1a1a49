//! GGUF v3 writer: the layout [`crate::gguf`] reads (header, metadata,
//! tensor infos, data aligned to `general.alignment`, 32 by default).
//!
//! Tensors are planned first (name, dims, type), so every offset is known
//! before any data is written, and their bytes are then asked for one at a
//! time: writing a file holds one tensor in memory, not the model. The file
//! is written beside its destination and renamed into place when complete,
//! so a failed write never leaves a truncated GGUF under the final name.

use std::io::{BufWriter, Write};
use std::path::Path;

use crate::dtype::GgmlType;
use crate::error::{FormatError, Result};
use crate::gguf::MetaValue;

/// The alignment of tensor data (GGUF's default; llama.cpp's converter
/// writes the same).
pub const GGUF_ALIGNMENT: u64 = 32;

/// One tensor to write: its GGUF name, dims fastest-first (`ne`), type.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorPlan {
    pub name: String,
    pub ne: Vec<u64>,
    pub ggml_type: GgmlType,
}

impl GgufTensorPlan {
    /// A tensor of row-major `shape` (slowest dimension first).
    pub fn new(name: impl Into<String>, shape: &[usize], ggml_type: GgmlType) -> Self {
        GgufTensorPlan {
            name: name.into(),
            ne: shape.iter().rev().map(|&d| d as u64).collect(),
            ggml_type,
        }
    }
}

fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Append `v`'s payload (without its type id); an error for an array
/// whose elements are not all of one type, or nested arrays.
fn put_value(out: &mut Vec<u8>, key: &str, v: &MetaValue) -> std::result::Result<(), String> {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend(x.to_le_bytes()),
        MetaValue::I16(x) => out.extend(x.to_le_bytes()),
        MetaValue::U32(x) => out.extend(x.to_le_bytes()),
        MetaValue::I32(x) => out.extend(x.to_le_bytes()),
        MetaValue::F32(x) => out.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::U64(x) => out.extend(x.to_le_bytes()),
        MetaValue::I64(x) => out.extend(x.to_le_bytes()),
        MetaValue::F64(x) => out.extend(x.to_le_bytes()),
        MetaValue::Array(items) => {
            // An empty array still needs an element type; u32 is as good as any.
            let ty = items.first().map(type_id).unwrap_or(4);
            if ty == 9 {
                return Err(format!("{key}: nested arrays are not written"));
            }
            if items.iter().any(|i| type_id(i) != ty) {
                return Err(format!("{key}: array elements must all be one type"));
            }
            out.extend(ty.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, key, i)?;
            }
        }
    }
    Ok(())
}

/// The header, metadata and tensor table of a GGUF file with `metadata`
/// and `tensors`, padded to the data section, and each tensor's byte
/// count.
fn header(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[GgufTensorPlan],
) -> Result<(Vec<u8>, Vec<u64>)> {
    let invalid = |what: String| FormatError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    let mut out = Vec::new();
    out.extend(b"GGUF");
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (i, (key, v)) in metadata.iter().enumerate() {
        if metadata[..i].iter().any(|(k, _)| k == key) {
            return Err(invalid(format!("metadata key {key} is given twice")));
        }
        put_str(&mut out, key);
        out.extend(type_id(v).to_le_bytes());
        put_value(&mut out, key, v).map_err(invalid)?;
    }
    let mut sizes = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|u| u.name == t.name) {
            return Err(invalid(format!("tensor {} is given twice", t.name)));
        }
        let bytes = t.ggml_type.bytes_for(&t.ne).ok_or_else(|| {
            invalid(format!(
                "tensor {}: dims {:?} are not whole {} blocks",
                t.name,
                t.ne,
                t.ggml_type.name()
            ))
        })?;
        put_str(&mut out, &t.name);
        out.extend((t.ne.len() as u32).to_le_bytes());
        for d in &t.ne {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ggml_type.to_u32().to_le_bytes());
        out.extend(offset.to_le_bytes());
        sizes.push(bytes);
        offset = (offset + bytes).next_multiple_of(GGUF_ALIGNMENT);
    }
    out.resize(
        (out.len() as u64).next_multiple_of(GGUF_ALIGNMENT) as usize,
        0,
    );
    Ok((out, sizes))
}

/// Write a GGUF file at `path` with `metadata` and `tensors`, asking
/// `data(i)` for tensor `i`'s bytes in order (each must be exactly the
/// size its dims and type give).
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[GgufTensorPlan],
    mut data: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<()> {
    let (head, sizes) = header(path, metadata, tensors)?;
    let tmp = path.with_extension("gguf.partial");
    let io = |e| FormatError::io(path, e);
    let file = std::fs::File::create(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
    let result = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&head).map_err(io)?;
        for (i, (t, &size)) in tensors.iter().zip(&sizes).enumerate() {
            let bytes = data(i)?;
            if bytes.len() as u64 != size {
                return Err(FormatError::Invalid {
                    path: path.to_path_buf(),
                    what: format!(
                        "tensor {}: {} bytes given, {} expected",
                        t.name,
                        bytes.len(),
                        size
                    ),
                });
            }
            w.write_all(&bytes).map_err(io)?;
            if i + 1 < tensors.len() {
                let pad = size.next_multiple_of(GGUF_ALIGNMENT) - size;
                w.write_all(&vec![0u8; pad as usize]).map_err(io)?;
            }
        }
        w.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)
    })();
    match result {
        Ok(()) => std::fs::rename(&tmp, path).map_err(io),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// A GGUF file at `path` whose tensor data is a hole (sparse: it reads as
/// zeros and takes no disk): the shapes and types of a model no one has the
/// weights of, for memory plans (`kiln fit`) and their tests.
pub fn write_gguf_shapes(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[GgufTensorPlan],
) -> Result<()> {
    let (head, sizes) = header(path, metadata, tensors)?;
    let io = |e| FormatError::io(path, e);
    let data: u64 = sizes
        .iter()
        .map(|s| s.next_multiple_of(GGUF_ALIGNMENT))
        .sum();
    let mut f = std::fs::File::create(path).map_err(io)?;
    f.write_all(&head).map_err(io)?;
    f.set_len(head.len() as u64 + data).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn written_file_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let meta = vec![
            (
                "general.architecture".to_string(),
                MetaValue::String("llama".into()),
            ),
            ("llama.block_count".to_string(), MetaValue::U32(2)),
            ("x.f".to_string(), MetaValue::F32(1e-5)),
            ("x.b".to_string(), MetaValue::Bool(true)),
            (
                "x.tokens".to_string(),
                MetaValue::Array(vec![
                    MetaValue::String("a".into()),
                    MetaValue::String("bc".into()),
                ]),
            ),
            (
                "x.ids".to_string(),
                MetaValue::Array(vec![MetaValue::I32(-1), MetaValue::I32(3)]),
            ),
        ];
        let tensors = vec![
            GgufTensorPlan::new("a", &[3], GgmlType::F32),
            GgufTensorPlan::new("b", &[2, 64], GgmlType::Q8_0),
        ];
        let a: Vec<u8> = [1.0f32, -2.0, 3.5]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = (0..4 * 34).map(|i| (i % 7) as u8).collect();
        let (a2, b2) = (a.clone(), b.clone());
        write_gguf(&path, &meta, &tensors, |i| {
            Ok(if i == 0 { a2.clone() } else { b2.clone() })
        })
        .unwrap();
        let f = GgufFile::open(&path).unwrap();
        for (k, v) in &meta {
            assert_eq!(f.metadata.get(k), Some(v), "{k}");
        }
        assert_eq!(f.tensors.len(), 2);
        let tb = f.tensor_info("b").unwrap();
        assert_eq!(tb.shape(), vec![2, 64]);
        assert_eq!(tb.offset % GGUF_ALIGNMENT, 0);
        assert_eq!(f.tensor_bytes(tb), &b[..]);
        assert_eq!(f.tensor_f32("a").unwrap(), vec![1.0, -2.0, 3.5]);
        assert!(!path.with_extension("gguf.partial").exists());
    }

    #[test]
    fn refusals_leave_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let t = vec![GgufTensorPlan::new("a", &[2], GgmlType::F32)];
        // Wrong byte count.
        let e = write_gguf(&path, &[], &t, |_| Ok(vec![0u8; 7])).unwrap_err();
        assert!(e.to_string().contains("7 bytes given, 8 expected"), "{e}");
        assert!(!path.exists() && !path.with_extension("gguf.partial").exists());
        // Rows that are not whole blocks.
        let t = vec![GgufTensorPlan::new("q", &[2, 40], GgmlType::Q8_0)];
        let e = write_gguf(&path, &[], &t, |_| Ok(vec![])).unwrap_err();
        assert!(e.to_string().contains("not whole Q8_0 blocks"), "{e}");
        // Mixed array, duplicate key.
        let m = vec![(
            "k".to_string(),
            MetaValue::Array(vec![MetaValue::U32(1), MetaValue::F32(1.0)]),
        )];
        let e = write_gguf(&path, &m, &[], |_| Ok(vec![])).unwrap_err();
        assert!(e.to_string().contains("one type"), "{e}");
        let m = vec![
            ("k".to_string(), MetaValue::U32(1)),
            ("k".to_string(), MetaValue::U32(2)),
        ];
        let e = write_gguf(&path, &m, &[], |_| Ok(vec![])).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        assert!(!path.exists());
    }
}
