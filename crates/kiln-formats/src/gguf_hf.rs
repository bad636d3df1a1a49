//! GGUF as a Hugging Face checkpoint: tensor names mapped to HF names, the
//! layout quirks of llama.cpp's converter undone, and `config.json` rebuilt
//! from the metadata. After this, a GGUF file and the safetensors directory
//! `kiln convert` writes from it hold identical f32 weights.
//!
//! Quirks undone here:
//! - `llama` files: rows of `attn_q`/`attn_k` are permuted for adjacent-pair
//!   RoPE; we permute them back so every model uses Hugging Face's rotate-half.
//! - `gemma3` files: norm weights are stored as `1 + w`; we subtract 1.
//! - `deepseek2` files (DeepSeek-V2/V3 and the models built on them): the
//!   latent attention's `kv_b_proj` is stored split for llama.cpp's
//!   absorbed form, each head's key rows transposed (`attn_k_b`, `[heads,
//!   kv_lora_rank, nope]`) and its value rows (`attn_v_b`, `[heads, value,
//!   kv_lora_rank]`); we join them back (older files keep `attn_kv_b`).
//!   The metadata's KV heads and lengths describe that MQA form
//!   (`key_length_mla` / `value_length_mla` are the model's); the gating
//!   function tells V3's sigmoid routing from V2's softmax.
//! - `glm4moe` files: `block_count` counts the MTP layers after the
//!   decoder's (`nextn_predict_layers`, their tensors `blk.N.nextn.*`); the
//!   router's selection bias is `exp_probs_b.bias`; RoPE's rotated width is
//!   `rope.dimension_count`.

use std::path::Path;

use kiln_quant::{QuantMatrix, SharedBytes};
use serde_json::{json, Map, Value};

use crate::error::{FormatError, Result};
use crate::gguf::{GgufFile, GgufMetadata, MetaValue};
use crate::weights::{HostTensor, StoredTensor, WeightSource};

mod arch;
use arch::{deepseek2_config, glm4moe_config, gpt_oss_config};

/// GGUF architectures Kiln maps, with their Hugging Face class and model type.
pub const SUPPORTED_ARCHS: &[(&str, &str, &str)] = &[
    ("llama", "LlamaForCausalLM", "llama"),
    ("mistral", "MistralForCausalLM", "mistral"),
    ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    ("qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
    ("qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe"),
    ("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    ("glm4moe", "Glm4MoeForCausalLM", "glm4_moe"),
    ("deepseek2", "DeepseekV2ForCausalLM", "deepseek_v2"),
    ("gpt-oss", "GptOssForCausalLM", "gpt_oss"),
];

/// Experts a stacked tensor may hold (any released model has far fewer).
const MAX_EXPERTS: u64 = 1 << 12;

/// The `llama` architecture with experts (`llama.expert_count`) is Mixtral.
const MIXTRAL: (&str, &str, &str) = ("llama", "MixtralForCausalLM", "mixtral");

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
    let gpt_oss = arch == "gpt-oss";
    if base == "attn_sinks" {
        // A parameter, not a module: no `.weight`.
        return Some(format!("model.layers.{layer}.self_attn.sinks"));
    }
    if base == "exp_probs_b" {
        // DeepSeek-style routing's selection bias: a buffer, no suffix.
        return Some(format!(
            "model.layers.{layer}.mlp.gate.e_score_correction_bias"
        ));
    }
    // DeepSeek-style shared experts (ungated, `shared_experts`).
    let deepseek_shared = arch == "glm4moe" || arch == "deepseek2";
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
        // A sparse layer's router: Mixtral's under `block_sparse_moe`,
        // gpt-oss's `mlp.router` (with a bias).
        "ffn_gate_inp" if arch == "llama" => "block_sparse_moe.gate",
        "ffn_gate_inp" if gpt_oss => "mlp.router",
        // gpt-oss's expert biases, `[experts, out]` (the stacked weights are
        // split by expert in `hf_expert_name`).
        "ffn_gate_exps" if suffix == "bias" => "mlp.experts.gate_proj",
        "ffn_up_exps" if suffix == "bias" => "mlp.experts.up_proj",
        "ffn_down_exps" if suffix == "bias" => "mlp.experts.down_proj",
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_shexp" if deepseek_shared => "mlp.shared_experts.gate_proj",
        "ffn_up_shexp" if deepseek_shared => "mlp.shared_experts.up_proj",
        "ffn_down_shexp" if deepseek_shared => "mlp.shared_experts.down_proj",
        // Latent attention (`deepseek2`; `attn_k_b` / `attn_v_b` are joined
        // into `kv_b_proj` by `GgufWeights`).
        "attn_q_a" => "self_attn.q_a_proj",
        "attn_q_a_norm" => "self_attn.q_a_layernorm",
        "attn_q_b" => "self_attn.q_b_proj",
        "attn_kv_a_mqa" => "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm" => "self_attn.kv_a_layernorm",
        "attn_kv_b" => "self_attn.kv_b_proj",
        // The MTP layer's own tensors (its `embed_tokens` and
        // `shared_head_head` repeat the model's and are not read).
        "nextn.eh_proj" => "eh_proj",
        "nextn.enorm" => "enorm",
        "nextn.hnorm" => "hnorm",
        "nextn.shared_head_norm" => "shared_head.norm",
        "ffn_gate_shexp" => "mlp.shared_expert.gate_proj",
        "ffn_up_shexp" => "mlp.shared_expert.up_proj",
        "ffn_down_shexp" => "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp" => "mlp.shared_expert_gate",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The Hugging Face name of expert `e` of the stacked GGUF expert tensor
/// `gguf_name` (`blk.N.ffn_{gate,up,down}_exps.weight`, experts outermost),
/// or `None` for any other tensor.
pub fn hf_expert_name(arch: &str, gguf_name: &str, e: usize) -> Option<String> {
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, suffix) = rest.rsplit_once('.')?;
    let (prefix, proj) = match (arch, base) {
        ("llama", "ffn_gate_exps") => ("block_sparse_moe", "w1"),
        ("llama", "ffn_up_exps") => ("block_sparse_moe", "w3"),
        ("llama", "ffn_down_exps") => ("block_sparse_moe", "w2"),
        (_, "ffn_gate_exps") => ("mlp", "gate_proj"),
        (_, "ffn_up_exps") => ("mlp", "up_proj"),
        (_, "ffn_down_exps") => ("mlp", "down_proj"),
        _ => return None,
    };
    Some(format!(
        "model.layers.{layer}.{prefix}.experts.{e}.{proj}.{suffix}"
    ))
}

/// The GGUF tensor bases [`hf_name`] maps, for its inverse.
const GGUF_BASES: &[&str] = &[
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_q_norm",
    "attn_k_norm",
    "ffn_norm",
    "post_attention_norm",
    "post_ffw_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_inp",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "ffn_gate_inp_shexp",
    "attn_q_a",
    "attn_q_a_norm",
    "attn_q_b",
    "attn_kv_a_mqa",
    "attn_kv_a_norm",
    "attn_kv_b",
    "nextn.eh_proj",
    "nextn.enorm",
    "nextn.hnorm",
    "nextn.shared_head_norm",
];

/// The GGUF name of the Hugging Face tensor `hf` for `arch`: the inverse
/// of [`hf_name`] (found through it, so the two cannot disagree).
pub fn gguf_name(arch: &str, hf: &str) -> Option<String> {
    for top in ["token_embd.weight", "output_norm.weight", "output.weight"] {
        if hf_name(arch, top).as_deref() == Some(hf) {
            return Some(top.to_string());
        }
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    if rest == "mlp.gate.e_score_correction_bias" {
        return Some(format!("blk.{layer}.exp_probs_b.bias"));
    }
    let suffix = rest.rsplit_once('.')?.1;
    GGUF_BASES
        .iter()
        .map(|base| format!("blk.{layer}.{base}.{suffix}"))
        .find(|g| hf_name(arch, g).as_deref() == Some(hf))
}

/// llama.cpp's Q/K row permutation for `llama` files (the inverse of
/// [`unpermute_qk`]): Hugging Face row `s * head_dim/2 + j` of a head is
/// GGUF row `2j + s`.
pub fn permute_qk<T: Copy + Default>(
    data: &[T],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Vec<T> {
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![T::default(); data.len()];
    for h in 0..n_head {
        for j in 0..half {
            for s in 0..2 {
                let src = (h * hd + s * half + j) * cols;
                let dst = (h * hd + 2 * j + s) * cols;
                out[dst..dst + cols].copy_from_slice(&data[src..src + cols]);
            }
        }
    }
    out
}

/// Undo llama.cpp's Q/K row permutation: GGUF row `2j + s` of a head is
/// Hugging Face row `s * head_dim/2 + j`. A row is `cols` elements of `T`
/// (f32 values, or a quantized row's bytes).
pub fn unpermute_qk<T: Copy + Default>(
    data: &[T],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Vec<T> {
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![T::default(); data.len()];
    for h in 0..n_head {
        for j in 0..half {
            for s in 0..2 {
                let src = h * head_dim + 2 * j + s;
                let dst = h * head_dim + s * half + j;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
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
    /// Every tensor by its Hugging Face name.
    names: Vec<(String, Entry)>,
}

/// Where a Hugging Face tensor lives in the file.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Index into `file.tensors`.
    index: usize,
    /// `Some((e, n))`: expert `e` of the `n` a stacked 3-D tensor holds.
    expert: Option<(usize, usize)>,
    /// `Some(v)`: `kv_b_proj` joined from `attn_k_b` (`index`) and
    /// `attn_v_b` (`file.tensors[v]`).
    kv_b: Option<usize>,
}

impl std::fmt::Debug for GgufWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufWeights")
            .field("file", &self.file)
            .field("arch", &self.arch)
            .finish()
    }
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
        let head_key = format!("{arch}.attention.head_count");
        let kv_key = format!("{arch}.attention.head_count_kv");
        let n_head = file.metadata.req_u64(&head_key)? as usize;
        let n_kv_head = file
            .metadata
            .u64(&kv_key)?
            .map(|v| v as usize)
            .unwrap_or(n_head);
        for (key, v) in [(head_key, n_head), (kv_key, n_kv_head)] {
            if v == 0 {
                return Err(FormatError::Metadata {
                    path: file.path.clone(),
                    key,
                    what: "expected at least one head, found 0".into(),
                });
            }
        }
        let mut names = Vec::new();
        for (index, t) in file.tensors.iter().enumerate() {
            if let Some(n) = hf_name(&arch, &t.name) {
                names.push((
                    n,
                    Entry {
                        index,
                        expert: None,
                        kv_b: None,
                    },
                ));
                continue;
            }
            // Latent attention's split `kv_b_proj`: one name for the pair.
            if let Some(layer) = t
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.strip_suffix(".attn_k_b.weight"))
            {
                let v_name = format!("blk.{layer}.attn_v_b.weight");
                if let Some(v) = file.tensors.iter().position(|x| x.name == v_name) {
                    names.push((
                        format!("model.layers.{layer}.self_attn.kv_b_proj.weight"),
                        Entry {
                            index,
                            expert: None,
                            kv_b: Some(v),
                        },
                    ));
                }
                continue;
            }
            // A stacked expert tensor: one Hugging Face tensor an expert
            // (no more than any model has: a crafted count must not make
            // millions of names).
            let num = match t.ne.as_slice() {
                &[_, _, n] if n <= MAX_EXPERTS && hf_expert_name(&arch, &t.name, 0).is_some() => {
                    n as usize
                }
                _ => continue,
            };
            for e in 0..num {
                if let Some(n) = hf_expert_name(&arch, &t.name, e) {
                    let expert = Some((e, num));
                    names.push((
                        n,
                        Entry {
                            index,
                            expert,
                            kv_b: None,
                        },
                    ));
                }
            }
        }
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

    fn entry(&self, hf: &str) -> Option<Entry> {
        self.names.iter().find(|(n, _)| n == hf).map(|&(_, e)| e)
    }

    /// The Hugging Face shape of an entry: an expert's matrix, or the
    /// tensor's own (the shared expert's gate, a vector in llama.cpp's
    /// files, as its `[1, hidden]` projection).
    fn entry_shape(&self, name: &str, e: Entry) -> Vec<usize> {
        let shape = self.file.tensors[e.index].shape();
        if let Some(v) = e.kv_b {
            // k_b [heads, latent, nope] and v_b [heads, value, latent] as
            // kv_b_proj [heads · (nope + value), latent].
            let vs = self.file.tensors[v].shape();
            return match (shape.as_slice(), vs.as_slice()) {
                (&[h, c, nope], &[_, value, _]) => vec![h * (nope + value), c],
                _ => shape,
            };
        }
        match e.expert {
            Some(_) => shape[1..].to_vec(),
            None if name.ends_with("shared_expert_gate.weight") => {
                vec![1, shape.iter().product()]
            }
            None => shape,
        }
    }

    /// The byte range of expert `e` of `n` within its stacked tensor.
    fn expert_bytes(&self, entry: Entry) -> Option<std::ops::Range<usize>> {
        let (e, n) = entry.expert?;
        let len = self
            .file
            .tensor_bytes(&self.file.tensors[entry.index])
            .len();
        let per = len / n.max(1);
        Some(e * per..(e + 1) * per)
    }

    /// The Hugging Face `config.json` equivalent of this file's metadata.
    pub fn hf_config(&self) -> Result<Value> {
        hf_config(
            &self.file.metadata,
            self.contains("lm_head.weight"),
            &self.file,
        )
    }
}

impl GgufWeights {
    /// `kv_b_proj` `[heads · (nope + value), latent]` from llama.cpp's
    /// `attn_k_b` `[heads, latent, nope]` (each head's key rows transposed)
    /// and `attn_v_b` `[heads, value, latent]`.
    fn joined_kv_b(
        &self,
        name: &str,
        k: &crate::gguf::GgufTensorInfo,
        v: &crate::gguf::GgufTensorInfo,
    ) -> Result<HostTensor> {
        let (ks, vs) = (k.shape(), v.shape());
        let (&[h, c, nope], &[vh, value, vc]) = (ks.as_slice(), vs.as_slice()) else {
            return Err(FormatError::ShapeMismatch {
                path: self.file.path.clone(),
                tensor: format!("{name} (GGUF {} and {})", k.name, v.name),
                found: ks,
                expected: vec![0, 0, 0],
            });
        };
        if (vh, vc) != (h, c) {
            return Err(FormatError::ShapeMismatch {
                path: self.file.path.clone(),
                tensor: format!("{name} (GGUF {})", v.name),
                found: vs,
                expected: vec![h, value, c],
            });
        }
        let kd = self.file.tensor_f32(&k.name)?;
        let vd = self.file.tensor_f32(&v.name)?;
        let mut out = Vec::with_capacity(h * (nope + value) * c);
        for head in 0..h {
            let kh = &kd[head * c * nope..(head + 1) * c * nope];
            for d in 0..nope {
                out.extend((0..c).map(|j| kh[j * nope + d]));
            }
            out.extend_from_slice(&vd[head * value * c..(head + 1) * value * c]);
        }
        Ok(HostTensor::new(vec![h * (nope + value), c], out))
    }

    /// The heads of a `llama` q/k weight whose rows llama.cpp permuted
    /// (`None` for every other tensor); an error when its rows do not split
    /// into them.
    fn permuted_heads(&self, name: &str, shape: &[usize]) -> Result<Option<usize>> {
        if self.arch != "llama" || shape.len() != 2 {
            return Ok(None);
        }
        let h = if name.ends_with("self_attn.q_proj.weight") {
            self.n_head
        } else if name.ends_with("self_attn.k_proj.weight") {
            self.n_kv_head
        } else {
            return Ok(None);
        };
        if !shape[0].is_multiple_of(2 * h) {
            return Err(FormatError::ShapeMismatch {
                path: self.file.path.clone(),
                tensor: name.to_string(),
                found: shape.to_vec(),
                expected: vec![h * 2, 0],
            });
        }
        Ok(Some(h))
    }
}

impl WeightSource for GgufWeights {
    fn path(&self) -> &Path {
        &self.file.path
    }

    fn tensors(&self) -> Vec<StoredTensor> {
        self.names
            .iter()
            .map(|(n, e)| {
                let t = &self.file.tensors[e.index];
                let bytes = t.ggml_type.bytes_for(&t.ne).unwrap_or(0);
                let joined = e.kv_b.map_or(0, |v| {
                    let vt = &self.file.tensors[v];
                    vt.ggml_type.bytes_for(&vt.ne).unwrap_or(0)
                });
                StoredTensor {
                    name: n.clone(),
                    shape: self.entry_shape(n, *e),
                    dtype: t.ggml_type.name().to_string(),
                    num_bytes: bytes / e.expert.map_or(1, |x| x.1.max(1) as u64) + joined,
                }
            })
            .collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.entry(name).is_some()
    }

    fn load_f32(&self, name: &str) -> Result<HostTensor> {
        let entry = self.entry(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.file.path.clone(),
            tensor: name.to_string(),
        })?;
        let info = &self.file.tensors[entry.index];
        let shape = self.entry_shape(name, entry);
        if let Some(v) = entry.kv_b {
            return self.joined_kv_b(name, info, &self.file.tensors[v]);
        }
        if let Some(range) = self.expert_bytes(entry) {
            let bytes = &self.file.tensor_bytes(info)[range];
            let n = shape.iter().product();
            let data = crate::dequant::dequantize(info.ggml_type, bytes, n).map_err(|_| {
                FormatError::UnsupportedDtype {
                    path: self.file.path.clone(),
                    tensor: format!("{name} (GGUF {})", info.name),
                    dtype: info.ggml_type.name().to_string(),
                }
            })?;
            return Ok(HostTensor::new(shape, data));
        }
        let mut data = self.file.tensor_f32(&info.name).map_err(|e| match e {
            // Name the tensor as the caller asked for it, and as the file stores it.
            FormatError::UnsupportedDtype {
                path,
                tensor,
                dtype,
            } => FormatError::UnsupportedDtype {
                path,
                tensor: format!("{name} (GGUF {tensor})"),
                dtype,
            },
            other => other,
        })?;
        if let Some(h) = self.permuted_heads(name, &shape)? {
            data = unpermute_qk(&data, shape[0], shape[1], h);
        }
        if self.arch == "gemma3" && name.ends_with("norm.weight") {
            for x in &mut data {
                *x -= 1.0;
            }
        }
        Ok(HostTensor::new(shape, data))
    }

    /// Every 2-D tensor in a block format, in place; `llama` q/k rows are
    /// un-permuted into a copy.
    fn load_blocks(&self, name: &str) -> Result<Option<QuantMatrix>> {
        let Some(entry) = self.entry(name).filter(|e| e.kv_b.is_none()) else {
            return Ok(None);
        };
        let info = &self.file.tensors[entry.index];
        let shape = self.entry_shape(name, entry);
        let (Some(format), &[rows, cols]) = (info.ggml_type.quant_format(), shape.as_slice())
        else {
            return Ok(None);
        };
        let mut bytes =
            match self.expert_bytes(entry) {
                Some(range) => self.file.tensor_part_shared(info, range).ok_or_else(|| {
                    FormatError::Corrupt {
                        path: self.file.path.clone(),
                        offset: info.offset,
                        what: format!("{name}: an expert past its tensor's bytes"),
                    }
                })?,
                None => self.file.tensor_shared(info),
            };
        if let Some(h) = self.permuted_heads(name, &[rows, cols])? {
            let row_bytes = bytes.len() / rows.max(1);
            bytes = SharedBytes::from_vec(unpermute_qk(bytes.as_slice(), rows, row_bytes, h));
        }
        QuantMatrix::new(format, rows, cols, bytes)
            .map(Some)
            .map_err(|what| FormatError::Corrupt {
                path: self.file.path.clone(),
                offset: info.offset,
                what: format!("{name}: {what}"),
            })
    }
}

/// A float metadata value as the decimal it was written from: an f32 `1e-5`
/// reads back as 9.999999747378752e-6 in f64, so f32 values go through their
/// shortest decimal form (which rounds to the same f32).
fn decimal_f64(md: &GgufMetadata, key: &str) -> Result<Option<f64>> {
    match md.get(key) {
        Some(MetaValue::F32(v)) => Ok(Some(v.to_string().parse().unwrap_or(*v as f64))),
        _ => md.f64(key),
    }
}

/// Build a Hugging Face `config.json` from GGUF metadata.
pub fn hf_config(md: &GgufMetadata, has_output: bool, file: &GgufFile) -> Result<Value> {
    let arch = md.architecture()?;
    let experts = md.u64(&format!("{arch}.expert_count"))?.unwrap_or(0);
    let found = match arch {
        "llama" if experts > 0 => Some(&MIXTRAL),
        _ => SUPPORTED_ARCHS.iter().find(|a| a.0 == arch),
    };
    // llama.cpp stores DeepSeek-V3 (sigmoid gating) as `deepseek2` too.
    const DEEPSEEK_V3: (&str, &str, &str) = ("deepseek2", "DeepseekV3ForCausalLM", "deepseek_v3");
    let found = match (arch, md.u64(&format!("{arch}.expert_gating_func"))?) {
        ("deepseek2", Some(2)) => Some(&DEEPSEEK_V3),
        _ => found,
    };
    let Some(&(_, class, model_type)) = found else {
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
    let head_dim = md
        .u64(&k("attention.key_length"))?
        .unwrap_or(hidden / n_head.max(1));
    // The embedding's row count is what a loader checks `vocab_size` against;
    // the token list can be shorter when the embedding is padded.
    let embd_rows = file
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .and_then(|t| t.ne.get(1).copied());
    let n_tokens = md
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .map(|a| a.len() as u64);
    let vocab = md
        .u64(&k("vocab_size"))?
        .or(embd_rows)
        .or(n_tokens)
        .unwrap_or(0);
    let default_eps = if arch == "gemma3" { 1e-6 } else { 1e-5 };
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("model_type".into(), json!(model_type));
    c.insert("hidden_size".into(), json!(hidden));
    let expert_ff = md.u64(&k("expert_feed_forward_length"))?;
    let ff = match expert_ff {
        // A file whose every layer is sparse may leave the dense size out.
        Some(e) => md.u64(&k("feed_forward_length"))?.unwrap_or(e),
        None => md.req_u64(&k("feed_forward_length"))?,
    };
    c.insert("intermediate_size".into(), json!(ff));
    if experts > 0 {
        c.insert("num_experts".into(), json!(experts));
        c.insert("num_local_experts".into(), json!(experts));
        if let Some(k_used) = md.u64(&k("expert_used_count"))? {
            c.insert("num_experts_per_tok".into(), json!(k_used));
        }
        if let Some(e) = expert_ff {
            c.insert("moe_intermediate_size".into(), json!(e));
        }
        if let Some(s) = md.u64(&k("expert_shared_feed_forward_length"))? {
            c.insert("shared_expert_intermediate_size".into(), json!(s));
        }
        // llama.cpp renormalizes Qwen3-MoE's kept weights and not
        // Qwen2-MoE's unless the file says otherwise.
        let norm = match md.get(&k("expert_weights_norm")) {
            Some(MetaValue::Bool(b)) => *b,
            _ => arch == "qwen3moe",
        };
        c.insert("norm_topk_prob".into(), json!(norm));
    }
    // llama.cpp counts a GLM-4.5 file's MTP layers in `block_count`.
    let nextn = md.u64(&k("nextn_predict_layers"))?.unwrap_or(0);
    let blocks = md.req_u64(&k("block_count"))?;
    if nextn > blocks {
        return Err(FormatError::Metadata {
            path: md.path.clone(),
            key: k("nextn_predict_layers"),
            what: format!("{nextn} MTP layers of {blocks} blocks"),
        });
    }
    c.insert("num_hidden_layers".into(), json!(blocks - nextn));
    c.insert("num_attention_heads".into(), json!(n_head));
    c.insert("num_key_value_heads".into(), json!(n_kv));
    c.insert("head_dim".into(), json!(head_dim));
    c.insert(
        "rms_norm_eps".into(),
        json!(decimal_f64(md, &k("attention.layer_norm_rms_epsilon"))?.unwrap_or(default_eps)),
    );
    c.insert(
        "rope_theta".into(),
        json!(decimal_f64(md, &k("rope.freq_base"))?.unwrap_or(10000.0)),
    );
    c.insert(
        "max_position_embeddings".into(),
        json!(md.u64(&k("context_length"))?.unwrap_or(4096)),
    );
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("tie_word_embeddings".into(), json!(!has_output));
    let act = if arch == "gemma3" {
        "gelu_pytorch_tanh"
    } else {
        "silu"
    };
    c.insert("hidden_act".into(), json!(act));
    if arch == "gemma3" {
        // Gemma3TextConfig reads `hidden_activation`, not `hidden_act`.
        c.insert("hidden_activation".into(), json!(act));
    }
    c.insert("torch_dtype".into(), json!("float32"));
    if arch == "gpt-oss" {
        gpt_oss_config(md, &mut c, experts)?;
    }
    if arch == "glm4moe" {
        glm4moe_config(md, &mut c, file, head_dim, nextn)?;
    }
    if arch == "deepseek2" {
        deepseek2_config(md, &mut c, file, model_type, n_head, head_dim)?;
    }
    if arch == "qwen2" || arch == "qwen2moe" {
        c.insert("attention_bias".into(), json!(true));
    }
    if let Some(scale) = md.str(&k("rope.scaling.type"))? {
        if scale == "linear" {
            if let Some(f) = md.f64(&k("rope.scaling.factor"))? {
                c.insert(
                    "rope_scaling".into(),
                    json!({"rope_type": "linear", "factor": f}),
                );
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

#[cfg(test)]
mod tests {
    use super::*;

    /// numpy's `a.reshape(dims).swapaxes(ax1, ax2)`, flattened row-major again:
    /// the definition llama.cpp's converter uses, read literally.
    fn reshape_swapaxes(data: &[f32], dims: &[usize], ax1: usize, ax2: usize) -> Vec<f32> {
        assert_eq!(dims.iter().product::<usize>(), data.len());
        let mut strides = vec![1; dims.len()];
        for k in (0..dims.len() - 1).rev() {
            strides[k] = strides[k + 1] * dims[k + 1];
        }
        let (mut out_dims, mut src_strides) = (dims.to_vec(), strides);
        out_dims.swap(ax1, ax2);
        src_strides.swap(ax1, ax2);
        let mut idx = vec![0; dims.len()];
        let mut out = Vec::with_capacity(data.len());
        for _ in 0..data.len() {
            out.push(
                data[idx
                    .iter()
                    .zip(&src_strides)
                    .map(|(i, s)| i * s)
                    .sum::<usize>()],
            );
            for k in (0..idx.len()).rev() {
                idx[k] += 1;
                if idx[k] < out_dims[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
        out
    }

    /// llama.cpp's `permute`: `reshape(n_head, 2, hd/2, cols).swapaxes(1, 2)`.
    fn llama_cpp_permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
        reshape_swapaxes(w, &[n_head, 2, rows / n_head / 2, cols], 1, 2)
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        for (n_head, head_dim, cols) in [(1, 2, 1), (1, 4, 3), (2, 6, 1), (3, 8, 5), (9, 64, 2)] {
            let rows = n_head * head_dim;
            let hf: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let gguf = llama_cpp_permute(&hf, rows, cols, n_head);
            if head_dim > 2 {
                assert_ne!(gguf, hf, "the permutation must move rows");
            }
            assert_eq!(
                unpermute_qk(&gguf, rows, cols, n_head),
                hf,
                "{n_head}×{head_dim}×{cols}"
            );
        }
    }

    #[test]
    fn unpermute_hand_worked() {
        // One head of 4 rows: HF rows [a, b, c, d] are stored as [a, c, b, d]
        // (pairs (a, c) and (b, d) become adjacent for llama.cpp's rope).
        assert_eq!(unpermute_qk(&[0., 2., 1., 3.], 4, 1, 1), [0., 1., 2., 3.]);
        // Two heads of 6 rows, 1 column: each head is un-permuted separately.
        let gguf = [0., 3., 1., 4., 2., 5., 6., 9., 7., 10., 8., 11.];
        let hf: Vec<f32> = (0..12).map(|i| i as f32).collect();
        assert_eq!(unpermute_qk(&gguf, 12, 1, 2), hf);
    }

    #[test]
    fn permute_inverts_unpermute_and_gguf_name_inverts_hf_name() {
        for (n_head, head_dim, cols) in [(1, 2, 1), (2, 6, 3), (9, 64, 2)] {
            let rows = n_head * head_dim;
            let hf: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let g = permute_qk(&hf, rows, cols, n_head);
            assert_eq!(g, llama_cpp_permute(&hf, rows, cols, n_head));
            assert_eq!(unpermute_qk(&g, rows, cols, n_head), hf);
        }
        for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
            for g in [
                "token_embd.weight",
                "output.weight",
                "output_norm.weight",
                "blk.7.attn_q.weight",
                "blk.0.attn_k.bias",
                "blk.3.ffn_norm.weight",
                "blk.11.ffn_down.weight",
                "blk.2.attn_q_norm.weight",
            ] {
                let hf = hf_name(arch, g).unwrap();
                assert_eq!(gguf_name(arch, &hf).as_deref(), Some(g), "{arch} {hf}");
            }
        }
        assert_eq!(
            gguf_name("llama", "model.layers.0.mlp.experts.weight"),
            None
        );
        assert_eq!(gguf_name("llama", "vision_tower.x.weight"), None);
    }

    #[test]
    fn names_by_architecture() {
        let n = |arch, name| hf_name(arch, name);
        assert_eq!(
            n("llama", "blk.3.ffn_norm.weight").as_deref(),
            Some("model.layers.3.post_attention_layernorm.weight")
        );
        assert_eq!(
            n("gemma3", "blk.3.ffn_norm.weight").as_deref(),
            Some("model.layers.3.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            n("gemma3", "blk.3.post_attention_norm.weight").as_deref(),
            Some("model.layers.3.post_attention_layernorm.weight")
        );
        assert_eq!(
            n("qwen2", "blk.0.attn_k.bias").as_deref(),
            Some("model.layers.0.self_attn.k_proj.bias")
        );
        assert_eq!(
            n("llama", "output.weight").as_deref(),
            Some("lm_head.weight")
        );
        assert_eq!(n("llama", "rope_freqs.weight"), None);
        assert_eq!(n("llama", "blk.x.attn_q.weight"), None);
    }
}
