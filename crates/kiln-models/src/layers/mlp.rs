//! The gated MLP: `down(act(gate(x)) * up(x))`, with gate and up packed
//! into one projection.

use kiln_tensor::{Activation, Backend, Tensor};

use super::{Linear, RmsNorm, WeightLoader};
use crate::error::Result;

pub struct GatedMlp {
    /// `[2 * intermediate, hidden]`: the gate rows, then the up rows.
    pub gate_up: Tensor,
    pub down: Linear,
    pub activation: Activation,
}

impl GatedMlp {
    pub fn load(
        l: &WeightLoader,
        prefix: &str,
        hidden: usize,
        intermediate: usize,
        activation: Activation,
    ) -> Result<Self> {
        let gate_up = Linear::load_packed(
            l,
            &[format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")],
            hidden,
            &[intermediate, intermediate],
            false,
        )?
        .weight;
        Ok(GatedMlp {
            gate_up,
            down: Linear::load(
                l,
                &format!("{prefix}.down_proj"),
                intermediate,
                hidden,
                false,
            )?,
            activation,
        })
    }

    /// `residual + mlp(x)`.
    pub fn forward_add(&self, b: &dyn Backend, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let h = b.gated_linear(x, &self.gate_up, self.activation)?;
        self.down.forward_add(b, &h, residual)
    }

    /// `x + mlp(norm(x))`: the pre-norm block, the norm fused into the
    /// gate/up projection ([`RmsNorm::forward_gated_linear`]).
    pub fn forward_norm_add(&self, b: &dyn Backend, norm: &RmsNorm, x: &Tensor) -> Result<Tensor> {
        let h = norm.forward_gated_linear(b, x, &self.gate_up, self.activation)?;
        self.down.forward_add(b, &h, x)
    }
}
