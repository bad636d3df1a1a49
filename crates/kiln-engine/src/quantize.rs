//! `kiln quantize`: a Hugging Face checkpoint (or a float GGUF) written as
//! a GGUF file in a block format, which Kiln and llama.cpp both load.
//!
//! Every float matrix takes the asked format where its rows are whole
//! blocks of it, else Q8_0 ([`kiln_formats::quantizing::target_format`],
//! the rule `--quantize` uses at load, so the file and the in-memory model
//! hold the same blocks); vectors stay F32; a matrix already in blocks is
//! copied. `--type q4_k` means Q4_K everywhere it fits; `--type q4_k_m`
//! is llama.cpp's mix (`kiln_formats::QuantMix::Q4KM`: some value, MLP-down
//! and output matrices in Q6_K).
//!
//! From a Hugging Face directory the architectures written are those
//! llama.cpp runs as `llama`, `qwen2` and `qwen3`, with byte-level BPE
//! tokenizers (`Tokenizer::gguf_metadata`); the metadata is what
//! `kiln_formats::gguf_hf::hf_config` reads back as the same
//! configuration, and `llama` q/k rows get llama.cpp's permutation.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_formats::gguf_hf::{gguf_name, permute_qk};
use kiln_formats::{
    write_gguf, GgmlType, GgufFile, GgufTensorPlan, MetaValue, QuantMix, Quantizing,
    SafetensorsDir, WeightSource,
};
use kiln_models::config::FamilyConfig;
use kiln_models::{ModelConfig, RopeScaling};
use kiln_quant::QuantFormat;
use kiln_text::Tokenizer;
use serde_json::Value;

use crate::error::{EngineError, Result};

/// What [`quantize_to_gguf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizeReport {
    /// The GGUF architecture.
    pub arch: String,
    /// Tensors written, by GGUF type name.
    pub tensors_by_type: BTreeMap<String, usize>,
    /// Bytes of tensor data written.
    pub tensor_bytes: u64,
}

/// llama.cpp's `general.file_type` for a file in `mix`.
fn file_type(mix: QuantMix) -> u32 {
    let QuantMix::Uniform(format) = mix else {
        return 15; // MOSTLY_Q4_K_M
    };
    match format {
        QuantFormat::F16 => 1,
        QuantFormat::Q8_0 => 7,
        QuantFormat::Q4K => 14,
        QuantFormat::Q5K => 16,
        QuantFormat::Q6K => 18,
        QuantFormat::BF16 => 32,
        _ => 0,
    }
}

fn refuse(path: &Path, what: impl Into<String>) -> EngineError {
    EngineError::BadModelPath {
        path: path.display().to_string(),
        what: what.into(),
    }
}

fn u32_of(path: &Path, key: &str, v: usize) -> Result<MetaValue> {
    u32::try_from(v)
        .map(MetaValue::U32)
        .map_err(|_| refuse(path, format!("{key} = {v} does not fit GGUF's u32")))
}

/// Write `input` (a Hugging Face directory or a GGUF file) as the GGUF
/// file `output` with its float matrices in `mix`.
pub fn quantize_to_gguf(input: &Path, output: &Path, mix: QuantMix) -> Result<QuantizeReport> {
    for format in mix.formats() {
        if !kiln_quant::QUANTIZE_FORMATS.contains(&format) {
            return Err(refuse(
                input,
                format!(
                    "cannot quantize to {format} (supported: {})",
                    kiln_quant::QUANTIZE_FORMATS.map(|f| f.name()).join(", ")
                ),
            ));
        }
        if GgmlType::from_quant_format(format).is_none() {
            return Err(refuse(
                input,
                format!(
                    "{format} has no GGUF type, so no GGUF file can hold it: load the float \
                     checkpoint with `--quantize {}` instead",
                    format.name().to_lowercase()
                ),
            ));
        }
    }
    if input.is_dir() {
        from_hf_dir(input, output, mix)
    } else if input.is_file() {
        from_gguf(input, output, mix)
    } else {
        Err(refuse(input, "no such file or directory"))
    }
}

/// The model keys of a GGUF for `config` (llama-family layout).
fn model_metadata(path: &Path, config: &ModelConfig) -> Result<(String, Vec<(String, MetaValue)>)> {
    let FamilyConfig::Llama(lc) = &config.family else {
        return Err(refuse(
            path,
            format!(
                "kiln quantize writes llama, mistral, qwen2 and qwen3 checkpoints, not {}",
                config.model_type
            ),
        ));
    };
    let arch = match config.model_type.as_str() {
        "llama" | "mistral" => "llama",
        "qwen2" => "qwen2",
        "qwen3" => "qwen3",
        other => {
            return Err(refuse(
                path,
                format!(
                    "kiln quantize writes llama, mistral, qwen2 and qwen3 checkpoints, not {other}"
                ),
            ))
        }
    };
    if lc.sliding_window.is_some() {
        return Err(refuse(
            path,
            "sliding-window attention has no form in a llama GGUF",
        ));
    }
    if lc.o_bias || (lc.qkv_bias && arch != "qwen2") {
        return Err(refuse(
            path,
            format!("attention biases have no form in a {arch} GGUF"),
        ));
    }
    let k = |s: &str| format!("{arch}.{s}");
    let counts = [
        (
            "context_length",
            "max_position_embeddings",
            config.max_position_embeddings,
        ),
        ("embedding_length", "hidden_size", config.hidden_size),
        ("block_count", "num_hidden_layers", config.num_layers),
        (
            "feed_forward_length",
            "intermediate_size",
            config.intermediate_size,
        ),
        (
            "attention.head_count",
            "num_attention_heads",
            config.num_heads,
        ),
        (
            "attention.head_count_kv",
            "num_key_value_heads",
            config.num_kv_heads,
        ),
        ("attention.key_length", "head_dim", config.head_dim),
        ("attention.value_length", "head_dim", config.head_dim),
        ("rope.dimension_count", "head_dim", config.head_dim),
        ("vocab_size", "vocab_size", config.vocab_size),
    ];
    let mut m = counts
        .into_iter()
        .map(|(key, hf, v)| Ok((k(key), u32_of(path, hf, v)?)))
        .collect::<Result<Vec<_>>>()?;
    m.extend([
        (k("rope.freq_base"), MetaValue::F32(lc.rope_theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(config.rms_norm_eps),
        ),
    ]);
    match lc.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            m.push((k("rope.scaling.type"), MetaValue::String("linear".into())));
            m.push((k("rope.scaling.factor"), MetaValue::F32(factor)));
        }
        RopeScaling::Llama3 { .. } => {
            return Err(refuse(
                path,
                "Llama 3 rope scaling is stored by llama.cpp as a rope_freqs tensor, which kiln quantize does not write yet",
            ))
        }
        RopeScaling::Yarn { .. } => {
            return Err(refuse(path, "kiln quantize does not write YaRN rope scaling yet"))
        }
    }
    Ok((arch.to_string(), m))
}

/// `general.sampling.*` from a `generation_config.json` (llama.cpp's keys).
fn sampling_metadata(gen: Option<&Value>) -> Vec<(String, MetaValue)> {
    let Some(gen) = gen else { return Vec::new() };
    if gen.get("do_sample").and_then(Value::as_bool) == Some(false) {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (hf, key) in [
        ("temperature", "temp"),
        ("top_p", "top_p"),
        ("min_p", "min_p"),
    ] {
        if let Some(v) = gen.get(hf).and_then(Value::as_f64) {
            out.push((format!("general.sampling.{key}"), MetaValue::F32(v as f32)));
        }
    }
    if let Some(v) = gen.get("top_k").and_then(Value::as_u64) {
        out.push((
            "general.sampling.top_k".into(),
            MetaValue::I32(v.min(i32::MAX as u64) as i32),
        ));
    }
    out
}

fn f32_bytes(data: &[f32]) -> Vec<u8> {
    data.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn from_hf_dir(input: &Path, output: &Path, mix: QuantMix) -> Result<QuantizeReport> {
    let weights = SafetensorsDir::open(input)?;
    let config = ModelConfig::from_hf(weights.config())?;
    let (arch, model_meta) = model_metadata(input, &config)?;
    let tokenizer = Tokenizer::from_hf_dir(input)?;
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut meta = vec![
        (
            "general.architecture".to_string(),
            MetaValue::String(arch.clone()),
        ),
        ("general.name".to_string(), MetaValue::String(name)),
        (
            "general.file_type".to_string(),
            MetaValue::U32(file_type(mix)),
        ),
        (
            "general.quantization_version".to_string(),
            MetaValue::U32(2),
        ),
    ];
    meta.extend(sampling_metadata(weights.generation_config()));
    meta.extend(model_meta);
    meta.extend(tokenizer.gguf_metadata(config.vocab_size)?);

    let stored = weights.tensors();
    let layers = config.num_layers;
    let source = Quantizing::with_mix(weights, mix, layers)?;
    let mut plans = Vec::new();
    let mut names = Vec::new();
    for t in &stored {
        if config.tie_word_embeddings && t.name == "lm_head.weight" {
            continue;
        }
        let g = gguf_name(&arch, &t.name).ok_or_else(|| {
            refuse(
                input,
                format!("tensor {} has no name in a {arch} GGUF", t.name),
            )
        })?;
        let ty = mix
            .target(t, layers)
            .and_then(GgmlType::from_quant_format)
            .unwrap_or(GgmlType::F32);
        plans.push(GgufTensorPlan::new(g, &t.shape, ty));
        names.push(t.name.clone());
    }
    let heads = |name: &str| {
        if arch != "llama" {
            None
        } else if name.ends_with("self_attn.q_proj.weight") {
            Some(config.num_heads)
        } else if name.ends_with("self_attn.k_proj.weight") {
            Some(config.num_kv_heads)
        } else {
            None
        }
    };
    write_gguf(output, &meta, &plans, |i| {
        let name = &names[i];
        let (rows, row_bytes, bytes) = if plans[i].ggml_type == GgmlType::F32 {
            let host = source.load_f32(name)?;
            let rows = host.shape.first().copied().unwrap_or(1);
            (
                rows,
                host.data.len() / rows.max(1) * 4,
                f32_bytes(&host.data),
            )
        } else {
            let m =
                source
                    .load_blocks(name)?
                    .ok_or_else(|| kiln_formats::FormatError::Invalid {
                        path: input.to_path_buf(),
                        what: format!("{name} was planned in blocks but has none"),
                    })?;
            (m.rows(), m.row_bytes(), m.rows_bytes(0..m.rows()).to_vec())
        };
        Ok(match heads(name) {
            Some(h) if plans[i].ne.len() == 2 => permute_qk(&bytes, rows, row_bytes, h),
            _ => bytes,
        })
    })?;
    Ok(report(arch, &plans))
}

fn report(arch: String, plans: &[GgufTensorPlan]) -> QuantizeReport {
    let mut tensors_by_type = BTreeMap::new();
    let mut tensor_bytes = 0;
    for p in plans {
        *tensors_by_type
            .entry(p.ggml_type.name().to_string())
            .or_insert(0) += 1;
        tensor_bytes += p.ggml_type.bytes_for(&p.ne).unwrap_or(0);
    }
    QuantizeReport {
        arch,
        tensors_by_type,
        tensor_bytes,
    }
}

/// A GGUF's float matrices re-stored in `mix`; its metadata and every
/// other tensor copied. Rows keep the file's order (quantization is per
/// row, so llama's permuted q/k rows need no undoing).
fn from_gguf(input: &Path, output: &Path, mix: QuantMix) -> Result<QuantizeReport> {
    let file = GgufFile::open(input)?;
    let arch = file.metadata.architecture()?.to_string();
    let layers = file
        .metadata
        .u64(&format!("{arch}.block_count"))?
        .unwrap_or(0) as usize;
    let mut meta: Vec<(String, MetaValue)> = file
        .metadata
        .entries
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "general.file_type" | "general.alignment"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    meta.push(("general.file_type".into(), MetaValue::U32(file_type(mix))));
    let mut plans = Vec::new();
    let mut targets = Vec::new();
    for t in &file.tensors {
        let stored = kiln_formats::StoredTensor {
            name: t.name.clone(),
            shape: t.shape(),
            dtype: t.ggml_type.name().to_string(),
            num_bytes: 0,
        };
        let target = mix.target(&stored, layers);
        let ty = target
            .and_then(GgmlType::from_quant_format)
            .unwrap_or(t.ggml_type);
        plans.push(GgufTensorPlan {
            name: t.name.clone(),
            ne: t.ne.clone(),
            ggml_type: ty,
        });
        targets.push(target);
    }
    write_gguf(output, &meta, &plans, |i| {
        let t = &file.tensors[i];
        match targets[i] {
            None => Ok(file.tensor_bytes(t).to_vec()),
            Some(f) => {
                let values = file.tensor_f32(&t.name)?;
                kiln_quant::quantize(f, &values).map_err(|what| {
                    kiln_formats::FormatError::Invalid {
                        path: input.to_path_buf(),
                        what: format!("quantizing {} to {f}: {what}", t.name),
                    }
                })
            }
        }
    })?;
    Ok(report(arch, &plans))
}

/// A GGUF of `config`'s shape (a llama-layout family) with random blocks as
/// its matrices (`kiln_quant::random_blocks`: codes uniform, scales in
/// ±[1e-4, 0.05)) in `mix`, norms 1 and biases 0, and `tokenizer`'s
/// metadata — written block by block, so a 32B-shaped file needs no float
/// checkpoint first. The weights mean nothing: such a file is for sizes
/// and speed (`kiln fit`, `kiln bench`), not for text.
pub fn random_gguf(
    config: &Value,
    tokenizer: &Tokenizer,
    mix: QuantMix,
    seed: u64,
    output: &Path,
) -> Result<QuantizeReport> {
    let cfg = ModelConfig::from_hf(config)?;
    let (arch, model_meta) = model_metadata(output, &cfg)?;
    let mut meta = vec![
        (
            "general.architecture".to_string(),
            MetaValue::String(arch.clone()),
        ),
        (
            "general.name".to_string(),
            MetaValue::String(format!("random {arch}")),
        ),
        (
            "general.quantization_version".to_string(),
            MetaValue::U32(2),
        ),
    ];
    meta.extend(model_meta);
    meta.extend(tokenizer.gguf_metadata(cfg.vocab_size)?);
    let shapes = kiln_models::random::RandomWeights::new(&cfg, seed)?.tensors();
    let mut plans = Vec::new();
    for t in &shapes {
        if cfg.tie_word_embeddings && t.name == "lm_head.weight" {
            continue;
        }
        let g = gguf_name(&arch, &t.name).ok_or_else(|| {
            refuse(
                output,
                format!("tensor {} has no name in a {arch} GGUF", t.name),
            )
        })?;
        let ty = match t.shape[..] {
            [_, cols] => {
                let f = mix.format_of(&t.name, cfg.num_layers);
                let f = if cols % f.block_size() == 0 {
                    f
                } else {
                    QuantFormat::Q8_0
                };
                GgmlType::from_quant_format(f).unwrap_or(GgmlType::F32)
            }
            _ => GgmlType::F32,
        };
        plans.push((GgufTensorPlan::new(g, &t.shape, ty), t.name.clone()));
    }
    let (plans, names): (Vec<GgufTensorPlan>, Vec<String>) = plans.into_iter().unzip();
    write_gguf(output, &meta, &plans, |i| {
        let p = &plans[i];
        let elems = p.ne.iter().product::<u64>() as usize;
        Ok(match p.ggml_type.quant_format() {
            Some(f) if p.ggml_type != GgmlType::F32 => {
                kiln_quant::random_blocks(f, elems / f.block_size(), seed ^ (i as u64 + 1))
            }
            _ => {
                let v = if names[i].ends_with("norm.weight") {
                    1f32
                } else {
                    0f32
                };
                f32_bytes(&vec![v; elems])
            }
        })
    })?;
    Ok(report(arch, &plans))
}
