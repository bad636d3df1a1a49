//! LFM2 (`lfm2`, `lfm2_moe`, Liquid AI): gated short convolutions
//! ([`kiln_tensor::ShortConv`], a state of the last `conv_L_cache - 1`
//! inputs a sequence) interleaved with GQA attention layers. Reference:
//! transformers `models/lfm2/modeling_lfm2.py`.
//!
//! Quirks, each as transformers computes it:
//! - `layer_types` names each layer `conv` or `full_attention` (else
//!   `full_attn_idxs` lists the attention layers).
//! - Pre-norm blocks (`operator_norm`, `ffn_norm`, plain RMSNorm weights,
//!   `norm_eps`); the final norm is `model.embedding_norm`.
//! - Attention: per-head RMSNorm of q and k (`q_layernorm`, `k_layernorm`)
//!   before RoPE; the output projection is `out_proj`.
//! - The feed-forward (`w1`, `w3`, `w2`, SwiGLU) is `2/3` of
//!   `intermediate_size`, times `block_ffn_dim_multiplier`, rounded up to
//!   `block_multiple_of`, when `block_auto_adjust_ff_dim`.
//! - The embedding is the output head unless untied.
//! - `lfm2_moe`: the feed-forwards past the first `num_dense_layers` are
//!   sparse (`w1`/`w3`/`w2` experts; a sigmoid router whose `expert_bias`
//!   picks but does not weigh, renormalized, times
//!   `routed_scaling_factor`); its dense ones are `intermediate_size` wide.

use std::sync::Arc;

use kiln_formats::WeightSource;
use kiln_tensor::{
    Activation, AttentionParams, Backend, ForwardBatch, KvCache, QkNorm, RecurrentMixer, ShortConv,
    StateShape, Tensor, Weight,
};
use serde_json::Value;

use super::llama::Ffn;
use super::{Family, FamilyConfig, StepOutput};
use crate::config::{err, opt_f32, opt_usize, FamilyLayers, LayerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::layers::{Fuse, GatedMlp, Linear, LoadProgress, RmsNorm, Rope, WeightLoader};
use crate::CausalLm;

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "lfm2",
    model_types: &["lfm2", "lfm2_moe"],
    tied_by_default: true,
    parse,
    tensor_shapes: |cfg| Ok(tensor_shapes(cfg)),
    check_weights: |_, _| Ok(()),
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: None,
    load: |backend, source, cfg, progress| {
        Ok(Box::new(Lfm2::load(backend, source, cfg, progress)?))
    },
};

/// The keys of `config.json` only LFM2 reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Lfm2Config {
    pub rope_theta: f32,
    pub norm_eps: f32,
    /// Which layers are short convolutions.
    pub conv_layers: Vec<bool>,
    /// Taps of the convolution (`conv_L_cache`).
    pub conv_kernel: usize,
    /// The feed-forward's inner size, after the auto-adjustment.
    pub ff_dim: usize,
    /// `lfm2_moe`'s sparse feed-forwards.
    pub moe: Option<Lfm2Moe>,
}

/// LFM2-MoE's sparse feed-forwards.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lfm2Moe {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    /// Layers before this one keep a dense feed-forward.
    pub num_dense_layers: usize,
    pub expert_bias: bool,
    pub normalize: bool,
    pub scale: f32,
}

impl Lfm2Moe {
    fn shape(&self, hidden: usize) -> crate::layers::MoeShape {
        crate::layers::MoeShape {
            hidden,
            num_experts: self.num_experts,
            intermediate: self.expert_intermediate,
            shared_intermediate: None,
            shared_names: crate::layers::SharedNames::GatedQwen,
            selection_bias: self.expert_bias.then_some("expert_bias"),
            routing: kiln_tensor::Routing {
                top_k: self.top_k,
                scoring: kiln_tensor::Scoring::Sigmoid,
                normalize: self.normalize,
                scale: self.scale,
            },
            activation: kiln_tensor::ExpertActivation::Gated(Activation::Silu),
            names: crate::layers::ExpertNames::W1W3W2,
            held: None,
        }
    }

    /// Whether layer `i`'s feed-forward is sparse.
    pub fn sparse(&self, i: usize) -> bool {
        i >= self.num_dense_layers
    }
}

fn parse(c: &Value, num_layers: usize, _head_dim: usize) -> Result<FamilyLayers> {
    let rope = c.get("rope_parameters").filter(|v| v.is_object());
    let rope_theta = match opt_f32(c, "rope_theta")? {
        Some(t) => t,
        None => rope
            .map(|r| opt_f32(r, "rope_theta"))
            .transpose()?
            .flatten()
            .unwrap_or(1e6),
    };
    if let Some(t) = rope
        .and_then(|r| r.get("rope_type"))
        .and_then(Value::as_str)
    {
        if t != "default" {
            return Err(err(
                "rope_parameters",
                format!("rope_type {t:?} (LFM2 uses default)"),
            ));
        }
    }
    let conv_layers = match c.get("layer_types").and_then(Value::as_array) {
        Some(types) => {
            if types.len() != num_layers {
                return Err(err(
                    "layer_types",
                    format!("{} entries for {num_layers} layers", types.len()),
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("conv") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(err("layer_types", format!("unknown layer type {other:?}"))),
                })
                .collect::<Result<Vec<_>>>()?
        }
        None => {
            let Some(idxs) = c.get("full_attn_idxs").and_then(Value::as_array) else {
                return Err(err("layer_types", "neither layer_types nor full_attn_idxs"));
            };
            let full: Vec<usize> = idxs
                .iter()
                .filter_map(Value::as_u64)
                .map(|i| i as usize)
                .collect();
            (0..num_layers).map(|i| !full.contains(&i)).collect()
        }
    };
    if c.get("conv_bias").and_then(Value::as_bool) == Some(true) {
        return Err(err(
            "conv_bias",
            "biased short convolutions are not supported",
        ));
    }
    let is_moe = c.get("model_type").and_then(Value::as_str) == Some("lfm2_moe");
    let moe = if is_moe {
        let flag = |k: &str| c.get(k).and_then(Value::as_bool).unwrap_or(true);
        let m = Lfm2Moe {
            num_experts: opt_usize(c, "num_experts")?.unwrap_or(32),
            top_k: opt_usize(c, "num_experts_per_tok")?.unwrap_or(4),
            expert_intermediate: opt_usize(c, "moe_intermediate_size")?.unwrap_or(1792),
            num_dense_layers: opt_usize(c, "num_dense_layers")?.unwrap_or(2),
            expert_bias: flag("use_expert_bias"),
            normalize: flag("norm_topk_prob"),
            scale: opt_f32(c, "routed_scaling_factor")?.unwrap_or(1.0),
        };
        if m.num_experts == 0 || m.top_k == 0 || m.top_k > m.num_experts {
            return Err(err(
                "num_experts_per_tok",
                format!("{} of {} experts", m.top_k, m.num_experts),
            ));
        }
        Some(m)
    } else {
        None
    };
    let intermediate = opt_usize(c, "intermediate_size")?.unwrap_or(12288);
    let ff_dim = if !is_moe
        && c.get("block_auto_adjust_ff_dim")
            .and_then(Value::as_bool)
            .unwrap_or(true)
    {
        let mut d = 2 * intermediate / 3;
        if let Some(m) = opt_f32(c, "block_ffn_dim_multiplier")? {
            let multiple = opt_usize(c, "block_multiple_of")?.unwrap_or(256).max(1);
            d = ((m as f64 * d as f64) as usize).div_ceil(multiple) * multiple;
        }
        d
    } else {
        intermediate
    };
    let cfg = Lfm2Config {
        rope_theta,
        norm_eps: opt_f32(c, "norm_eps")?.unwrap_or(1e-5),
        conv_kernel: opt_usize(c, "conv_L_cache")?.unwrap_or(3),
        ff_dim,
        moe,
        conv_layers,
    };
    if cfg.conv_kernel == 0 || cfg.ff_dim == 0 {
        return Err(err(
            "conv_L_cache",
            "the kernel and feed-forward must be positive",
        ));
    }
    let layer_kinds = cfg
        .conv_layers
        .iter()
        .map(|&conv| {
            if conv {
                LayerKind::Recurrent
            } else {
                LayerKind::FullAttention
            }
        })
        .collect();
    Ok(FamilyLayers {
        family: FamilyConfig::Lfm2(cfg),
        layer_kinds,
        layer_kv: None,
    })
}

fn lfm2_config(cfg: &ModelConfig) -> Result<&Lfm2Config> {
    match &cfg.family {
        FamilyConfig::Lfm2(l) => Ok(l),
        _ => Err(super::wrong_family(cfg, "lfm2")),
    }
}

/// Every weight an LFM2 checkpoint with `cfg` holds.
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let Ok(f) = lfm2_config(cfg) else {
        return Vec::new();
    };
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for (l, &conv) in f.conv_layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let mut add = |n: &str, s: Vec<usize>| out.push((format!("{p}.{n}"), s));
        add("operator_norm.weight", vec![h]);
        add("ffn_norm.weight", vec![h]);
        if conv {
            add("conv.in_proj.weight", vec![3 * h, h]);
            add("conv.conv.weight", vec![h, 1, f.conv_kernel]);
            add("conv.out_proj.weight", vec![h, h]);
        } else {
            add("self_attn.q_proj.weight", vec![cfg.num_heads * hd, h]);
            add("self_attn.k_proj.weight", vec![cfg.num_kv_heads * hd, h]);
            add("self_attn.v_proj.weight", vec![cfg.num_kv_heads * hd, h]);
            add("self_attn.out_proj.weight", vec![h, cfg.num_heads * hd]);
            add("self_attn.q_layernorm.weight", vec![hd]);
            add("self_attn.k_layernorm.weight", vec![hd]);
        }
        match f.moe.filter(|m| m.sparse(l)) {
            Some(m) => {
                let prefix = format!("{p}.feed_forward");
                out.extend(
                    m.shape(h)
                        .tensor_shapes(&prefix, &format!("{prefix}.gate.weight")),
                );
            }
            None => {
                add("feed_forward.w1.weight", vec![f.ff_dim, h]);
                add("feed_forward.w3.weight", vec![f.ff_dim, h]);
                add("feed_forward.w2.weight", vec![h, f.ff_dim]);
            }
        }
    }
    out.push(("model.embedding_norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

enum Mixer {
    Conv {
        in_proj: Linear,
        conv: RecurrentMixer,
        out_proj: Linear,
    },
    Attention {
        qkv: Linear,
        q_norm: RmsNorm,
        k_norm: RmsNorm,
        o: Linear,
        params: AttentionParams,
        kv_slot: usize,
    },
}

struct Block {
    operator_norm: RmsNorm,
    mixer: Mixer,
    ffn_norm: RmsNorm,
    mlp: Ffn,
}

pub struct Lfm2 {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    embed: Weight,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    conv_layers: usize,
    conv_state: usize,
}

impl Lfm2 {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let f = lfm2_config(&cfg)?.clone();
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, f.norm_eps);
        let (nh, nkv) = (cfg.num_heads, cfg.num_kv_heads);
        let norm = |name: &str, dim: usize| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: l.tensor(name, &[dim])?,
                eps,
                weight_offset: 0.0,
            })
        };
        let embed = l.embedding("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let kv_slots = cfg.kv_slots();
        let mut recurrent = 0;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for (i, &is_conv) in f.conv_layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = if is_conv {
                let conv = RecurrentMixer::ShortConv(ShortConv {
                    dim: h,
                    kernel: f.conv_kernel,
                    conv: l.host(&format!("{p}.conv.conv.weight"), &[h, 1, f.conv_kernel])?,
                    state_layer: recurrent,
                    device: Default::default(),
                });
                recurrent += 1;
                if !backend.supports_recurrent(&conv) {
                    return Err(ModelError::Tensor(kiln_tensor::TensorError::Unsupported {
                        backend: backend.name(),
                        what: "gated short convolutions (LFM2)".into(),
                    }));
                }
                Mixer::Conv {
                    in_proj: Linear::load(&l, &format!("{p}.conv.in_proj"), h, 3 * h, false)?,
                    conv,
                    out_proj: Linear::load(&l, &format!("{p}.conv.out_proj"), h, h, false)?,
                }
            } else {
                let a = format!("{p}.self_attn");
                let slot = kv_slots[i];
                Mixer::Attention {
                    qkv: Linear::load_packed(
                        &l,
                        &[
                            format!("{a}.q_proj"),
                            format!("{a}.k_proj"),
                            format!("{a}.v_proj"),
                        ],
                        h,
                        &[nh * hd, nkv * hd, nkv * hd],
                        false,
                    )?,
                    q_norm: norm(&format!("{a}.q_layernorm.weight"), hd)?,
                    k_norm: norm(&format!("{a}.k_layernorm.weight"), hd)?,
                    o: Linear::load(&l, &format!("{a}.out_proj"), nh * hd, h, false)?,
                    params: AttentionParams {
                        num_heads: nh,
                        num_kv_heads: nkv,
                        head_dim: hd,
                        scale: (hd as f32).powf(-0.5),
                        sliding_window: None,
                        softcap: None,
                        kv_group: slot.group,
                        causal: true,
                    },
                    kv_slot: slot.slot,
                }
            };
            let ff = format!("{p}.feed_forward");
            let mlp = match f.moe.filter(|m| m.sparse(i)) {
                Some(m) => Ffn::Sparse(crate::layers::SparseMoe::load(
                    &l,
                    &ff,
                    &format!("{ff}.gate.weight"),
                    &m.shape(h),
                )?),
                None => Ffn::Dense(GatedMlp {
                    gate_up: Linear::load_packed(
                        &l,
                        &[format!("{ff}.w1"), format!("{ff}.w3")],
                        h,
                        &[f.ff_dim, f.ff_dim],
                        false,
                    )?,
                    down: Linear::load(&l, &format!("{ff}.w2"), f.ff_dim, h, false)?,
                    activation: Activation::Silu,
                }),
            };
            blocks.push(Block {
                operator_norm: norm(&format!("{p}.operator_norm.weight"), h)?,
                mixer,
                ffn_norm: norm(&format!("{p}.ffn_norm.weight"), h)?,
                mlp,
            });
        }
        let final_norm = norm("model.embedding_norm.weight", h)?;
        let lm_head = Linear::output(&l, &embed, cfg.tie_word_embeddings)?;
        Ok(Lfm2 {
            weight_bytes: l.weight_bytes(),
            backend,
            embed,
            blocks,
            norm: final_norm,
            lm_head,
            rope: Rope::new(hd, f.rope_theta, &crate::RopeScaling::None),
            conv_layers: recurrent,
            conv_state: (f.conv_kernel - 1) * h,
            cfg,
        })
    }

    fn state_shape(&self, num_slots: usize) -> StateShape {
        StateShape {
            num_layers: self.conv_layers,
            num_slots,
            conv: self.conv_state,
            recurrent: 0,
        }
    }

    fn step(&self, batch: &ForwardBatch, cache: &mut KvCache, out: StepOutput) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let mut x = b.embedding(&self.embed, &batch.token_ids)?;
        let (nh, hd) = (self.cfg.num_heads, self.cfg.head_dim);
        for blk in &self.blocks {
            let mixed = match &blk.mixer {
                Mixer::Conv {
                    in_proj,
                    conv,
                    out_proj,
                } => {
                    let bcx = in_proj.forward(b, &x, Fuse::norm(&blk.operator_norm))?;
                    let y = b.recurrent_mixer(&bcx, conv, batch, cache)?;
                    out_proj.forward(b, &y, Fuse::NONE.with_residual(&x))?
                }
                Mixer::Attention {
                    qkv,
                    q_norm,
                    k_norm,
                    o,
                    params,
                    kv_slot,
                } => {
                    let y = qkv.forward(b, &x, Fuse::norm(&blk.operator_norm))?;
                    let qk_norm = QkNorm {
                        v_weight: None,
                        q_weight: &q_norm.weight,
                        k_weight: &k_norm.weight,
                        eps: q_norm.eps,
                        weight_offset: 0.0,
                    };
                    let attn = b.qkv_attention(
                        &y,
                        cache,
                        *kv_slot,
                        batch,
                        params,
                        &self.rope.params(nh, hd),
                        Some(qk_norm),
                    )?;
                    o.forward(b, &attn, Fuse::NONE.with_residual(&x))?
                }
            };
            x = blk
                .mlp
                .forward_pre_norm(b, &mixed, &blk.ffn_norm, &batch.lora, true)?;
        }
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        if out == StepOutput::Hidden {
            return self.norm.forward(b, &x);
        }
        self.lm_head.forward(b, &x, Fuse::norm(&self.norm))
    }
}

impl CausalLm for Lfm2 {
    fn weight_bytes(&self) -> Option<&crate::WeightBytes> {
        Some(&self.weight_bytes)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The attention layers' KV blocks and one sequence's convolution state.
    fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        self.new_cache(num_blocks, block_size, 1)
    }

    /// The attention layers' KV blocks and `max_seqs` sequences' state.
    fn new_cache(&self, num_blocks: usize, block_size: usize, max_seqs: usize) -> Result<KvCache> {
        let kv = self
            .backend
            .alloc_kv_cache(self.cfg.kv_pool_shape(num_blocks, block_size))?;
        let shape = self.state_shape(max_seqs.max(1));
        Ok(kv.with_state(shape, self.backend.alloc_state(shape)?))
    }

    fn state_bytes_per_seq(&self) -> u64 {
        self.state_shape(1).bytes()
    }

    fn expert_load(&self) -> Vec<Vec<u64>> {
        self.blocks
            .iter()
            .filter_map(|b| b.mlp.expert_load())
            .collect()
    }

    fn forward(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        super::run_step(self.backend.as_ref(), batch, cache, |b, c| {
            self.step(b, c, StepOutput::Logits)
        })
    }

    fn hidden_states(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        self.step(batch, cache, StepOutput::Hidden)
    }
}
