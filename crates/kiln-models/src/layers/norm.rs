//! RMSNorm: `x / sqrt(mean(x²) + eps) * (offset + w)`; Gemma uses offset 1.

use kiln_tensor::{Backend, NormPrologue, Tensor};

use super::WeightLoader;
use crate::error::Result;

pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f32,
    pub weight_offset: f32,
}

impl RmsNorm {
    pub fn load(l: &WeightLoader, name: &str, dim: usize, eps: f32) -> Result<Self> {
        Ok(RmsNorm {
            weight: l.tensor(name, &[dim])?,
            eps,
            weight_offset: 0.0,
        })
    }

    /// Normalize the last dimension of `x`.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(b.rms_norm(x, &self.weight, self.eps, self.weight_offset)?)
    }

    /// `residual + self(x)`: a post-norm sub-layer joining the residual
    /// stream (one kernel where the backend fuses it).
    pub fn forward_add(&self, b: &dyn Backend, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        Ok(b.rms_norm_add(x, &self.weight, self.eps, self.weight_offset, residual)?)
    }

    /// This norm as the prologue of a product that consumes its output.
    pub fn prologue(&self) -> NormPrologue<'_> {
        NormPrologue {
            weight: &self.weight,
            eps: self.eps,
            offset: self.weight_offset,
        }
    }
}
