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

/// The formats of a quantized file's matrices: one format throughout, or
/// llama.cpp's Q4_K_M mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMix {
    /// Every matrix in one format where its rows are whole blocks of it.
    Uniform(QuantFormat),
    /// llama.cpp's Q4_K_M: Q4_K, with the value and MLP-down matrices in
    /// Q6_K on the first and last eighth of the layers and every third
    /// layer between, and the output matrix in Q6_K.
    Q4KM,
}

impl QuantMix {
    /// `q4_k_m`, or a format `kiln quantize` writes (`kiln_quant::parse_quantize_type`).
    pub fn parse(s: &str) -> std::result::Result<QuantMix, String> {
        if s.eq_ignore_ascii_case("q4_k_m") {
            return Ok(QuantMix::Q4KM);
        }
        kiln_quant::parse_quantize_type(s)
            .map(QuantMix::Uniform)
            .map_err(|e| format!("{e}, or q4_k_m"))
    }

    /// `q4_k_m`, or any GGUF block format by name (random blocks need no quantizer).
    pub fn parse_ggml(s: &str) -> Option<QuantMix> {
        if s.eq_ignore_ascii_case("q4_k_m") {
            return Some(QuantMix::Q4KM);
        }
        QuantFormat::ALL
            .into_iter()
            .find(|f| {
                f.name().eq_ignore_ascii_case(s) && crate::GgmlType::from_quant_format(*f).is_some()
            })
            .map(QuantMix::Uniform)
    }

    /// The formats the mix writes (before the Q8_0 fallback).
    pub fn formats(self) -> Vec<QuantFormat> {
        match self {
            QuantMix::Uniform(f) => vec![f],
            QuantMix::Q4KM => vec![QuantFormat::Q4K, QuantFormat::Q6K],
        }
    }

    /// The format most of the file's matrices get.
    pub fn main_format(self) -> QuantFormat {
        self.formats()[0]
    }

    /// The format asked for matrix `name` (a Hugging Face or a GGUF name) of
    /// a model of `layers` layers, before the Q8_0 fallback.
    pub fn format_of(self, name: &str, layers: usize) -> QuantFormat {
        match self {
            QuantMix::Uniform(f) => f,
            QuantMix::Q4KM => {
                let layer = name
                    .strip_prefix("model.layers.")
                    .or_else(|| name.strip_prefix("blk."))
                    .and_then(|r| r.split('.').next())
                    .and_then(|i| i.parse::<usize>().ok());
                let more_bits =
                    |i: usize| i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2;
                let wide = [
                    "v_proj.weight",
                    "attn_v.weight",
                    "down_proj.weight",
                    "ffn_down.weight",
                ]
                .iter()
                .any(|s| name.ends_with(s));
                let head = name == "lm_head.weight" || name == "output.weight";
                if head || layer.is_some_and(|i| wide && more_bits(i)) {
                    QuantFormat::Q6K
                } else {
                    QuantFormat::Q4K
                }
            }
        }
    }

    /// The format `stored` is quantized to ([`target_format`] of
    /// [`QuantMix::format_of`]), `None` where it stays as it is.
    pub fn target(self, stored: &StoredTensor, layers: usize) -> Option<QuantFormat> {
        target_format(self.format_of(&stored.name, layers), stored)
    }
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
        Self::with_mix(inner, QuantMix::Uniform(format), 0)
    }

    /// Every float matrix in `mix`'s format for it ([`QuantMix::target`]) in
    /// a model of `layers` layers.
    pub fn with_mix(inner: S, mix: QuantMix, layers: usize) -> Result<Self> {
        if let Some(f) = mix
            .formats()
            .into_iter()
            .find(|f| !kiln_quant::QUANTIZE_FORMATS.contains(f))
        {
            return Err(FormatError::Invalid {
                path: inner.path().to_path_buf(),
                what: format!(
                    "cannot quantize to {f} (supported: {})",
                    kiln_quant::QUANTIZE_FORMATS.map(|f| f.name()).join(", ")
                ),
            });
        }
        let targets = inner
            .tensors()
            .iter()
            .filter_map(|t| mix.target(t, layers).map(|f| (t.name.clone(), f)))
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
