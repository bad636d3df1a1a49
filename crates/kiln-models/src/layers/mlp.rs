//! The gated MLP: `down(act(gate(x)) * up(x))`, with gate and up packed
//! into one projection.

use kiln_tensor::{Activation, Backend, Epilogue, Tensor};

use super::{Fuse, Linear, WeightLoader};
use crate::error::Result;

pub struct GatedMlp {
    /// `[2 * intermediate, hidden]`: the gate rows, then the up rows.
    pub gate_up: Linear,
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
        )?;
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

    /// `fuse.residual + mlp(fuse.norm(x))`: the norm runs inside the
    /// gate/up product, the residual add inside the down product.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, fuse: Fuse<'_>) -> Result<Tensor> {
        let (first, last) = fuse.split();
        let h = self
            .gate_up
            .forward_epilogue(b, x, first, Epilogue::gated(self.activation))?;
        self.down.forward(b, &h, last)
    }
}
