//! GGUF as a Hugging Face checkpoint: tensor names mapped to HF names, the
//! layout quirks of llama.cpp's converter undone, and `config.json` rebuilt
//! from the metadata. After this, a GGUF file and the safetensors directory
//! `kiln convert` writes from it hold identical f32 weights.
//!
//! Quirks undone here:
//! - `llama` files: rows of `attn_q`/`attn_k` are permuted for adjacent-pair
//!   RoPE; we permute them back so every model uses Hugging Face's rotate-half.
//! - `gemma3` files: norm weights are stored as `1 + w`; we subtract 1.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{FormatError, Result};
use crate::gguf::{GgufFile, GgufMetadata};
use crate::weights::{HostTensor, StoredTensor, WeightSource};

/// GGUF architectures Kiln maps, with their Hugging Face class and model type.
pub const SUPPORTED_ARCHS: &[(&str, &str, &str)] = &[
    ("llama", "LlamaForCausalLM", "llama"),
    ("mistral", "MistralForCausalLM", "mistral"),
    ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    ("qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
];

fn supported_list() -> String {
    SUPPORTED_ARCHS
        .iter()
        .map(|a| a.0)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Map a GGUF tensor name to its Hugging Face name for `arch`.
pub fn hf_name(arch: &str, gguf_name: &str) -> Option<String> {
    let top = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, suffix) = rest.rsplit_once('.')?;
    let gemma = arch == "gemma3";
    let hf = match base {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" => "post_attention_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undo llama.cpp's Q/K row permutation: GGUF row `2j + s` of a head is
/// Hugging Face row `s * head_dim/2 + j`.
pub fn unpermute_qk(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_head {
        for j in 0..half {
            for s in 0..2 {
                let src = h * head_dim + 2 * j + s;
                let dst = h * head_dim + s * half + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// A GGUF file seen through Hugging Face names.
pub struct GgufWeights {
    pub file: GgufFile,
    arch: String,
    n_head: usize,
    n_kv_head: usize,
    /// (hf name, index into file.tensors)
    names: Vec<(String, usize)>,
}

impl GgufWeights {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let file = GgufFile::open(path)?;
        Self::new(file)
    }

    pub fn new(file: GgufFile) -> Result<Self> {
        let arch = file.metadata.architecture()?.to_string();
        if !SUPPORTED_ARCHS.iter().any(|a| a.0 == arch) {
            return Err(FormatError::UnknownArchitecture {
                path: file.path.clone(),
                arch,
                supported: supported_list(),
            });
        }
        let n_head = file.metadata.req_u64(&format!("{arch}.attention.head_count"))? as usize;
        let n_kv_head = file
            .metadata
            .u64(&format!("{arch}.attention.head_count_kv"))?
            .map(|v| v as usize)
            .unwrap_or(n_head);
        let names = file
            .tensors
            .iter()
            .enumerate()
            .filter_map(|(i, t)| hf_name(&arch, &t.name).map(|n| (n, i)))
            .collect();
        Ok(GgufWeights {
            file,
            arch,
            n_head,
            n_kv_head,
            names,
        })
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn metadata(&self) -> &GgufMetadata {
        &self.file.metadata
    }

    fn index(&self, hf: &str) -> Option<usize> {
        self.names.iter().find(|(n, _)| n == hf).map(|&(_, i)| i)
    }

    /// The Hugging Face `config.json` equivalent of this file's metadata.
    pub fn hf_config(&self) -> Result<Value> {
        hf_config(&self.file.metadata, self.contains("lm_head.weight"), &self.file)
    }
}

impl WeightSource for GgufWeights {
    fn path(&self) -> &Path {
        &self.file.path
    }

    fn tensors(&self) -> Vec<StoredTensor> {
        self.names
            .iter()
            .map(|(n, i)| {
                let t = &self.file.tensors[*i];
                StoredTensor {
                    name: n.clone(),
                    shape: t.shape(),
                    dtype: t.ggml_type.name().to_string(),
                    num_bytes: t.ggml_type.bytes_for(&t.ne).unwrap_or(0),
                }
            })
            .collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.index(name).is_some()
    }

    fn load_f32(&self, name: &str) -> Result<HostTensor> {
        let i = self.index(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.file.path.clone(),
            tensor: name.to_string(),
        })?;
        let info = &self.file.tensors[i];
        let shape = info.shape();
        let mut data = self.file.tensor_f32(&info.name)?;
        if self.arch == "llama" && shape.len() == 2 {
            let heads = if name.ends_with("self_attn.q_proj.weight") {
                Some(self.n_head)
            } else if name.ends_with("self_attn.k_proj.weight") {
                Some(self.n_kv_head)
            } else {
                None
            };
            if let Some(h) = heads {
                if shape[0] % (2 * h) != 0 {
                    return Err(FormatError::ShapeMismatch {
                        path: self.file.path.clone(),
                        tensor: name.to_string(),
                        found: shape,
                        expected: vec![h * 2, 0],
                    });
                }
                data = unpermute_qk(&data, shape[0], shape[1], h);
            }
        }
        if self.arch == "gemma3" && name.ends_with("norm.weight") {
            for x in &mut data {
                *x -= 1.0;
            }
        }
        Ok(HostTensor::new(shape, data))
    }
}

/// Build a Hugging Face `config.json` from GGUF metadata.
pub fn hf_config(md: &GgufMetadata, has_output: bool, file: &GgufFile) -> Result<Value> {
    let arch = md.architecture()?;
    let Some(&(_, class, model_type)) = SUPPORTED_ARCHS.iter().find(|a| a.0 == arch) else {
        return Err(FormatError::UnknownArchitecture {
            path: md.path.clone(),
            arch: arch.to_string(),
            supported: supported_list(),
        });
    };
    let k = |s: &str| format!("{arch}.{s}");
    let hidden = md.req_u64(&k("embedding_length"))?;
    let n_head = md.req_u64(&k("attention.head_count"))?;
    let n_kv = md.u64(&k("attention.head_count_kv"))?.unwrap_or(n_head);
    let head_dim = md.u64(&k("attention.key_length"))?.unwrap_or(hidden / n_head.max(1));
    let vocab = match md.u64(&k("vocab_size"))? {
        Some(v) => v,
        None => match md.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(a) => a.len() as u64,
            None => file
                .tensors
                .iter()
                .find(|t| t.name == "token_embd.weight")
                .map(|t| t.ne.get(1).copied().unwrap_or(0))
                .unwrap_or(0),
        },
    };
    let default_eps = if arch == "gemma3" { 1e-6 } else { 1e-5 };
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("model_type".into(), json!(model_type));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("intermediate_size".into(), json!(md.req_u64(&k("feed_forward_length"))?));
    c.insert("num_hidden_layers".into(), json!(md.req_u64(&k("block_count"))?));
    c.insert("num_attention_heads".into(), json!(n_head));
    c.insert("num_key_value_heads".into(), json!(n_kv));
    c.insert("head_dim".into(), json!(head_dim));
    c.insert(
        "rms_norm_eps".into(),
        json!(md.f64(&k("attention.layer_norm_rms_epsilon"))?.unwrap_or(default_eps)),
    );
    c.insert(
        "rope_theta".into(),
        json!(md.f64(&k("rope.freq_base"))?.unwrap_or(10000.0)),
    );
    c.insert(
        "max_position_embeddings".into(),
        json!(md.u64(&k("context_length"))?.unwrap_or(4096)),
    );
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("tie_word_embeddings".into(), json!(!has_output));
    c.insert(
        "hidden_act".into(),
        json!(if arch == "gemma3" { "gelu_pytorch_tanh" } else { "silu" }),
    );
    c.insert("torch_dtype".into(), json!("float32"));
    if arch == "qwen2" {
        c.insert("attention_bias".into(), json!(true));
    }
    if let Some(scale) = md.str(&k("rope.scaling.type"))? {
        if scale == "linear" {
            if let Some(f) = md.f64(&k("rope.scaling.factor"))? {
                c.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": f}));
            }
        }
    }
    if arch == "gemma3" {
        if let Some(w) = md.u64(&k("attention.sliding_window"))? {
            c.insert("sliding_window".into(), json!(w));
        }
        c.insert("query_pre_attn_scalar".into(), json!(head_dim));
        c.insert("rope_local_base_freq".into(), json!(10000.0));
        c.insert("sliding_window_pattern".into(), json!(6));
    }
    for (key, gkey) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(v) = md.u64(gkey)? {
            c.insert(key.into(), json!(v));
        }
    }
    Ok(Value::Object(c))
}
