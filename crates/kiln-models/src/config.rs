//! The model configuration, read from a Hugging Face `config.json` (or the
//! equivalent `kiln-formats` builds from GGUF metadata).

use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::registry;

/// The activation of the gated MLP.
pub use kiln_tensor::Activation;

/// How a layer keeps its past (full attention, a sliding window, recurrent state).
pub use kiln_scheduler::LayerKind;

pub use crate::families::FamilyConfig;

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f32,
    },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// YaRN (gpt-oss and others): frequencies blended between the scaled
    /// and the original ones over a ramp of dimensions, and cos/sin scaled
    /// by `attention_factor`.
    Yarn {
        factor: f32,
        beta_fast: f32,
        beta_slow: f32,
        original_max_position_embeddings: f32,
        /// Round the ramp's ends to whole dimensions.
        truncate: bool,
        /// `None`: `0.1 · ln(factor) + 1` (or the `mscale` ratio).
        attention_factor: Option<f32>,
        mscale: Option<f32>,
        mscale_all_dim: Option<f32>,
    },
}

/// What every decoder has, read by [`ModelConfig::from_hf`], plus what
/// only its family reads ([`FamilyConfig`], parsed by the family's own file)
/// and how each layer keeps its past ([`ModelConfig::layer_kinds`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `model_type` as in config.json (`llama`, `qwen2`, `gemma3_text`, ...).
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// End-of-sequence ids from config.json (one or several).
    pub eos_token_ids: Vec<u32>,
    /// How each layer keeps its past, one entry a layer: the KV layout the
    /// engine's scheduler and memory plan follow.
    pub layer_kinds: Vec<LayerKind>,
    /// Each layer's keys and values: their shape, and whether the layer
    /// reads another layer's instead of keeping its own.
    pub layer_kv: Vec<LayerKv>,
    /// The keys only the model's family reads.
    pub family: FamilyConfig,
    /// The rank of a tensor-parallel model this config is a part of
    /// (`crate::tp::shard_config`); `None` for a whole model.
    pub tensor_parallel: Option<crate::tp::TpShard>,
}

/// One layer's keys and values: `num_kv_heads` heads of `head_dim` a token,
/// kept by the layer itself or read from an earlier layer's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerKv {
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `Some(j)`: the layer attends over layer `j`'s keys and values (same
    /// kind and shape) and keeps none of its own (Gemma 4's KV sharing).
    pub shared_from: Option<usize>,
}

impl LayerKv {
    /// Elements of keys (and of values) a token has in this layer.
    pub fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// What a family's `parse` reads from `config.json`: its own keys, how each
/// layer keeps its past, and (when its layers differ in shape or share
/// caches) each layer's keys and values; `None` is every layer alike, with
/// the config's `num_key_value_heads` and `head_dim`.
pub struct FamilyLayers {
    pub family: FamilyConfig,
    pub layer_kinds: Vec<LayerKind>,
    pub layer_kv: Option<Vec<LayerKv>>,
}

pub(crate) fn err(key: &str, what: impl Into<String>) -> ModelError {
    ModelError::Config {
        key: key.to_string(),
        what: what.into(),
    }
}

/// The largest value each dimension may take: far above any released
/// model, and low enough that nothing sized from them (the tensor list,
/// KV bytes per token, rotary tables) overflows or grows absurd before
/// the weights are checked against the configuration.
const LIMITS: &[(&str, u64)] = &[
    ("hidden_size", 1 << 16),
    ("intermediate_size", 1 << 20),
    ("num_hidden_layers", 1 << 10),
    ("num_attention_heads", 1 << 10),
    ("num_key_value_heads", 1 << 10),
    ("head_dim", 1 << 12),
    ("vocab_size", 1 << 22),
    ("max_position_embeddings", 1 << 24),
    ("original_max_position_embeddings", 1 << 24),
    ("sliding_window", 1 << 24),
];

/// `v` as a dimension named `key`, within its limit.
pub(crate) fn dimension(key: &str, v: &Value) -> Result<usize> {
    let n = v
        .as_u64()
        .ok_or_else(|| err(key, format!("{v} is not a non-negative integer")))?;
    if let Some((_, max)) = LIMITS.iter().find(|(k, _)| *k == key) {
        if n > *max {
            return Err(err(
                key,
                format!("{n} is larger than any model Kiln can serve (at most {max})"),
            ));
        }
    }
    Ok(n as usize)
}

pub(crate) fn req_usize(c: &Value, key: &str) -> Result<usize> {
    match c.get(key) {
        None | Some(Value::Null) => Err(err(key, "missing")),
        Some(v) => dimension(key, v),
    }
}

pub(crate) fn opt_usize(c: &Value, key: &str) -> Result<Option<usize>> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => dimension(key, v).map(Some),
    }
}

pub(crate) fn opt_f32(c: &Value, key: &str) -> Result<Option<f32>> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|v| Some(v as f32))
            .ok_or_else(|| err(key, "not a number")),
    }
}

pub(crate) fn ids(c: &Value, key: &str) -> Vec<u32> {
    match c.get(key) {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelConfig {
    /// Parse a `config.json` value: the shared decoder keys here, then the
    /// family's own keys by the family that serves `model_type`.
    pub fn from_hf(c: &Value) -> Result<Self> {
        let model_type = c
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| err("model_type", "missing"))?
            .to_string();
        let descriptor =
            registry::find(&model_type).ok_or_else(|| ModelError::UnsupportedModel {
                model_type: model_type.clone(),
                supported: registry::supported_model_types(),
            })?;
        let hidden_size = req_usize(c, "hidden_size")?;
        let num_heads = req_usize(c, "num_attention_heads")?;
        if num_heads == 0 || hidden_size == 0 {
            return Err(err("num_attention_heads", "must be positive"));
        }
        let num_kv_heads = opt_usize(c, "num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(err(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide {num_heads} attention heads"),
            ));
        }
        let head_dim = opt_usize(c, "head_dim")?.unwrap_or(hidden_size / num_heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(err(
                "head_dim",
                format!("{head_dim} must be even and positive"),
            ));
        }
        let num_layers = req_usize(c, "num_hidden_layers")?;
        let FamilyLayers {
            family,
            layer_kinds,
            layer_kv,
        } = (descriptor.parse)(c, num_layers, head_dim)?;
        if layer_kinds.len() != num_layers {
            return Err(err(
                "layer_types",
                format!("{} layer kinds for {num_layers} layers", layer_kinds.len()),
            ));
        }
        let layer_kv = layer_kv.unwrap_or_else(|| {
            vec![
                LayerKv {
                    num_kv_heads,
                    head_dim,
                    shared_from: None,
                };
                num_layers
            ]
        });
        check_layer_kv(&layer_kv, &layer_kinds, num_heads)?;
        Ok(ModelConfig {
            model_type,
            hidden_size,
            // (A model whose every feed-forward is sparse, such as
            // Qwen3.5-MoE, has only its experts' size.)
            intermediate_size: match opt_usize(c, "intermediate_size")? {
                Some(i) => i,
                None => req_usize(c, "moe_intermediate_size")?,
            },
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: req_usize(c, "vocab_size")?,
            rms_norm_eps: opt_f32(c, "rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings: opt_usize(c, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: c
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(descriptor.tied_by_default),
            bos_token_id: ids(c, "bos_token_id").first().copied(),
            eos_token_ids: ids(c, "eos_token_id"),
            layer_kinds,
            layer_kv,
            family,
            tensor_parallel: None,
        })
    }

    /// Bytes of KV cache per token over all layers at `dtype_bytes` per
    /// element, when every layer holds every token (full attention); layers
    /// that read another layer's cache add nothing.
    pub fn kv_bytes_per_token(&self, dtype_bytes: usize) -> usize {
        self.layer_kv
            .iter()
            .filter(|l| l.shared_from.is_none())
            .map(|l| 2 * l.row() * dtype_bytes)
            .sum()
    }

    /// Elements of keys (and of values) a token has in one layer of a KV
    /// block: the widest layer's (a block of a narrower group uses the
    /// front of each row).
    pub fn kv_row(&self) -> usize {
        self.layer_kv
            .iter()
            .filter(|l| l.shared_from.is_none())
            .map(LayerKv::row)
            .max()
            .unwrap_or(0)
    }

    /// Bytes of one KV block of `block_size` tokens at `dtype_bytes` per
    /// element: the layers of one group ([`ModelConfig::kv_layout`]), each
    /// [`ModelConfig::kv_row`] wide.
    pub fn kv_bytes_per_block(&self, block_size: usize, dtype_bytes: usize) -> usize {
        let (spec, _) = self.kv_layout(block_size);
        2 * spec.layers_per_block() * self.kv_row() * dtype_bytes * block_size
    }

    /// The KV layout the scheduler keeps, with `block_size`-token blocks:
    /// the layers that keep a cache split into groups of equal kind and size
    /// (one group when every layer attends alike), and each layer's group
    /// and place in a block (see [`kiln_scheduler::KvCacheSpec::for_layers`]);
    /// a layer that reads another layer's cache gets that layer's place.
    /// Recurrent layers keep no KV (their state is a slot a sequence,
    /// [`ModelConfig::has_recurrent_layers`]): they are in no group, and their
    /// place (group 0, slot 0) is never read.
    pub fn kv_layout(
        &self,
        block_size: usize,
    ) -> (kiln_scheduler::KvCacheSpec, Vec<kiln_scheduler::LayerSlot>) {
        let owners: Vec<usize> = (0..self.num_layers)
            .filter(|&i| {
                self.layer_kv[i].shared_from.is_none()
                    && self.layer_kinds[i] != LayerKind::Recurrent
            })
            .collect();
        let kinds: Vec<LayerKind> = owners.iter().map(|&i| self.layer_kinds[i]).collect();
        let (spec, owner_slots) = kiln_scheduler::KvCacheSpec::for_layers(&kinds, block_size);
        let mut slots = vec![None; self.num_layers];
        for (&i, slot) in owners.iter().zip(owner_slots) {
            slots[i] = Some(slot);
        }
        let slots = (0..self.num_layers)
            .map(|i| {
                if self.layer_kinds[i] == LayerKind::Recurrent {
                    return kiln_scheduler::LayerSlot { group: 0, slot: 0 };
                }
                let from = self.layer_kv[i].shared_from.unwrap_or(i);
                slots[from].expect("a shared cache's layer keeps its own (checked at parse)")
            })
            .collect();
        (spec, slots)
    }

    /// The backend pool of `num_blocks` blocks of `block_size` tokens for
    /// [`ModelConfig::kv_layout`] (a block holds one group's layers).
    pub fn kv_pool_shape(&self, num_blocks: usize, block_size: usize) -> kiln_tensor::KvPoolShape {
        let (spec, _) = self.kv_layout(block_size);
        kiln_tensor::KvPoolShape {
            num_layers: spec.layers_per_block(),
            num_groups: spec.groups.len(),
            num_blocks,
            block_size,
            kv_row: self.kv_row(),
        }
    }

    /// Whether some layers keep recurrent state instead of KV (hybrids).
    pub fn has_recurrent_layers(&self) -> bool {
        self.layer_kinds.contains(&LayerKind::Recurrent)
    }

    /// Bytes of recurrent state one sequence holds (f32, every recurrent
    /// layer; 0 without them): what the family's `new_cache` allocates a slot.
    pub fn state_bytes_per_seq(&self) -> u64 {
        let layers = self
            .layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::Recurrent)
            .count() as u64;
        let per_layer = match &self.family {
            crate::families::FamilyConfig::Qwen35(q) => q.state_values() as u64,
            crate::families::FamilyConfig::Lfm2(l) => {
                ((l.conv_kernel - 1) * self.hidden_size) as u64
            }
            _ => 0,
        };
        4 * layers * per_layer
    }

    /// Where each layer's keys and values live (its group and place in a
    /// block; the same for every block size).
    pub fn kv_slots(&self) -> Vec<kiln_scheduler::LayerSlot> {
        self.kv_layout(kiln_scheduler::DEFAULT_BLOCK_SIZE).1
    }
}

/// A family's per-layer KV shapes must fit the attention heads, and a layer
/// may only read the cache of an earlier layer of its kind and shape that
/// keeps its own.
fn check_layer_kv(layers: &[LayerKv], kinds: &[LayerKind], num_heads: usize) -> Result<()> {
    if layers.len() != kinds.len() {
        return Err(err(
            "num_hidden_layers",
            format!(
                "{} layer KV shapes for {} layers",
                layers.len(),
                kinds.len()
            ),
        ));
    }
    for (i, l) in layers.iter().enumerate() {
        if l.num_kv_heads == 0 || !num_heads.is_multiple_of(l.num_kv_heads) {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "layer {i}: {} KV heads do not divide {num_heads} attention heads",
                    l.num_kv_heads
                ),
            ));
        }
        if l.head_dim == 0 || l.head_dim % 2 != 0 {
            return Err(err(
                "head_dim",
                format!("layer {i}: {} must be even and positive", l.head_dim),
            ));
        }
        if let Some(j) = l.shared_from {
            let ok = j < i
                && layers[j].shared_from.is_none()
                && kinds[j] == kinds[i]
                && (layers[j].num_kv_heads, layers[j].head_dim) == (l.num_kv_heads, l.head_dim);
            if !ok {
                return Err(err(
                    "num_kv_shared_layers",
                    format!("layer {i} cannot read layer {j}'s keys and values"),
                ));
            }
        }
    }
    Ok(())
}

/// Parse a rotary scaling object (`rope_scaling`, or one entry of
/// transformers 5's `rope_parameters`).
pub(crate) fn parse_rope_scaling(s: Option<&Value>) -> Result<RopeScaling> {
    let Some(s) = s else {
        return Ok(RopeScaling::None);
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = opt_f32(s, "factor")?.unwrap_or(1.0);
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "yarn" => RopeScaling::Yarn {
            factor,
            beta_fast: opt_f32(s, "beta_fast")?
                .filter(|&b| b != 0.0)
                .unwrap_or(32.0),
            beta_slow: opt_f32(s, "beta_slow")?
                .filter(|&b| b != 0.0)
                .unwrap_or(1.0),
            original_max_position_embeddings: opt_usize(s, "original_max_position_embeddings")?
                .ok_or_else(|| {
                    err(
                        "rope_scaling",
                        "yarn needs original_max_position_embeddings",
                    )
                })? as f32,
            truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            attention_factor: opt_f32(s, "attention_factor")?,
            mscale: opt_f32(s, "mscale")?,
            mscale_all_dim: opt_f32(s, "mscale_all_dim")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor,
            low_freq_factor: opt_f32(s, "low_freq_factor")?.unwrap_or(1.0),
            high_freq_factor: opt_f32(s, "high_freq_factor")?.unwrap_or(4.0),
            original_max_position_embeddings: opt_usize(s, "original_max_position_embeddings")?
                .unwrap_or(8192) as f32,
        },
        other => {
            return Err(err(
                "rope_scaling",
                format!("rope type {other:?} is not supported yet"),
            ))
        }
    })
}

/// `layer_types` as "is this layer `sliding_attention`" (the other kind
/// being `full_attention`), when the config lists them.
pub(crate) fn sliding_layer_types(c: &Value) -> Result<Option<Vec<bool>>> {
    let Some(types) = c.get("layer_types").and_then(Value::as_array) else {
        return Ok(None);
    };
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(err(
                "layer_types",
                format!("{t} is not a layer type Kiln knows"),
            )),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The gated MLP's activation from `hidden_act` (or Gemma's
/// `hidden_activation`), `default` when neither is given.
pub(crate) fn parse_activation(c: &Value, default: &str) -> Result<Activation> {
    let name = c
        .get("hidden_activation")
        .or_else(|| c.get("hidden_act"))
        .and_then(Value::as_str)
        .unwrap_or(default);
    match name {
        "silu" | "swish" => Ok(Activation::Silu),
        "gelu_pytorch_tanh" | "gelu_tanh" => Ok(Activation::GeluTanh),
        other => Err(err("hidden_act", format!("{other:?} is not supported"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 10000.0})
    }

    #[test]
    fn parses_defaults_and_llama3_scaling() {
        let c = ModelConfig::from_hf(&base()).unwrap();
        assert_eq!(c.head_dim, 16);
        let FamilyConfig::Llama(l) = &c.family else {
            panic!("{:?}", c.family)
        };
        assert!(!l.qkv_bias && !c.tie_word_embeddings);
        assert_eq!(c.layer_kinds, vec![LayerKind::FullAttention; 2]);
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_hf(&v).unwrap();
        let FamilyConfig::Llama(l) = &c.family else {
            panic!("{:?}", c.family)
        };
        assert!(matches!(l.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }

    #[test]
    fn absurd_dimensions_are_refused_by_name() {
        for key in [
            "num_hidden_layers",
            "hidden_size",
            "vocab_size",
            "intermediate_size",
        ] {
            let mut v = base();
            v[key] = json!(1_000_000_000u64);
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("1000000000"), "{e}");
            v[key] = json!(1e9);
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn rejects_bad_configs_with_the_key() {
        let mut v = base();
        v["num_key_value_heads"] = json!(3);
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(ModelConfig::from_hf(&v)
            .unwrap_err()
            .to_string()
            .contains("hidden_size"));
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(ModelConfig::from_hf(&v)
            .unwrap_err()
            .to_string()
            .contains("yarn"));
    }
}
