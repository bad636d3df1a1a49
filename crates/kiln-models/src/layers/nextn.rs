//! A DeepSeek-V3-style multi-token-prediction layer, as DeepSeek-V3 and
//! GLM-4.5 checkpoints ship it after their decoder's layers
//! (`model.layers.{num_layers}`): for position `p`'s final hidden state `h`
//! and the token `t` after it, `eh_proj([enorm(embed(t)) ‖ hnorm(h)])`, then
//! one decoder block of the family's (writing its own one-layer cache), then
//! `shared_head.norm` and the model's output head — the logits of the token
//! two after `p`. `eh_proj` runs as two products over its column halves
//! ([`Linear::load_column_halves`]), each with its norm fused as the
//! product's prologue. The family owns the block and runs it between
//! [`NextN::input`] and [`NextN::output`].

use kiln_tensor::{Backend, Tensor, Weight};

use super::{Fuse, Linear, RmsNorm, WeightLoader};
use crate::error::Result;

pub struct NextN<B> {
    enorm: RmsNorm,
    hnorm: RmsNorm,
    eh_embed: Linear,
    eh_hidden: Linear,
    pub block: B,
    norm: RmsNorm,
}

impl<B> NextN<B> {
    /// The layer at `prefix` (`model.layers.61`), where the file has it,
    /// with the block `block` loads (given the prefix).
    pub fn load(
        l: &WeightLoader,
        prefix: &str,
        hidden: usize,
        eps: f32,
        block: impl FnOnce(&str) -> Result<B>,
    ) -> Result<Option<Self>> {
        if !l.contains(&format!("{prefix}.eh_proj.weight")) {
            return Ok(None);
        }
        let [eh_embed, eh_hidden] =
            Linear::load_column_halves(l, &format!("{prefix}.eh_proj.weight"), hidden, hidden)?;
        Ok(Some(NextN {
            enorm: RmsNorm::load(l, &format!("{prefix}.enorm.weight"), hidden, eps)?,
            hnorm: RmsNorm::load(l, &format!("{prefix}.hnorm.weight"), hidden, eps)?,
            eh_embed,
            eh_hidden,
            block: block(prefix)?,
            norm: RmsNorm::load(l, &format!("{prefix}.shared_head.norm.weight"), hidden, eps)?,
        }))
    }

    /// The block's input: `eh_proj([enorm(embed(tokens)) ‖ hnorm(hidden)])`.
    pub fn input(
        &self,
        b: &dyn Backend,
        embed: &Weight,
        tokens: &[u32],
        hidden: &Tensor,
    ) -> Result<Tensor> {
        let e = b.embedding(embed, tokens)?;
        let e = self.eh_embed.forward(b, &e, Fuse::norm(&self.enorm))?;
        self.eh_hidden
            .forward(b, hidden, Fuse::norm(&self.hnorm).with_residual(&e))
    }

    /// The logits (through `lm_head`) and the normed hidden state of the
    /// block's output `x` at `rows`.
    pub fn output(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        rows: &[u32],
        lm_head: &Linear,
    ) -> Result<(Tensor, Tensor)> {
        let x = b.gather_rows(x, rows)?;
        let out = self.norm.forward(b, &x)?;
        Ok((lm_head.forward(b, &out, Fuse::NONE)?, out))
    }
}
