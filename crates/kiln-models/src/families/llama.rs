//! The Llama-family decoder: Llama 2/3 (incl. `llama3` RoPE scaling),
//! Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (per-head q/k
//! RMSNorm), SmolLM. Reference: transformers `modeling_llama.py`,
//! `modeling_qwen2.py`, `modeling_qwen3.py`.
//!
//! Quirks: weights use Hugging Face names and layout (GGUF's permuted q/k
//! rows are undone by `kiln-formats`), so RoPE is rotate-half. Tied models
//! reuse the embedding matrix as the output projection.

use std::sync::Arc;

use kiln_formats::{StoredTensor, WeightSource};
use kiln_scheduler::LayerSlot;
use kiln_tensor::{Activation, Backend, ForwardBatch, KvCache, Tensor, Weight};
use serde_json::Value;

use super::{Family, FamilyConfig, StepOutput};
use crate::config::{
    opt_f32, opt_usize, parse_activation, parse_rope_scaling, FamilyLayers, LayerKind, ModelConfig,
    RopeScaling,
};
use crate::error::Result;
use crate::layers::{
    Attention, AttentionConfig, Fuse, GatedMlp, Linear, LoadProgress, NextN, RmsNorm, Rope,
    SparseMoe, WeightLoader,
};
use crate::tp::{TensorParallel, TpRole};
use crate::CausalLm;

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "llama",
    model_types: &["llama", "mistral", "qwen2", "qwen3", "smollm3"],
    tied_by_default: false,
    parse,
    tensor_shapes: |cfg| Ok(tensor_shapes(cfg, llama_config(cfg)?)),
    check_weights,
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: Some(&TENSOR_PARALLEL),
    load: |backend, source, cfg, progress| {
        Ok(Box::new(Llama::load(backend, source, cfg, progress)?))
    },
};

/// Tensor parallelism: the Megatron split of [`crate::tp`] (the family's
/// own keys hold no size that splits).
static TENSOR_PARALLEL: TensorParallel = TensorParallel {
    role: tp_role,
    shard: |f, _, expert_parallel| match expert_parallel {
        false => Ok((f.clone(), None)),
        true => Err(crate::config::err(
            "num_experts",
            "expert parallelism needs a Mixture-of-Experts model; this one is dense",
        )),
    },
};

/// How a Llama-family tensor (or a sparse family's: experts by either
/// naming, fused stacks, a shared expert) splits over tensor-parallel
/// ranks.
pub(crate) fn tp_role(name: &str) -> TpRole {
    let mut it = name.rsplit('.');
    let last = it.next().unwrap_or("");
    let (module, bias) = match last {
        "weight" => (it.next().unwrap_or(""), false),
        "bias" => (it.next().unwrap_or(""), true),
        // transformers' fused expert stacks have no suffix.
        fused => (fused, false),
    };
    match module {
        "q_proj" | "gate_proj" | "up_proj" | "w1" | "w3" => TpRole::Column,
        "k_proj" | "v_proj" => TpRole::KvColumn,
        "gate_up_proj" => TpRole::ColumnHalves,
        "o_proj" | "down_proj" | "w2" if bias => TpRole::FirstRank,
        "o_proj" | "down_proj" | "w2" => TpRole::Row,
        "embed_tokens" | "lm_head" => TpRole::Vocab,
        _ => TpRole::Replicated,
    }
}

/// The keys of `config.json` only the Llama family reads.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Biases on q, k, v projections (Qwen2).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama with `attention_bias`).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub activation: Activation,
    /// Sliding-window attention span for every layer (Mistral), if any.
    pub sliding_window: Option<usize>,
    /// Dims RoPE rotates at the start of each head (rotate-half within
    /// them; the rest pass through): `head_dim · partial_rotary_factor`
    /// (GLM-4.5: half), else all.
    pub rotary_dim: Option<usize>,
    /// DeepSeek-style multi-token-prediction layers the config declares
    /// after the decoder's (`num_nextn_predict_layers`; GLM-4.5 ships one).
    pub nextn_layers: usize,
}

/// The family's keys of `c` and its layers' KV layout: every layer full
/// attention, or every layer the same sliding window (Mistral).
fn parse(c: &Value, num_layers: usize, head_dim: usize) -> Result<FamilyLayers> {
    let model_type = c.get("model_type").and_then(Value::as_str).unwrap_or("");
    let cfg = parse_keys(c, model_type, head_dim)?;
    Ok(FamilyLayers {
        layer_kinds: vec![cfg.layer_kind(); num_layers],
        family: FamilyConfig::Llama(cfg),
        layer_kv: None,
    })
}

/// The attention and MLP keys of a Llama-shaped decoder, read as the
/// `model_type` whose attention `c` has (`qwen2`: q/k/v biases; `qwen3`:
/// QK-norm; `mistral`: a sliding window by default). Sparse families
/// ([`super::moe`]) read theirs through it too.
pub(crate) fn parse_keys(c: &Value, model_type: &str, head_dim: usize) -> Result<LlamaConfig> {
    // transformers 5 moved rope settings into `rope_parameters`.
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
    let attention_bias = c.get("attention_bias").and_then(Value::as_bool);
    let (qkv_bias, o_bias) = match model_type {
        // Qwen2 always has q/k/v biases and never an o bias.
        "qwen2" => (true, false),
        // GLM-4.5: `attention_bias` is q/k/v's; the output projection has none.
        "glm4_moe" => (attention_bias.unwrap_or(false), false),
        _ => {
            let b = attention_bias.unwrap_or(false);
            (b, b)
        }
    };
    let use_sliding = c.get("use_sliding_window").and_then(Value::as_bool);
    let sliding_window = match (model_type, use_sliding) {
        (_, Some(false)) => None,
        ("mistral", _) | (_, Some(true)) => opt_usize(c, "sliding_window")?,
        _ => None,
    };
    // transformers' `int(head_dim * partial_rotary_factor)`, at the top
    // level or in `rope_parameters`; GLM-4.5 rotates half by default.
    let partial = match opt_f32(c, "partial_rotary_factor")? {
        Some(p) => Some(p),
        None => rope_params
            .map(|p| opt_f32(p, "partial_rotary_factor"))
            .transpose()?
            .flatten(),
    }
    .or((model_type == "glm4_moe").then_some(0.5));
    let rotary_dim = match partial {
        None => None,
        Some(p) => {
            let dim = (head_dim as f64 * p as f64) as usize;
            if !(p > 0.0 && p <= 1.0) || dim == 0 || dim % 2 != 0 {
                return Err(crate::config::err(
                    "partial_rotary_factor",
                    format!("{p} of a {head_dim}-wide head (must rotate an even number of dims)"),
                ));
            }
            (dim < head_dim).then_some(dim)
        }
    };
    let qk_norm = match model_type {
        "qwen3" => true,
        "glm4_moe" => c
            .get("use_qk_norm")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        _ => false,
    };
    Ok(LlamaConfig {
        rope_theta,
        rope_scaling: parse_rope_scaling(scaling)?,
        qkv_bias,
        o_bias,
        qk_norm,
        activation: parse_activation(c, "silu")?,
        sliding_window,
        rotary_dim,
        nextn_layers: match model_type {
            "glm4_moe" => opt_usize(c, "num_nextn_predict_layers")?
                .or(opt_usize(c, "num_mtp_layers")?)
                .unwrap_or(0),
            _ => 0,
        },
    })
}

impl LlamaConfig {
    /// How every layer keeps its past: the sliding window, or all of it.
    pub(crate) fn layer_kind(&self) -> LayerKind {
        match self.sliding_window {
            Some(window) => LayerKind::SlidingWindow {
                window: window.max(1),
            },
            None => LayerKind::FullAttention,
        }
    }
}

/// The Llama part of `cfg` (a sparse family's attention keys included).
fn llama_config(cfg: &ModelConfig) -> Result<&LlamaConfig> {
    match &cfg.family {
        FamilyConfig::Llama(l) => Ok(l),
        FamilyConfig::Moe(m) => Ok(&m.attention),
        _ => Err(super::wrong_family(cfg, "llama")),
    }
}

/// A block's feed-forward part: the gated MLP, or a sparse one.
pub(crate) enum Ffn {
    Dense(GatedMlp),
    Sparse(SparseMoe),
}

impl Ffn {
    /// `x + ffn(norm(x))`: the dense MLP with the norm and residual fused
    /// (and the step's LoRA deltas), the sparse one after the norm;
    /// without `x +` unless `residual` (a tensor-parallel rank, whose
    /// partial output is all-reduced first).
    pub(crate) fn forward_pre_norm(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        norm: &RmsNorm,
        lora: &kiln_tensor::LoraBatch,
        residual: bool,
    ) -> Result<Tensor> {
        match self {
            Ffn::Dense(mlp) => {
                let fuse = Fuse::norm(norm).with_lora(lora);
                let fuse = match residual {
                    true => fuse.with_residual(x),
                    false => fuse,
                };
                mlp.forward(b, x, fuse)
            }
            Ffn::Sparse(moe) => {
                let h = norm.forward(b, x)?;
                let y = moe.forward(b, &h)?;
                match residual {
                    true => Ok(b.add(x, &y)?),
                    false => Ok(y),
                }
            }
        }
    }

    /// Tokens routed to each expert so far (a sparse layer only).
    pub(crate) fn expert_load(&self) -> Option<Vec<u64>> {
        match self {
            Ffn::Sparse(m) => Some(m.layer.load.snapshot()),
            Ffn::Dense(_) => None,
        }
    }
}

/// Loads layer `i`'s feed-forward part.
pub(crate) type FfnLoader<'f> = &'f dyn Fn(&WeightLoader, usize) -> Result<Ffn>;

struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    mlp: Ffn,
}

pub struct Llama {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    embed: Weight,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    /// Where each layer's keys and values live in the cache.
    kv_slots: Vec<LayerSlot>,
    /// The first DeepSeek-style multi-token-prediction layer, where the
    /// checkpoint has it.
    nextn: Option<NextN<Block>>,
}

impl Llama {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let f = llama_config(&cfg)?.clone();
        let (h, i, act) = (cfg.hidden_size, cfg.intermediate_size, f.activation);
        let dense = move |l: &WeightLoader, layer: usize| -> Result<Ffn> {
            let p = format!("model.layers.{layer}.mlp");
            Ok(Ffn::Dense(GatedMlp::load(l, &p, h, i, act)?))
        };
        Self::load_with(backend, source, cfg, progress, &dense)
    }

    /// [`Llama::load`] with each layer's feed-forward part from `ffn`.
    pub(crate) fn load_with(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
        ffn: FfnLoader<'_>,
    ) -> Result<Self> {
        let f = llama_config(&cfg)?.clone();
        let f = &f;
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed = l.embedding("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let attn_cfg = AttentionConfig {
            hidden_size: h,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            qkv_bias: f.qkv_bias,
            o_bias: f.o_bias,
            qk_norm_eps: f.qk_norm.then_some(eps),
            scale: (cfg.head_dim as f32).powf(-0.5),
            sliding_window: f.sliding_window,
            sinks: false,
        };
        let block = |i: usize| -> Result<Block> {
            let p = format!("model.layers.{i}");
            Ok(Block {
                input_norm: RmsNorm::load(&l, &format!("{p}.input_layernorm.weight"), h, eps)?,
                attn: Attention::load(&l, &format!("{p}.self_attn"), attn_cfg.clone())?,
                post_attn_norm: RmsNorm::load(
                    &l,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    eps,
                )?,
                mlp: ffn(&l, i)?,
            })
        };
        let blocks = (0..cfg.num_layers).map(block).collect::<Result<Vec<_>>>()?;
        // The first MTP layer, where declared and present (Kiln runs one;
        // not on tensor-parallel ranks).
        let nextn = match f.nextn_layers > 0 && cfg.tensor_parallel.is_none() {
            true => NextN::load(
                &l,
                &format!("model.layers.{}", cfg.num_layers),
                h,
                eps,
                |_| block(cfg.num_layers),
            )?,
            false => None,
        };
        let norm = RmsNorm::load(&l, "model.norm.weight", h, eps)?;
        let lm_head = Linear::output(&l, &embed, cfg.tie_word_embeddings)?;
        // Frequencies over the rotated dims only (all of them unless partial).
        let rope = Rope::new(
            f.rotary_dim.unwrap_or(cfg.head_dim),
            f.rope_theta,
            &f.rope_scaling,
        );
        let kv_slots = cfg.kv_slots();
        Ok(Llama {
            weight_bytes: l.weight_bytes(),
            kv_slots,
            nextn,
            cfg,
            backend,
            embed,
            blocks,
            norm,
            lm_head,
            rope,
        })
    }
}

/// Checks `cfg` against the checkpoint's tensor table before anything is
/// loaded: the layers the weights have (MTP layers past them allowed where
/// declared), and each dimension a tensor's
/// shape shows (the embedding's vocabulary and width, the first layer's
/// q, k and gate rows). A mismatch names the `config.json` key.
pub fn check_weights(cfg: &ModelConfig, tensors: &[StoredTensor]) -> Result<()> {
    check_layer_count(
        cfg,
        tensors,
        llama_config(cfg).map_or(0, |f| f.nextn_layers),
    )?;
    let shape = |name: &str| tensors.iter().find(|t| t.name == name).map(|t| &t.shape);
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let dims = [
        ("vocab_size", cfg.vocab_size, "model.embed_tokens.weight", 0),
        (
            "hidden_size",
            cfg.hidden_size,
            "model.embed_tokens.weight",
            1,
        ),
        (
            "intermediate_size",
            cfg.intermediate_size,
            "model.layers.0.mlp.gate_proj.weight",
            0,
        ),
        (
            "num_attention_heads",
            q,
            "model.layers.0.self_attn.q_proj.weight",
            0,
        ),
        (
            "num_key_value_heads",
            kv,
            "model.layers.0.self_attn.k_proj.weight",
            0,
        ),
    ];
    for (key, expected, tensor, axis) in dims {
        // A missing tensor is the loader's error, with the file's name.
        let Some(found) = shape(tensor).and_then(|s| s.get(axis)) else {
            continue;
        };
        if *found != expected {
            let what = match key {
                "num_attention_heads" | "num_key_value_heads" => format!(
                    "config.json gives {expected} rows ({key} x head_dim {}) for {tensor}, \
                     the weights have {found}",
                    cfg.head_dim
                ),
                _ => format!(
                    "config.json says {expected}, the weights' {tensor} has {found} \
                     (dimension {axis})"
                ),
            };
            return Err(config_error(key, what));
        }
    }
    Ok(())
}

/// The layers the tensor table has (`model.layers.N.*`) against the
/// config's count; `nextn` DeepSeek-style MTP layers may follow the
/// decoder's (the file may have them or not).
pub(crate) fn check_layer_count(
    cfg: &ModelConfig,
    tensors: &[StoredTensor],
    nextn: usize,
) -> Result<()> {
    let found = tensors
        .iter()
        .filter_map(|t| t.name.strip_prefix("model.layers.")?.split('.').next())
        .filter_map(|i| i.parse::<usize>().ok())
        .max()
        .map_or(0, |i| i + 1);
    if found < cfg.num_layers || found > cfg.num_layers + nextn {
        return Err(config_error(
            "num_hidden_layers",
            format!(
                "config.json says {} layers, the weights have {found}",
                cfg.num_layers
            ),
        ));
    }
    Ok(())
}

fn config_error(key: &str, what: String) -> crate::error::ModelError {
    crate::error::ModelError::Config {
        key: key.to_string(),
        what,
    }
}

/// Every weight a Llama-family checkpoint with `cfg` holds: Hugging Face
/// name and shape (the tied `lm_head` is left out when tied).
pub fn tensor_shapes(cfg: &ModelConfig, f: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let i = cfg.intermediate_size;
    let h = cfg.hidden_size;
    tensor_shapes_with(cfg, f, &|l, out| {
        let p = format!("model.layers.{l}.mlp");
        out.push((format!("{p}.gate_proj.weight"), vec![i, h]));
        out.push((format!("{p}.up_proj.weight"), vec![i, h]));
        out.push((format!("{p}.down_proj.weight"), vec![h, i]));
    })
}

/// [`tensor_shapes`] with layer `l`'s feed-forward weights from `ffn`.
pub(crate) fn tensor_shapes_with(
    cfg: &ModelConfig,
    f: &LlamaConfig,
    ffn: &dyn Fn(usize, &mut Vec<(String, Vec<usize>)>),
) -> Vec<(String, Vec<usize>)> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    // The decoder's layers, then the first DeepSeek-style MTP layer where
    // the config declares one (its own norms and projection, then a block).
    for l in 0..cfg.num_layers + usize::from(f.nextn_layers > 0) {
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
        add("self_attn.q_proj.weight", vec![q, h]);
        add("self_attn.k_proj.weight", vec![kv, h]);
        add("self_attn.v_proj.weight", vec![kv, h]);
        add("self_attn.o_proj.weight", vec![h, q]);
        if f.qkv_bias {
            add("self_attn.q_proj.bias", vec![q]);
            add("self_attn.k_proj.bias", vec![kv]);
            add("self_attn.v_proj.bias", vec![kv]);
        }
        if f.o_bias {
            add("self_attn.o_proj.bias", vec![h]);
        }
        if f.qk_norm {
            add("self_attn.q_norm.weight", vec![hd]);
            add("self_attn.k_norm.weight", vec![hd]);
        }
        ffn(l, &mut out);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

impl CausalLm for Llama {
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
        self.nextn()?;
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
        let slot = LayerSlot { group: 0, slot: 0 };
        let x = self.block(&m.block, x, batch, cache, slot, true)?;
        m.output(b, &x, &batch.logits_rows, &self.lm_head)
    }

    fn expert_load(&self) -> Vec<Vec<u64>> {
        self.blocks
            .iter()
            .filter_map(|b| b.mlp.expert_load())
            .collect()
    }

    fn lora_targets(&self) -> Vec<crate::LoraTarget> {
        let h = self.cfg.hidden_size;
        self.blocks
            .iter()
            .flat_map(|blk| {
                let attn = blk.attn.qkv.parts.iter().map(|(n, c)| (n, h, c.len()));
                let o = blk
                    .attn
                    .o
                    .parts
                    .iter()
                    .map(|(n, c)| (n, self.cfg.num_heads * self.cfg.head_dim, c.len()));
                // Experts are not adapted (PEFT's LoRA targets linear
                // modules; a sparse layer's experts are not those).
                let dense = match &blk.mlp {
                    Ffn::Dense(m) => Some(m),
                    Ffn::Sparse(_) => None,
                };
                let mlp = dense
                    .into_iter()
                    .flat_map(|m| m.gate_up.parts.iter().map(|(n, c)| (n, h, c.len())));
                let down = dense.into_iter().flat_map(|m| {
                    m.down
                        .parts
                        .iter()
                        .map(|(n, c)| (n, self.cfg.intermediate_size, c.len()))
                });
                attn.chain(o)
                    .chain(mlp)
                    .chain(down)
                    .map(|(name, in_dim, out_dim)| crate::LoraTarget {
                        name: name.clone(),
                        in_dim,
                        out_dim,
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

impl Llama {
    /// One forward step as backend ops; `run_step` may record it.
    ///
    /// A tensor-parallel rank ([`crate::tp`]) looks up its vocabulary
    /// slice's rows, all-reduces each sub-layer's output before adding the
    /// residual, and all-gathers the logits.
    fn step(&self, batch: &ForwardBatch, cache: &mut KvCache, out: StepOutput) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let x = self.trunk(batch, cache)?;
        // Only the rows that want logits go through the final norm and head.
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        match (out, self.cfg.tensor_parallel) {
            (StepOutput::Logits, None) => self.lm_head.forward(b, &x, Fuse::norm(&self.norm)),
            (StepOutput::Logits, Some(t)) => {
                let local = self.lm_head.forward(b, &x, Fuse::norm(&self.norm))?;
                Ok(b.all_gather_columns(&local, &t.vocab_widths())?)
            }
            (StepOutput::Hidden, _) => self.norm.forward(b, &x),
        }
    }

    /// Every row's last hidden state, before the final norm.
    fn trunk(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let mut x = match self.cfg.tensor_parallel {
            None => b.embedding(&self.embed, &batch.token_ids)?,
            Some(t) => {
                let rows = b.embedding(&self.embed, &t.local_ids(&batch.token_ids))?;
                b.all_reduce_sum(&rows)?
            }
        };
        let whole = self.cfg.tensor_parallel.is_none();
        for (i, blk) in self.blocks.iter().enumerate() {
            x = self.block(blk, x, batch, cache, self.kv_slots[i], whole)?;
        }
        Ok(x)
    }

    /// One pre-norm block over `x`: each norm runs fused into the
    /// projection that consumes it. Whole, the residual adds run fused
    /// into each sub-layer's last product; split (a tensor-parallel rank),
    /// each rank's partial output is all-reduced and the residual added
    /// after, so it is rounded once, as whole (in bf16 a rank-0 epilogue
    /// would round it twice: there and in the sum).
    fn block(
        &self,
        blk: &Block,
        x: Tensor,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        slot: LayerSlot,
        whole: bool,
    ) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let join = |x: &Tensor, y: Tensor| -> Result<Tensor> {
            match whole {
                true => Ok(y),
                false => Ok(b.add(x, &b.all_reduce_sum(&y)?)?),
            }
        };
        let attn = Fuse::norm(&blk.input_norm).with_lora(&batch.lora);
        let attn = match whole {
            true => attn.with_residual(&x),
            false => attn,
        };
        let y = blk
            .attn
            .forward(b, &x, attn, &self.rope, batch, cache, slot)?;
        let x = join(&x, y)?;
        let y = blk
            .mlp
            .forward_pre_norm(b, &x, &blk.post_attn_norm, &batch.lora, whole)?;
        join(&x, y)
    }

    fn nextn(&self) -> Result<&NextN<Block>> {
        self.nextn.as_ref().ok_or_else(|| self.no_mtp())
    }
}
