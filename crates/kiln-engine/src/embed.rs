//! Sentence embeddings: a model's final hidden states pooled, projected and
//! normalized the way its sentence-transformers directory says.
//!
//! [`EmbeddingHead`] reads `modules.json` (a `Pooling` module's
//! `config.json` — CLS, mean, max, mean/√len or last token, with or without
//! the prompt's tokens — `Dense` modules' `model.safetensors` with their
//! activation, `Normalize`), `sentence_bert_config.json`'s
//! `max_seq_length` and `config_sentence_transformers.json`'s task prompts.
//! A model without `modules.json` gets mean pooling and normalization for
//! an encoder, last-token pooling and normalization for a decoder (the
//! usual heads of each kind).
//!
//! [`Embedder`] tokenizes as sentence-transformers does (prompt + text with
//! the tokenizer's special tokens; past the limit the text is cut and the
//! special tokens kept), runs each sequence whole in one step (its keys and
//! values in a cache of its own, dropped after the step) and applies the
//! head on the host in f32.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_tensor::ForwardBatch;
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::LoadedModel;

/// How token vectors become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The first token's vector.
    Cls,
    /// The mean over tokens.
    Mean,
    /// The elementwise maximum over tokens.
    Max,
    /// The sum over tokens divided by √(tokens).
    MeanSqrtLen,
    /// The last token's vector.
    LastToken,
}

/// A `Dense` module: `act(W·x + b)`.
#[derive(Clone, Debug)]
pub struct DenseLayer {
    pub in_features: usize,
    pub out_features: usize,
    /// `[out, in]`.
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    tanh: bool,
}

impl DenseLayer {
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        (0..self.out_features)
            .map(|o| {
                let row = &self.weight[o * self.in_features..(o + 1) * self.in_features];
                let mut s: f32 = row.iter().zip(x).map(|(w, v)| w * v).sum();
                if let Some(b) = &self.bias {
                    s += b[o];
                }
                if self.tanh {
                    s.tanh()
                } else {
                    s
                }
            })
            .collect()
    }
}

/// What turns a sequence's hidden states into its embedding.
#[derive(Clone, Debug)]
pub struct EmbeddingHead {
    pub pooling: Pooling,
    /// Whether the prompt's tokens count in the pooling.
    pub include_prompt: bool,
    pub dense: Vec<DenseLayer>,
    pub normalize: bool,
    /// Tokens a sequence may have (special tokens included).
    pub max_seq_length: usize,
    /// Task prompts by name (`query`, `document`, ...).
    pub prompts: BTreeMap<String, String>,
    /// The prompt used when a request names none.
    pub default_prompt_name: Option<String>,
    /// The length of the output vector.
    pub dimension: usize,
    /// Shorter vectors the model was trained to give by truncation
    /// (Matryoshka): `config.json`'s `matryoshka_dimensions`, or any length
    /// (an empty list) where it says `is_matryoshka`; `None`: not declared.
    pub matryoshka: Option<Vec<usize>>,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| bad(path, format!("not JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(bad(path, e.to_string())),
    }
}

fn bad(path: &Path, what: impl Into<String>) -> EngineError {
    EngineError::BadModelPath {
        path: path.display().to_string(),
        what: what.into(),
    }
}

impl EmbeddingHead {
    /// The head of `model`: from its directory's sentence-transformers
    /// files where it has them, else the default for its kind.
    pub fn of(model: &LoadedModel) -> Result<EmbeddingHead> {
        let cfg = model.model.config();
        let hidden = cfg.hidden_size;
        let encoder = !model.model.generates();
        let mut head = EmbeddingHead {
            pooling: if encoder {
                Pooling::Mean
            } else {
                Pooling::LastToken
            },
            include_prompt: true,
            dense: Vec::new(),
            normalize: true,
            max_seq_length: cfg.max_position_embeddings,
            prompts: BTreeMap::new(),
            default_prompt_name: None,
            dimension: hidden,
            matryoshka: None,
        };
        // sentence-transformers' own defaults where a model names none.
        for name in ["query", "document"] {
            head.prompts.insert(name.to_string(), String::new());
        }
        let dir = &model.path;
        if !dir.is_dir() {
            return Ok(head);
        }
        if let Some(c) = read_json(&dir.join("config.json"))? {
            if let Some(dims) = c.get("matryoshka_dimensions").and_then(Value::as_array) {
                head.matryoshka = Some(
                    dims.iter()
                        .filter_map(Value::as_u64)
                        .map(|d| d as usize)
                        .collect(),
                );
            } else if c.get("is_matryoshka").and_then(Value::as_bool) == Some(true) {
                head.matryoshka = Some(Vec::new());
            }
        }
        if let Some(c) = read_json(&dir.join("sentence_bert_config.json"))? {
            if let Some(n) = c.get("max_seq_length").and_then(Value::as_u64) {
                head.max_seq_length = (n as usize).min(cfg.max_position_embeddings);
            }
        }
        if let Some(c) = read_json(&dir.join("config_sentence_transformers.json"))? {
            if let Some(p) = c.get("prompts").and_then(Value::as_object) {
                for (k, v) in p {
                    if let Some(v) = v.as_str() {
                        head.prompts.insert(k.clone(), v.to_string());
                    }
                }
            }
            head.default_prompt_name = c
                .get("default_prompt_name")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        let modules_path = dir.join("modules.json");
        let Some(modules) = read_json(&modules_path)? else {
            return Ok(head);
        };
        let modules = modules
            .as_array()
            .ok_or_else(|| bad(&modules_path, "not a list of modules"))?;
        head.normalize = false;
        let mut width = hidden;
        for m in modules {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or("");
            let sub = dir.join(m.get("path").and_then(Value::as_str).unwrap_or(""));
            match kind.rsplit('.').next().unwrap_or("") {
                "Transformer" => {}
                "Pooling" => {
                    let path = sub.join("config.json");
                    let c = read_json(&path)?.ok_or_else(|| bad(&path, "missing"))?;
                    let on = |k: &str| c.get(k).and_then(Value::as_bool) == Some(true);
                    head.pooling = if on("pooling_mode_cls_token") {
                        Pooling::Cls
                    } else if on("pooling_mode_mean_tokens") {
                        Pooling::Mean
                    } else if on("pooling_mode_max_tokens") {
                        Pooling::Max
                    } else if on("pooling_mode_mean_sqrt_len_tokens") {
                        Pooling::MeanSqrtLen
                    } else if on("pooling_mode_lasttoken") {
                        Pooling::LastToken
                    } else {
                        return Err(bad(&path, "no pooling mode Kiln runs is on"));
                    };
                    head.include_prompt = c
                        .get("include_prompt")
                        .and_then(Value::as_bool)
                        .unwrap_or(true);
                }
                "Dense" => {
                    let d = dense(&sub, width)?;
                    width = d.out_features;
                    head.dense.push(d);
                }
                "Normalize" => head.normalize = true,
                other => {
                    return Err(bad(
                        &modules_path,
                        format!("the module {other:?} is not one Kiln runs"),
                    ))
                }
            }
        }
        head.dimension = width;
        Ok(head)
    }

    /// The embedding of one sequence from its hidden states (`rows × h`,
    /// the rows [`Self::rows`] asked for), the first `skip` rows left out
    /// of a mean or max (the prompt, where it does not count).
    pub fn apply(&self, hidden: &[f32], h: usize, skip: usize) -> Vec<f32> {
        let rows = hidden.len() / h.max(1);
        let take = |i: usize| &hidden[i * h..(i + 1) * h];
        let from = skip.min(rows.saturating_sub(1));
        let mut v = match self.pooling {
            Pooling::Cls | Pooling::LastToken => take(0).to_vec(),
            Pooling::Max => (0..h)
                .map(|d| {
                    (from..rows)
                        .map(|r| hidden[r * h + d])
                        .fold(f32::NEG_INFINITY, f32::max)
                })
                .collect(),
            Pooling::Mean | Pooling::MeanSqrtLen => {
                let mut s = vec![0f32; h];
                for r in from..rows {
                    for (s, v) in s.iter_mut().zip(take(r)) {
                        *s += v;
                    }
                }
                let n = (rows - from) as f32;
                let div = if self.pooling == Pooling::Mean {
                    n
                } else {
                    n.sqrt()
                };
                s.iter().map(|v| v / div).collect()
            }
        };
        for d in &self.dense {
            v = d.apply(&v);
        }
        if self.normalize {
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            v.iter_mut().for_each(|x| *x /= norm);
        }
        v
    }

    /// The rows of a sequence of `len` tokens the pooling reads.
    pub fn rows(&self, len: usize) -> std::ops::Range<usize> {
        match self.pooling {
            Pooling::Cls => 0..len.min(1),
            Pooling::LastToken => len.saturating_sub(1)..len,
            _ => 0..len,
        }
    }
}

/// A `Dense` module's directory: `config.json` and `model.safetensors`
/// (`linear.weight`, `linear.bias`).
fn dense(dir: &Path, in_width: usize) -> Result<DenseLayer> {
    let path = dir.join("config.json");
    let c = read_json(&path)?.ok_or_else(|| bad(&path, "missing"))?;
    let dim = |k: &str| {
        c.get(k)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| bad(&path, format!("no {k}")))
    };
    let (in_features, out_features) = (dim("in_features")?, dim("out_features")?);
    if in_features != in_width {
        return Err(bad(
            &path,
            format!("in_features {in_features}, but the vectors it gets are {in_width} long"),
        ));
    }
    let act = c
        .get("activation_function")
        .and_then(Value::as_str)
        .unwrap_or("torch.nn.modules.linear.Identity");
    let tanh = match act.rsplit('.').next().unwrap_or("") {
        "Identity" => false,
        "Tanh" => true,
        other => {
            return Err(bad(
                &path,
                format!("the activation {other:?} is not one Kiln runs"),
            ))
        }
    };
    let weights_path = dir.join("model.safetensors");
    let bytes = std::fs::read(&weights_path).map_err(|e| bad(&weights_path, e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(&weights_path, e.to_string()))?;
    let f32s = |name: &str, shape: &[usize]| -> Result<Option<Vec<f32>>> {
        let Ok(t) = st.tensor(name) else {
            return Ok(None);
        };
        if t.shape() != shape || t.dtype() != safetensors::Dtype::F32 {
            return Err(bad(
                &weights_path,
                format!(
                    "{name}: {:?} {:?}, want F32 {shape:?}",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        Ok(Some(
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    };
    let weight = f32s("linear.weight", &[out_features, in_features])?
        .ok_or_else(|| bad(&weights_path, "no linear.weight"))?;
    let bias = f32s("linear.bias", &[out_features])?;
    Ok(DenseLayer {
        in_features,
        out_features,
        weight,
        bias,
        tanh,
    })
}

/// One input to embed: its token ids and how many of them are the
/// prompt's (special tokens at the front included).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EmbedInput {
    pub ids: Vec<u32>,
    pub prompt_tokens: usize,
}

/// A loaded model with its embedding head.
pub struct Embedder<'a> {
    pub model: &'a LoadedModel,
    pub head: EmbeddingHead,
}

impl<'a> Embedder<'a> {
    pub fn new(model: &'a LoadedModel) -> Result<Self> {
        Ok(Embedder {
            head: EmbeddingHead::of(model)?,
            model,
        })
    }

    /// An embedder with a head already read.
    pub fn with_head(model: &'a LoadedModel, head: EmbeddingHead) -> Self {
        Embedder { model, head }
    }

    /// The special tokens the tokenizer puts before and after a text.
    fn specials(&self) -> Result<(Vec<u32>, Vec<u32>)> {
        let tok = &self.model.tokenizer;
        let with = tok.encode("a", true)?;
        let without = tok.encode("a", false)?;
        let at = with
            .windows(without.len().max(1))
            .position(|w| w == without.as_slice())
            .unwrap_or(with.len());
        Ok((
            with[..at].to_vec(),
            with[(at + without.len()).min(with.len())..].to_vec(),
        ))
    }

    /// `prompt_name`'s prompt (the default prompt where none is named) and
    /// `text`, tokenized as sentence-transformers does. Past the model's
    /// limit the text is cut when `truncate`, else it is an error naming
    /// the limit.
    pub fn tokenize(
        &self,
        text: &str,
        prompt_name: Option<&str>,
        truncate: bool,
    ) -> Result<EmbedInput> {
        let name = prompt_name.or(self.head.default_prompt_name.as_deref());
        let prompt = match name {
            None => "",
            Some(n) => self
                .head
                .prompts
                .get(n)
                .map(String::as_str)
                .ok_or_else(|| {
                    EngineError::InvalidRequest(format!(
                        "the model has no prompt named {n:?} (it has: {})",
                        self.head
                            .prompts
                            .keys()
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?,
        };
        let (pre, post) = self.specials()?;
        let tok = &self.model.tokenizer;
        let mut body = tok.encode(&format!("{prompt}{text}"), false)?;
        self.finish(&mut body, &pre, &post, truncate)?;
        let prompt_tokens = if prompt.is_empty() {
            0
        } else {
            pre.len() + tok.encode(prompt, false)?.len()
        };
        let mut ids = pre;
        ids.extend(body);
        ids.extend(post);
        Ok(EmbedInput { ids, prompt_tokens })
    }

    /// Token ids as given: checked against the vocabulary and the limit
    /// (cut when `truncate`); the tokenizer's special tokens are not added.
    pub fn input_ids(&self, ids: &[u32], truncate: bool) -> Result<EmbedInput> {
        let vocab = self.model.model.config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let mut ids = ids.to_vec();
        self.finish(&mut ids, &[], &[], truncate)?;
        Ok(EmbedInput {
            ids,
            prompt_tokens: 0,
        })
    }

    fn finish(&self, body: &mut Vec<u32>, pre: &[u32], post: &[u32], truncate: bool) -> Result<()> {
        let limit = self.head.max_seq_length;
        let room = limit.saturating_sub(pre.len() + post.len());
        if body.len() > room {
            if !truncate {
                return Err(EngineError::InvalidRequest(format!(
                    "the input is {} tokens, more than the model's limit of {limit}",
                    body.len() + pre.len() + post.len()
                )));
            }
            body.truncate(room);
        }
        if body.len() + pre.len() + post.len() == 0 {
            return Err(EngineError::InvalidRequest("an input has no tokens".into()));
        }
        Ok(())
    }

    /// The embeddings of `inputs`, all in one step: each sequence whole,
    /// attending only to itself, its keys and values in a cache of the
    /// step's own.
    pub fn embed(&self, inputs: &[EmbedInput]) -> Result<Vec<Vec<f32>>> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let n = blocks_needed(self.model, inputs, kiln_scheduler::DEFAULT_BLOCK_SIZE);
        let mut cache = self
            .model
            .model
            .new_kv_cache(n, kiln_scheduler::DEFAULT_BLOCK_SIZE)?;
        let blocks: Vec<u32> = (0..n as u32).collect();
        embed_in(self.model, &self.head, inputs, &mut cache, &blocks)
    }
}

/// KV blocks of `block_size` tokens the step of [`embed_in`] needs for
/// `inputs`: every sequence's tokens in every layer group.
pub fn blocks_needed(model: &LoadedModel, inputs: &[EmbedInput], block_size: usize) -> usize {
    let (spec, _) = model.model.config().kv_layout(block_size);
    let groups = spec.groups.len().max(1);
    inputs
        .iter()
        .map(|i| groups * i.ids.len().div_ceil(block_size))
        .sum()
}

/// The embeddings of `inputs` in one step over `cache`, whose blocks
/// `blocks` ([`blocks_needed`] of them, in order: sequence by sequence,
/// group by group) the step may write.
pub fn embed_in(
    model: &LoadedModel,
    head: &EmbeddingHead,
    inputs: &[EmbedInput],
    cache: &mut kiln_tensor::KvCache,
    blocks: &[u32],
) -> Result<Vec<Vec<f32>>> {
    let m = &model.model;
    let cfg = m.config();
    let block_size = cache.spec.block_size;
    if blocks.len() != blocks_needed(model, inputs, block_size) {
        return Err(EngineError::Failed(format!(
            "{} blocks for an embedding step that needs {}; this is a bug",
            blocks.len(),
            blocks_needed(model, inputs, block_size)
        )));
    }
    let (spec, _) = cfg.kv_layout(block_size);
    let groups = spec.groups.len().max(1);
    let mut batch = ForwardBatch {
        block_size,
        ..ForwardBatch::default()
    };
    let mut next = blocks.iter().copied();
    let mut spans = Vec::with_capacity(inputs.len());
    for input in inputs {
        let per = input.ids.len().div_ceil(block_size);
        let tables = (0..groups)
            .map(|_| next.by_ref().take(per).collect())
            .collect();
        let start = batch.token_ids.len();
        batch.push_seq_groups(&input.ids, 0, tables, false);
        let rows = head.rows(input.ids.len());
        let first = batch.logits_rows.len();
        batch
            .logits_rows
            .extend(rows.clone().map(|r| (start + r) as u32));
        spans.push((first, rows.len()));
    }
    let hidden = m.hidden_states(&batch, cache)?;
    let hidden = m.backend().to_host(&hidden)?;
    let h = cfg.hidden_size;
    Ok(inputs
        .iter()
        .zip(spans)
        .map(|(input, (first, n))| {
            let skip = match head.pooling {
                Pooling::Mean | Pooling::Max | Pooling::MeanSqrtLen if !head.include_prompt => {
                    input.prompt_tokens
                }
                _ => 0,
            };
            head.apply(&hidden[first * h..(first + n) * h], h, skip)
        })
        .collect())
}
