//! What one model is, read from its headers: a GGUF file's metadata and
//! tensor table, or a Hugging Face directory's `config.json`, safetensors
//! headers and chat template. Tensor bytes are never read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_formats::{GgufFile, GgufWeights, SafetensorsDir, WeightSource};
use serde_json::Value;

use crate::error::{RegistryError, Result};

/// How the weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    Gguf,
    Safetensors,
}

impl ModelFormat {
    pub fn name(self) -> &'static str {
        match self {
            ModelFormat::Gguf => "gguf",
            ModelFormat::Safetensors => "safetensors",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "gguf" => Some(ModelFormat::Gguf),
            "safetensors" => Some(ModelFormat::Safetensors),
            _ => None,
        }
    }
}

/// What a model can do beyond plain text, judged from its chat template
/// and config.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// The chat template mentions `tools`.
    pub tools: bool,
    /// The chat template mentions `enable_thinking` or `<think>`.
    pub thinking: bool,
    /// The config has a vision part (`vision_config`, a vision tower).
    pub vision: bool,
    /// The config has an audio part.
    pub audio: bool,
}

impl Capabilities {
    /// `tools,thinking,...` (empty when none).
    pub fn names(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        for (on, name) in [
            (self.tools, "tools"),
            (self.thinking, "thinking"),
            (self.vision, "vision"),
            (self.audio, "audio"),
        ] {
            if on {
                out.push(name);
            }
        }
        out
    }
}

/// One model as its headers describe it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub format: ModelFormat,
    /// The class in `architectures` (`LlamaForCausalLM`), or GGUF's
    /// `general.architecture` when no class is known.
    pub architecture: String,
    /// `model_type` (`llama`, `qwen2`, `gemma3_text`, ...).
    pub model_type: String,
    /// Parameters, counted from the tensor table (`None` when the weights
    /// could not be read).
    pub num_params: Option<u64>,
    /// GGUF file type (`Q4_K_M`) or safetensors dtypes by bytes (`BF16`).
    pub quant: String,
    pub context_length: Option<u64>,
    pub size_bytes: u64,
    pub capabilities: Capabilities,
    /// The Kiln family that serves it; `None`: unsupported.
    pub family: Option<String>,
    /// What could not be read (the model is still listed).
    pub problem: Option<String>,
}

/// Read `path`: a `.gguf` file or a Hugging Face model directory.
pub fn inspect(path: &Path) -> Result<ModelInfo> {
    if path.is_dir() {
        inspect_dir(path)
    } else if path.is_file() {
        inspect_gguf(path)
    } else {
        Err(RegistryError::Invalid {
            path: path.to_path_buf(),
            what: "no such file or directory".into(),
        })
    }
}

/// The model's Hugging Face `config.json` (rebuilt from metadata for GGUF).
pub fn hf_config(path: &Path) -> Result<Value> {
    if path.is_dir() {
        read_json(&path.join("config.json"))
    } else {
        Ok(GgufWeights::open(path)?.hf_config()?)
    }
}

/// llama.cpp's `general.file_type` names.
fn file_type_name(v: u64) -> Option<&'static str> {
    Some(match v {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        _ => return None,
    })
}

/// Storage types by total bytes, largest first, joined with `+`.
fn dominant_types(bytes_by_type: BTreeMap<String, u64>) -> String {
    let mut v: Vec<_> = bytes_by_type.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.into_iter().map(|(t, _)| t).collect::<Vec<_>>().join("+")
}

fn template_capabilities(template: &str) -> Capabilities {
    Capabilities {
        tools: template.contains("tools"),
        thinking: template.contains("enable_thinking") || template.contains("<think>"),
        ..Capabilities::default()
    }
}

fn inspect_gguf(path: &Path) -> Result<ModelInfo> {
    let file = GgufFile::open(path)?;
    let md = &file.metadata;
    let arch = md.architecture()?.to_string();
    let num_params: u64 = file.tensors.iter().map(|t| t.num_elements()).sum();
    let mut bytes_by_type = BTreeMap::new();
    for t in &file.tensors {
        let n = t.ggml_type.bytes_for(&t.ne).unwrap_or(0);
        *bytes_by_type
            .entry(t.ggml_type.name().to_string())
            .or_insert(0) += n;
    }
    let file_type = md.u64("general.file_type").ok().flatten();
    let quant = file_type
        .and_then(file_type_name)
        .map(str::to_string)
        .unwrap_or_else(|| dominant_types(bytes_by_type));
    let context_length = md.u64(&format!("{arch}.context_length")).ok().flatten();
    let mut templates = String::new();
    for (k, v) in &md.entries {
        if k.starts_with("tokenizer.chat_template") {
            templates.push_str(v.as_str().unwrap_or(""));
        }
    }
    let mut capabilities = template_capabilities(&templates);
    capabilities.vision = md.entries.keys().any(|k| k.starts_with("clip.vision"));
    capabilities.audio = md.entries.keys().any(|k| k.starts_with("clip.audio"));
    // The config Kiln would build names the model type and class; an
    // architecture it does not know keeps GGUF's name.
    let (architecture, model_type) = match GgufWeights::new(file).and_then(|w| w.hf_config()) {
        Ok(c) => (
            c["architectures"][0].as_str().unwrap_or(&arch).to_string(),
            c["model_type"].as_str().unwrap_or(&arch).to_string(),
        ),
        Err(_) => (arch.clone(), arch.clone()),
    };
    Ok(ModelInfo {
        format: ModelFormat::Gguf,
        architecture,
        family: kiln_models::family(&model_type).map(str::to_string),
        model_type,
        num_params: Some(num_params),
        quant,
        context_length,
        size_bytes: std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
        capabilities,
        problem: None,
    })
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| RegistryError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| RegistryError::Invalid {
        path: path.to_path_buf(),
        what: format!("not valid JSON: {e}"),
    })
}

/// Every chat template a Hugging Face directory carries, concatenated.
fn dir_templates(dir: &Path) -> String {
    let mut out = String::new();
    if let Ok(tc) = read_json(&dir.join("tokenizer_config.json")) {
        match tc.get("chat_template") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(named)) => {
                for t in named {
                    out.push_str(t["template"].as_str().unwrap_or(""));
                }
            }
            _ => {}
        }
    }
    if let Ok(s) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
        out.push_str(&s);
    }
    if let Ok(v) = read_json(&dir.join("chat_template.json")) {
        out.push_str(v["chat_template"].as_str().unwrap_or(""));
    }
    out
}

/// The first of `keys` that is a number, at the top level or in `text_config`.
fn config_u64(c: &Value, keys: &[&str]) -> Option<u64> {
    let scopes = [Some(c), c.get("text_config")];
    scopes
        .into_iter()
        .flatten()
        .find_map(|s| keys.iter().find_map(|k| s.get(*k).and_then(Value::as_u64)))
}

/// Bytes of every file under `dir`, following the hub cache's symlinks.
fn dir_size(dir: &Path, depth: usize) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0;
    for e in rd.flatten() {
        let p: PathBuf = e.path();
        match std::fs::metadata(&p) {
            Ok(m) if m.is_file() => total += m.len(),
            Ok(m) if m.is_dir() && depth < 4 => total += dir_size(&p, depth + 1),
            _ => {}
        }
    }
    total
}

fn inspect_dir(dir: &Path) -> Result<ModelInfo> {
    let config = read_json(&dir.join("config.json"))?;
    let text = config.get("text_config").unwrap_or(&config);
    let model_type = text
        .get("model_type")
        .or_else(|| config.get("model_type"))
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_string();
    let architecture = config["architectures"][0]
        .as_str()
        .unwrap_or(&model_type)
        .to_string();
    let obj = config.as_object();
    let has = |pred: &dyn Fn(&str) -> bool| obj.is_some_and(|o| o.keys().any(|k| pred(k)));
    let mut capabilities = template_capabilities(&dir_templates(dir));
    capabilities.vision = has(&|k| k.starts_with("vision_") || k == "mm_vision_tower");
    capabilities.audio = has(&|k| k.starts_with("audio_"));
    let (num_params, quant, problem) = match SafetensorsDir::open(dir) {
        Ok(st) => {
            let mut n = 0u64;
            let mut bytes_by_type = BTreeMap::new();
            for t in st.tensors() {
                n += t.shape.iter().map(|&d| d as u64).product::<u64>();
                *bytes_by_type.entry(t.dtype.to_uppercase()).or_insert(0) += t.num_bytes;
            }
            (Some(n), dominant_types(bytes_by_type), None)
        }
        Err(e) => {
            let dtype = config
                .get("torch_dtype")
                .or_else(|| config.get("dtype"))
                .and_then(Value::as_str)
                .unwrap_or("?");
            (None, dtype.to_string(), Some(e.to_string()))
        }
    };
    Ok(ModelInfo {
        format: ModelFormat::Safetensors,
        architecture,
        family: kiln_models::family(&model_type).map(str::to_string),
        model_type,
        num_params,
        quant,
        context_length: config_u64(
            &config,
            &["max_position_embeddings", "n_positions", "max_seq_len"],
        ),
        size_bytes: dir_size(dir, 0),
        capabilities,
        problem,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_name_capabilities() {
        let c = template_capabilities("{% if tools %}...{% endif %}<think>");
        assert!(c.tools && c.thinking && !c.vision);
        let c = template_capabilities("{{ messages }}");
        assert_eq!(c.names(), Vec::<&str>::new());
    }

    #[test]
    fn dominant_types_order_by_bytes() {
        let m = BTreeMap::from([("F32".to_string(), 10), ("BF16".to_string(), 100)]);
        assert_eq!(dominant_types(m), "BF16+F32");
    }

    #[test]
    fn bad_files_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x.gguf");
        std::fs::write(&f, b"GGUF\x03\x00\x00\x00garbage").unwrap();
        assert!(inspect(&f).is_err());
        std::fs::write(dir.path().join("config.json"), b"{not json").unwrap();
        assert!(inspect(dir.path()).is_err());
        std::fs::write(
            dir.path().join("config.json"),
            br#"{"model_type": "llama"}"#,
        )
        .unwrap();
        let info = inspect(dir.path()).unwrap();
        assert_eq!(info.family.as_deref(), Some("llama"));
        assert!(info.problem.is_some() && info.num_params.is_none());
    }
}
