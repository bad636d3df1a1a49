//! BERT encoders (`bert`, `BertModel`: all-MiniLM and the other
//! sentence-transformers BERTs). Reference: transformers
//! `models/bert/modeling_bert.py`.
//!
//! Quirks, each as transformers computes it:
//! - Embeddings: word + learned absolute position (`position_ids` from 0)
//!   + token type 0, then a LayerNorm (with bias, `layer_norm_eps`).
//! - Post-norm blocks: `x = LN(x + o(attn(x)))`, `x = LN(x + W2·gelu(W1·x))`,
//!   every projection with a bias; attention over the whole sequence
//!   (bidirectional), scale `head_dim^-0.5`, no rotary embedding.
//! - `hidden_act: "gelu"` is the erf form (`gelu_new` / `gelu_pytorch_tanh`
//!   the tanh one).
//! - No output head: the model only returns hidden states (its
//!   `last_hidden_state` is the last block's output, no final norm), so an
//!   embedding head pools them. A sequence must be run whole in one step
//!   (every token attends to every other).
//! - Checkpoints name weights `embeddings.*`/`encoder.layer.N.*`, or with a
//!   `bert.` prefix (`BertForMaskedLM` and friends); both load.

use std::sync::Arc;

use kiln_formats::{StoredTensor, WeightSource};
use kiln_tensor::{
    require_extensions, AttentionParams, Backend, ExtensionOp, ForwardBatch, GeluErf, KvCache,
    LayerNorm, Tensor, Weight,
};
use serde_json::Value;

use super::{Family, FamilyConfig};
use crate::config::{err, opt_f32, FamilyLayers, LayerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::layers::{Fuse, Linear, LoadProgress, WeightLoader};
use crate::CausalLm;

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "bert",
    model_types: &["bert"],
    tied_by_default: false,
    parse,
    tensor_shapes: |cfg| Ok(tensor_shapes(cfg, "")),
    check_weights,
    stored_blocks: super::no_stored_blocks,
    tensor_parallel: None,
    load: |backend, source, cfg, progress| {
        Ok(Box::new(Bert::load(backend, source, cfg, progress)?))
    },
};

/// The keys of `config.json` only BERT reads.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    pub layer_norm_eps: f32,
    pub type_vocab_size: usize,
    /// GELU by the error function (`gelu`), else by tanh.
    pub gelu_erf: bool,
}

fn parse(c: &Value, num_layers: usize, _head_dim: usize) -> Result<FamilyLayers> {
    let act = c
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("gelu");
    let gelu_erf = match act {
        "gelu" => true,
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => false,
        other => {
            return Err(err(
                "hidden_act",
                format!("{other:?} is not a GELU Kiln runs for BERT"),
            ))
        }
    };
    let kind = c
        .get("position_embedding_type")
        .and_then(Value::as_str)
        .unwrap_or("absolute");
    if kind != "absolute" {
        return Err(err(
            "position_embedding_type",
            format!("{kind:?}: Kiln runs absolute position embeddings"),
        ));
    }
    let type_vocab_size = c
        .get("type_vocab_size")
        .and_then(Value::as_u64)
        .unwrap_or(2) as usize;
    if type_vocab_size == 0 {
        return Err(err("type_vocab_size", "must be positive"));
    }
    Ok(FamilyLayers {
        family: FamilyConfig::Bert(BertConfig {
            layer_norm_eps: opt_f32(c, "layer_norm_eps")?.unwrap_or(1e-12),
            type_vocab_size,
            gelu_erf,
        }),
        layer_kinds: vec![LayerKind::FullAttention; num_layers],
        layer_kv: None,
    })
}

fn bert_config(cfg: &ModelConfig) -> Result<&BertConfig> {
    match &cfg.family {
        FamilyConfig::Bert(b) => Ok(b),
        _ => Err(super::wrong_family(cfg, "bert")),
    }
}

/// The prefix a checkpoint's weights carry (`""` or `"bert."`).
fn prefix_of(tensors: &[StoredTensor]) -> &'static str {
    if tensors
        .iter()
        .any(|t| t.name.starts_with("bert.embeddings."))
    {
        "bert."
    } else {
        ""
    }
}

/// Every weight of a BERT encoder with `cfg`, names under `prefix`.
fn tensor_shapes(cfg: &ModelConfig, prefix: &str) -> Vec<(String, Vec<usize>)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let types = bert_config(cfg).map_or(2, |b| b.type_vocab_size);
    let mut out = vec![
        (
            format!("{prefix}embeddings.word_embeddings.weight"),
            vec![cfg.vocab_size, h],
        ),
        (
            format!("{prefix}embeddings.position_embeddings.weight"),
            vec![cfg.max_position_embeddings, h],
        ),
        (
            format!("{prefix}embeddings.token_type_embeddings.weight"),
            vec![types, h],
        ),
        (format!("{prefix}embeddings.LayerNorm.weight"), vec![h]),
        (format!("{prefix}embeddings.LayerNorm.bias"), vec![h]),
    ];
    for l in 0..cfg.num_layers {
        let p = format!("{prefix}encoder.layer.{l}");
        for (name, shape) in [
            ("attention.self.query", vec![h, h]),
            ("attention.self.key", vec![h, h]),
            ("attention.self.value", vec![h, h]),
            ("attention.output.dense", vec![h, h]),
            ("intermediate.dense", vec![i, h]),
            ("output.dense", vec![h, i]),
        ] {
            out.push((format!("{p}.{name}.bias"), vec![shape[0]]));
            out.push((format!("{p}.{name}.weight"), shape));
        }
        for ln in ["attention.output.LayerNorm", "output.LayerNorm"] {
            out.push((format!("{p}.{ln}.weight"), vec![h]));
            out.push((format!("{p}.{ln}.bias"), vec![h]));
        }
    }
    out
}

fn check_weights(cfg: &ModelConfig, tensors: &[StoredTensor]) -> Result<()> {
    let prefix = prefix_of(tensors);
    let layers = tensors
        .iter()
        .filter_map(|t| {
            t.name
                .strip_prefix(&format!("{prefix}encoder.layer."))?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |i| i + 1);
    if layers != cfg.num_layers {
        return Err(err(
            "num_hidden_layers",
            format!(
                "config.json says {} layers, the weights have {layers}",
                cfg.num_layers
            ),
        ));
    }
    for (name, shape) in tensor_shapes(cfg, prefix) {
        match tensors.iter().find(|t| t.name == name) {
            None => {
                return Err(err(
                    "model_type",
                    format!("a BERT checkpoint needs {name}, which the weights lack"),
                ))
            }
            Some(t) if t.shape != shape => {
                return Err(err(
                    "hidden_size",
                    format!(
                        "config.json gives {name} the shape {shape:?}, the weights {:?}",
                        t.shape
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

struct Block {
    qkv: Linear,
    o: Linear,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
    params: AttentionParams,
}

pub struct Bert {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    word: Weight,
    position: Weight,
    token_type: Weight,
    embed_norm: LayerNorm,
    blocks: Vec<Block>,
    gelu_erf: bool,
    /// Where each layer's keys and values live in the cache.
    kv_slots: Vec<kiln_scheduler::LayerSlot>,
}

impl Bert {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let b = bert_config(&cfg)?.clone();
        let prefix = prefix_of(&source.tensors());
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, i, eps) = (cfg.hidden_size, cfg.intermediate_size, b.layer_norm_eps);
        let ln = |name: &str| -> Result<LayerNorm> {
            Ok(LayerNorm {
                weight: l.host(&format!("{name}.weight"), &[h])?,
                bias: l.host(&format!("{name}.bias"), &[h])?,
                eps,
            })
        };
        let e = format!("{prefix}embeddings");
        let word = l.embedding(&format!("{e}.word_embeddings.weight"), &[cfg.vocab_size, h])?;
        let position = l.embedding(
            &format!("{e}.position_embeddings.weight"),
            &[cfg.max_position_embeddings, h],
        )?;
        let token_type = l.embedding(
            &format!("{e}.token_type_embeddings.weight"),
            &[b.type_vocab_size, h],
        )?;
        let embed_norm = ln(&format!("{e}.LayerNorm"))?;
        let kv_slots = cfg.kv_slots();
        let blocks = (0..cfg.num_layers)
            .map(|n| {
                let p = format!("{prefix}encoder.layer.{n}");
                let a = format!("{p}.attention.self");
                Ok(Block {
                    qkv: Linear::load_packed(
                        &l,
                        &[
                            format!("{a}.query"),
                            format!("{a}.key"),
                            format!("{a}.value"),
                        ],
                        h,
                        &[h, h, h],
                        true,
                    )?,
                    o: Linear::load(&l, &format!("{p}.attention.output.dense"), h, h, true)?,
                    attn_norm: ln(&format!("{p}.attention.output.LayerNorm"))?,
                    up: Linear::load(&l, &format!("{p}.intermediate.dense"), h, i, true)?,
                    down: Linear::load(&l, &format!("{p}.output.dense"), i, h, true)?,
                    out_norm: ln(&format!("{p}.output.LayerNorm"))?,
                    params: AttentionParams {
                        num_heads: cfg.num_heads,
                        num_kv_heads: cfg.num_kv_heads,
                        head_dim: cfg.head_dim,
                        scale: (cfg.head_dim as f32).powf(-0.5),
                        sliding_window: None,
                        softcap: None,
                        kv_group: kv_slots[n].group,
                        causal: false,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let needs: [&dyn ExtensionOp; 2] = [&embed_norm, &GeluErf];
        require_extensions(backend.as_ref(), &needs)?;
        if let Some(blk) = blocks.first() {
            if !backend.supports_attention(&blk.params) {
                return Err(ModelError::Config {
                    key: "model_type".into(),
                    what: format!(
                        "the {} backend does not run bidirectional attention",
                        backend.name()
                    ),
                });
            }
        }
        Ok(Bert {
            weight_bytes: l.weight_bytes(),
            gelu_erf: b.gelu_erf,
            kv_slots,
            cfg,
            backend,
            word,
            position,
            token_type,
            embed_norm,
            blocks,
        })
    }

    fn hidden(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let max = self.cfg.max_position_embeddings;
        if let Some(&p) = batch.positions.iter().find(|&&p| p as usize >= max) {
            return Err(ModelError::Config {
                key: "max_position_embeddings".into(),
                what: format!("position {p} is past the model's {max} positions"),
            });
        }
        let x = b.embedding(&self.word, &batch.token_ids)?;
        let x = b.add(&x, &b.embedding(&self.position, &batch.positions)?)?;
        let types = vec![0u32; batch.token_ids.len()];
        let x = b.add(&x, &b.embedding(&self.token_type, &types)?)?;
        let mut x = b.extension(&self.embed_norm, &x)?;
        let h = self.cfg.hidden_size;
        for (layer, blk) in self.blocks.iter().enumerate() {
            let qkv = blk.qkv.forward(b, &x, Fuse::NONE)?;
            let parts = b.split_cols(&qkv, &[h, h, h])?;
            let attn = b.attention(
                &parts[0],
                &parts[1],
                &parts[2],
                cache,
                self.kv_slots[layer].slot,
                batch,
                &blk.params,
            )?;
            let y = blk.o.forward(b, &attn, Fuse::NONE.with_residual(&x))?;
            x = b.extension(&blk.attn_norm, &y)?;
            let up = blk.up.forward(b, &x, Fuse::NONE)?;
            let act = if self.gelu_erf {
                b.extension(&GeluErf, &up)?
            } else {
                gelu_tanh(b, &up)?
            };
            let y = blk.down.forward(b, &act, Fuse::NONE.with_residual(&x))?;
            x = b.extension(&blk.out_norm, &y)?;
        }
        Ok(b.gather_rows(&x, &batch.logits_rows)?)
    }
}

/// `gelu_tanh(x)` through the backend's gated activation with an all-ones
/// gate partner.
fn gelu_tanh(b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
    let ones = b.upload(x.shape(), &vec![1.0; x.shape().iter().product()])?;
    Ok(b.gated_activation(x, &ones, kiln_tensor::Activation::GeluTanh)?)
}

impl CausalLm for Bert {
    fn weight_bytes(&self) -> Option<&crate::WeightBytes> {
        Some(&self.weight_bytes)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    fn forward(&self, _batch: &ForwardBatch, _cache: &mut KvCache) -> Result<Tensor> {
        Err(ModelError::Config {
            key: "model_type".into(),
            what: "a BERT encoder has no output head: it embeds, it does not generate".into(),
        })
    }

    fn hidden_states(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        self.hidden(batch, cache)
    }

    fn generates(&self) -> bool {
        false
    }
}
