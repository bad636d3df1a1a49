//! [`Quantizing`]: a weight source whose float matrices read as blocks of
//! a chosen format, quantized when they are loaded (`--quantize`), and the
//! rule for which format a matrix gets, shared with `kiln quantize`.

use std::collections::HashMap;
use std::path::Path;

use kiln_quant::{QuantFormat, QuantMatrix, SharedBytes};

use crate::error::{FormatError, Result};
use crate::weights::{HostTensor, StoredTensor, WeightSource};

/// The format a float matrix of `cols` columns is stored in when `format`
/// is asked for: `format` where a row is whole blocks of it, else Q8_0
/// (blocks of 32) for a K-quant, else `None` (kept as it is). Only
/// 2-D tensors stored as F32, F16 or BF16 are quantized: a matrix already
/// in blocks keeps its blocks (re-quantizing a quantized file compounds
/// two roundings), and vectors (norms, biases) stay in float.
pub fn target_format(format: QuantFormat, stored: &StoredTensor) -> Option<QuantFormat> {
    let &[_, cols] = stored.shape.as_slice() else {
        return None;
    };
    if !matches!(stored.dtype.as_str(), "F32" | "F16" | "BF16") {
        return None;
    }
    [format, QuantFormat::Q8_0]
        .into_iter()
        .find(|f| cols % f.block_size() == 0)
}

/// `inner` with every float matrix quantized to `format` (by
/// [`target_format`]) as it is loaded: [`WeightSource::load_blocks`] gives
/// its blocks, [`WeightSource::load_f32`] their dequantized values (so a
/// backend that multiplies only dense tensors computes with the same
/// weights).
pub struct Quantizing<S> {
    inner: S,
    /// The target format of each tensor this source quantizes, by name.
    targets: HashMap<String, QuantFormat>,
}

impl<S: WeightSource> Quantizing<S> {
    /// Checks `format` is one [`kiln_quant::quantize`] writes.
    pub fn new(inner: S, format: QuantFormat) -> Result<Self> {
        if !kiln_quant::QUANTIZE_FORMATS.contains(&format) {
            return Err(FormatError::Invalid {
                path: inner.path().to_path_buf(),
                what: format!(
                    "cannot quantize to {format} (supported: {})",
                    kiln_quant::QUANTIZE_FORMATS.map(|f| f.name()).join(", ")
                ),
            });
        }
        let targets = inner
            .tensors()
            .iter()
            .filter_map(|t| target_format(format, t).map(|f| (t.name.clone(), f)))
            .collect();
        Ok(Quantizing { inner, targets })
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// `name`'s target format, if it is one this source quantizes.
    fn target(&self, name: &str) -> Option<QuantFormat> {
        self.targets.get(name).copied()
    }

    fn quantized(&self, name: &str, format: QuantFormat) -> Result<QuantMatrix> {
        let host = self.inner.load_f32(name)?;
        let (rows, cols) = (host.shape[0], host.shape[1]);
        let bytes =
            kiln_quant::quantize(format, &host.data).map_err(|what| FormatError::Invalid {
                path: self.inner.path().to_path_buf(),
                what: format!("quantizing {name} to {format}: {what}"),
            })?;
        QuantMatrix::new(format, rows, cols, SharedBytes::from_vec(bytes)).map_err(|what| {
            FormatError::Invalid {
                path: self.inner.path().to_path_buf(),
                what: format!("{name}: {what}"),
            }
        })
    }
}

impl<S: WeightSource> WeightSource for Quantizing<S> {
    fn path(&self) -> &Path {
        self.inner.path()
    }

    /// The tensors as they will be held: quantized ones with their format
    /// and block bytes.
    fn tensors(&self) -> Vec<StoredTensor> {
        self.inner
            .tensors()
            .into_iter()
            .map(|mut t| {
                if let Some(&f) = self.targets.get(&t.name) {
                    let rows = t.shape[0];
                    t.num_bytes = f.row_bytes(t.shape[1]).map_or(0, |b| (b * rows) as u64);
                    t.dtype = f.name().to_string();
                }
                t
            })
            .collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn load_f32(&self, name: &str) -> Result<HostTensor> {
        let Some(format) = self.target(name) else {
            return self.inner.load_f32(name);
        };
        let m = self.quantized(name, format)?;
        Ok(HostTensor::new(vec![m.rows(), m.cols()], m.dequantize()))
    }

    fn load_bf16(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<u16>)>> {
        if self.target(name).is_some() {
            return Ok(None);
        }
        self.inner.load_bf16(name)
    }

    fn load_blocks(&self, name: &str) -> Result<Option<QuantMatrix>> {
        match self.target(name) {
            Some(format) => self.quantized(name, format).map(Some),
            None => self.inner.load_blocks(name),
        }
    }
}
