//! Self-attention with GQA, optional q/k/v/o biases, optional per-head q/k
//! RMSNorm (Qwen3, Gemma 3), RoPE, and the backend's cached attention.

use kiln_scheduler::LayerSlot;
use kiln_tensor::{AttentionParams, Backend, ForwardBatch, KvCache, QkNorm, Tensor};

use super::{Fuse, Linear, RmsNorm, Rope, WeightLoader};
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
    /// A learned sink logit a head (`{prefix}.sinks`, gpt-oss).
    pub sinks: bool,
}

pub struct Attention {
    pub cfg: AttentionConfig,
    /// q, k and v projections packed: `[(heads + 2 * kv_heads) * head_dim, hidden]`.
    pub qkv: Linear,
    pub o: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    /// `[num_heads]`, with [`AttentionConfig::sinks`].
    pub sinks: Option<Tensor>,
}

impl Attention {
    pub fn load(l: &WeightLoader, prefix: &str, cfg: AttentionConfig) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let qkv = Linear::load_packed(
            l,
            &[
                format!("{prefix}.q_proj"),
                format!("{prefix}.k_proj"),
                format!("{prefix}.v_proj"),
            ],
            h,
            &[
                cfg.num_heads * hd,
                cfg.num_kv_heads * hd,
                cfg.num_kv_heads * hd,
            ],
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
        let sinks = match cfg.sinks {
            true if !l.backend.supports_attention_sinks() => {
                return Err(kiln_tensor::TensorError::Unsupported {
                    backend: l.backend.name(),
                    what: "attention sinks (the CPU backend runs them)".into(),
                }
                .into())
            }
            true => Some(l.tensor(&format!("{prefix}.sinks"), &[cfg.num_heads])?),
            false => None,
        };
        Ok(Attention {
            cfg,
            qkv,
            o,
            q_norm,
            k_norm,
            sinks,
        })
    }

    /// `fuse.residual +` attention of `fuse.norm(x)` for the batch's new
    /// tokens `x [n, hidden]` over the cache where the layer's keys and
    /// values live (`slot`, from the model's KV layout): the norm runs
    /// inside the packed qkv product, the residual add inside the output
    /// projection.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        fuse: Fuse<'_>,
        rope: &Rope,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        slot: LayerSlot,
    ) -> Result<Tensor> {
        let (first, last) = fuse.split();
        let qkv = self.qkv.forward(b, x, first)?;
        let c = &self.cfg;
        let params = AttentionParams {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: c.scale,
            sliding_window: c.sliding_window,
            softcap: None,
            kv_group: slot.group,
            causal: true,
        };
        let qk_norm = match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some(QkNorm {
                v_weight: None,
                q_weight: &q.weight,
                k_weight: &k.weight,
                eps: q.eps,
                weight_offset: q.weight_offset,
            }),
            _ => None,
        };
        let rope = rope.params(c.num_heads, c.head_dim);
        let out = match &self.sinks {
            Some(sinks) => {
                let (q, k, v) = kiln_tensor::qkv_rope(b, &qkv, batch, &params, &rope, qk_norm)?;
                b.attention_sinks(&q, &k, &v, cache, slot.slot, batch, &params, sinks)?
            }
            None => b.qkv_attention(&qkv, cache, slot.slot, batch, &params, &rope, qk_norm)?,
        };
        self.o.forward(b, &out, last)
    }
}
