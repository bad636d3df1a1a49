//! A linear projection `y = x · Wᵀ (+ b)` with Hugging Face weight layout `[out, in]`.

use kiln_tensor::{Backend, Tensor};

use super::WeightLoader;
use crate::error::Result;

pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// Load `{prefix}.weight` (`[out, in]`) and, when `bias`, `{prefix}.bias`.
    pub fn load(
        l: &WeightLoader,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = l.tensor(&format!("{prefix}.weight"), &[out_dim, in_dim])?;
        let bias = if bias {
            Some(l.tensor(&format!("{prefix}.bias"), &[out_dim])?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(b.linear(x, &self.weight, self.bias.as_ref())?)
    }
}
