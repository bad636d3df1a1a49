//! gpt-oss (OpenAI's open-weight Mixture-of-Experts decoders, 20b and
//! 120b). Reference: transformers `modeling_gpt_oss.py` and
//! `integrations/mxfp4.py`.
//!
//! Quirks:
//! - Attention: q/k/v/o biases, a learned **sink** logit a head that joins
//!   every softmax and takes its share of the weight (`self_attn.sinks`),
//!   sliding-window layers (128 keys) alternating with full ones
//!   (`layer_types`; by default even layers slide), YaRN RoPE.
//! - Router: a biased linear layer; the top k logits, then a softmax over
//!   those alone (no renormalization needed).
//! - Experts: biases on both products and a clamped SwiGLU over
//!   **interleaved** gate/up columns: `gate = y[..., ::2]`, `up = y[...,
//!   1::2]`, `(clamp(up, ±7) + 1) · g·σ(1.702 g)` with `g = min(gate, 7)`.
//!   transformers keeps the experts as `gate_up_proj [E, hidden, 2i]` and
//!   `down_proj [E, i, hidden]` (`x @ W`); they are loaded transposed and
//!   de-interleaved into the packed `[gate rows | up rows]` layout.
//! - Released checkpoints store the experts in **MXFP4**: `*_blocks [E,
//!   out, in/32, 16]` (two e2m1 codes a byte, low nibble first) and
//!   `*_scales [E, out, in/32]` (exponents biased by 127), rows in the
//!   interleaved output order. A backend that reads MXFP4 blocks keeps
//!   them (re-laid in GGUF's block layout, as llama.cpp's files hold
//!   gpt-oss: a quarter of bf16's bytes); elsewhere every MXFP4 value is
//!   exact in bf16, so the experts are expanded to bf16 blocks where the
//!   backend keeps those, else to its dense type.
//! - Its output is the `harmony` format; the server reads its channels
//!   (`kiln-server`'s `parse/harmony.rs`).

use std::sync::Arc;

use kiln_formats::{FormatError, WeightSource};
use kiln_scheduler::LayerSlot;
use kiln_tensor::{
    Backend, Expert, ExpertActivation, ForwardBatch, KvCache, MoeLayer, QuantFormat, QuantMatrix,
    Routing, Scoring, SharedBytes, Tensor, Weight, WeightKind,
};
use serde_json::Value;

use super::{Family, FamilyConfig, StepOutput};
use crate::config::{
    err, opt_f32, opt_usize, parse_rope_scaling, sliding_layer_types, FamilyLayers, LayerKind,
    ModelConfig, RopeScaling,
};
use crate::error::Result;
use crate::layers::{
    Attention, AttentionConfig, Fuse, Linear, LoadProgress, RmsNorm, Rope, SparseMoe, WeightLoader,
};
use crate::CausalLm;

/// The registry's entry for the family.
pub static FAMILY: Family = Family {
    name: "gpt_oss",
    model_types: &["gpt_oss"],
    tied_by_default: false,
    parse,
    tensor_shapes: |cfg| Ok(tensor_shapes(cfg, gpt_oss_config(cfg)?)),
    check_weights: super::llama::check_weights,
    stored_blocks,
    tensor_parallel: None,
    load: |backend, source, cfg, progress| {
        Ok(Box::new(GptOss::load(backend, source, cfg, progress)?))
    },
};

/// The keys of `config.json` only gpt-oss reads.
#[derive(Debug, Clone, PartialEq)]
pub struct GptOssConfig {
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub sliding_window: usize,
    /// Which layers are `sliding_attention`.
    pub sliding_layers: Vec<bool>,
    pub num_experts: usize,
    pub top_k: usize,
    pub swiglu_alpha: f32,
    pub swiglu_limit: f32,
    pub attention_bias: bool,
}

fn parse(c: &Value, num_layers: usize, _head_dim: usize) -> Result<FamilyLayers> {
    let rope = c.get("rope_parameters").filter(|v| v.is_object());
    let rope_theta = match opt_f32(c, "rope_theta")? {
        Some(t) => t,
        None => rope
            .map(|p| opt_f32(p, "rope_theta"))
            .transpose()?
            .flatten()
            .unwrap_or(150000.0),
    };
    let sliding_window = opt_usize(c, "sliding_window")?.unwrap_or(128);
    if sliding_window == 0 {
        return Err(err("sliding_window", "must be positive"));
    }
    let sliding_layers = match sliding_layer_types(c)? {
        Some(t) => t,
        None => (0..num_layers).map(|i| (i + 1) % 2 == 1).collect(),
    };
    let num_experts = opt_usize(c, "num_local_experts")?.unwrap_or(128);
    let top_k = opt_usize(c, "num_experts_per_tok")?.unwrap_or(4);
    if num_experts == 0 || num_experts > 1 << 12 || top_k == 0 || top_k > num_experts {
        return Err(err(
            "num_experts_per_tok",
            format!("{top_k} experts a token of {num_experts}"),
        ));
    }
    let cfg = GptOssConfig {
        rope_theta,
        rope_scaling: parse_rope_scaling(c.get("rope_scaling").filter(|v| v.is_object()).or(rope))?,
        sliding_window,
        sliding_layers: sliding_layers.clone(),
        num_experts,
        top_k,
        swiglu_alpha: opt_f32(c, "swiglu_alpha")?.unwrap_or(1.702),
        swiglu_limit: opt_f32(c, "swiglu_limit")?.unwrap_or(7.0),
        attention_bias: c
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(true),
    };
    let layer_kinds = sliding_layers
        .iter()
        .map(|&s| match s {
            true => LayerKind::SlidingWindow {
                window: sliding_window,
            },
            false => LayerKind::FullAttention,
        })
        .collect();
    Ok(FamilyLayers {
        family: FamilyConfig::GptOss(cfg),
        layer_kinds,
        layer_kv: None,
    })
}

fn gpt_oss_config(cfg: &ModelConfig) -> Result<&GptOssConfig> {
    match &cfg.family {
        FamilyConfig::GptOss(g) => Ok(g),
        _ => Err(super::wrong_family(cfg, "gpt_oss")),
    }
}

/// Every weight of a gpt-oss checkpoint with `cfg`, the experts split by
/// expert and projection as a GGUF file holds them (so `kiln fit` finds
/// their stored blocks by name); transformers' checkpoints hold the same
/// elements stacked (`gate_up_proj [E, hidden, 2i]`, `down_proj [E, i,
/// hidden]`, or their MXFP4 `*_blocks`/`*_scales`), which the loader reads
/// as well.
pub fn tensor_shapes(cfg: &ModelConfig, g: &GptOssConfig) -> Vec<(String, Vec<usize>)> {
    let (h, hd, i, e) = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.intermediate_size,
        g.num_experts,
    );
    let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        let mut add = |n: &str, s: Vec<usize>| out.push((format!("{p}.{n}"), s));
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        for (n, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            add(&format!("self_attn.{n}.weight"), vec![rows, h]);
            if g.attention_bias {
                add(&format!("self_attn.{n}.bias"), vec![rows]);
            }
        }
        add("self_attn.o_proj.weight", vec![h, q]);
        if g.attention_bias {
            add("self_attn.o_proj.bias", vec![h]);
        }
        add("self_attn.sinks", vec![cfg.num_heads]);
        add("mlp.router.weight", vec![e, h]);
        add("mlp.router.bias", vec![e]);
        for x in 0..e {
            add(&format!("mlp.experts.{x}.gate_proj.weight"), vec![i, h]);
            add(&format!("mlp.experts.{x}.up_proj.weight"), vec![i, h]);
            add(&format!("mlp.experts.{x}.down_proj.weight"), vec![h, i]);
        }
        add("mlp.experts.gate_proj.bias", vec![e, i]);
        add("mlp.experts.up_proj.bias", vec![e, i]);
        add("mlp.experts.down_proj.bias", vec![e, h]);
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    moe: SparseMoe,
    kv_slot: LayerSlot,
}

pub struct GptOss {
    weight_bytes: crate::WeightBytes,
    cfg: ModelConfig,
    backend: Arc<dyn Backend>,
    embed: Weight,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
}

/// e2m1 values of the 16 codes (sign in bit 3).
const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// MXFP4 rows (`blocks [rows, cols/32, 16]`, `scales [rows, cols/32]`) to
/// f32 `[rows, cols]`: code `c` of group `g` is `FP4_VALUES[c] · 2^(s-127)`.
fn dequantize_mxfp4(blocks: &[u8], scales: &[u8], out: &mut [f32]) {
    for ((o, b), &s) in out
        .chunks_exact_mut(32)
        .zip(blocks.chunks_exact(16))
        .zip(scales)
    {
        let scale = (s as f32 - 127.0).exp2();
        for (pair, &byte) in o.chunks_exact_mut(2).zip(b) {
            pair[0] = FP4_VALUES[(byte & 15) as usize] * scale;
            pair[1] = FP4_VALUES[(byte >> 4) as usize] * scale;
        }
    }
}

impl GptOss {
    pub fn load(
        backend: Arc<dyn Backend>,
        source: &dyn WeightSource,
        cfg: ModelConfig,
        progress: Option<LoadProgress<'_>>,
    ) -> Result<Self> {
        let g = gpt_oss_config(&cfg)?.clone();
        let l = WeightLoader::with_progress(&backend, source, progress);
        let (h, eps, i) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.intermediate_size);
        let embed = l.embedding("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let slots = cfg.kv_slots();
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for (layer, &slot) in slots.iter().enumerate() {
            let p = format!("model.layers.{layer}");
            let attn_cfg = AttentionConfig {
                hidden_size: h,
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
                qkv_bias: g.attention_bias,
                o_bias: g.attention_bias,
                qk_norm_eps: None,
                scale: (cfg.head_dim as f32).powf(-0.5),
                sliding_window: g.sliding_layers[layer].then_some(g.sliding_window),
                sinks: true,
            };
            blocks.push(Block {
                input_norm: RmsNorm::load(&l, &format!("{p}.input_layernorm.weight"), h, eps)?,
                attn: Attention::load(&l, &format!("{p}.self_attn"), attn_cfg)?,
                post_attn_norm: RmsNorm::load(
                    &l,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    eps,
                )?,
                moe: Self::load_moe(&l, &format!("{p}.mlp"), &g, h, i)?,
                kv_slot: slot,
            });
        }
        let norm = RmsNorm::load(&l, "model.norm.weight", h, eps)?;
        let lm_head = Linear::output(&l, &embed, cfg.tie_word_embeddings)?;
        let rope = Rope::new(cfg.head_dim, g.rope_theta, &g.rope_scaling);
        Ok(GptOss {
            weight_bytes: l.weight_bytes(),
            cfg,
            backend,
            embed,
            blocks,
            norm,
            lm_head,
            rope,
        })
    }

    /// The router and experts under `p` (`model.layers.N.mlp`).
    fn load_moe(
        l: &WeightLoader,
        p: &str,
        g: &GptOssConfig,
        h: usize,
        i: usize,
    ) -> Result<SparseMoe> {
        if !l.backend.supports_moe() {
            return Err(kiln_tensor::TensorError::Unsupported {
                backend: l.backend.name(),
                what: "Mixture-of-Experts layers (the CPU backend runs them)".into(),
            }
            .into());
        }
        let e = g.num_experts;
        let experts = match l
            .source
            .contains(&format!("{p}.experts.0.gate_proj.weight"))
        {
            true => Self::load_split_experts(l, p, e, h, i)?,
            false => Self::load_stacked_experts(l, p, e, h, i)?,
        };
        Ok(SparseMoe {
            layer: MoeLayer {
                router: l.weight(&format!("{p}.router.weight"), &[e, h])?,
                router_bias: Some(l.tensor(&format!("{p}.router.bias"), &[e])?),
                selection_bias: None,
                experts,
                held: None,
                shared: None,
                activation: ExpertActivation::ClampedSwiglu {
                    alpha: g.swiglu_alpha,
                    limit: g.swiglu_limit,
                },
                routing: Routing {
                    top_k: g.top_k,
                    scoring: Scoring::TopKSoftmax,
                    normalize: false,
                    scale: 1.0,
                },
                load: Arc::new(kiln_tensor::ExpertLoad::new(e)),
            },
        })
    }

    /// Experts split by expert and into gate, up and down, as llama.cpp's
    /// GGUF files hold them (`ffn_{gate,up,down}_exps`, seen one expert at a
    /// time: `{p}.experts.{e}.{gate,up,down}_proj.weight`, kept as stored —
    /// MXFP4 blocks in place) with `[experts, out]` biases
    /// (`{p}.experts.{gate,up,down}_proj.bias`).
    fn load_split_experts(
        l: &WeightLoader,
        p: &str,
        e: usize,
        h: usize,
        i: usize,
    ) -> Result<Vec<Expert>> {
        let gate_b = l.host(&format!("{p}.experts.gate_proj.bias"), &[e, i])?;
        let up_b = l.host(&format!("{p}.experts.up_proj.bias"), &[e, i])?;
        let down_b = l.host(&format!("{p}.experts.down_proj.bias"), &[e, h])?;
        let b = l.backend;
        (0..e)
            .map(|x| {
                let q = format!("{p}.experts.{x}");
                let bias: Vec<f32> = gate_b[x * i..(x + 1) * i]
                    .iter()
                    .chain(&up_b[x * i..(x + 1) * i])
                    .copied()
                    .collect();
                Ok(Expert {
                    gate_up: l.stacked_weight(
                        &[
                            format!("{q}.gate_proj.weight"),
                            format!("{q}.up_proj.weight"),
                        ],
                        &[vec![i, h], vec![i, h]],
                    )?,
                    down: l.weight(&format!("{q}.down_proj.weight"), &[h, i])?,
                    gate_up_bias: Some(b.upload(&[2 * i], &bias)?),
                    down_bias: Some(b.upload(&[h], &down_b[x * h..(x + 1) * h])?),
                })
            })
            .collect()
    }

    /// MXFP4 experts as the released checkpoints store them, kept in their
    /// blocks (a quarter of bf16's bytes: gpt-oss-20b's experts fit a 16 GB
    /// card) on a backend that reads MXFP4 blocks: each expert's gate/up
    /// rows de-interleaved into `[gate rows | up rows]`, one matrix of `2I`
    /// rows, and its down rows, in GGUF's block layout. `None` when the
    /// checkpoint's experts are not in MXFP4.
    fn load_mxfp4_experts(
        l: &WeightLoader,
        p: &str,
        e: usize,
        h: usize,
        i: usize,
    ) -> Result<Option<Vec<Expert>>> {
        let gu_name = format!("{p}.experts.gate_up_proj");
        let Some((gu_blocks, gu_scales)) = mxfp4_bytes(l, &gu_name, [e, 2 * i, h])? else {
            return Ok(None);
        };
        let down_name = format!("{p}.experts.down_proj");
        let Some((d_blocks, d_scales)) = mxfp4_bytes(l, &down_name, [e, h, i])? else {
            return Ok(None);
        };
        let gate_up_bias = l.host(&format!("{p}.experts.gate_up_proj_bias"), &[e, 2 * i])?;
        let down_bias = l.host(&format!("{p}.experts.down_proj_bias"), &[e, h])?;
        let b = l.backend;
        let (gu_nb, d_nb) = (h / 32, i / 32);
        let upload = |rows: usize, cols: usize, bytes: Vec<u8>| -> Result<Weight> {
            let m = QuantMatrix::new(QuantFormat::MXFP4, rows, cols, SharedBytes::from_vec(bytes))
                .map_err(|what| err("experts", what))?;
            let w = Weight::Blocks(kiln_tensor::BlockWeight::new(vec![b.upload_blocks(m)?])?);
            l.note(&w);
            Ok(w)
        };
        (0..e)
            .map(|x| {
                let order = (0..i).map(|j| 2 * j).chain((0..i).map(|j| 2 * j + 1));
                let (gb, gs) = (
                    &gu_blocks[x * 2 * i * gu_nb * 16..(x + 1) * 2 * i * gu_nb * 16],
                    &gu_scales[x * 2 * i * gu_nb..(x + 1) * 2 * i * gu_nb],
                );
                let (db, ds) = (
                    &d_blocks[x * h * d_nb * 16..(x + 1) * h * d_nb * 16],
                    &d_scales[x * h * d_nb..(x + 1) * h * d_nb],
                );
                let eb = &gate_up_bias[x * 2 * i..(x + 1) * 2 * i];
                let bias: Vec<f32> = order.clone().map(|r| eb[r]).collect();
                Ok(Expert {
                    gate_up: upload(2 * i, h, gguf_mxfp4_rows(gb, gs, gu_nb, order))?,
                    down: upload(h, i, gguf_mxfp4_rows(db, ds, d_nb, 0..h))?,
                    gate_up_bias: Some(b.upload(&[2 * i], &bias)?),
                    down_bias: Some(b.upload(&[h], &down_bias[x * h..(x + 1) * h])?),
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Experts as transformers saves them (stacked, gate/up interleaved),
    /// unquantized or in MXFP4 blocks and scales (expanded: every MXFP4
    /// value is exact in bf16).
    fn load_stacked_experts(
        l: &WeightLoader,
        p: &str,
        e: usize,
        h: usize,
        i: usize,
    ) -> Result<Vec<Expert>> {
        let b = l.backend;
        if b.supports_weight(WeightKind::Blocks(QuantFormat::MXFP4)) {
            if let Some(experts) = Self::load_mxfp4_experts(l, p, e, h, i)? {
                return Ok(experts);
            }
        }
        // Each expert's weights as [out, in] rows in the checkpoint's
        // output order (gate/up interleaved).
        let gate_up = expert_rows(l, &format!("{p}.experts.gate_up_proj"), [e, 2 * i, h])?;
        let down = expert_rows(l, &format!("{p}.experts.down_proj"), [e, h, i])?;
        let gate_up_bias = l.host(&format!("{p}.experts.gate_up_proj_bias"), &[e, 2 * i])?;
        let down_bias = l.host(&format!("{p}.experts.down_proj_bias"), &[e, h])?;
        let mut experts = Vec::with_capacity(e);
        for x in 0..e {
            let rows = &gate_up[x * 2 * i * h..(x + 1) * 2 * i * h];
            // Interleaved (gate, up, gate, up, ...) rows to gate rows, then up rows.
            let order = (0..i).map(|j| 2 * j).chain((0..i).map(|j| 2 * j + 1));
            let mut packed = Vec::with_capacity(2 * i * h);
            let mut bias = Vec::with_capacity(2 * i);
            let eb = &gate_up_bias[x * 2 * i..(x + 1) * 2 * i];
            for r in order {
                packed.extend_from_slice(&rows[r * h..(r + 1) * h]);
                bias.push(eb[r]);
            }
            let down_x = &down[x * h * i..(x + 1) * h * i];
            let (gate_up, down) = (
                upload_weight(b, &packed, [2 * i, h])?,
                upload_weight(b, down_x, [h, i])?,
            );
            l.note(&gate_up);
            l.note(&down);
            experts.push(Expert {
                gate_up,
                down,
                gate_up_bias: Some(b.upload(&[2 * i], &bias)?),
                down_bias: Some(b.upload(&[h], &down_bias[x * h..(x + 1) * h])?),
            });
        }
        Ok(experts)
    }
}

/// The experts a released checkpoint's MXFP4 `{p}.experts.gate_up_proj_blocks
/// [E, 2i, h/32, 16]` or `{p}.experts.down_proj_blocks [E, h, i/32, 16]`
/// (U8) holds, under `tensor_shapes`' per-expert names: gate and up rows
/// i each, down rows h, all MXFP4 (the `_scales` byte of a block joins its
/// 16 — as the loader keeps them).
fn stored_blocks(t: &kiln_formats::StoredTensor) -> Vec<super::StoredBlocks> {
    let (Some(base), "U8", &[e, out, nb, 16]) = (
        t.name.strip_suffix("_blocks"),
        t.dtype.as_str(),
        t.shape.as_slice(),
    ) else {
        return Vec::new();
    };
    let Some((pre, proj)) = base.rsplit_once(".experts.") else {
        return Vec::new();
    };
    let parts: &[(&str, usize)] = match proj {
        "gate_up_proj" if out % 2 == 0 => &[("gate_proj", out / 2), ("up_proj", out / 2)],
        "down_proj" => &[("down_proj", out)],
        _ => return Vec::new(),
    };
    (0..e)
        .flat_map(|x| {
            parts.iter().map(move |&(name, rows)| super::StoredBlocks {
                name: format!("{pre}.experts.{x}.{name}.weight"),
                format: QuantFormat::MXFP4,
                rows,
                cols: nb * 32,
            })
        })
        .collect()
}

/// The MXFP4 `{name}_blocks [E, out, in/32, 16]` and `{name}_scales [E,
/// out, in/32]` of stacked experts of `shape` `[E, out, in]`, where the
/// checkpoint holds them.
fn mxfp4_bytes(
    l: &WeightLoader,
    name: &str,
    [e, out, inp]: [usize; 3],
) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
    let path = || l.source.path().to_path_buf();
    let blocks_name = format!("{name}_blocks");
    if !l.source.contains(&blocks_name) {
        return Ok(None);
    }
    let scales_name = format!("{name}_scales");
    let bytes = |n: &str, want: Vec<usize>| -> Result<Vec<u8>> {
        match l.source.load_bytes(n)? {
            Some((dtype, found, b)) if dtype == "U8" && found == want => Ok(b),
            Some((_, found, _)) => Err(FormatError::ShapeMismatch {
                path: path(),
                tensor: n.to_string(),
                found,
                expected: want,
            }
            .into()),
            None => Err(FormatError::MissingTensor {
                path: path(),
                tensor: n.to_string(),
            }
            .into()),
        }
    };
    if inp % 32 != 0 {
        return Err(err(
            "intermediate_size",
            format!("MXFP4 experts need widths that are multiples of 32, not {inp}"),
        ));
    }
    let blocks = bytes(&blocks_name, vec![e, out, inp / 32, 16])?;
    let scales = bytes(&scales_name, vec![e, out, inp / 32])?;
    l.loaded(&blocks_name);
    l.loaded(&scales_name);
    Ok(Some((blocks, scales)))
}

/// Rows `rows` of one expert's MXFP4 matrix (`blocks`/`scales` as the
/// checkpoint stores them, `nb` blocks a row) in GGUF's MXFP4 block layout,
/// as llama.cpp's files hold them and the backends read them: the scale
/// byte (the same e8m0 exponent), then 16 bytes whose byte `j` holds
/// element `j` in its low nibble and element `j + 16` in its high one
/// (the checkpoint's byte `j` holds elements `2j` and `2j + 1`).
fn gguf_mxfp4_rows(
    blocks: &[u8],
    scales: &[u8],
    nb: usize,
    rows: impl Iterator<Item = usize>,
) -> Vec<u8> {
    let mut out = Vec::new();
    for r in rows {
        for k in r * nb..(r + 1) * nb {
            let hb = &blocks[16 * k..16 * (k + 1)];
            let code = |c: usize| (hb[c / 2] >> (4 * (c % 2))) & 15;
            out.push(scales[k]);
            out.extend((0..16).map(|j| code(j) | (code(j + 16) << 4)));
        }
    }
    out
}

/// The stacked expert matrices `name` as f32 rows `[E, out, in]` (`shape`):
/// from MXFP4 `{name}_blocks`/`{name}_scales` where the checkpoint has
/// them, else from the `[E, in, out]` tensor transformers saves, transposed.
fn expert_rows(l: &WeightLoader, name: &str, shape: [usize; 3]) -> Result<Vec<f32>> {
    let [e, out, inp] = shape;
    if let Some((blocks, scales)) = mxfp4_bytes(l, name, shape)? {
        let mut rows = vec![0f32; e * out * inp];
        dequantize_mxfp4(&blocks, &scales, &mut rows);
        return Ok(rows);
    }
    let t = l.host(name, &[e, inp, out])?;
    let mut rows = vec![0f32; e * out * inp];
    for x in 0..e {
        let (src, dst) = (
            &t[x * inp * out..(x + 1) * inp * out],
            &mut rows[x * out * inp..(x + 1) * out * inp],
        );
        for r in 0..inp {
            for c in 0..out {
                dst[c * inp + r] = src[r * out + c];
            }
        }
    }
    Ok(rows)
}

/// `data [rows, cols]` as a weight: bf16 blocks where the backend keeps
/// them and every value is exact in bf16 (MXFP4's are), else dense.
fn upload_weight(b: &Arc<dyn Backend>, data: &[f32], [rows, cols]: [usize; 2]) -> Result<Weight> {
    let exact = data
        .iter()
        .all(|&v| f32::from_bits(v.to_bits() & 0xffff_0000) == v);
    if exact && b.supports_weight(WeightKind::Blocks(QuantFormat::BF16)) {
        let bytes: Vec<u8> = data
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let m = QuantMatrix::new(QuantFormat::BF16, rows, cols, SharedBytes::from_vec(bytes))
            .map_err(|what| err("experts", what))?;
        return Ok(Weight::Blocks(kiln_tensor::BlockWeight::new(vec![
            b.upload_blocks(m)?
        ])?));
    }
    Ok(Weight::Dense(b.upload(&[rows, cols], data)?))
}

impl CausalLm for GptOss {
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

    fn expert_load(&self) -> Vec<Vec<u64>> {
        self.blocks
            .iter()
            .map(|b| b.moe.layer.load.snapshot())
            .collect()
    }
}

impl GptOss {
    fn step(&self, batch: &ForwardBatch, cache: &mut KvCache, out: StepOutput) -> Result<Tensor> {
        let b = self.backend.as_ref();
        let mut x = b.embedding(&self.embed, &batch.token_ids)?;
        for blk in &self.blocks {
            let fuse = Fuse::norm(&blk.input_norm).with_residual(&x);
            x = blk
                .attn
                .forward(b, &x, fuse, &self.rope, batch, cache, blk.kv_slot)?;
            let h = blk.post_attn_norm.forward(b, &x)?;
            x = b.add(&x, &blk.moe.forward(b, &h)?)?;
        }
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        match out {
            StepOutput::Logits => self.lm_head.forward(b, &x, Fuse::norm(&self.norm)),
            StepOutput::Hidden => self.norm.forward(b, &x),
        }
    }
}
