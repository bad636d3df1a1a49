//! Gemma 4 text decoders (`gemma4_text`, `Gemma4ForCausalLM`). Reference:
//! transformers `models/gemma4/modeling_gemma4.py` (5.24).
//!
//! What differs from Gemma 3, each as transformers computes it:
//! - RMSNorms scale by their weight `w` (no `1 + w`); the value norm has
//!   no weight (a weight of ones here).
//! - Attention scale 1 (the q and k norms carry it), no attention
//!   soft-capping; values are RMS-normalised per head.
//! - Layers differ in shape: full-attention layers have heads of
//!   `global_head_dim` (and `num_global_key_value_heads` with
//!   `attention_k_eq_v`), sliding layers of `head_dim`.
//! - `attention_k_eq_v`: full layers have no `v_proj`; their values are
//!   the raw key projection (here the key rows loaded twice, so the packed
//!   q/k/v product and kernels stay as they are).
//! - RoPE per layer type from `rope_parameters`; full layers use
//!   `proportional` RoPE: frequencies over the whole head, only the first
//!   `partial_rotary_factor` of them non-zero.
//! - KV sharing (`num_kv_shared_layers`): the last layers keep no cache and
//!   attend over the cache of the last earlier layer of their type
//!   ([`crate::config::LayerKv::shared_from`]); `use_double_wide_mlp`
//!   doubles their MLPs.
//! - Per-layer input embeddings (`hidden_size_per_layer_input`): a second
//!   embedding table and a projection of the input embedding, combined once
//!   into one slice a layer, which gates a residual branch at the end of
//!   the layer.
//! - `layer_scalar`: each layer's output is multiplied by a stored scalar.
//! - Mixture-of-experts blocks (`enable_moe_block`) are refused at parse.

mod config;

use std::sync::Arc;

use kiln_formats::{StoredTensor, WeightSource};
use kiln_tensor::{
    Activation, AttentionParams, Backend, ForwardBatch, KvCache, QkNorm, RopeParams, Tensor, Weight,
};

use config::{gemma4_config, intermediate_size};
pub use config::{tensor_shapes, Gemma4Config, LayerRope, PerLayerInput};

use super::{Family, StepOutput};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::{Fuse, GatedMlp, Linear, LoadProgress, RmsNorm, SoftCapping, WeightLoader};
use crate::CausalLm;

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "gemma4",
    model_types: &["gemma4_text"],
    tied_by_default: true,
    parse: config::parse,
    tensor_shapes,
    check_weights,
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: None,
    load: |backend, source, cfg, progress| {
        Ok(Box::new(Gemma4::load(backend, source, cfg, progress)?))
    },
};

/// Every tensor the config implies must be in the checkpoint with its
/// shape (checked before a byte is loaded); a checkpoint may hold more
/// (transformers before 5.24 keeps key and value projections on the layers
/// that share another layer's cache, which never run).
fn check_weights(cfg: &ModelConfig, tensors: &[StoredTensor]) -> Result<()> {
    for (name, shape) in tensor_shapes(cfg)? {
        if name == "lm_head.weight" {
            continue;
        }
        match tensors.iter().find(|t| t.name == name) {
            None => {
                return Err(ModelError::Config {
                    key: "model_type".into(),
                    what: format!("the checkpoint has no {name} (shape {shape:?})"),
                })
            }
            Some(t) if t.shape != shape => {
                return Err(ModelError::Config {
                    key: "model_type".into(),
                    what: format!(
                        "config.json implies {name} of shape {shape:?}, the checkpoint has {:?}",
                        t.shape
                    ),
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A Gemma 4 RMSNorm: the stored weight is the multiplier.
fn norm(l: &WeightLoader, name: &str, dim: usize, eps: f32) -> Result<RmsNorm> {
    RmsNorm::load(l, name, dim, eps)
}

/// How a layer gets its keys and values.
enum Kv {
    /// Its own: q, k and v packed (`[q, k, k]` rows with `attention_k_eq_v`),
    /// k and v normed per head (v by a weight of ones).
    Own {
        qkv: Linear,
        k_norm: RmsNorm,
        v_ones: Tensor,
    },
    /// Another layer's cache, written earlier in the step: q only.
    Shared { q: Linear },
}

/// A layer's per-layer-input branch.
struct LayerInput {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

struct Block {
    input_norm: RmsNorm,
    kv: Kv,
    q_norm: RmsNorm,
    o: Linear,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    mlp: GatedMlp,
    post_ff_norm: RmsNorm,
    input: Option<LayerInput>,
    layer_scalar: f32,
    params: AttentionParams,
    /// The layer's place in its KV group's blocks.
    kv_slot: usize,
    /// The layer's RoPE frequencies (by its type and head size).
    inv_freq: Vec<f32>,
}

/// The per-layer input embeddings' model-wide weights.
struct PerLayerInputs {
    table: Weight,
    projection: Linear,
    norm: RmsNorm,
    width: usize,
}

pub struct Gemma4 {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    embed: Weight,
    blocks: Vec<Block>,
    inputs: Option<PerLayerInputs>,
    norm: RmsNorm,
    lm_head: Linear,
    final_softcap: Option<SoftCapping>,
}

impl Gemma4 {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let g = gemma4_config(&cfg)?.clone();
        // Built first: a backend without the op refuses here, at load time.
        let final_softcap = g
            .final_logit_softcapping
            .map(|cap| SoftCapping::load(backend.as_ref(), cap))
            .transpose()?;
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed = l.embedding("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let inputs = match g.per_layer_input {
            Some(ple) => Some(PerLayerInputs {
                table: l.embedding(
                    "model.embed_tokens_per_layer.weight",
                    &[ple.vocab_size, cfg.num_layers * ple.width],
                )?,
                projection: Linear::load(
                    &l,
                    "model.per_layer_model_projection",
                    h,
                    cfg.num_layers * ple.width,
                    false,
                )?,
                norm: norm(&l, "model.per_layer_projection_norm.weight", ple.width, eps)?,
                width: ple.width,
            }),
            None => None,
        };
        let slots = cfg.kv_slots();
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for (i, (kv, slot)) in cfg.layer_kv.iter().zip(&slots).enumerate() {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let (hd, sliding) = (kv.head_dim, g.sliding_layers[i]);
            let q = cfg.num_heads * hd;
            let kv_part = match kv.shared_from {
                Some(_) => Kv::Shared {
                    q: Linear::load(&l, &format!("{a}.q_proj"), h, q, false)?,
                },
                None => {
                    let v = if g.k_eq_v && !sliding { "k" } else { "v" };
                    Kv::Own {
                        qkv: Linear::load_packed(
                            &l,
                            &[
                                format!("{a}.q_proj"),
                                format!("{a}.k_proj"),
                                format!("{a}.{v}_proj"),
                            ],
                            h,
                            &[q, kv.row(), kv.row()],
                            false,
                        )?,
                        k_norm: norm(&l, &format!("{a}.k_norm.weight"), hd, eps)?,
                        v_ones: backend.upload(&[hd], &vec![1.0; hd])?,
                    }
                }
            };
            // Read on the host: the scale is applied as an f32 on every backend.
            let scalar = source.load_f32(&format!("{p}.layer_scalar"))?;
            let layer_scalar = match (scalar.shape.as_slice(), scalar.data.as_slice()) {
                ([1], [s]) => *s,
                _ => {
                    return Err(kiln_formats::FormatError::ShapeMismatch {
                        path: source.path().to_path_buf(),
                        tensor: format!("{p}.layer_scalar"),
                        found: scalar.shape,
                        expected: vec![1],
                    }
                    .into())
                }
            };
            let input = match g.per_layer_input {
                Some(ple) => Some(LayerInput {
                    gate: Linear::load(
                        &l,
                        &format!("{p}.per_layer_input_gate"),
                        h,
                        ple.width,
                        false,
                    )?,
                    projection: Linear::load(
                        &l,
                        &format!("{p}.per_layer_projection"),
                        ple.width,
                        h,
                        false,
                    )?,
                    norm: norm(&l, &format!("{p}.post_per_layer_input_norm.weight"), h, eps)?,
                }),
                None => None,
            };
            let rope = if sliding {
                &g.sliding_rope
            } else {
                &g.full_rope
            };
            let named = |n: &str| format!("{p}.{n}.weight");
            blocks.push(Block {
                input_norm: norm(&l, &named("input_layernorm"), h, eps)?,
                kv: kv_part,
                q_norm: norm(&l, &format!("{a}.q_norm.weight"), hd, eps)?,
                o: Linear::load(&l, &format!("{a}.o_proj"), q, h, false)?,
                post_attn_norm: norm(&l, &named("post_attention_layernorm"), h, eps)?,
                pre_ff_norm: norm(&l, &named("pre_feedforward_layernorm"), h, eps)?,
                mlp: GatedMlp::load(
                    &l,
                    &format!("{p}.mlp"),
                    h,
                    intermediate_size(&cfg, &g, i),
                    Activation::GeluTanh,
                )?,
                post_ff_norm: norm(&l, &named("post_feedforward_layernorm"), h, eps)?,
                input,
                layer_scalar,
                params: AttentionParams {
                    num_heads: cfg.num_heads,
                    num_kv_heads: kv.num_kv_heads,
                    head_dim: hd,
                    scale: 1.0,
                    sliding_window: sliding.then_some(g.sliding_window),
                    softcap: None,
                    kv_group: slot.group,
                    causal: true,
                },
                kv_slot: slot.slot,
                inv_freq: rope.inv_freq(hd),
            });
        }
        if let Some(blk) = blocks
            .iter()
            .find(|blk| !backend.supports_attention(&blk.params))
        {
            return Err(ModelError::Config {
                key: "head_dim".into(),
                what: format!(
                    "the {} backend does not run this attention (head size {}; window {:?})",
                    backend.name(),
                    blk.params.head_dim,
                    blk.params.sliding_window
                ),
            });
        }
        let final_norm = norm(&l, "model.norm.weight", h, eps)?;
        let lm_head = Linear::output(&l, &embed, cfg.tie_word_embeddings)?;
        Ok(Gemma4 {
            weight_bytes: l.weight_bytes(),
            backend,
            embed,
            blocks,
            inputs,
            norm: final_norm,
            lm_head,
            final_softcap,
            cfg,
        })
    }

    /// Each layer's per-layer input `[n, width]`: the token's row of the
    /// second table scaled by `sqrt(width)`, plus the normed projection of
    /// the input embedding `x0` scaled by `hidden^-1/2`, the sum by `2^-1/2`.
    fn layer_inputs(&self, ple: &PerLayerInputs, x0: &Tensor, ids: &[u32]) -> Result<Vec<Tensor>> {
        let b = self.backend.as_ref();
        let (n, layers, w) = (ids.len(), self.cfg.num_layers, ple.width);
        let tok = b.embedding(&ple.table, ids)?;
        let tok = b.scale(&tok, (w as f32).sqrt())?;
        let ctx = ple.projection.forward(b, x0, Fuse::NONE)?;
        let ctx = b.scale(&ctx, (self.cfg.hidden_size as f32).powf(-0.5))?;
        let ctx = ple
            .norm
            .forward(b, &ctx.reshape(&[n * layers, w])?)?
            .reshape(&[n, layers * w])?;
        let sum = b.scale(&b.add(&ctx, &tok)?, std::f32::consts::FRAC_1_SQRT_2)?;
        Ok(b.split_cols(&sum, &vec![w; layers])?)
    }

    /// One forward step as backend ops; [`Backend::run_step`] may record it.
    fn step(&self, batch: &ForwardBatch, cache: &mut KvCache, out: StepOutput) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let n = batch.token_ids.len();
        let x = b.embedding(&self.embed, &batch.token_ids)?;
        let mut x = b.scale(&x, (self.cfg.hidden_size as f32).sqrt())?;
        let layer_inputs = match &self.inputs {
            Some(ple) => Some(self.layer_inputs(ple, &x, &batch.token_ids)?),
            None => None,
        };
        let nh = self.cfg.num_heads;
        for (i, blk) in self.blocks.iter().enumerate() {
            let hd = blk.params.head_dim;
            let rope = RopeParams {
                num_heads: nh,
                head_dim: hd,
                inv_freq: &blk.inv_freq,
                attention_scaling: 1.0,
            };
            let attn = match &blk.kv {
                Kv::Own {
                    qkv,
                    k_norm,
                    v_ones,
                } => {
                    let qkv = qkv.forward(b, &x, Fuse::norm(&blk.input_norm))?;
                    let qk_norm = QkNorm {
                        q_weight: &blk.q_norm.weight,
                        k_weight: &k_norm.weight,
                        v_weight: Some(v_ones),
                        eps: blk.q_norm.eps,
                        weight_offset: 0.0,
                    };
                    b.qkv_attention(
                        &qkv,
                        cache,
                        blk.kv_slot,
                        batch,
                        &blk.params,
                        &rope,
                        Some(qk_norm),
                    )?
                }
                Kv::Shared { q } => {
                    let q = q.forward(b, &x, Fuse::norm(&blk.input_norm))?;
                    let q = blk
                        .q_norm
                        .forward(b, &q.reshape(&[n * nh, hd])?)?
                        .reshape(&[n, nh * hd])?;
                    let q = b.rope(&q, &batch.positions, &rope)?;
                    b.attention_shared(&q, cache, blk.kv_slot, batch, &blk.params)?
                }
            };
            let attn = blk.o.forward(b, &attn, Fuse::NONE)?;
            x = blk.post_attn_norm.forward_add(b, &attn, &x)?;
            let h = blk.mlp.forward(b, &x, Fuse::norm(&blk.pre_ff_norm))?;
            x = blk.post_ff_norm.forward_add(b, &h, &x)?;
            if let (Some(input), Some(inputs)) = (&blk.input, &layer_inputs) {
                let gate = input.gate.forward(b, &x, Fuse::NONE)?;
                let gated = b.gated_activation(&gate, &inputs[i], Activation::GeluTanh)?;
                let branch = input.projection.forward(b, &gated, Fuse::NONE)?;
                x = input.norm.forward_add(b, &branch, &x)?;
            }
            x = b.scale(&x, blk.layer_scalar)?;
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

impl CausalLm for Gemma4 {
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
