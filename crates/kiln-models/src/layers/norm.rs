//! RMSNorm: `x / sqrt(mean(x²) + eps) * (offset + w)`; Gemma uses offset 1.

use kiln_tensor::{Activation, Backend, Tensor};

use super::{Linear, WeightLoader};
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

    /// `proj(norm(x))` as one backend op ([`Backend::rms_norm_linear`]).
    pub fn forward_linear(&self, b: &dyn Backend, x: &Tensor, proj: &Linear) -> Result<Tensor> {
        Ok(b.rms_norm_linear(
            x,
            &self.weight,
            self.eps,
            self.weight_offset,
            &proj.weight,
            proj.bias.as_ref(),
        )?)
    }

    /// `act(norm(x) · gᵀ) * (norm(x) · uᵀ)` as one backend op
    /// ([`Backend::rms_norm_gated_linear`]).
    pub fn forward_gated_linear(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        w_gate_up: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        Ok(b.rms_norm_gated_linear(
            x,
            &self.weight,
            self.eps,
            self.weight_offset,
            w_gate_up,
            act,
        )?)
    }
}
