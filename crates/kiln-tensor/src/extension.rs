//! Extension ops, in the manner of candle's `CustomOp`: an op a family
//! needs that is not one of [`crate::Ops`]'s basics. Each op type carries
//! its CPU reference ([`ExtensionOp::cpu`], required); a backend with a
//! kernel of its own says so through [`crate::Ops::has_extension`] and
//! runs it in [`crate::Ops::extension`], reading the op's parameters by
//! downcasting [`ExtensionOp::as_any`]. A model checks that its backend
//! has every op it needs while it loads ([`require_extensions`]), so a
//! missing kernel is a load error, never a failed request.

use std::any::Any;

use rayon::prelude::*;

use crate::backend::Backend;
use crate::error::{Result, TensorError};

/// An op outside the basic set.
pub trait ExtensionOp: Send + Sync + std::fmt::Debug {
    /// The name backends know the op by (unique among extension ops).
    fn name(&self) -> &'static str;

    /// The reference: the op on host f32 data `x` of `shape`, returning the
    /// output's shape and data. Other backends are tested against it.
    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)>;

    /// The op itself, for a backend's kernel to read its parameters.
    fn as_any(&self) -> &dyn Any;
}

/// Fails unless `backend` runs every op of `ops`: the error names the
/// backend and the first op it lacks.
pub fn require_extensions<B: Backend + ?Sized>(
    backend: &B,
    ops: &[&dyn ExtensionOp],
) -> Result<()> {
    match ops.iter().find(|op| !backend.has_extension(op.name())) {
        Some(op) => Err(TensorError::Unsupported {
            backend: backend.name(),
            what: format!("the extension op `{}` ({op:?}) this model needs", op.name()),
        }),
        None => Ok(()),
    }
}

/// Soft-capping `tanh(x / cap) * cap`, elementwise: Gemma 2's final-logit
/// capping (`final_logit_softcapping`), which squashes logits into
/// `(-cap, cap)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftCap {
    pub cap: f32,
}

impl SoftCap {
    pub const NAME: &'static str = "softcap";
}

impl ExtensionOp for SoftCap {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        if !(self.cap > 0.0 && self.cap.is_finite()) {
            return Err(TensorError::Shape {
                op: "softcap",
                detail: format!("cap {} (must be positive and finite)", self.cap),
            });
        }
        let c = self.cap;
        Ok((
            shape.to_vec(),
            x.iter().map(|&v| (v / c).tanh() * c).collect(),
        ))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// LayerNorm over the last dimension, with a weight and bias:
/// `(x − mean) / sqrt(var + eps) · w + b`, the variance the biased one (as
/// `torch.nn.LayerNorm`), in f32. Encoders (BERT) and other families whose
/// norms are not RMSNorms.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerNorm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub eps: f32,
}

impl LayerNorm {
    pub const NAME: &'static str = "layer_norm";
}

impl ExtensionOp for LayerNorm {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        let d = self.weight.len();
        if d == 0 || shape.last() != Some(&d) || self.bias.len() != d || x.len() % d != 0 {
            return Err(TensorError::Shape {
                op: "layer_norm",
                detail: format!(
                    "input {shape:?} against weight [{d}] and bias [{}]",
                    self.bias.len()
                ),
            });
        }
        let mut out = vec![0f32; x.len()];
        // Rows in parallel (each row's arithmetic is its own).
        let rows = (16384 / d).max(1);
        out.par_chunks_mut(d * rows)
            .zip(x.par_chunks(d * rows))
            .for_each(|(out, x)| {
                for (o, r) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                    let mean = r.iter().sum::<f32>() / d as f32;
                    let var = r.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
                    let inv = 1.0 / (var + self.eps).sqrt();
                    for (((o, &v), &w), &b) in o.iter_mut().zip(r).zip(&self.weight).zip(&self.bias)
                    {
                        *o = (v - mean) * inv * w + b;
                    }
                }
            });
        Ok((shape.to_vec(), out))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// GELU with the error function, `x · (1 + erf(x / √2)) / 2`, elementwise
/// (BERT's `hidden_act: "gelu"`; the tanh form is [`crate::Activation`]'s).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GeluErf;

impl GeluErf {
    pub const NAME: &'static str = "gelu_erf";
}

impl ExtensionOp for GeluErf {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        let r = std::f32::consts::FRAC_1_SQRT_2;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(16384)
            .zip(x.par_chunks(16384))
            .for_each(|(o, x)| {
                for (o, &v) in o.iter_mut().zip(x) {
                    *o = 0.5 * v * (1.0 + libm::erff(v * r));
                }
            });
        Ok((shape.to_vec(), out))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_rows_have_the_weight_and_bias_of_a_unit_row() {
        let ln = LayerNorm {
            weight: vec![1.0, 2.0, 1.0, 0.5],
            bias: vec![0.0, 1.0, -1.0, 0.0],
            eps: 1e-12,
        };
        let x = [1.0f32, 2.0, 3.0, 4.0, -2.0, -2.0, -2.0, -2.0];
        let (shape, y) = ln.cpu(&x, &[2, 4]).unwrap();
        assert_eq!(shape, [2, 4]);
        // Row 0: mean 2.5, variance 1.25.
        let s = 1.25f64.sqrt();
        let want = [-1.5 / s, 2.0 * -0.5 / s + 1.0, 0.5 / s - 1.0, 0.5 * 1.5 / s];
        for (g, w) in y[..4].iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
        }
        // A constant row normalizes to zeros: only the bias is left.
        assert_eq!(&y[4..], &[0.0, 1.0, -1.0, 0.0]);
        assert!(ln.cpu(&x, &[1, 8]).is_err());
    }

    #[test]
    fn gelu_erf_is_the_erf_form() {
        let (_, y) = GeluErf.cpu(&[-3.0, -1.0, 0.0, 0.5, 2.0], &[5]).unwrap();
        // x · Φ(x), from the normal distribution's table.
        let want = [-0.004_049_71, -0.158_655_25, 0.0, 0.345_731_37, 1.954_499_7];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
    }
}
