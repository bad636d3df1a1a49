//! The gated MLP: `down(act(gate(x)) * up(x))`.

use kiln_tensor::{Activation, Backend, Tensor};

use super::{Linear, WeightLoader};
use crate::error::Result;

pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
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
        Ok(GatedMlp {
            gate: Linear::load(
                l,
                &format!("{prefix}.gate_proj"),
                hidden,
                intermediate,
                false,
            )?,
            up: Linear::load(l, &format!("{prefix}.up_proj"), hidden, intermediate, false)?,
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

    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        let g = self.gate.forward(b, x)?;
        let u = self.up.forward(b, x)?;
        let h = b.gated_activation(&g, &u, self.activation)?;
        self.down.forward(b, &h)
    }
}
