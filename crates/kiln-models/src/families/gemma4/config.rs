//! Gemma 4's `config.json` keys (`Gemma4TextConfig`) and the weights a
//! checkpoint of a config holds.

use serde_json::Value;

use crate::config::{
    err, opt_f32, opt_usize, parse_rope_scaling, sliding_layer_types, FamilyLayers, LayerKind,
    LayerKv, ModelConfig, RopeScaling,
};
use crate::error::Result;
use crate::families::FamilyConfig;

/// The keys of `config.json` only Gemma 4 reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Config {
    /// Keys a sliding layer's query reads, itself included.
    pub sliding_window: usize,
    /// Which layers are `sliding_attention`.
    pub sliding_layers: Vec<bool>,
    /// RoPE of the sliding and of the full-attention layers.
    pub sliding_rope: LayerRope,
    pub full_rope: LayerRope,
    /// Full-attention layers have no `v_proj`: their values are the raw
    /// key projection (`attention_k_eq_v`).
    pub k_eq_v: bool,
    /// The MLP of a layer that reads another layer's cache is twice as wide
    /// (`use_double_wide_mlp`).
    pub double_wide_mlp: bool,
    /// Per-layer input embeddings (`hidden_size_per_layer_input`), if any.
    pub per_layer_input: Option<PerLayerInput>,
    pub final_logit_softcapping: Option<f32>,
}

/// One layer type's rotary embedding (`rope_parameters.<layer type>`).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRope {
    pub theta: f32,
    /// `proportional`: the first `partial_rotary_factor * head_dim / 2`
    /// frequencies of a full-width table, the rest zero (those dimensions
    /// pass through); `default`: the first `partial_rotary_factor *
    /// head_dim` dimensions rotate with their own table.
    pub proportional: bool,
    pub partial_rotary_factor: f32,
    /// Divides every frequency (`factor` of proportional RoPE).
    pub factor: f32,
    pub scaling: RopeScaling,
}

impl LayerRope {
    /// The inverse frequencies for heads of `head_dim`, in f32 as
    /// transformers computes them.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        if self.proportional {
            let angles = ((self.partial_rotary_factor as f64 * head_dim as f64) / 2.0).floor();
            let angles = (angles as usize).min(head_dim / 2);
            return (0..head_dim / 2)
                .map(|j| {
                    if j < angles {
                        1.0 / self.theta.powf((2 * j) as f32 / head_dim as f32) / self.factor
                    } else {
                        0.0
                    }
                })
                .collect();
        }
        let rotary = ((head_dim as f64 * self.partial_rotary_factor as f64) as usize) & !1;
        crate::layers::Rope::new(rotary.max(2), self.theta, &self.scaling).inv_freq
    }
}

/// Gemma 4's per-layer input embeddings: a second table of
/// `num_layers * width` columns and a projection of the input embedding,
/// one `width`-wide slice a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerLayerInput {
    pub vocab_size: usize,
    pub width: usize,
}

/// The Gemma 4 part of `cfg`.
pub fn gemma4_config(cfg: &ModelConfig) -> Result<&Gemma4Config> {
    match &cfg.family {
        FamilyConfig::Gemma4(g) => Ok(g),
        _ => Err(crate::families::wrong_family(cfg, "gemma4")),
    }
}

/// One layer type's `rope_parameters` entry, or transformers' default.
fn layer_rope(c: &Value, kind: &str, default_theta: f32, proportional: bool) -> Result<LayerRope> {
    let p = c
        .get("rope_parameters")
        .and_then(|p| p.get(kind))
        .filter(|v| v.is_object());
    let key = |k: &str| format!("rope_parameters.{kind}.{k}");
    let Some(p) = p else {
        return Ok(LayerRope {
            theta: default_theta,
            proportional,
            partial_rotary_factor: if proportional { 0.25 } else { 1.0 },
            factor: 1.0,
            scaling: RopeScaling::None,
        });
    };
    let rope_type = p
        .get("rope_type")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let partial = opt_f32(p, "partial_rotary_factor")?.unwrap_or(1.0);
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(err(&key("partial_rotary_factor"), "must be in (0, 1]"));
    }
    let theta = opt_f32(p, "rope_theta")?.unwrap_or(default_theta);
    if rope_type == "proportional" {
        let factor = opt_f32(p, "factor")?.unwrap_or(1.0);
        if factor <= 0.0 {
            return Err(err(&key("factor"), "must be positive"));
        }
        return Ok(LayerRope {
            theta,
            proportional: true,
            partial_rotary_factor: partial,
            factor,
            scaling: RopeScaling::None,
        });
    }
    Ok(LayerRope {
        theta,
        proportional: false,
        partial_rotary_factor: partial,
        factor: 1.0,
        scaling: parse_rope_scaling(Some(p))?,
    })
}

/// `(head_dim, num_kv_heads)` overrides of the full-attention layers:
/// transformers >= 5.24 writes them per layer (`per_layer_config`, keyed by
/// the zero-padded layer index), earlier ones as `global_head_dim` and
/// `num_global_key_value_heads` (the latter only with `attention_k_eq_v`).
fn layer_shapes(
    c: &Value,
    sliding: &[bool],
    head_dim: usize,
    kv_heads: usize,
    k_eq_v: bool,
) -> Result<Vec<(usize, usize)>> {
    let global_hd = opt_usize(c, "global_head_dim")?.unwrap_or(512);
    let global_kvh = match opt_usize(c, "num_global_key_value_heads")? {
        Some(h) if k_eq_v => h,
        _ => kv_heads,
    };
    let mut shapes: Vec<(usize, usize)> = sliding
        .iter()
        .map(|&s| {
            if s {
                (head_dim, kv_heads)
            } else {
                (global_hd, global_kvh)
            }
        })
        .collect();
    if let Some(per_layer) = c.get("per_layer_config").and_then(Value::as_object) {
        for (k, v) in per_layer {
            let i = k
                .parse::<usize>()
                .ok()
                .filter(|&i| i < shapes.len())
                .ok_or_else(|| err("per_layer_config", format!("{k:?} is not a layer index")))?;
            if let Some(hd) = opt_usize(v, "head_dim")? {
                shapes[i].0 = hd;
            }
            if let Some(h) = opt_usize(v, "num_key_value_heads")? {
                shapes[i].1 = h;
            }
        }
    }
    Ok(shapes)
}

/// The family's keys of `c` and its layers' KV layout.
pub(super) fn parse(c: &Value, num_layers: usize, head_dim: usize) -> Result<FamilyLayers> {
    if c.get("enable_moe_block").and_then(Value::as_bool) == Some(true) {
        return Err(err(
            "enable_moe_block",
            "Gemma 4's mixture-of-experts blocks are not supported yet",
        ));
    }
    if c.get("use_bidirectional_attention").and_then(Value::as_str) == Some("all") {
        return Err(err(
            "use_bidirectional_attention",
            "\"all\" makes an encoder; Kiln serves Gemma 4 as a causal model",
        ));
    }
    if c.get("attention_bias").and_then(Value::as_bool) == Some(true) {
        return Err(err(
            "attention_bias",
            "Gemma 4 with attention biases is not supported",
        ));
    }
    if !matches!(
        c.get("hidden_activation")
            .or_else(|| c.get("hidden_act"))
            .and_then(Value::as_str),
        None | Some("gelu_pytorch_tanh") | Some("gelu_tanh")
    ) {
        return Err(err("hidden_activation", "Gemma 4 uses gelu_pytorch_tanh"));
    }
    let sliding_window = opt_usize(c, "sliding_window")?.unwrap_or(512);
    if sliding_window == 0 {
        return Err(err("sliding_window", "must be positive"));
    }
    let sliding_layers: Vec<bool> = match sliding_layer_types(c)? {
        Some(types) => types,
        // Every sixth layer full, and the last one always.
        None => (0..num_layers)
            .map(|i| (i + 1) % 6 != 0 && i + 1 != num_layers)
            .collect(),
    };
    if sliding_layers.len() != num_layers {
        return Err(err(
            "layer_types",
            format!("{} types for {num_layers} layers", sliding_layers.len()),
        ));
    }
    let num_heads = c
        .get("num_attention_heads")
        .and_then(Value::as_u64)
        .unwrap_or(1) as usize;
    let kv_heads = opt_usize(c, "num_key_value_heads")?.unwrap_or(num_heads);
    let k_eq_v = c
        .get("attention_k_eq_v")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let shapes = layer_shapes(c, &sliding_layers, head_dim, kv_heads, k_eq_v)?;
    // The last `num_kv_shared_layers` layers read the cache of the last
    // earlier layer of their type.
    let shared = opt_usize(c, "num_kv_shared_layers")?.unwrap_or(0);
    if shared >= num_layers && shared > 0 {
        return Err(err(
            "num_kv_shared_layers",
            format!("{shared} of {num_layers} layers leaves none to keep a cache"),
        ));
    }
    let first_shared = num_layers - shared;
    let layer_kv = (0..num_layers)
        .map(|i| {
            let shared_from = if i < first_shared {
                None
            } else {
                let producer = (0..first_shared)
                    .rev()
                    .find(|&j| sliding_layers[j] == sliding_layers[i])
                    .ok_or_else(|| {
                        err(
                            "num_kv_shared_layers",
                            format!("layer {i} has no earlier layer of its type to share with"),
                        )
                    })?;
                Some(producer)
            };
            Ok(LayerKv {
                head_dim: shapes[i].0,
                num_kv_heads: shapes[i].1,
                shared_from,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let layer_kinds = sliding_layers
        .iter()
        .map(|&s| {
            if s {
                LayerKind::SlidingWindow {
                    window: sliding_window,
                }
            } else {
                LayerKind::FullAttention
            }
        })
        .collect();
    // Absent means transformers' default (256); 0 or null means none.
    let ple_width = match c.get("hidden_size_per_layer_input") {
        None => 256,
        Some(Value::Null) => 0,
        Some(_) => opt_usize(c, "hidden_size_per_layer_input")?.unwrap_or(0),
    };
    let per_layer_input = match ple_width {
        0 => None,
        width => Some(PerLayerInput {
            vocab_size: opt_usize(c, "vocab_size_per_layer_input")?.unwrap_or(262_144),
            width,
        }),
    };
    let cfg = Gemma4Config {
        sliding_window,
        sliding_rope: layer_rope(c, "sliding_attention", 1e4, false)?,
        full_rope: layer_rope(c, "full_attention", 1e6, true)?,
        sliding_layers,
        k_eq_v,
        double_wide_mlp: c
            .get("use_double_wide_mlp")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        per_layer_input,
        final_logit_softcapping: opt_f32(c, "final_logit_softcapping")?.filter(|&v| v != 0.0),
    };
    Ok(FamilyLayers {
        family: FamilyConfig::Gemma4(cfg),
        layer_kinds,
        layer_kv: Some(layer_kv),
    })
}

/// The MLP width of layer `i`.
pub fn intermediate_size(cfg: &ModelConfig, g: &Gemma4Config, i: usize) -> usize {
    if g.double_wide_mlp && cfg.layer_kv[i].shared_from.is_some() {
        2 * cfg.intermediate_size
    } else {
        cfg.intermediate_size
    }
}

/// Every weight a Gemma 4 checkpoint with `cfg` holds: Hugging Face name
/// and shape (the output projection is the embedding unless untied).
pub fn tensor_shapes(cfg: &ModelConfig) -> Result<Vec<(String, Vec<usize>)>> {
    let g = gemma4_config(cfg)?;
    let h = cfg.hidden_size;
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    if let Some(ple) = g.per_layer_input {
        let all = cfg.num_layers * ple.width;
        out.push((
            "model.embed_tokens_per_layer.weight".into(),
            vec![ple.vocab_size, all],
        ));
        out.push((
            "model.per_layer_model_projection.weight".into(),
            vec![all, h],
        ));
        out.push((
            "model.per_layer_projection_norm.weight".into(),
            vec![ple.width],
        ));
    }
    for (l, kv) in cfg.layer_kv.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let mut add = |n: &str, s: Vec<usize>| out.push((format!("{p}.{n}"), s));
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            add(&format!("{norm}.weight"), vec![h]);
        }
        add("layer_scalar", vec![1]);
        let (q, hd) = (cfg.num_heads * kv.head_dim, kv.head_dim);
        add("self_attn.q_proj.weight", vec![q, h]);
        add("self_attn.q_norm.weight", vec![hd]);
        if kv.shared_from.is_none() {
            add("self_attn.k_proj.weight", vec![kv.row(), h]);
            add("self_attn.k_norm.weight", vec![hd]);
            // K = V full layers have no value projection.
            if !g.k_eq_v || g.sliding_layers[l] {
                add("self_attn.v_proj.weight", vec![kv.row(), h]);
            }
        }
        add("self_attn.o_proj.weight", vec![h, q]);
        let i = intermediate_size(cfg, g, l);
        add("mlp.gate_proj.weight", vec![i, h]);
        add("mlp.up_proj.weight", vec![i, h]);
        add("mlp.down_proj.weight", vec![h, i]);
        if let Some(ple) = g.per_layer_input {
            add("per_layer_input_gate.weight", vec![ple.width, h]);
            add("per_layer_projection.weight", vec![h, ple.width]);
            add("post_per_layer_input_norm.weight", vec![h]);
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Value {
        json!({"model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 32,
               "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "global_head_dim": 32, "vocab_size": 128, "sliding_window": 4,
               "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention", "sliding_attention", "full_attention"]})
    }

    fn shapes(c: &ModelConfig) -> Vec<(usize, usize, Option<usize>)> {
        c.layer_kv
            .iter()
            .map(|l| (l.num_kv_heads, l.head_dim, l.shared_from))
            .collect()
    }

    #[test]
    fn global_layer_shapes_parse_from_both_config_styles() {
        // transformers 5.5-5.23: global_head_dim and num_global_key_value_heads.
        let mut legacy = tiny();
        legacy["attention_k_eq_v"] = json!(true);
        legacy["num_global_key_value_heads"] = json!(1);
        let a = ModelConfig::from_hf(&legacy).unwrap();
        // transformers 5.24: per_layer_config, zero-padded indices.
        let mut v = tiny();
        v.as_object_mut().unwrap().remove("global_head_dim");
        v["attention_k_eq_v"] = json!(true);
        v["per_layer_config"] = json!({"02": {"head_dim": 32, "num_key_value_heads": 1},
                                       "05": {"head_dim": 32, "num_key_value_heads": 1}});
        let b = ModelConfig::from_hf(&v).unwrap();
        assert_eq!(shapes(&a), shapes(&b));
        assert_eq!(shapes(&a)[2], (1, 32, None));
        assert_eq!(shapes(&a)[0], (2, 16, None));
        // Without K = V the global KV-head count does not apply.
        legacy["attention_k_eq_v"] = json!(false);
        let c = ModelConfig::from_hf(&legacy).unwrap();
        assert_eq!(shapes(&c)[2], (2, 32, None));
        v["per_layer_config"] = json!({"9": {"head_dim": 32}});
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("per_layer_config"), "{e}");
    }

    #[test]
    fn shared_layers_read_the_last_earlier_layer_of_their_type() {
        let mut v = tiny();
        v["num_kv_shared_layers"] = json!(3);
        v["use_double_wide_mlp"] = json!(true);
        let c = ModelConfig::from_hf(&v).unwrap();
        let from: Vec<_> = shapes(&c).iter().map(|s| s.2).collect();
        assert_eq!(from, [None, None, None, Some(1), Some(1), Some(2)]);
        let g = gemma4_config(&c).unwrap();
        assert_eq!(intermediate_size(&c, g, 2), 32);
        assert_eq!(intermediate_size(&c, g, 3), 64);
        // Shared sliding layers with no earlier sliding layer: refused.
        v["layer_types"] = json!([
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "full_attention",
            "full_attention"
        ]);
        v["num_kv_shared_layers"] = json!(5);
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("num_kv_shared_layers"), "{e}");
    }

    #[test]
    fn defaults_follow_transformers() {
        let mut v = tiny();
        v["num_hidden_layers"] = json!(8);
        v.as_object_mut().unwrap().remove("layer_types");
        v.as_object_mut()
            .unwrap()
            .remove("hidden_size_per_layer_input");
        let c = ModelConfig::from_hf(&v).unwrap();
        let full: Vec<usize> = (0..8)
            .filter(|&i| c.layer_kinds[i] == LayerKind::FullAttention)
            .collect();
        // Every sixth layer full, and the last.
        assert_eq!(full, [5, 7]);
        let g = gemma4_config(&c).unwrap();
        // Absent means 256 per-layer input dimensions, as transformers.
        assert_eq!(g.per_layer_input.map(|p| p.width), Some(256));
        assert!(g.full_rope.proportional && !g.sliding_rope.proportional);
        assert_eq!((g.full_rope.theta, g.sliding_rope.theta), (1e6, 1e4));
        assert!(c.tie_word_embeddings);
    }

    #[test]
    fn proportional_rope_rotates_the_first_frequencies_of_a_full_width_table() {
        let r = LayerRope {
            theta: 1e6,
            proportional: true,
            partial_rotary_factor: 0.25,
            factor: 1.0,
            scaling: RopeScaling::None,
        };
        let f = r.inv_freq(32);
        assert_eq!(f.len(), 16);
        assert_eq!(f.iter().filter(|&&x| x != 0.0).count(), 4);
        assert_eq!(f[0], 1.0);
        // The exponent's denominator is the whole head, not the rotated part.
        assert!((f[1] - 1e6f32.powf(-2.0 / 32.0)).abs() < 1e-9);
    }

    #[test]
    fn unsupported_variants_are_refused_by_key() {
        for (key, value) in [
            ("enable_moe_block", json!(true)),
            ("use_bidirectional_attention", json!("all")),
            ("attention_bias", json!(true)),
        ] {
            let mut v = tiny();
            v[key] = value;
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }
}
