//! Qwen3.5 text decoders (`qwen3_5_text`, `qwen3_5_moe_text`) and Qwen3-Next
//! (`qwen3_next`, their forerunner: the same layers, its DeltaNet
//! projections grouped by key head, sparse layers by `decoder_sparse_step`
//! and `mlp_only_layers`; the text side
//! of the `qwen3_5` / `qwen3_5_moe` multimodal checkpoints, whose
//! `text_config` `kiln-formats` lifts): a hybrid of gated DeltaNet layers
//! (linear attention with a fixed-size state, [`kiln_tensor::recurrent`])
//! and gated full-attention layers; the MoE models' every feed-forward is a
//! sparse block (softmax top-k renormalized, a shared expert under a sigmoid
//! gate). Reference: transformers `models/qwen3_5/modeling_qwen3_5.py`,
//! `models/qwen3_5_moe/modeling_qwen3_5_moe.py` and
//! `models/qwen3_next/modeling_qwen3_next.py` (whose `in_proj_qkvz` rows are
//! `[key head][q | k | v | z of its value heads]` and `in_proj_ba` rows
//! `[key head][b | a]`: regrouped at load into the packed `qkv | z | b | a`).
//!
//! Quirks, each as transformers computes it:
//! - `layer_types` names each layer `linear_attention` or `full_attention`
//!   (else every `full_attention_interval`-th layer, 4 by default, is full).
//! - RMSNorms scale by `1 + w` (zero-centred), q/k norms included; the
//!   DeltaNet's output norm by `w` (and a SiLU gate).
//! - Full attention: `q_proj` gives each head its query and then an output
//!   gate (`[heads][2][head_dim]` rows); the attention output is multiplied
//!   by `sigmoid(gate)` before `o_proj`. RoPE rotates the first
//!   `partial_rotary_factor · head_dim` dims (multimodal RoPE's sections
//!   coincide for text, where the three position ids are equal).
//! - DeltaNet: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` are
//!   one packed product here; the convolution, the delta rule and the gated
//!   norm are [`kiln_tensor::Ops::recurrent_mixer`].
//! - Recurrent layers keep no KV: [`LayerKind::Recurrent`]; their state
//!   lives beside the KV blocks ([`CausalLm::new_kv_cache`] allocates one
//!   slot a sequence the cache can hold).

use std::sync::Arc;

use kiln_formats::WeightSource;
use kiln_tensor::{
    Activation, AttentionParams, Backend, ForwardBatch, GatedDeltaNet, KvCache, QkNorm,
    RecurrentMixer, StateShape, Tensor, Weight,
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
    name: "qwen3_5",
    model_types: &["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"],
    tied_by_default: false,
    parse,
    tensor_shapes: |cfg| Ok(tensor_shapes(cfg)),
    check_weights: |_, _| Ok(()),
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: None,
    load: |backend, source, cfg, progress| {
        Ok(Box::new(Qwen35::load(backend, source, cfg, progress)?))
    },
};

/// The keys of `config.json` only Qwen3.5 reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Config {
    pub rope_theta: f32,
    /// Dims of each head RoPE rotates (the rest pass through).
    pub rotary_dim: usize,
    /// Which layers are gated DeltaNet (`linear_attention`).
    pub linear_layers: Vec<bool>,
    pub linear_k_heads: usize,
    pub linear_v_heads: usize,
    pub linear_k_dim: usize,
    pub linear_v_dim: usize,
    pub conv_kernel: usize,
    /// The sparse feed-forward of the MoE models (`None`: dense).
    pub moe: Option<Qwen35Moe>,
    /// Which layers' feed-forwards are sparse (all of a MoE model's but
    /// Qwen3-Next's `mlp_only_layers` and off-step ones).
    pub sparse_layers: Vec<bool>,
    /// Qwen3-Next's projection layout (`in_proj_qkvz`, `in_proj_ba`).
    pub next: bool,
    /// Multi-token-prediction layers the config declares
    /// (`mtp_num_hidden_layers`; `num_nextn_predict_layers`), if it does.
    /// The head is read when the checkpoint holds it and has one layer
    /// (undeclared: one, as vLLM assumes).
    pub mtp_layers: Option<usize>,
}

/// The sparse feed-forward of `qwen3_5_moe_text` and `qwen3_next`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Qwen35Moe {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub shared_intermediate: usize,
    /// Renormalize the kept weights (always for Qwen3.5-MoE; Qwen3-Next's
    /// `norm_topk_prob`).
    pub normalize: bool,
}

impl Qwen35Moe {
    fn shape(&self, hidden: usize) -> crate::layers::MoeShape {
        crate::layers::MoeShape {
            hidden,
            num_experts: self.num_experts,
            intermediate: self.expert_intermediate,
            shared_intermediate: Some(self.shared_intermediate),
            shared_names: crate::layers::SharedNames::GatedQwen,
            selection_bias: None,
            routing: kiln_tensor::Routing {
                top_k: self.top_k,
                scoring: kiln_tensor::Scoring::Softmax,
                normalize: self.normalize,
                scale: 1.0,
            },
            activation: kiln_tensor::ExpertActivation::Gated(Activation::Silu),
            names: crate::layers::ExpertNames::Proj,
            held: None,
        }
    }
}

impl Qwen35Config {
    /// Channels through a DeltaNet layer's convolution.
    fn conv_dim(&self) -> usize {
        2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim
    }

    /// f32 values of one DeltaNet layer's state a sequence: the
    /// convolution's past inputs and one `k_dim × v_dim` matrix a value head.
    pub fn state_values(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
            + self.linear_v_heads * self.linear_k_dim * self.linear_v_dim
    }
}

fn parse(c: &Value, num_layers: usize, head_dim: usize) -> Result<FamilyLayers> {
    let rope = c.get("rope_parameters").filter(|v| v.is_object());
    let from_rope = |key: &str| -> Result<Option<f32>> {
        match opt_f32(c, key)? {
            Some(v) => Ok(Some(v)),
            None => rope
                .map(|r| opt_f32(r, key))
                .transpose()
                .map(Option::flatten),
        }
    };
    let rope_theta = from_rope("rope_theta")?.unwrap_or(1e7);
    let partial = from_rope("partial_rotary_factor")?.unwrap_or(0.25);
    let rotary_dim = (head_dim as f32 * partial) as usize;
    if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
        return Err(err(
            "partial_rotary_factor",
            format!("{partial} of head_dim {head_dim} is no even number of rotated dims"),
        ));
    }
    if let Some(t) = rope
        .and_then(|r| r.get("rope_type"))
        .and_then(Value::as_str)
    {
        if t != "default" {
            return Err(err(
                "rope_parameters",
                format!("rope_type {t:?} (Qwen3.5 uses default)"),
            ));
        }
    }
    let linear_layers = match c.get("layer_types").and_then(Value::as_array) {
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
                    Some("linear_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(err("layer_types", format!("unknown layer type {other:?}"))),
                })
                .collect::<Result<Vec<_>>>()?
        }
        None => {
            let interval = opt_usize(c, "full_attention_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(err("full_attention_interval", "must be positive"));
            }
            (0..num_layers).map(|i| (i + 1) % interval != 0).collect()
        }
    };
    let model_type = c.get("model_type").and_then(Value::as_str).unwrap_or("");
    let next = model_type == "qwen3_next";
    let sparse_layers: Vec<bool> = {
        let step = opt_usize(c, "decoder_sparse_step")?.unwrap_or(1).max(1);
        let dense_only: Vec<usize> = c
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|v| v as usize)
                    .collect()
            })
            .unwrap_or_default();
        let moe = matches!(model_type, "qwen3_5_moe_text" | "qwen3_next")
            && opt_usize(c, "num_experts")? != Some(0);
        (0..num_layers)
            .map(|l| moe && !dense_only.contains(&l) && (l + 1) % step == 0)
            .collect()
    };
    if c.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        return Err(err("attention_bias", "Qwen3.5 attention has no biases"));
    }
    if !matches!(
        c.get("hidden_act").and_then(Value::as_str),
        None | Some("silu")
    ) {
        return Err(err("hidden_act", "Qwen3.5 uses silu"));
    }
    let cfg = Qwen35Config {
        rope_theta,
        rotary_dim,
        linear_k_heads: opt_usize(c, "linear_num_key_heads")?.unwrap_or(16),
        linear_v_heads: opt_usize(c, "linear_num_value_heads")?.unwrap_or(32),
        linear_k_dim: opt_usize(c, "linear_key_head_dim")?.unwrap_or(128),
        linear_v_dim: opt_usize(c, "linear_value_head_dim")?.unwrap_or(128),
        conv_kernel: opt_usize(c, "linear_conv_kernel_dim")?.unwrap_or(4),
        moe: match model_type {
            "qwen3_5_moe_text" | "qwen3_next" => Some(Qwen35Moe {
                num_experts: opt_usize(c, "num_experts")?.unwrap_or(if next { 512 } else { 256 }),
                top_k: opt_usize(c, "num_experts_per_tok")?.unwrap_or(if next { 10 } else { 8 }),
                expert_intermediate: opt_usize(c, "moe_intermediate_size")?.unwrap_or(512),
                shared_intermediate: opt_usize(c, "shared_expert_intermediate_size")?
                    .unwrap_or(512),
                normalize: !next
                    || c.get("norm_topk_prob")
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
            })
            .filter(|m| m.num_experts > 0),
            _ => None,
        },
        sparse_layers,
        next,
        linear_layers,
        mtp_layers: match opt_usize(c, "mtp_num_hidden_layers")? {
            Some(n) => Some(n),
            None => opt_usize(c, "num_nextn_predict_layers")?,
        },
    };
    if let Some(m) = &cfg.moe {
        if m.num_experts == 0 || m.top_k == 0 || m.top_k > m.num_experts {
            return Err(err(
                "num_experts_per_tok",
                format!("{} of {} experts", m.top_k, m.num_experts),
            ));
        }
    }
    if cfg.linear_k_heads == 0
        || cfg.linear_v_heads % cfg.linear_k_heads != 0
        || cfg.conv_kernel == 0
        || cfg.linear_k_dim == 0
        || cfg.linear_v_dim == 0
    {
        return Err(err(
            "linear_num_value_heads",
            format!(
                "{} value heads over {} key heads of {}/{} dims, kernel {}",
                cfg.linear_v_heads,
                cfg.linear_k_heads,
                cfg.linear_k_dim,
                cfg.linear_v_dim,
                cfg.conv_kernel
            ),
        ));
    }
    let layer_kinds = cfg
        .linear_layers
        .iter()
        .map(|&l| {
            if l {
                LayerKind::Recurrent
            } else {
                LayerKind::FullAttention
            }
        })
        .collect();
    Ok(FamilyLayers {
        family: FamilyConfig::Qwen35(cfg),
        layer_kinds,
        layer_kv: None,
    })
}

fn qwen35_config(cfg: &ModelConfig) -> Result<&Qwen35Config> {
    match &cfg.family {
        FamilyConfig::Qwen35(q) => Ok(q),
        _ => Err(super::wrong_family(cfg, "qwen3_5")),
    }
}

/// Every weight a Qwen3.5 text checkpoint with `cfg` holds (with the
/// multi-token-prediction head where the config declares one layer).
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let Ok(q) = qwen35_config(cfg) else {
        return Vec::new();
    };
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    let vdim = q.linear_v_heads * q.linear_v_dim;
    let mut layer = |p: &str, linear: bool, sparse: bool| {
        let mut add = |n: &str, s: Vec<usize>| out.push((format!("{p}.{n}"), s));
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        if linear && q.next {
            add(
                "linear_attn.in_proj_qkvz.weight",
                vec![q.conv_dim() + vdim, h],
            );
            add(
                "linear_attn.in_proj_ba.weight",
                vec![2 * q.linear_v_heads, h],
            );
        } else if linear {
            add("linear_attn.in_proj_qkv.weight", vec![q.conv_dim(), h]);
            add("linear_attn.in_proj_z.weight", vec![vdim, h]);
            add("linear_attn.in_proj_b.weight", vec![q.linear_v_heads, h]);
            add("linear_attn.in_proj_a.weight", vec![q.linear_v_heads, h]);
        }
        if linear {
            add(
                "linear_attn.conv1d.weight",
                vec![q.conv_dim(), 1, q.conv_kernel],
            );
            add("linear_attn.A_log", vec![q.linear_v_heads]);
            add("linear_attn.dt_bias", vec![q.linear_v_heads]);
            add("linear_attn.norm.weight", vec![q.linear_v_dim]);
            add("linear_attn.out_proj.weight", vec![h, vdim]);
        } else {
            add("self_attn.q_proj.weight", vec![2 * cfg.num_heads * hd, h]);
            add("self_attn.k_proj.weight", vec![cfg.num_kv_heads * hd, h]);
            add("self_attn.v_proj.weight", vec![cfg.num_kv_heads * hd, h]);
            add("self_attn.o_proj.weight", vec![h, cfg.num_heads * hd]);
            add("self_attn.q_norm.weight", vec![hd]);
            add("self_attn.k_norm.weight", vec![hd]);
        }
        match q.moe.filter(|_| sparse) {
            Some(m) => {
                let prefix = format!("{p}.mlp");
                out.extend(
                    m.shape(h)
                        .tensor_shapes(&prefix, &format!("{prefix}.gate.weight")),
                );
            }
            None => {
                add("mlp.gate_proj.weight", vec![i, h]);
                add("mlp.up_proj.weight", vec![i, h]);
                add("mlp.down_proj.weight", vec![h, i]);
            }
        }
    };
    for (l, &linear) in q.linear_layers.iter().enumerate() {
        layer(&format!("model.layers.{l}"), linear, q.sparse_layers[l]);
    }
    if q.mtp_layers == Some(1) {
        layer("mtp.layers.0", false, q.moe.is_some());
        out.push(("mtp.fc.weight".to_string(), vec![h, 2 * h]));
        for n in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
            out.push((format!("mtp.{n}.weight"), vec![h]));
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// A zero-centred RMSNorm (`1 + w`).
fn norm(l: &WeightLoader, name: &str, dim: usize, eps: f32) -> Result<RmsNorm> {
    Ok(RmsNorm {
        weight: l.tensor(name, &[dim])?,
        eps,
        weight_offset: 1.0,
    })
}

/// A gated full-attention layer (`{a}` = `….self_attn`) writing KV slot
/// `slot` of group `group`: `q_proj`'s rows are `[head][query | gate][head_dim]`,
/// packed here as the queries of every head, k, v, then the gates.
fn attention_mixer(
    l: &WeightLoader,
    backend: &Arc<dyn Backend>,
    cfg: &ModelConfig,
    a: &str,
    group: usize,
    slot: usize,
) -> Result<Mixer> {
    let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
    let (nh, nkv) = (cfg.num_heads, cfg.num_kv_heads);
    let qg = l.host(&format!("{a}.q_proj.weight"), &[2 * nh * hd, h])?;
    let kw = l.host(&format!("{a}.k_proj.weight"), &[nkv * hd, h])?;
    let vw = l.host(&format!("{a}.v_proj.weight"), &[nkv * hd, h])?;
    let row = |r: usize| &qg[r * h..(r + 1) * h];
    let mut packed = Vec::with_capacity((2 * nh + 2 * nkv) * hd * h);
    for head in 0..nh {
        for d in 0..hd {
            packed.extend_from_slice(row(head * 2 * hd + d));
        }
    }
    packed.extend_from_slice(&kw);
    packed.extend_from_slice(&vw);
    for head in 0..nh {
        for d in 0..hd {
            packed.extend_from_slice(row(head * 2 * hd + hd + d));
        }
    }
    let rows = (2 * nh + 2 * nkv) * hd;
    let weight = Weight::Dense(backend.upload(&[rows, h], &packed)?);
    l.note(&weight);
    Ok(Mixer::Attention {
        qkvg: Linear {
            weight,
            bias: None,
            parts: vec![
                (format!("{a}.q_proj"), 0..nh * hd),
                (format!("{a}.k_proj"), nh * hd..(nh + nkv) * hd),
                (format!("{a}.v_proj"), (nh + nkv) * hd..(nh + 2 * nkv) * hd),
            ],
        },
        q_norm: norm(l, &format!("{a}.q_norm.weight"), hd, eps)?,
        k_norm: norm(l, &format!("{a}.k_norm.weight"), hd, eps)?,
        o: Linear::load(l, &format!("{a}.o_proj"), nh * hd, h, false)?,
        params: AttentionParams {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: (hd as f32).powf(-0.5),
            sliding_window: None,
            softcap: None,
            kv_group: group,
            causal: true,
        },
        kv_slot: slot,
    })
}

/// The feed-forward of layer `p` (`model.layers.N`, `mtp.layers.N`): the
/// sparse block where `sparse`, else the gated MLP.
fn feed_forward(
    l: &WeightLoader,
    q: &Qwen35Config,
    cfg: &ModelConfig,
    p: &str,
    sparse: bool,
) -> Result<Ffn> {
    let h = cfg.hidden_size;
    Ok(match q.moe.filter(|_| sparse) {
        Some(m) => {
            let prefix = format!("{p}.mlp");
            Ffn::Sparse(crate::layers::SparseMoe::load(
                l,
                &prefix,
                &format!("{prefix}.gate.weight"),
                &m.shape(h),
            )?)
        }
        None => Ffn::Dense(GatedMlp::load(
            l,
            &format!("{p}.mlp"),
            h,
            cfg.intermediate_size,
            Activation::Silu,
        )?),
    })
}

/// The multi-token-prediction head (`mtp.*`): from the final hidden state
/// `h` of position `p` and the token `t` after it, `fc(norm_e(embed(t)) ‖
/// norm_h(h))` through one gated full-attention block (with its own KV) and
/// `norm`, whose output the shared `lm_head` reads — the token two after
/// `p` — and the next depth takes as its hidden state. `fc` is kept as its
/// two halves, the embedding's and the hidden state's, so the concatenation
/// is a sum of two products.
struct Mtp {
    norm_embed: RmsNorm,
    norm_hidden: RmsNorm,
    fc_embed: Linear,
    fc_hidden: Linear,
    block: Block,
    norm: RmsNorm,
}

impl Mtp {
    fn load(
        l: &WeightLoader,
        backend: &Arc<dyn Backend>,
        q: &Qwen35Config,
        cfg: &ModelConfig,
    ) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let [fc_embed, fc_hidden] = Linear::load_column_halves(l, "mtp.fc.weight", h, h)?;
        let p = "mtp.layers.0";
        Ok(Mtp {
            norm_embed: norm(l, "mtp.pre_fc_norm_embedding.weight", h, eps)?,
            norm_hidden: norm(l, "mtp.pre_fc_norm_hidden.weight", h, eps)?,
            fc_embed,
            fc_hidden,
            block: Block {
                input_norm: norm(l, &format!("{p}.input_layernorm.weight"), h, eps)?,
                mixer: attention_mixer(l, backend, cfg, &format!("{p}.self_attn"), 0, 0)?,
                post_norm: norm(l, &format!("{p}.post_attention_layernorm.weight"), h, eps)?,
                mlp: feed_forward(l, q, cfg, p, q.moe.is_some())?,
            },
            norm: norm(l, "mtp.norm.weight", h, eps)?,
        })
    }
}

/// Qwen3-Next's `in_proj_qkvz` (`[key head][q | k | v | z]`) and
/// `in_proj_ba` (`[key head][b | a]`) regrouped into the packed `q | k | v |
/// z | b | a` rows the DeltaNet op reads (a row permutation, on the host).
fn next_projections(
    l: &WeightLoader,
    backend: &dyn Backend,
    a: &str,
    q: &Qwen35Config,
    h: usize,
) -> Result<Linear> {
    let (kh, vh, kd, vd) = (
        q.linear_k_heads,
        q.linear_v_heads,
        q.linear_k_dim,
        q.linear_v_dim,
    );
    let g = vh / kh;
    let qkvz = l.host(
        &format!("{a}.in_proj_qkvz.weight"),
        &[q.conv_dim() + vh * vd, h],
    )?;
    let ba = l.host(&format!("{a}.in_proj_ba.weight"), &[2 * vh, h])?;
    let per_head = 2 * kd + 2 * g * vd;
    let rows = |m: &[f32], r: std::ops::Range<usize>| m[r.start * h..r.end * h].to_vec();
    let mut out = Vec::with_capacity((q.conv_dim() + vh * vd + 2 * vh) * h);
    // q, k, v, z: each part of every key head in turn.
    for (off, len) in [
        (0, kd),
        (kd, kd),
        (2 * kd, g * vd),
        (2 * kd + g * vd, g * vd),
    ] {
        for head in 0..kh {
            let r0 = head * per_head + off;
            out.extend(rows(&qkvz, r0..r0 + len));
        }
    }
    for off in [0, g] {
        for head in 0..kh {
            let r0 = head * 2 * g + off;
            out.extend(rows(&ba, r0..r0 + g));
        }
    }
    let n = out.len() / h;
    let weight = Weight::Dense(backend.upload(&[n, h], &out)?);
    l.note(&weight);
    Ok(Linear {
        weight,
        bias: None,
        parts: vec![
            (format!("{a}.in_proj_qkvz"), 0..q.conv_dim() + vh * vd),
            (format!("{a}.in_proj_ba"), q.conv_dim() + vh * vd..n),
        ],
    })
}

enum Mixer {
    /// Gated DeltaNet: the packed in-projections, the op, the out-projection.
    Linear {
        proj: Linear,
        delta: RecurrentMixer,
        out: Linear,
    },
    /// Gated full attention: `q | k | v | gate` packed (queries and gates
    /// de-interleaved at load).
    Attention {
        qkvg: Linear,
        q_norm: RmsNorm,
        k_norm: RmsNorm,
        o: Linear,
        params: AttentionParams,
        kv_slot: usize,
    },
}

struct Block {
    input_norm: RmsNorm,
    mixer: Mixer,
    post_norm: RmsNorm,
    mlp: Ffn,
}

pub struct Qwen35 {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    embed: Weight,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    /// One slot's recurrent state, per recurrent layer (conv, recurrence).
    state: (usize, usize),
    recurrent_layers: usize,
    /// The multi-token-prediction head, where the checkpoint has one.
    mtp: Option<Mtp>,
}

impl Qwen35 {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let q = qwen35_config(&cfg)?.clone();
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed = l.embedding("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let kv_slots = cfg.kv_slots();
        let vdim = q.linear_v_heads * q.linear_v_dim;
        let mut recurrent = 0;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for (i, &linear) in q.linear_layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = if linear {
                let a = format!("{p}.linear_attn");
                let cd = q.conv_dim();
                let delta = GatedDeltaNet {
                    k_heads: q.linear_k_heads,
                    v_heads: q.linear_v_heads,
                    k_dim: q.linear_k_dim,
                    v_dim: q.linear_v_dim,
                    kernel: q.conv_kernel,
                    conv: l.host(&format!("{a}.conv1d.weight"), &[cd, 1, q.conv_kernel])?,
                    a_log: l.host(&format!("{a}.A_log"), &[q.linear_v_heads])?,
                    dt_bias: l.host(&format!("{a}.dt_bias"), &[q.linear_v_heads])?,
                    norm: l.host(&format!("{a}.norm.weight"), &[q.linear_v_dim])?,
                    eps,
                    state_layer: recurrent,
                    device: Default::default(),
                };
                recurrent += 1;
                let delta = RecurrentMixer::GatedDeltaNet(delta);
                if !backend.supports_recurrent(&delta) {
                    return Err(ModelError::Tensor(kiln_tensor::TensorError::Unsupported {
                        backend: backend.name(),
                        what: "gated DeltaNet layers (Qwen3.5)".into(),
                    }));
                }
                let proj = if q.next {
                    next_projections(&l, backend.as_ref(), &a, &q, h)?
                } else {
                    Linear::load_packed(
                        &l,
                        &[
                            format!("{a}.in_proj_qkv"),
                            format!("{a}.in_proj_z"),
                            format!("{a}.in_proj_b"),
                            format!("{a}.in_proj_a"),
                        ],
                        h,
                        &[cd, vdim, q.linear_v_heads, q.linear_v_heads],
                        false,
                    )?
                };
                Mixer::Linear {
                    proj,
                    delta,
                    out: Linear::load(&l, &format!("{a}.out_proj"), vdim, h, false)?,
                }
            } else {
                let slot = kv_slots[i];
                attention_mixer(
                    &l,
                    &backend,
                    &cfg,
                    &format!("{p}.self_attn"),
                    slot.group,
                    slot.slot,
                )?
            };
            blocks.push(Block {
                input_norm: norm(&l, &format!("{p}.input_layernorm.weight"), h, eps)?,
                mixer,
                post_norm: norm(&l, &format!("{p}.post_attention_layernorm.weight"), h, eps)?,
                mlp: feed_forward(&l, &q, &cfg, &p, q.sparse_layers[i])?,
            });
        }
        let final_norm = norm(&l, "model.norm.weight", h, eps)?;
        // The head is read only where it is there (conversions often drop
        // it) and has the one layer Kiln runs.
        let mtp = match q.mtp_layers.unwrap_or(1) == 1 && l.contains("mtp.fc.weight") {
            true => Some(Mtp::load(&l, &backend, &q, &cfg)?),
            false => None,
        };
        let lm_head = Linear::output(&l, &embed, cfg.tie_word_embeddings)?;
        let state = blocks
            .iter()
            .find_map(|b| match &b.mixer {
                Mixer::Linear { delta, .. } => Some(delta.state()),
                _ => None,
            })
            .unwrap_or((0, 0));
        // Frequencies over the rotated dims only: `rotary_dim / 2` of them.
        let rope = Rope::new(q.rotary_dim, q.rope_theta, &crate::RopeScaling::None);
        Ok(Qwen35 {
            weight_bytes: l.weight_bytes(),
            backend,
            embed,
            blocks,
            norm: final_norm,
            lm_head,
            rope,
            state,
            recurrent_layers: recurrent,
            mtp,
            cfg,
        })
    }

    /// The recurrent state of `num_slots` sequences.
    pub fn state_shape(&self, num_slots: usize) -> StateShape {
        StateShape {
            num_layers: self.recurrent_layers,
            num_slots,
            conv: self.state.0,
            recurrent: self.state.1,
        }
    }

    /// One block over `x`: its mixer, then its feed-forward, each with the
    /// residual around it.
    fn block(
        &self,
        blk: &Block,
        x: &Tensor,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let mixed = match &blk.mixer {
            Mixer::Linear { proj, delta, out } => {
                let p = proj.forward(b, x, Fuse::norm(&blk.input_norm))?;
                let core = b.recurrent_mixer(&p, delta, batch, cache)?;
                out.forward(b, &core, Fuse::NONE.with_residual(x))?
            }
            Mixer::Attention {
                qkvg,
                q_norm,
                k_norm,
                o,
                params,
                kv_slot,
            } => {
                let y = qkvg.forward(b, x, Fuse::norm(&blk.input_norm))?;
                let parts = b.split_cols(&y, &[(nh + 2 * nkv) * hd, nh * hd])?;
                let qk_norm = QkNorm {
                    v_weight: None,
                    q_weight: &q_norm.weight,
                    k_weight: &k_norm.weight,
                    eps: q_norm.eps,
                    weight_offset: q_norm.weight_offset,
                };
                let attn = b.qkv_attention(
                    &parts[0],
                    cache,
                    *kv_slot,
                    batch,
                    params,
                    &self.rope.params(nh, hd),
                    Some(qk_norm),
                )?;
                let gated = b.gated_activation(&parts[1], &attn, Activation::Sigmoid)?;
                o.forward(b, &gated, Fuse::NONE.with_residual(x))?
            }
        };
        blk.mlp
            .forward_pre_norm(b, &mixed, &blk.post_norm, &batch.lora, true)
    }

    /// The last block's output, every row.
    fn trunk(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        let mut x = self.backend.embedding(&self.embed, &batch.token_ids)?;
        for blk in &self.blocks {
            x = self.block(blk, &x, batch, cache)?;
        }
        Ok(x)
    }

    fn step(&self, batch: &ForwardBatch, cache: &mut KvCache, out: StepOutput) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let x = self.trunk(batch, cache)?;
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        if out == StepOutput::Hidden {
            return self.norm.forward(b, &x);
        }
        self.lm_head.forward(b, &x, Fuse::norm(&self.norm))
    }

    fn mtp_head(&self) -> Result<&Mtp> {
        self.mtp.as_ref().ok_or_else(|| self.no_mtp())
    }
}

impl CausalLm for Qwen35 {
    fn weight_bytes(&self) -> Option<&crate::WeightBytes> {
        Some(&self.weight_bytes)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The attention layers' KV blocks and one sequence's recurrent state.
    fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        self.new_cache(num_blocks, block_size, 1)
    }

    /// The attention layers' KV blocks and `max_seqs` sequences' recurrent state.
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

    fn mtp_heads(&self) -> usize {
        usize::from(self.mtp.is_some())
    }

    fn new_mtp_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        self.mtp_head()?;
        super::mtp_cache(
            self.backend.as_ref(),
            self.cfg.num_kv_heads * self.cfg.head_dim,
            num_blocks,
            block_size,
        )
    }

    /// The logits as [`CausalLm::forward`] computes them (the same fused
    /// final norm and head, so the same bits), and every row's final
    /// hidden state. Run eagerly: a recorded step returns one tensor.
    fn forward_with_hidden(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        let x = self.trunk(batch, cache)?;
        let b = self.backend.as_ref();
        super::logits_and_hidden(b, &x, &batch.logits_rows, &self.norm, &self.lm_head)
    }

    fn mtp_forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        let m = self.mtp_head()?;
        let b = self.backend.as_ref();
        let e = b.embedding(&self.embed, &batch.token_ids)?;
        let e = m.fc_embed.forward(b, &e, Fuse::norm(&m.norm_embed))?;
        let x = m
            .fc_hidden
            .forward(b, hidden, Fuse::norm(&m.norm_hidden).with_residual(&e))?;
        let x = self.block(&m.block, &x, batch, cache)?;
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        let out = m.norm.forward(b, &x)?;
        Ok((self.lm_head.forward(b, &out, Fuse::NONE)?, out))
    }
}
