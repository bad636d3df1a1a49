//! A linear projection `y = x · Wᵀ (+ b)` with Hugging Face weight layout
//! `[out, in]`, and [`Fuse`]: the norm and residual a block asks a layer to
//! fold into its products.

use kiln_tensor::{Backend, Epilogue, Tensor, Weight};

use super::{RmsNorm, WeightLoader};
use crate::error::Result;

/// What a block folds into a layer: an RMSNorm of the layer's input, run
/// inside its first product (the norm prologue of `matmul`), and a
/// residual added to its output inside its last (the residual epilogue).
/// The layer returns the value either way; the block decides where norms
/// and residuals go (a pre-norm block passes both, a post-norm block
/// normalizes the returned value itself and passes neither).
#[derive(Clone, Copy, Default)]
pub struct Fuse<'a> {
    pub norm: Option<&'a RmsNorm>,
    pub residual: Option<&'a Tensor>,
}

impl<'a> Fuse<'a> {
    /// Nothing folded in: the layer of `x` as it is.
    pub const NONE: Fuse<'static> = Fuse {
        norm: None,
        residual: None,
    };

    /// `norm` applied to the layer's input.
    pub fn norm(norm: &'a RmsNorm) -> Self {
        Fuse {
            norm: Some(norm),
            residual: None,
        }
    }

    /// This, with `residual` added to the layer's output.
    pub fn with_residual(self, residual: &'a Tensor) -> Self {
        Fuse {
            residual: Some(residual),
            ..self
        }
    }

    /// The part for a layer's first product (the norm) and the part for
    /// its last (the residual).
    pub fn split(self) -> (Fuse<'a>, Fuse<'a>) {
        (
            Fuse {
                norm: self.norm,
                residual: None,
            },
            Fuse {
                norm: None,
                residual: self.residual,
            },
        )
    }
}

pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// The output projection: `lm_head.weight` (`[vocab, hidden]`) unless
    /// the embedding is tied to it (or the file has none), then the
    /// embedding table itself.
    pub fn output(l: &WeightLoader, embed: &Weight, tied: bool) -> Result<Self> {
        let shape = embed.shape().to_vec();
        let weight = match tied {
            false => l.optional_weight("lm_head.weight", &shape)?,
            true => None,
        };
        Ok(Linear {
            weight: l.supported(weight.unwrap_or_else(|| embed.clone()))?,
            bias: None,
        })
    }

    /// Load `{prefix}.weight` (`[out, in]`) and, when `bias`, `{prefix}.bias`.
    pub fn load(
        l: &WeightLoader,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = l.weight(&format!("{prefix}.weight"), &[out_dim, in_dim])?;
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
        let weight = l.stacked_weight(
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

    /// `fuse.residual + self(fuse.norm(x))`, one `matmul`.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, fuse: Fuse<'_>) -> Result<Tensor> {
        self.forward_epilogue(b, x, fuse, Epilogue::bias(self.bias.as_ref()))
    }

    /// The product with `epilogue` (which carries the bias, if any), the
    /// norm and residual of `fuse` around it.
    pub(crate) fn forward_epilogue(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        fuse: Fuse<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<Tensor> {
        let epilogue = match fuse.residual {
            Some(r) => epilogue.with_residual(r),
            None => epilogue,
        };
        let prologue = fuse.norm.map(RmsNorm::prologue);
        Ok(b.matmul(x, &self.weight, prologue, epilogue)?)
    }
}
