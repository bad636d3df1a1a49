//! Self-attention with GQA, optional q/k/v/o biases, optional per-head q/k
//! RMSNorm (Qwen3, Gemma 3), RoPE, and the backend's cached attention.

use kiln_tensor::{AttentionParams, Backend, ForwardBatch, KvCache, Tensor};

use super::{Linear, RmsNorm, Rope, WeightLoader};
use crate::error::Result;

/// What differs between families' attention blocks.
#[derive(Debug, Clone)]
pub struct AttentionConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k with this eps.
    pub qk_norm_eps: Option<f32>,
    pub scale: f32,
    pub sliding_window: Option<usize>,
}

pub struct Attention {
    pub cfg: AttentionConfig,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
}

impl Attention {
    pub fn load(l: &WeightLoader, prefix: &str, cfg: AttentionConfig) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let q = Linear::load(
            l,
            &format!("{prefix}.q_proj"),
            h,
            cfg.num_heads * hd,
            cfg.qkv_bias,
        )?;
        let k = Linear::load(
            l,
            &format!("{prefix}.k_proj"),
            h,
            cfg.num_kv_heads * hd,
            cfg.qkv_bias,
        )?;
        let v = Linear::load(
            l,
            &format!("{prefix}.v_proj"),
            h,
            cfg.num_kv_heads * hd,
            cfg.qkv_bias,
        )?;
        let o = Linear::load(
            l,
            &format!("{prefix}.o_proj"),
            cfg.num_heads * hd,
            h,
            cfg.o_bias,
        )?;
        let (q_norm, k_norm) = match cfg.qk_norm_eps {
            Some(eps) => (
                Some(RmsNorm::load(
                    l,
                    &format!("{prefix}.q_norm.weight"),
                    hd,
                    eps,
                )?),
                Some(RmsNorm::load(
                    l,
                    &format!("{prefix}.k_norm.weight"),
                    hd,
                    eps,
                )?),
            ),
            None => (None, None),
        };
        Ok(Attention {
            cfg,
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
        })
    }

    /// Attention of the batch's new tokens `x [n, hidden]` over the cache of `layer`.
    pub fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        rope: &Rope,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        layer: usize,
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let positions = batch.positions.as_slice();
        let n = positions.len();
        let mut q = self.q.forward(b, x)?;
        let mut k = self.k.forward(b, x)?;
        let v = self.v.forward(b, x)?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn
                .forward(b, &q.reshape(&[n * c.num_heads, c.head_dim])?)?
                .reshape(&[n, c.num_heads * c.head_dim])?;
            k = kn
                .forward(b, &k.reshape(&[n * c.num_kv_heads, c.head_dim])?)?
                .reshape(&[n, c.num_kv_heads * c.head_dim])?;
        }
        let q = rope.apply(b, &q, positions, c.num_heads, c.head_dim)?;
        let k = rope.apply(b, &k, positions, c.num_kv_heads, c.head_dim)?;
        let params = AttentionParams {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: c.scale,
            sliding_window: c.sliding_window,
            softcap: None,
        };
        let out = b.attention(&q, &k, &v, cache, layer, batch, &params)?;
        self.o.forward(b, &out)
    }
}
