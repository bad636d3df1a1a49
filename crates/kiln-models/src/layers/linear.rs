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

    /// Several projections of the same input packed into one: the weights
    /// `{prefix}.weight` of every prefix stacked by rows (biases likewise).
    pub fn load_packed(
        l: &WeightLoader,
        prefixes: &[String],
        in_dim: usize,
        out_dims: &[usize],
        bias: bool,
    ) -> Result<Self> {
        let names = |suffix: &str| -> Vec<String> {
            prefixes.iter().map(|p| format!("{p}.{suffix}")).collect()
        };
        let weight = l.stacked(
            &names("weight"),
            &out_dims
                .iter()
                .map(|&o| vec![o, in_dim])
                .collect::<Vec<_>>(),
        )?;
        let bias = if bias {
            Some(l.stacked(
                &names("bias"),
                &out_dims.iter().map(|&o| vec![o]).collect::<Vec<_>>(),
            )?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(b.linear(x, &self.weight, self.bias.as_ref())?)
    }

    /// `residual + self(x)`.
    pub fn forward_add(&self, b: &dyn Backend, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        Ok(b.linear_add(x, &self.weight, self.bias.as_ref(), residual)?)
    }
}
