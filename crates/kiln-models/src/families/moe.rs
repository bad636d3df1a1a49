//! Mixture-of-Experts decoders with Llama-family attention: Mixtral,
//! Qwen2-MoE, Qwen3-MoE and GLM-4.5 (`glm4_moe`). Reference: transformers
//! `modeling_mixtral.py`, `modeling_qwen2_moe.py`, `modeling_qwen3_moe.py`,
//! `modeling_glm4_moe.py`.
//!
//! The blocks are the Llama family's (pre-norm attention as Mistral, Qwen2
//! with q/k/v biases, Qwen3 with QK-norm), with the MLP replaced by a
//! sparse one on the layers the config makes sparse.
//!
//! Quirks:
//! - Routing is softmax over all experts in f32, then the top k; Mixtral
//!   always renormalizes the kept weights, Qwen only with `norm_topk_prob`
//!   (off by default, on in the released Qwen3-MoE checkpoints).
//! - Qwen2-MoE adds a shared expert every token runs, scaled by
//!   `sigmoid(x · shared_expert_gate)`.
//! - Qwen layers are sparse unless listed in `mlp_only_layers` or off the
//!   `decoder_sparse_step` stride; the dense ones use `intermediate_size`,
//!   the experts `moe_intermediate_size`. Mixtral's experts use
//!   `intermediate_size` and are named `block_sparse_moe.experts.{e}.w1/w3/w2`.
//! - transformers 5 names Qwen3-MoE's expert count `num_local_experts` in
//!   the configs it writes; released ones say `num_experts`. Both are read.
//! - GLM-4.5 routes as DeepSeek-V3: sigmoid scores plus
//!   `gate.e_score_correction_bias` pick (within the best `topk_group` of
//!   `n_group` groups) but do not weigh, renormalized (`norm_topk_prob`),
//!   times `routed_scaling_factor`; `n_shared_experts` ungated shared
//!   experts (`shared_experts`, `n_shared_experts · moe_intermediate_size`
//!   wide); the first `first_k_dense_replace` layers dense. Its attention
//!   has q/k/v biases (`attention_bias`) but none on `o_proj`, optional
//!   QK-norm (`use_qk_norm`), and rotates only `partial_rotary_factor`
//!   (default half) of each head.

use std::sync::Arc;

use kiln_formats::{StoredTensor, WeightSource};
use kiln_tensor::{ExpertActivation, Routing, Scoring};
use serde_json::Value;

use super::llama::{self, Ffn, Llama, LlamaConfig};
use super::{Family, FamilyConfig};
use crate::config::{err, opt_f32, opt_usize, FamilyLayers, ModelConfig};
use crate::error::Result;
use crate::layers::{
    ExpertNames, GatedMlp, LoadProgress, MoeShape, SharedNames, SparseMoe, WeightLoader,
};
use crate::tp::{self, TensorParallel};

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "moe",
    model_types: &["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe"],
    tied_by_default: false,
    parse,
    tensor_shapes: |cfg| tensor_shapes(cfg, moe_config(cfg)?),
    check_weights,
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: Some(&TENSOR_PARALLEL),
    load,
};

/// The keys of `config.json` only the sparse decoders read.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// The attention (and dense-MLP) keys, as the Llama family reads them.
    pub attention: LlamaConfig,
    pub num_experts: usize,
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub expert_intermediate: usize,
    pub shared_intermediate: Option<usize>,
    pub shared_names: SharedNames,
    pub scoring: Scoring,
    pub normalize: bool,
    /// `routed_scaling_factor` (1 but for GLM-4.5).
    pub scale: f32,
    /// The router's selection bias under the sparse MLP's prefix.
    pub selection_bias: Option<&'static str>,
    /// Which layers have a sparse MLP (the others a dense one).
    pub sparse_layers: Vec<bool>,
    pub names: ExpertNames,
}

impl MoeConfig {
    /// The sparse MLP's shape.
    pub fn shape(&self, hidden: usize) -> MoeShape {
        MoeShape {
            hidden,
            num_experts: self.num_experts,
            intermediate: self.expert_intermediate,
            shared_intermediate: self.shared_intermediate,
            shared_names: self.shared_names,
            selection_bias: self.selection_bias,
            routing: Routing {
                top_k: self.top_k,
                scoring: self.scoring,
                normalize: self.normalize,
                scale: self.scale,
            },
            activation: ExpertActivation::Gated(self.attention.activation),
            names: self.names,
            held: None,
        }
    }

    /// The share of weight `name` a token reads: `top_k / num_experts` of
    /// each expert's, all of the rest.
    pub fn decode_share(&self, name: &str) -> f64 {
        match name.contains(".experts.") {
            true => self.top_k as f64 / self.num_experts.max(1) as f64,
            false => 1.0,
        }
    }

    /// Layer `l`'s sparse MLP: its weights' prefix and its router's name.
    fn prefix(&self, l: usize) -> (String, String) {
        match self.names {
            ExpertNames::W1W3W2 => {
                let p = format!("model.layers.{l}.block_sparse_moe");
                (p.clone(), format!("{p}.gate.weight"))
            }
            ExpertNames::Proj => {
                let p = format!("model.layers.{l}.mlp");
                (p.clone(), format!("{p}.gate.weight"))
            }
        }
    }
}

/// Experts beyond any released model (Qwen3-MoE has 128, DeepSeek 256).
/// Tensor parallelism: every expert (and the shared one) split like a
/// dense MLP ([`crate::tp`]); the router is replicated.
static TENSOR_PARALLEL: TensorParallel = TensorParallel {
    role: llama::tp_role,
    shard: |f, world, expert_parallel| {
        let FamilyConfig::Moe(m) = f else {
            return Ok((f.clone(), None));
        };
        let mut m = m.clone();
        let experts = match expert_parallel {
            // Whole experts, an equal run a rank.
            true => Some(tp::split("num_experts", m.num_experts, world).map(|_| m.num_experts)?),
            false => {
                m.expert_intermediate =
                    tp::split("moe_intermediate_size", m.expert_intermediate, world)?;
                None
            }
        };
        m.shared_intermediate = m
            .shared_intermediate
            .map(|s| tp::split("shared_expert_intermediate_size", s, world))
            .transpose()?;
        Ok((FamilyConfig::Moe(m), experts))
    },
};

const MAX_EXPERTS: usize = 1 << 12;

fn parse(c: &Value, num_layers: usize, head_dim: usize) -> Result<FamilyLayers> {
    let model_type = c.get("model_type").and_then(Value::as_str).unwrap_or("");
    let flag = |key: &str, default: bool| c.get(key).and_then(Value::as_bool).unwrap_or(default);
    let experts_key = |keys: &[&str], default: usize| -> Result<usize> {
        for k in keys {
            if let Some(n) = opt_usize(c, k)? {
                return Ok(n);
            }
        }
        Ok(default)
    };
    let cfg = match model_type {
        "mixtral" => MoeConfig {
            attention: llama::parse_keys(c, "mistral", head_dim)?,
            num_experts: experts_key(&["num_local_experts", "num_experts"], 8)?,
            top_k: opt_usize(c, "num_experts_per_tok")?.unwrap_or(2),
            expert_intermediate: opt_usize(c, "intermediate_size")?.unwrap_or(14336),
            shared_intermediate: None,
            shared_names: SharedNames::GatedQwen,
            scoring: Scoring::Softmax,
            normalize: true,
            scale: 1.0,
            selection_bias: None,
            sparse_layers: vec![true; num_layers],
            names: ExpertNames::W1W3W2,
        },
        "glm4_moe" => {
            let num_experts = experts_key(&["n_routed_experts", "num_local_experts"], 128)?;
            let first_dense = opt_usize(c, "first_k_dense_replace")?.unwrap_or(1);
            let expert_intermediate = opt_usize(c, "moe_intermediate_size")?.unwrap_or(1408);
            let shared = opt_usize(c, "n_shared_experts")?.unwrap_or(1);
            let groups = opt_usize(c, "n_group")?.unwrap_or(1);
            let keep = opt_usize(c, "topk_group")?.unwrap_or(1);
            if groups == 0
                || groups > 64
                || keep == 0
                || keep > groups
                || num_experts % groups != 0
                || (groups > 1 && num_experts / groups < 2)
            {
                return Err(err(
                    "n_group",
                    format!(
                        "{groups} groups keeping {keep} of {num_experts} experts (groups of at \
                         least two experts, at most 64 groups)"
                    ),
                ));
            }
            MoeConfig {
                attention: llama::parse_keys(c, "glm4_moe", head_dim)?,
                num_experts,
                top_k: opt_usize(c, "num_experts_per_tok")?.unwrap_or(8),
                expert_intermediate,
                shared_intermediate: (shared > 0).then_some(shared * expert_intermediate),
                shared_names: SharedNames::DeepSeek,
                scoring: Scoring::SigmoidGroups {
                    groups: groups as u16,
                    keep: keep as u16,
                },
                normalize: flag("norm_topk_prob", true),
                scale: opt_f32(c, "routed_scaling_factor")?.unwrap_or(1.0),
                selection_bias: Some("gate.e_score_correction_bias"),
                sparse_layers: (0..num_layers).map(|l| l >= first_dense).collect(),
                names: ExpertNames::Proj,
            }
        }
        "qwen2_moe" | "qwen3_moe" => {
            let qwen2 = model_type == "qwen2_moe";
            let step = opt_usize(c, "decoder_sparse_step")?.unwrap_or(1).max(1);
            let dense_only: Vec<usize> = c
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_u64())
                        .map(|v| v as usize)
                        .collect()
                })
                .unwrap_or_default();
            let num_experts = experts_key(
                &["num_experts", "num_local_experts"],
                if qwen2 { 60 } else { 128 },
            )?;
            let sparse_layers = (0..num_layers)
                .map(|l| num_experts > 0 && !dense_only.contains(&l) && (l + 1) % step == 0)
                .collect();
            let shared = match qwen2 {
                true => Some(opt_usize(c, "shared_expert_intermediate_size")?.unwrap_or(5632)),
                false => None,
            };
            MoeConfig {
                attention: llama::parse_keys(c, if qwen2 { "qwen2" } else { "qwen3" }, head_dim)?,
                num_experts,
                top_k: opt_usize(c, "num_experts_per_tok")?.unwrap_or(if qwen2 { 4 } else { 8 }),
                expert_intermediate: opt_usize(c, "moe_intermediate_size")?.unwrap_or(if qwen2 {
                    1408
                } else {
                    768
                }),
                shared_intermediate: shared.filter(|&s| s > 0),
                shared_names: SharedNames::GatedQwen,
                scoring: Scoring::Softmax,
                normalize: flag("norm_topk_prob", false),
                scale: 1.0,
                selection_bias: None,
                sparse_layers,
                names: ExpertNames::Proj,
            }
        }
        other => {
            return Err(err(
                "model_type",
                format!("{other} is not a Mixture-of-Experts decoder"),
            ))
        }
    };
    if cfg.num_experts > MAX_EXPERTS {
        return Err(err(
            "num_experts",
            format!(
                "{} is more than Kiln serves (at most {MAX_EXPERTS})",
                cfg.num_experts
            ),
        ));
    }
    if cfg.sparse_layers.iter().any(|&s| s) && (cfg.top_k == 0 || cfg.top_k > cfg.num_experts) {
        return Err(err(
            "num_experts_per_tok",
            format!(
                "{} experts a token of {} experts",
                cfg.top_k, cfg.num_experts
            ),
        ));
    }
    if cfg.expert_intermediate == 0 || cfg.expert_intermediate > 1 << 20 {
        return Err(err(
            "moe_intermediate_size",
            format!(
                "{} (must be positive, at most 2^20)",
                cfg.expert_intermediate
            ),
        ));
    }
    Ok(FamilyLayers {
        layer_kinds: vec![cfg.attention.layer_kind(); num_layers],
        family: FamilyConfig::Moe(cfg),
        layer_kv: None,
    })
}

fn moe_config(cfg: &ModelConfig) -> Result<&MoeConfig> {
    match &cfg.family {
        FamilyConfig::Moe(m) => Ok(m),
        _ => Err(super::wrong_family(cfg, "moe")),
    }
}

fn tensor_shapes(cfg: &ModelConfig, m: &MoeConfig) -> Result<Vec<(String, Vec<usize>)>> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let shape = m.shape(h);
    Ok(llama::tensor_shapes_with(cfg, &m.attention, &|l, out| {
        if m.sparse_layers.get(l).copied().unwrap_or(true) {
            let (prefix, router) = m.prefix(l);
            out.extend(shape.tensor_shapes(&prefix, &router));
        } else {
            let p = format!("model.layers.{l}.mlp");
            out.push((format!("{p}.gate_proj.weight"), vec![i, h]));
            out.push((format!("{p}.up_proj.weight"), vec![i, h]));
            out.push((format!("{p}.down_proj.weight"), vec![h, i]));
        }
    }))
}

/// The Llama family's checks, then each sparse layer's router against the
/// configured expert count.
fn check_weights(cfg: &ModelConfig, tensors: &[StoredTensor]) -> Result<()> {
    llama::check_weights(cfg, tensors)?;
    let m = moe_config(cfg)?;
    for (l, _) in m.sparse_layers.iter().enumerate().filter(|s| *s.1) {
        let (_, router) = m.prefix(l);
        if let Some(t) = tensors.iter().find(|t| t.name == router) {
            if t.shape.first() != Some(&m.num_experts) {
                return Err(err(
                    "num_experts",
                    format!(
                        "config.json says {} experts, the weights' {router} routes to {:?}",
                        m.num_experts,
                        t.shape.first()
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn load(
    backend: Arc<dyn kiln_tensor::Backend>,
    source: &dyn WeightSource,
    cfg: ModelConfig,
    progress: Option<LoadProgress<'_>>,
) -> Result<Box<dyn crate::CausalLm>> {
    let m = moe_config(&cfg)?.clone();
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let shape = MoeShape {
        held: cfg
            .tensor_parallel
            .and_then(|t| t.held_experts())
            .map(|r| (r.start, r.end)),
        ..m.shape(h)
    };
    // Layers past the decoder's are MTP layers: sparse, as transformers
    // builds them.
    let ffn = move |l: &WeightLoader, layer: usize| -> Result<Ffn> {
        if m.sparse_layers.get(layer).copied().unwrap_or(true) {
            let (prefix, router) = m.prefix(layer);
            Ok(Ffn::Sparse(SparseMoe::load(l, &prefix, &router, &shape)?))
        } else {
            let p = format!("model.layers.{layer}.mlp");
            let act = m.attention.activation;
            Ok(Ffn::Dense(GatedMlp::load(l, &p, h, i, act)?))
        }
    };
    Ok(Box::new(Llama::load_with(
        backend, source, cfg, progress, &ffn,
    )?))
}
