//! A linear projection `y = x · Wᵀ (+ b)` with Hugging Face weight layout
//! `[out, in]`, and [`Fuse`]: the norm and residual a block asks a layer to
//! fold into its products.

use kiln_tensor::{Backend, Epilogue, LoraBatch, LoraDelta, Tensor, Weight};

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
    /// The step's LoRA adapters: a layer an adapter adapts adds its delta
    /// to that adapter's rows (and then runs unfused: the delta needs the
    /// normed input and goes in before any gating).
    pub lora: Option<&'a LoraBatch>,
}

impl<'a> Fuse<'a> {
    /// Nothing folded in: the layer of `x` as it is.
    pub const NONE: Fuse<'static> = Fuse {
        norm: None,
        residual: None,
        lora: None,
    };

    /// `norm` applied to the layer's input.
    pub fn norm(norm: &'a RmsNorm) -> Self {
        Fuse {
            norm: Some(norm),
            ..Fuse::NONE
        }
    }

    /// This, with `residual` added to the layer's output.
    pub fn with_residual(self, residual: &'a Tensor) -> Self {
        Fuse {
            residual: Some(residual),
            ..self
        }
    }

    /// This, with the step's LoRA adapters (none when the batch has none).
    pub fn with_lora(self, lora: &'a LoraBatch) -> Self {
        Fuse {
            lora: (!lora.is_empty()).then_some(lora),
            ..self
        }
    }

    /// The part for a layer's first product (the norm) and the part for
    /// its last (the residual); both keep the adapters.
    pub fn split(self) -> (Fuse<'a>, Fuse<'a>) {
        (
            Fuse {
                norm: self.norm,
                residual: None,
                lora: self.lora,
            },
            Fuse {
                norm: None,
                residual: self.residual,
                lora: self.lora,
            },
        )
    }
}

pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
    /// The modules packed here, by name (`model.layers.0.self_attn.q_proj`)
    /// with their output columns: what a LoRA adapter addresses.
    pub parts: Vec<(String, std::ops::Range<usize>)>,
}

impl Linear {
    /// `name` (`[rows, 2 · half]`, no bias) as two products over its left
    /// and right column halves: `W · [a ‖ b] = W_a · a + W_b · b` (an MTP
    /// head's projection of a concatenation, each half with its own norm
    /// fused as the product's prologue). Split on the host, dense.
    pub fn load_column_halves(
        l: &WeightLoader,
        name: &str,
        rows: usize,
        half: usize,
    ) -> Result<[Linear; 2]> {
        let w = l.host(name, &[rows, 2 * half])?;
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let side = |right: bool| -> Result<Linear> {
            let cols: Vec<f32> = w
                .chunks(2 * half)
                .flat_map(|r| if right { &r[half..] } else { &r[..half] })
                .copied()
                .collect();
            Linear::from_host(l, module, [rows, half], &cols, None)
        };
        Ok([side(false)?, side(true)?])
    }

    /// Module `module` from values its family reshaped on the host
    /// (`[rows, cols]` row-major, the bias `[rows]`): dense, on the
    /// loader's backend, counted in the model's weight bytes.
    pub fn from_host(
        l: &WeightLoader,
        module: &str,
        [rows, cols]: [usize; 2],
        values: &[f32],
        bias: Option<&[f32]>,
    ) -> Result<Linear> {
        let weight = Weight::Dense(l.backend.upload(&[rows, cols], values)?);
        l.note(&weight);
        Ok(Linear {
            weight,
            bias: bias.map(|b| l.backend.upload(&[rows], b)).transpose()?,
            parts: vec![(module.to_string(), 0..rows)],
        })
    }

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
            parts: vec![("lm_head".to_string(), 0..shape[0])],
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
        Ok(Linear {
            weight,
            bias,
            parts: vec![(prefix.to_string(), 0..out_dim)],
        })
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
        let mut at = 0;
        let parts = prefixes
            .iter()
            .zip(out_dims)
            .map(|(p, &o)| {
                at += o;
                (p.clone(), at - o..at)
            })
            .collect();
        Ok(Linear {
            weight,
            bias,
            parts,
        })
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
        if let Some(lora) = fuse
            .lora
            .filter(|l| self.parts.iter().any(|(p, _)| l.touches(p)))
        {
            return self.forward_lora(b, x, fuse, epilogue, lora);
        }
        let epilogue = match fuse.residual {
            Some(r) => epilogue.with_residual(r),
            None => epilogue,
        };
        let prologue = fuse.norm.map(RmsNorm::prologue);
        Ok(b.matmul(x, &self.weight, prologue, epilogue)?)
    }

    /// The product as `kiln_tensor::matmul_unfused` runs it — norm, product
    /// and bias, (gating, residual) — with each adapter's delta added to its
    /// rows after the bias: the rows of no adapter get the bits the fused
    /// path gives on a backend whose fused path is that one (the CPU).
    fn forward_lora(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        fuse: Fuse<'_>,
        epilogue: Epilogue<'_>,
        lora: &LoraBatch,
    ) -> Result<Tensor> {
        let normed;
        let x = match fuse.norm {
            Some(n) => {
                normed = n.forward(b, x)?;
                &normed
            }
            None => x,
        };
        let y = b.matmul(x, &self.weight, None, Epilogue::bias(epilogue.bias))?;
        let deltas: Vec<LoraDelta<'_>> = lora
            .groups
            .iter()
            .flat_map(|g| {
                self.parts.iter().filter_map(move |(name, cols)| {
                    g.adapter.projs.get(name).map(|proj| LoraDelta {
                        rows: &g.rows,
                        proj,
                        cols: cols.clone(),
                    })
                })
            })
            .collect();
        let after = Epilogue {
            bias: None,
            gated: epilogue.gated,
            residual: fuse.residual.or(epilogue.residual),
        };
        Ok(b.lora_apply(&y, x, &deltas, after)?)
    }
}
