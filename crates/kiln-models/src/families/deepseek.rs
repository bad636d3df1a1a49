//! DeepSeek-V2 and DeepSeek-V3 (`deepseek_v2`, `deepseek_v3`; also the
//! releases built on them: Moonlight as `deepseek_v3`, Kimi-K2 as
//! `kimi_k2`) and GLM-4.7-Flash
//! (`glm4_moe_lite`: DeepSeek-V3's attention and routing, its sparse layers
//! listed in `mlp_layer_types`): multi-head latent attention and sparse
//! feed-forwards with shared experts. Reference: transformers
//! `modeling_deepseek_v3.py`, `modeling_deepseek_v2.py`,
//! `modeling_glm4_moe_lite.py`.
//!
//! Quirks, each as transformers computes it:
//! - Attention (MLA): queries from `q_proj`, or with `q_lora_rank` from
//!   `q_a_proj` → `q_a_layernorm` → `q_b_proj`, each head `[nope | rope]`
//!   (`qk_nope_head_dim`, `qk_rope_head_dim`); `kv_a_proj_with_mqa` gives a
//!   latent (`kv_lora_rank`, RMS-normed by `kv_a_layernorm`) and one rotary
//!   key part shared by every head; `kv_b_proj` expands the latent into
//!   each head's key (`nope`) and value (`v_head_dim`) rows. Kiln runs it
//!   absorbed ([`kiln_tensor::mla`]): one KV head of `rope + latent` a
//!   layer in the cache, not every head's keys and values.
//! - RoPE pairs dims `(2i, 2i + 1)` (V2 always; V3 with `rope_interleave`,
//!   its default): the rotary rows of the query and KV projections are
//!   permuted at load into rotate-half order (a permutation both sides
//!   share leaves every score as it was).
//! - The softmax scale is `(nope + rope)^-0.5`, times `mscale²` under YaRN
//!   with `mscale_all_dim` (`0.1 · mscale_all_dim · ln(factor) + 1`).
//! - Feed-forwards: the first `first_k_dense_replace` dense
//!   (`intermediate_size`), then every `moe_layer_freq`-th sparse (V2; V3
//!   all): `n_routed_experts` experts of `moe_intermediate_size` and
//!   `n_shared_experts` ungated shared ones (`shared_experts`). V3 routes
//!   as `Scoring::SigmoidGroups` (sigmoids plus `e_score_correction_bias`
//!   pick within the best `topk_group` of `n_group` groups, renormalized
//!   with `norm_topk_prob`); V2 by a softmax over every expert, top k,
//!   never renormalized (`topk_method` `greedy`, or `group_limited_greedy`
//!   as the 236B releases: only the best `topk_group` of `n_group` groups,
//!   ranked by their best expert, `Scoring::SoftmaxGroups`). Both scale the
//!   weights by `routed_scaling_factor`.
//! - V3 checkpoints ship a multi-token-prediction layer after the
//!   decoder's (`model.layers.{num_layers}`, [`NextN`]; its block sparse);
//!   it is loaded where `num_nextn_predict_layers` declares it and the file
//!   has it.
//! - MLA runs where the backend has the three extension ops (the CPU).

use std::sync::Arc;

use kiln_formats::WeightSource;
use kiln_scheduler::LayerSlot;
use kiln_tensor::{
    require_extensions, AttentionParams, Backend, ExpertActivation, ForwardBatch, KvCache, MlaKv,
    MlaOutput, MlaQuery, Routing, Scoring, Tensor, Weight,
};
use serde_json::Value;

use super::llama::Ffn;
use super::{Family, FamilyConfig, StepOutput};
use crate::config::{
    err, opt_f32, opt_usize, parse_activation, parse_rope_scaling, FamilyLayers, LayerKind,
    LayerKv, ModelConfig, RopeScaling,
};
use crate::error::Result;
use crate::layers::{
    ExpertNames, Fuse, GatedMlp, Linear, LoadProgress, MoeShape, NextN, RmsNorm, Rope, SharedNames,
    SparseMoe, WeightLoader,
};
use crate::CausalLm;

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "deepseek",
    model_types: &["deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite"],
    tied_by_default: false,
    parse,
    tensor_shapes: |cfg| Ok(tensor_shapes(cfg, deepseek_config(cfg)?)),
    check_weights,
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: None,
    load: |backend, source, cfg, progress| {
        Ok(Box::new(Deepseek::load(backend, source, cfg, progress)?))
    },
};

/// The keys of `config.json` only DeepSeek reads.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub nope: usize,
    pub rope: usize,
    pub value: usize,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// The rotary dims come in pairs `(2i, 2i + 1)`.
    pub rope_interleave: bool,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    pub attention_bias: bool,
    /// The softmax scale of `q · k`.
    pub scale: f32,
    pub activation: kiln_tensor::Activation,
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    /// The shared experts' width (`n_shared_experts · moe_intermediate_size`).
    pub shared_intermediate: Option<usize>,
    pub scoring: Scoring,
    pub normalize: bool,
    pub routed_scale: f32,
    /// Which layers have a sparse feed-forward.
    pub sparse_layers: Vec<bool>,
    /// Multi-token-prediction layers declared after the decoder's.
    pub nextn_layers: usize,
}

impl DeepseekConfig {
    fn moe_shape(&self, hidden: usize) -> MoeShape {
        MoeShape {
            hidden,
            num_experts: self.num_experts,
            intermediate: self.expert_intermediate,
            shared_intermediate: self.shared_intermediate,
            shared_names: SharedNames::DeepSeek,
            selection_bias: match self.scoring {
                Scoring::SigmoidGroups { .. } => Some("gate.e_score_correction_bias"),
                _ => None,
            },
            routing: Routing {
                top_k: self.top_k,
                scoring: self.scoring,
                normalize: self.normalize,
                scale: self.routed_scale,
            },
            activation: ExpertActivation::Gated(self.activation),
            names: ExpertNames::Proj,
            held: None,
        }
    }

    /// The one KV head a layer keeps: the rotary part and the latent.
    fn kv_width(&self) -> usize {
        self.rope + self.kv_lora_rank
    }

    /// The share of weight `name` a decode token reads (`top_k /
    /// num_experts` of each routed expert's).
    pub fn decode_share(&self, name: &str) -> f64 {
        match name.contains(".experts.") {
            true => self.top_k as f64 / self.num_experts.max(1) as f64,
            false => 1.0,
        }
    }
}

fn parse(c: &Value, num_layers: usize, _head_dim: usize) -> Result<FamilyLayers> {
    let model_type = c.get("model_type").and_then(Value::as_str).unwrap_or("");
    // Kimi-K2's checkpoints are DeepSeek-V3's architecture under their own
    // `model_type`.
    let v3 = matches!(model_type, "deepseek_v3" | "kimi_k2" | "glm4_moe_lite");
    let need = |k: &str| -> Result<usize> {
        opt_usize(c, k)?
            .filter(|&v| v > 0)
            .ok_or_else(|| err(k, "a DeepSeek config needs it, positive"))
    };
    let (nope, rope, value) = (
        need("qk_nope_head_dim")?,
        need("qk_rope_head_dim")?,
        need("v_head_dim")?,
    );
    if rope % 2 != 0 {
        return Err(err("qk_rope_head_dim", format!("{rope} must be even")));
    }
    let kv_lora_rank = need("kv_lora_rank")?;
    let rope_params = c.get("rope_parameters").filter(|v| v.is_object());
    let rope_theta = match opt_f32(c, "rope_theta")? {
        Some(t) => t,
        None => rope_params
            .map(|p| opt_f32(p, "rope_theta"))
            .transpose()?
            .flatten()
            .unwrap_or(10000.0),
    };
    let scaling = c
        .get("rope_scaling")
        .filter(|v| v.is_object())
        .or(rope_params);
    let rope_scaling = parse_rope_scaling(scaling)?;
    let partial = match opt_f32(c, "partial_rotary_factor")? {
        Some(p) => Some(p),
        None => rope_params
            .map(|p| opt_f32(p, "partial_rotary_factor"))
            .transpose()?
            .flatten(),
    };
    if partial.is_some_and(|p| p != 1.0) {
        return Err(err(
            "partial_rotary_factor",
            format!("{partial:?}: latent attention here rotates all qk_rope_head_dim dims"),
        ));
    }
    let mut scale = ((nope + rope) as f32).powf(-0.5);
    if let RopeScaling::Yarn {
        factor,
        mscale_all_dim: Some(m),
        ..
    } = rope_scaling
    {
        if m != 0.0 && factor > 1.0 {
            let ms = 0.1 * m * factor.ln() + 1.0;
            scale *= ms * ms;
        }
    }
    let num_experts = opt_usize(c, "n_routed_experts")?.unwrap_or(0);
    let first_dense = opt_usize(c, "first_k_dense_replace")?.unwrap_or(match model_type {
        "deepseek_v3" | "kimi_k2" => 3,
        "glm4_moe_lite" => 1,
        _ => 0,
    });
    let freq = opt_usize(c, "moe_layer_freq")?.unwrap_or(1).max(1);
    let sparse_layers: Vec<bool> = match c.get("mlp_layer_types").and_then(Value::as_array) {
        Some(types) => {
            if types.len() != num_layers {
                return Err(err(
                    "mlp_layer_types",
                    format!("{} entries for {num_layers} layers", types.len()),
                ));
            }
            types
                .iter()
                .map(|t| num_experts > 0 && t.as_str() == Some("sparse"))
                .collect()
        }
        None => (0..num_layers)
            .map(|l| num_experts > 0 && l >= first_dense && l % freq == 0)
            .collect(),
    };
    let top_k = opt_usize(c, "num_experts_per_tok")?.unwrap_or(if v3 { 8 } else { 6 });
    let groups = opt_usize(c, "n_group")?.unwrap_or(1).max(1);
    let keep = opt_usize(c, "topk_group")?.unwrap_or(1).max(1);
    // The routers' group limit: equal groups (at most 64), `keep` of them.
    let group_limit = || -> Result<(u16, u16)> {
        match groups <= 64 && keep <= groups && num_experts % groups == 0 {
            true => Ok((groups as u16, keep as u16)),
            false => Err(err(
                "n_group",
                format!("{groups} groups keeping {keep} of {num_experts} experts"),
            )),
        }
    };
    let scoring = match v3 {
        true => {
            let (groups, keep) = group_limit()?;
            Scoring::SigmoidGroups { groups, keep }
        }
        false => {
            let method = c
                .get("topk_method")
                .and_then(Value::as_str)
                .unwrap_or("greedy");
            match method {
                "greedy" => Scoring::Softmax,
                "group_limited_greedy" => {
                    let (groups, keep) = group_limit()?;
                    Scoring::SoftmaxGroups { groups, keep }
                }
                other => {
                    return Err(err(
                        "topk_method",
                        format!("{other} (greedy and group_limited_greedy are supported)"),
                    ))
                }
            }
        }
    };
    if sparse_layers.iter().any(|&s| s) && (top_k == 0 || top_k > num_experts) {
        return Err(err(
            "num_experts_per_tok",
            format!("{top_k} experts a token of {num_experts} experts"),
        ));
    }
    let expert_intermediate = opt_usize(c, "moe_intermediate_size")?.unwrap_or(2048);
    let shared = opt_usize(c, "n_shared_experts")?.unwrap_or(0);
    let cfg = DeepseekConfig {
        q_lora_rank: opt_usize(c, "q_lora_rank")?.filter(|&r| r > 0),
        kv_lora_rank,
        nope,
        rope,
        value,
        rope_theta,
        rope_scaling,
        rope_interleave: !v3 || c.get("rope_interleave").and_then(Value::as_bool) != Some(false),
        attention_bias: c
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        scale,
        activation: parse_activation(c, "silu")?,
        num_experts,
        top_k,
        expert_intermediate,
        shared_intermediate: (shared > 0).then_some(shared * expert_intermediate),
        scoring,
        // transformers' V2 router never renormalizes.
        normalize: v3
            && c.get("norm_topk_prob")
                .and_then(Value::as_bool)
                .unwrap_or(true),
        routed_scale: opt_f32(c, "routed_scaling_factor")?.unwrap_or(1.0),
        sparse_layers,
        nextn_layers: opt_usize(c, "num_nextn_predict_layers")?
            .or(opt_usize(c, "num_mtp_layers")?)
            .unwrap_or(0),
    };
    let kv = LayerKv {
        num_kv_heads: 1,
        head_dim: cfg.kv_width(),
        shared_from: None,
    };
    Ok(FamilyLayers {
        layer_kinds: vec![LayerKind::FullAttention; num_layers],
        layer_kv: Some(vec![kv; num_layers]),
        family: FamilyConfig::Deepseek(cfg),
    })
}

/// The config against the tensor table before anything loads: the layer
/// count (MTP layers past it where declared) and the latent attention's
/// widths, each mismatch naming its key.
fn check_weights(cfg: &ModelConfig, tensors: &[kiln_formats::StoredTensor]) -> Result<()> {
    let d = deepseek_config(cfg)?;
    super::llama::check_layer_count(cfg, tensors, d.nextn_layers)?;
    let rows = |name: &str| {
        tensors
            .iter()
            .find(|t| t.name == name)
            .and_then(|t| t.shape.first().copied())
    };
    let p = "model.layers.0.self_attn";
    let checks = [
        (
            "kv_lora_rank",
            format!("{p}.kv_a_proj_with_mqa.weight"),
            d.kv_lora_rank + d.rope,
        ),
        (
            "v_head_dim",
            format!("{p}.kv_b_proj.weight"),
            cfg.num_heads * (d.nope + d.value),
        ),
    ];
    for (key, name, want) in checks {
        if let Some(found) = rows(&name).filter(|&r| r != want) {
            return Err(err(
                key,
                format!("config.json gives {want} rows for {name}, the weights have {found}"),
            ));
        }
    }
    Ok(())
}

fn deepseek_config(cfg: &ModelConfig) -> Result<&DeepseekConfig> {
    match &cfg.family {
        FamilyConfig::Deepseek(d) => Ok(d),
        _ => Err(super::wrong_family(cfg, "deepseek")),
    }
}

fn tensor_shapes(cfg: &ModelConfig, d: &DeepseekConfig) -> Vec<(String, Vec<usize>)> {
    let (h, nh, i) = (cfg.hidden_size, cfg.num_heads, cfg.intermediate_size);
    let qk = d.nope + d.rope;
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    // The decoder's layers, then the first MTP layer where declared.
    for l in 0..cfg.num_layers + usize::from(d.nextn_layers > 0) {
        let p = format!("model.layers.{l}");
        let mut add = |n: &str, s: Vec<usize>| out.push((format!("{p}.{n}"), s));
        if l == cfg.num_layers {
            add("enorm.weight", vec![h]);
            add("hnorm.weight", vec![h]);
            add("eh_proj.weight", vec![h, 2 * h]);
            add("shared_head.norm.weight", vec![h]);
        }
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        match d.q_lora_rank {
            Some(r) => {
                add("self_attn.q_a_proj.weight", vec![r, h]);
                if d.attention_bias {
                    add("self_attn.q_a_proj.bias", vec![r]);
                }
                add("self_attn.q_a_layernorm.weight", vec![r]);
                add("self_attn.q_b_proj.weight", vec![nh * qk, r]);
            }
            None => add("self_attn.q_proj.weight", vec![nh * qk, h]),
        }
        add(
            "self_attn.kv_a_proj_with_mqa.weight",
            vec![d.kv_lora_rank + d.rope, h],
        );
        if d.attention_bias {
            add(
                "self_attn.kv_a_proj_with_mqa.bias",
                vec![d.kv_lora_rank + d.rope],
            );
        }
        add("self_attn.kv_a_layernorm.weight", vec![d.kv_lora_rank]);
        add(
            "self_attn.kv_b_proj.weight",
            vec![nh * (d.nope + d.value), d.kv_lora_rank],
        );
        add("self_attn.o_proj.weight", vec![h, nh * d.value]);
        if d.attention_bias {
            add("self_attn.o_proj.bias", vec![h]);
        }
        if d.sparse_layers.get(l).copied().unwrap_or(true) {
            let prefix = format!("{p}.mlp");
            out.extend(
                d.moe_shape(h)
                    .tensor_shapes(&prefix, &format!("{prefix}.gate.weight")),
            );
        } else {
            add("mlp.gate_proj.weight", vec![i, h]);
            add("mlp.up_proj.weight", vec![i, h]);
            add("mlp.down_proj.weight", vec![h, i]);
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Rows `[0, rope)` of each `width`-row group that starts at `offset`,
/// reordered from interleaved pairs to rotate-half order (evens, then
/// odds): the row permutation of a projection whose output holds them.
fn rope_order(rows: usize, width: usize, offset: usize, rope: usize) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..rows).collect();
    for g in (0..rows / width).map(|g| g * width + offset) {
        for j in 0..rope / 2 {
            perm[g + j] = g + 2 * j;
            perm[g + rope / 2 + j] = g + 2 * j + 1;
        }
    }
    perm
}

/// `name` (`[rows, cols]`, with its `.bias` where `bias`) with its rows
/// reordered by `perm` (`perm[i]`: the stored row that becomes row `i`).
fn permuted_linear(
    l: &WeightLoader,
    name: &str,
    rows: usize,
    cols: usize,
    bias: bool,
    perm: &[usize],
) -> Result<Linear> {
    let w = l.host(&format!("{name}.weight"), &[rows, cols])?;
    let w: Vec<f32> = perm
        .iter()
        .flat_map(|&r| w[r * cols..(r + 1) * cols].iter().copied())
        .collect();
    let bias = match bias {
        true => {
            let b = l.host(&format!("{name}.bias"), &[rows])?;
            Some(perm.iter().map(|&r| b[r]).collect::<Vec<f32>>())
        }
        false => None,
    };
    Linear::from_host(l, name, [rows, cols], &w, bias.as_deref())
}

enum Query {
    Direct(Linear),
    Lora { a: Linear, norm: RmsNorm, b: Linear },
}

/// One layer's multi-head latent attention, absorbed.
struct Mla {
    q: Query,
    kv_a: Linear,
    query: MlaQuery,
    kv: MlaKv,
    output: MlaOutput,
    o: Linear,
    params: AttentionParams,
}

impl Mla {
    fn load(
        l: &WeightLoader,
        p: &str,
        cfg: &ModelConfig,
        d: &DeepseekConfig,
        slot: LayerSlot,
    ) -> Result<Self> {
        let (h, nh, eps) = (cfg.hidden_size, cfg.num_heads, cfg.rms_norm_eps);
        let (dn, dr, c, dv) = (d.nope, d.rope, d.kv_lora_rank, d.value);
        let order = |rows: usize, width: usize, offset: usize| -> Vec<usize> {
            match d.rope_interleave {
                true => rope_order(rows, width, offset, dr),
                false => (0..rows).collect(),
            }
        };
        let q_perm = order(nh * (dn + dr), dn + dr, dn);
        let q = match d.q_lora_rank {
            Some(r) => Query::Lora {
                a: Linear::load(l, &format!("{p}.q_a_proj"), h, r, d.attention_bias)?,
                norm: RmsNorm::load(l, &format!("{p}.q_a_layernorm.weight"), r, eps)?,
                b: permuted_linear(
                    l,
                    &format!("{p}.q_b_proj"),
                    nh * (dn + dr),
                    r,
                    false,
                    &q_perm,
                )?,
            },
            None => Query::Direct(permuted_linear(
                l,
                &format!("{p}.q_proj"),
                nh * (dn + dr),
                h,
                false,
                &q_perm,
            )?),
        };
        let kv_a = permuted_linear(
            l,
            &format!("{p}.kv_a_proj_with_mqa"),
            c + dr,
            h,
            d.attention_bias,
            &order(c + dr, c + dr, c),
        )?;
        // kv_b_proj: each head's `nope` key rows, then its `value` rows.
        let kv_b = l.host(&format!("{p}.kv_b_proj.weight"), &[nh * (dn + dv), c])?;
        let rows = |head: usize, from: usize, n: usize| {
            let r0 = head * (dn + dv) + from;
            kv_b[r0 * c..(r0 + n) * c].to_vec()
        };
        // The per-head projections live where the model does.
        let up = |shape: &[usize], v: Vec<f32>| -> Result<Tensor> {
            let t = l.backend.upload(shape, &v)?;
            l.note(&Weight::Dense(t.clone()));
            Ok(t)
        };
        let w_uk: Vec<f32> = (0..nh).flat_map(|hd| rows(hd, 0, dn)).collect();
        let w_uv: Vec<f32> = (0..nh).flat_map(|hd| rows(hd, dn, dv)).collect();
        let query = MlaQuery {
            heads: nh,
            nope: dn,
            rope: dr,
            latent: c,
            w_uk: up(&[nh, dn, c], w_uk)?,
        };
        let kv = MlaKv {
            rope: dr,
            latent: c,
            weight: l.tensor(&format!("{p}.kv_a_layernorm.weight"), &[c])?,
            eps,
        };
        let output = MlaOutput {
            heads: nh,
            rope: dr,
            latent: c,
            value: dv,
            w_uv: up(&[nh, dv, c], w_uv)?,
        };
        require_extensions(l.backend.as_ref(), &[&query, &kv, &output])?;
        Ok(Mla {
            q,
            kv_a,
            query,
            kv,
            output,
            o: Linear::load(l, &format!("{p}.o_proj"), nh * dv, h, d.attention_bias)?,
            params: AttentionParams {
                num_heads: nh,
                num_kv_heads: 1,
                head_dim: d.kv_width(),
                scale: d.scale,
                sliding_window: None,
                softcap: None,
                kv_group: slot.group,
                causal: true,
            },
        })
    }

    /// `x +` attention of the normed `xn` (`[n, hidden]`).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        xn: &Tensor,
        rope: &Rope,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        slot: usize,
    ) -> Result<Tensor> {
        let q = match &self.q {
            Query::Direct(q) => q.forward(b, xn, Fuse::NONE)?,
            Query::Lora { a, norm, b: qb } => {
                let t = a.forward(b, xn, Fuse::NONE)?;
                qb.forward(b, &t, Fuse::norm(norm))?
            }
        };
        let q = b.extension(&self.query, &q)?;
        let k = b.extension(&self.kv, &self.kv_a.forward(b, xn, Fuse::NONE)?)?;
        let (nh, width) = (self.params.num_heads, self.params.head_dim);
        let q = rope.apply(b, &q, &batch.positions, nh, width)?;
        let k = rope.apply(b, &k, &batch.positions, 1, width)?;
        // The values are the keys' rows: the latent part is what
        // `MlaOutput` reads.
        let out = b.attention(&q, &k, &k, cache, slot, batch, &self.params)?;
        let v = b.extension(&self.output, &out)?;
        self.o.forward(b, &v, Fuse::NONE.with_residual(x))
    }
}

struct Block {
    input_norm: RmsNorm,
    attn: Mla,
    post_norm: RmsNorm,
    mlp: Ffn,
}

pub struct Deepseek {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    embed: Weight,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    kv_slots: Vec<LayerSlot>,
    nextn: Option<NextN<Block>>,
}

impl Deepseek {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let d = deepseek_config(&cfg)?.clone();
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed = l.embedding("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let kv_slots = cfg.kv_slots();
        let shape = d.moe_shape(h);
        // Layers past the decoder's are MTP layers: sparse, their own cache.
        let block = |i: usize| -> Result<Block> {
            let p = format!("model.layers.{i}");
            let slot = kv_slots
                .get(i)
                .copied()
                .unwrap_or(LayerSlot { group: 0, slot: 0 });
            let mlp = match d.sparse_layers.get(i).copied().unwrap_or(true) {
                true => Ffn::Sparse(SparseMoe::load(
                    &l,
                    &format!("{p}.mlp"),
                    &format!("{p}.mlp.gate.weight"),
                    &shape,
                )?),
                false => Ffn::Dense(GatedMlp::load(
                    &l,
                    &format!("{p}.mlp"),
                    h,
                    cfg.intermediate_size,
                    d.activation,
                )?),
            };
            Ok(Block {
                input_norm: RmsNorm::load(&l, &format!("{p}.input_layernorm.weight"), h, eps)?,
                attn: Mla::load(&l, &format!("{p}.self_attn"), &cfg, &d, slot)?,
                post_norm: RmsNorm::load(
                    &l,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    eps,
                )?,
                mlp,
            })
        };
        let blocks = (0..cfg.num_layers).map(block).collect::<Result<Vec<_>>>()?;
        let n = cfg.num_layers;
        let nextn = match d.nextn_layers > 0 {
            true => NextN::load(&l, &format!("model.layers.{n}"), h, eps, |_| block(n))?,
            false => None,
        };
        let norm = RmsNorm::load(&l, "model.norm.weight", h, eps)?;
        let lm_head = Linear::output(&l, &embed, cfg.tie_word_embeddings)?;
        let rope = Rope::new(d.rope, d.rope_theta, &d.rope_scaling);
        Ok(Deepseek {
            weight_bytes: l.weight_bytes(),
            cfg,
            backend,
            embed,
            blocks,
            norm,
            lm_head,
            rope,
            kv_slots,
            nextn,
        })
    }

    /// Every row's last hidden state, before the final norm.
    fn trunk(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let mut x = b.embedding(&self.embed, &batch.token_ids)?;
        for (blk, slot) in self.blocks.iter().zip(&self.kv_slots) {
            x = self.block(blk, &x, batch, cache, slot.slot)?;
        }
        Ok(x)
    }

    fn block(
        &self,
        blk: &Block,
        x: &Tensor,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        slot: usize,
    ) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let xn = blk.input_norm.forward(b, x)?;
        let x = blk
            .attn
            .forward(b, x, &xn, &self.rope, batch, cache, slot)?;
        blk.mlp
            .forward_pre_norm(b, &x, &blk.post_norm, &batch.lora, true)
    }

    fn nextn(&self) -> Result<&NextN<Block>> {
        self.nextn.as_ref().ok_or_else(|| self.no_mtp())
    }

    fn step(&self, batch: &ForwardBatch, cache: &mut KvCache, out: StepOutput) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let x = self.trunk(batch, cache)?;
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        match out {
            StepOutput::Logits => self.lm_head.forward(b, &x, Fuse::norm(&self.norm)),
            StepOutput::Hidden => self.norm.forward(b, &x),
        }
    }
}

impl CausalLm for Deepseek {
    fn weight_bytes(&self) -> Option<&crate::WeightBytes> {
        Some(&self.weight_bytes)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
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
        usize::from(self.nextn.is_some())
    }

    fn new_mtp_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        let width = self.nextn()?.block.attn.params.head_dim;
        super::mtp_cache(self.backend.as_ref(), width, num_blocks, block_size)
    }

    /// The logits as [`CausalLm::forward`] computes them (the same fused
    /// final norm and head, so the same bits), and every row's final
    /// hidden state.
    fn forward_with_hidden(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        self.nextn()?;
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
        let m = self.nextn()?;
        let b = self.backend.as_ref();
        let x = m.input(b, &self.embed, &batch.token_ids, hidden)?;
        let x = self.block(&m.block, &x, batch, cache, 0)?;
        m.output(b, &x, &batch.logits_rows, &self.lm_head)
    }

    fn expert_load(&self) -> Vec<Vec<u64>> {
        self.blocks
            .iter()
            .filter_map(|b| b.mlp.expert_load())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::rope_order;

    #[test]
    fn interleaved_rotary_rows_become_evens_then_odds_in_each_head() {
        // Two heads of 2 + 4: the rotary rows 2..6 and 8..12.
        let p = rope_order(12, 6, 2, 4);
        assert_eq!(p, [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]);
    }
}
