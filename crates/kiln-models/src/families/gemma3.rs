//! Gemma 3 text decoders (`gemma3_text`, `Gemma3ForCausalLM`, the `gemma3`
//! GGUF architecture) and the text side of EmbeddingGemma. Reference:
//! transformers `models/gemma3/modeling_gemma3.py` (with Gemma 2's
//! soft-capping from `modeling_gemma2.py`).
//!
//! Quirks, each as transformers computes it:
//! - Four RMSNorms a block, each scaling by `(1 + w)` in f32: input and
//!   post-attention around attention, pre- and post-feedforward around the
//!   MLP, every output normalized before it joins the residual stream.
//!   (GGUF files store `1 + w`; `kiln-formats` subtracts the 1.)
//! - GeGLU: `down(gelu_tanh(gate(x)) * up(x))`.
//! - Per-head RMSNorm of q and k (also `(1 + w)`) before RoPE.
//! - Attention scale `query_pre_attn_scalar^-0.5`, not `head_dim^-0.5`.
//! - Token embeddings multiplied by `sqrt(hidden_size)`, rounded to the
//!   activation dtype first; the output projection is the embedding (tied).
//! - Layers are `sliding_attention` (a window of `sliding_window` keys, the
//!   query's own included) or `full_attention`, from `layer_types` or else
//!   `sliding_window_pattern` (every 6th layer full). Sliding layers rotate
//!   with the local base `rope_local_base_freq` (10k) and no scaling; full
//!   layers with `rope_theta` and the global `rope_scaling`. transformers 5
//!   writes both under `rope_parameters.{sliding,full}_attention`.
//! - `attn_logit_softcapping` and `final_logit_softcapping` (Gemma 2):
//!   `tanh(x / cap) * cap` on attention scores and on the logits, when set.
//! - `use_bidirectional_attention` (EmbeddingGemma) turns the causal mask
//!   off: full layers attend to the whole sequence, sliding layers to keys
//!   less than `sliding_window / 2 + 1` away on either side (transformers
//!   halves the window when it reads such a config). Its layers keep every
//!   block (a window that looks ahead frees nothing as the sequence grows).
//! - Each layer's keys and values live where the KV layout puts them
//!   ([`ModelConfig::kv_layout`]): sliding and full layers in separate
//!   groups, so the sliding groups free the blocks behind their window.

use std::sync::Arc;

use kiln_formats::WeightSource;
use kiln_tensor::{
    Activation, AttentionParams, Backend, ForwardBatch, KvCache, QkNorm, Tensor, Weight,
};
use serde_json::Value;

use super::{Family, FamilyConfig, StepOutput};
use crate::config::{
    err, opt_f32, opt_usize, parse_rope_scaling, sliding_layer_types, FamilyLayers, LayerKind,
    ModelConfig, RopeScaling,
};
use crate::error::{ModelError, Result};
use crate::layers::{
    Fuse, GatedMlp, Linear, LoadProgress, RmsNorm, Rope, SoftCapping, WeightLoader,
};
use crate::CausalLm;

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "gemma3",
    model_types: &["gemma3_text"],
    tied_by_default: true,
    parse,
    tensor_shapes: |cfg| Ok(tensor_shapes(cfg)),
    check_weights: super::llama::check_weights,
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: None,
    load: |backend, source, cfg, progress| {
        Ok(Box::new(Gemma3::load(backend, source, cfg, progress)?))
    },
};

/// The keys of `config.json` only Gemma 3 reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    /// The global (full-attention) RoPE base and scaling.
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// The sliding layers' RoPE base (never scaled).
    pub rope_local_base_freq: f32,
    /// Keys a sliding layer's query reads, itself included (as in
    /// `config.json`; a bidirectional model reads `sliding_window / 2 + 1`
    /// on each side).
    pub sliding_window: usize,
    /// Which layers are `sliding_attention`.
    pub sliding_layers: Vec<bool>,
    /// Attention scores are multiplied by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: f32,
    pub attn_logit_softcapping: Option<f32>,
    pub final_logit_softcapping: Option<f32>,
    /// Attention over the whole sequence instead of causal (EmbeddingGemma).
    pub bidirectional: bool,
}

/// A soft-capping value: absent, `null` and 0 all mean none.
fn softcap(c: &Value, key: &str) -> Result<Option<f32>> {
    Ok(opt_f32(c, key)?.filter(|&v| v != 0.0))
}

/// The family's keys of `c` and its layers' KV layout.
fn parse(c: &Value, num_layers: usize, head_dim: usize) -> Result<FamilyLayers> {
    // transformers 5 keeps RoPE per layer type under `rope_parameters`.
    let params = |kind: &str| {
        c.get("rope_parameters")
            .and_then(|p| p.get(kind))
            .filter(|v| v.is_object())
    };
    let theta = |p: Option<&Value>| p.map(|p| opt_f32(p, "rope_theta")).transpose();
    let rope_theta = match opt_f32(c, "rope_theta")? {
        Some(t) => t,
        None => theta(params("full_attention"))?.flatten().unwrap_or(1e6),
    };
    let rope_local_base_freq = match opt_f32(c, "rope_local_base_freq")? {
        Some(t) => t,
        None => theta(params("sliding_attention"))?.flatten().unwrap_or(1e4),
    };
    let rope_scaling = parse_rope_scaling(
        c.get("rope_scaling")
            .filter(|v| v.is_object())
            .or(params("full_attention")),
    )?;
    let sliding_window = opt_usize(c, "sliding_window")?.unwrap_or(4096);
    if sliding_window == 0 {
        return Err(err("sliding_window", "must be positive"));
    }
    let sliding_layers = match sliding_layer_types(c)? {
        Some(types) => types,
        None => {
            let pattern = match opt_usize(c, "sliding_window_pattern")? {
                Some(p) => p,
                None => opt_usize(c, "_sliding_window_pattern")?.unwrap_or(6),
            };
            if pattern == 0 {
                return Err(err("sliding_window_pattern", "must be positive"));
            }
            (0..num_layers).map(|i| (i + 1) % pattern != 0).collect()
        }
    };
    let bidirectional = c
        .get("use_bidirectional_attention")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let layer_kinds = sliding_layers
        .iter()
        .map(|&sliding| {
            if sliding && !bidirectional {
                LayerKind::SlidingWindow {
                    window: sliding_window,
                }
            } else {
                LayerKind::FullAttention
            }
        })
        .collect();
    let cfg = Gemma3Config {
        rope_theta,
        rope_scaling,
        rope_local_base_freq,
        sliding_window,
        sliding_layers,
        query_pre_attn_scalar: opt_f32(c, "query_pre_attn_scalar")?.unwrap_or(head_dim as f32),
        attn_logit_softcapping: softcap(c, "attn_logit_softcapping")?,
        final_logit_softcapping: softcap(c, "final_logit_softcapping")?,
        bidirectional,
    };
    if !matches!(
        c.get("hidden_activation")
            .or_else(|| c.get("hidden_act"))
            .and_then(Value::as_str),
        None | Some("gelu_pytorch_tanh") | Some("gelu_tanh")
    ) {
        return Err(err("hidden_activation", "Gemma 3 uses gelu_pytorch_tanh"));
    }
    Ok(FamilyLayers {
        family: FamilyConfig::Gemma3(cfg),
        layer_kinds,
        layer_kv: None,
    })
}

/// The Gemma 3 part of `cfg`.
fn gemma3_config(cfg: &ModelConfig) -> Result<&Gemma3Config> {
    match &cfg.family {
        FamilyConfig::Gemma3(g) => Ok(g),
        _ => Err(super::wrong_family(cfg, "gemma3")),
    }
}

/// Every weight a Gemma 3 checkpoint with `cfg` holds: Hugging Face name
/// and shape (the output projection is the embedding unless untied).
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for l in 0..cfg.num_layers {
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
        add("self_attn.q_proj.weight", vec![q, h]);
        add("self_attn.k_proj.weight", vec![kv, h]);
        add("self_attn.v_proj.weight", vec![kv, h]);
        add("self_attn.o_proj.weight", vec![h, q]);
        add("self_attn.q_norm.weight", vec![hd]);
        add("self_attn.k_norm.weight", vec![hd]);
        add("mlp.gate_proj.weight", vec![i, h]);
        add("mlp.up_proj.weight", vec![i, h]);
        add("mlp.down_proj.weight", vec![h, i]);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// A Gemma RMSNorm: the stored weight `w` scales by `1 + w`.
fn norm(l: &WeightLoader, name: &str, dim: usize, eps: f32) -> Result<RmsNorm> {
    Ok(RmsNorm {
        weight: l.tensor(name, &[dim])?,
        eps,
        weight_offset: 1.0,
    })
}

struct Block {
    input_norm: RmsNorm,
    /// q, k and v packed: `[(heads + 2 * kv_heads) * head_dim, hidden]`.
    qkv: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    o: Linear,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    /// GeGLU: gelu-tanh of the gate rows times the up rows, then down.
    mlp: GatedMlp,
    post_ff_norm: RmsNorm,
    /// The layer's attention: its window, soft-capping, mask and KV group.
    params: AttentionParams,
    /// The layer's place in its KV group's blocks.
    kv_slot: usize,
    /// Whether the layer rotates with the local (sliding) RoPE.
    local_rope: bool,
}

pub struct Gemma3 {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    embed: Weight,
    /// `sqrt(hidden_size)`, as f32.
    embed_scale: f32,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    global_rope: Rope,
    local_rope: Rope,
    final_softcap: Option<SoftCapping>,
}

impl Gemma3 {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let g = gemma3_config(&cfg)?.clone();
        // Built first: a backend without the op refuses here, at load time.
        let final_softcap = g
            .final_logit_softcapping
            .map(|cap| SoftCapping::load(backend.as_ref(), cap))
            .transpose()?;
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let embed = l.embedding("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let kv_slots = cfg.kv_slots();
        let window = if g.bidirectional {
            g.sliding_window / 2 + 1
        } else {
            g.sliding_window
        };
        let blocks = g
            .sliding_layers
            .iter()
            .zip(&kv_slots)
            .enumerate()
            .map(|(i, (&sliding, slot))| {
                let p = format!("model.layers.{i}");
                let a = format!("{p}.self_attn");
                let m = format!("{p}.mlp");
                let sliding_window = sliding.then_some(window);
                Ok(Block {
                    input_norm: norm(&l, &format!("{p}.input_layernorm.weight"), h, eps)?,
                    qkv: Linear::load_packed(
                        &l,
                        &[
                            format!("{a}.q_proj"),
                            format!("{a}.k_proj"),
                            format!("{a}.v_proj"),
                        ],
                        h,
                        &[q, kv, kv],
                        false,
                    )?,
                    q_norm: norm(&l, &format!("{a}.q_norm.weight"), hd, eps)?,
                    k_norm: norm(&l, &format!("{a}.k_norm.weight"), hd, eps)?,
                    o: Linear::load(&l, &format!("{a}.o_proj"), q, h, false)?,
                    post_attn_norm: norm(
                        &l,
                        &format!("{p}.post_attention_layernorm.weight"),
                        h,
                        eps,
                    )?,
                    pre_ff_norm: norm(
                        &l,
                        &format!("{p}.pre_feedforward_layernorm.weight"),
                        h,
                        eps,
                    )?,
                    mlp: GatedMlp::load(&l, &m, h, cfg.intermediate_size, Activation::GeluTanh)?,
                    post_ff_norm: norm(
                        &l,
                        &format!("{p}.post_feedforward_layernorm.weight"),
                        h,
                        eps,
                    )?,
                    params: AttentionParams {
                        num_heads: cfg.num_heads,
                        num_kv_heads: cfg.num_kv_heads,
                        head_dim: hd,
                        scale: g.query_pre_attn_scalar.powf(-0.5),
                        sliding_window,
                        softcap: g.attn_logit_softcapping,
                        kv_group: slot.group,
                        causal: !g.bidirectional,
                    },
                    kv_slot: slot.slot,
                    local_rope: sliding,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(blk) = blocks
            .iter()
            .find(|blk| !backend.supports_attention(&blk.params))
        {
            return Err(ModelError::Config {
                key: "use_bidirectional_attention".into(),
                what: format!(
                    "the {} backend does not run this attention ({}; window {:?})",
                    backend.name(),
                    if blk.params.causal {
                        "causal"
                    } else {
                        "bidirectional"
                    },
                    blk.params.sliding_window
                ),
            });
        }
        let final_norm = norm(&l, "model.norm.weight", h, eps)?;
        let lm_head = Linear::output(&l, &embed, cfg.tie_word_embeddings)?;
        Ok(Gemma3 {
            weight_bytes: l.weight_bytes(),
            embed_scale: (h as f32).sqrt(),
            backend,
            embed,
            blocks,
            norm: final_norm,
            lm_head,
            global_rope: Rope::new(hd, g.rope_theta, &g.rope_scaling),
            local_rope: Rope::new(hd, g.rope_local_base_freq, &RopeScaling::None),
            final_softcap,
            cfg,
        })
    }

    /// One forward step as backend ops; [`Backend::run_step`] may record it.
    fn step(&self, batch: &ForwardBatch, cache: &mut KvCache, out: StepOutput) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let x = b.embedding(&self.embed, &batch.token_ids)?;
        let mut x = b.scale(&x, self.embed_scale)?;
        let (nh, hd) = (self.cfg.num_heads, self.cfg.head_dim);
        for blk in &self.blocks {
            let rope = if blk.local_rope {
                &self.local_rope
            } else {
                &self.global_rope
            };
            let qkv = blk.qkv.forward(b, &x, Fuse::norm(&blk.input_norm))?;
            let qk_norm = QkNorm {
                v_weight: None,
                q_weight: &blk.q_norm.weight,
                k_weight: &blk.k_norm.weight,
                eps: blk.q_norm.eps,
                weight_offset: blk.q_norm.weight_offset,
            };
            let attn = b.qkv_attention(
                &qkv,
                cache,
                blk.kv_slot,
                batch,
                &blk.params,
                &rope.params(nh, hd),
                Some(qk_norm),
            )?;
            // Post-norms: each sub-layer's output is normalised before
            // the residual add, so no residual is fused into the products.
            let attn = blk.o.forward(b, &attn, Fuse::NONE)?;
            x = blk.post_attn_norm.forward_add(b, &attn, &x)?;
            let h = blk.mlp.forward(b, &x, Fuse::norm(&blk.pre_ff_norm))?;
            x = blk.post_ff_norm.forward_add(b, &h, &x)?;
        }
        // Only the rows that want logits go through the final norm and head.
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        if out == StepOutput::Hidden {
            return self.norm.forward(b, &x);
        }
        let logits = self.lm_head.forward(b, &x, Fuse::norm(&self.norm))?;
        match &self.final_softcap {
            Some(cap) => cap.forward(b, &logits),
            None => Ok(logits),
        }
    }
}

impl CausalLm for Gemma3 {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::RandomWeights;
    use kiln_tensor::cpu::CpuBackend;
    use serde_json::json;

    fn tiny() -> Value {
        json!({"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 16, "vocab_size": 50, "sliding_window": 4,
               "sliding_window_pattern": 2, "query_pre_attn_scalar": 16})
    }

    fn gemma(c: &ModelConfig) -> &Gemma3Config {
        gemma3_config(c).unwrap()
    }

    #[test]
    fn layer_types_rope_bases_and_softcaps_parse_both_config_styles() {
        let c = ModelConfig::from_hf(&tiny()).unwrap();
        let sw = LayerKind::SlidingWindow { window: 4 };
        let full = LayerKind::FullAttention;
        assert_eq!(c.layer_kinds, [sw, full, sw, full]);
        assert!(c.tie_word_embeddings);
        let g = gemma(&c);
        assert_eq!((g.rope_theta, g.rope_local_base_freq), (1e6, 1e4));
        assert_eq!(g.attn_logit_softcapping, None);
        // transformers 5: explicit layer types and RoPE per layer type.
        let mut v = tiny();
        v["layer_types"] = json!([
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "sliding_attention"
        ]);
        v["rope_parameters"] = json!({
            "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 2e6}});
        v["attn_logit_softcapping"] = json!(50.0);
        v["final_logit_softcapping"] = json!(0);
        let c = ModelConfig::from_hf(&v).unwrap();
        assert_eq!(c.layer_kinds, [full, sw, sw, sw]);
        let g = gemma(&c);
        assert_eq!((g.rope_theta, g.rope_local_base_freq), (2e6, 5000.0));
        assert_eq!(g.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(
            (g.attn_logit_softcapping, g.final_logit_softcapping),
            (Some(50.0), None)
        );
        v["layer_types"] = json!(["full_attention", "chunked_attention"]);
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("layer_types"), "{e}");
    }

    fn logits(config: &Value, tokens: &[u32]) -> Vec<f32> {
        let cfg = ModelConfig::from_hf(config).unwrap();
        let w = RandomWeights::new(&cfg, 7).unwrap();
        let m = crate::load_model(Arc::new(CpuBackend::new()), &w, cfg).unwrap();
        let mut cache = m.kv_cache_for_tokens(tokens.len(), 4).unwrap();
        let batch = ForwardBatch::single(tokens, 0, &cache.spec, 0);
        let out = m.forward(&batch, &mut cache).unwrap();
        m.backend().to_host(&out).unwrap()
    }

    #[test]
    fn sliding_and_global_layers_get_their_own_kv_groups() {
        let c = ModelConfig::from_hf(&tiny()).unwrap();
        let (spec, slots) = c.kv_layout(4);
        // Layers sw, full, sw, full: a sliding group and a global group.
        assert_eq!(spec.groups.len(), 2);
        assert_eq!(slots[0].group, slots[2].group);
        assert_eq!(slots[1].group, slots[3].group);
        assert_ne!(slots[0].group, slots[1].group);
        assert_eq!((slots[2].slot, slots[3].slot), (1, 1));
    }

    #[test]
    fn bidirectional_attention_sees_later_tokens_and_keeps_every_block() {
        let mut v = tiny();
        let causal_a = logits(&v, &[2, 7, 11, 3, 9, 30]);
        let causal_b = logits(&v, &[2, 7, 11, 3, 9, 31]);
        let vocab = 50;
        // Causal: rows before the changed token are unchanged.
        assert_eq!(causal_a[..5 * vocab], causal_b[..5 * vocab]);
        v["use_bidirectional_attention"] = json!(true);
        let c = ModelConfig::from_hf(&v).unwrap();
        assert!(c.layer_kinds.iter().all(|k| *k == LayerKind::FullAttention));
        let bi_a = logits(&v, &[2, 7, 11, 3, 9, 30]);
        let bi_b = logits(&v, &[2, 7, 11, 3, 9, 31]);
        // Bidirectional: the first row depends on the last token.
        assert!(bi_a[..vocab]
            .iter()
            .zip(&bi_b[..vocab])
            .any(|(a, b)| (a - b).abs() > 1e-5));
        assert!(bi_a[..vocab]
            .iter()
            .zip(&causal_a[..vocab])
            .any(|(a, b)| (a - b).abs() > 1e-5));
    }

    #[test]
    fn final_logit_softcapping_bounds_the_logits() {
        let tokens = [2, 7, 11, 3, 9, 30, 1, 4];
        let plain = logits(&tiny(), &tokens);
        // A cap at half the largest logit: it bites on the largest ones.
        let cap = plain.iter().fold(0f32, |m, x| m.max(x.abs())) / 2.0;
        assert!(cap > 0.0, "the random model gives non-zero logits");
        let mut v = tiny();
        v["final_logit_softcapping"] = json!(cap);
        let capped = logits(&v, &tokens);
        for (p, c) in plain.iter().zip(&capped) {
            assert!(
                (c - (p / cap).tanh() * cap).abs() < 1e-5 * (1.0 + cap),
                "{p} -> {c}"
            );
        }
        // Attention soft-capping changes the scores, so the logits move.
        v["attn_logit_softcapping"] = json!(0.01);
        let attn_capped = logits(&v, &tokens);
        assert!(attn_capped
            .iter()
            .zip(&capped)
            .any(|(a, c)| (a - c).abs() > 1e-4));
    }
}
