//! A [`Tokenizer`] as GGUF `tokenizer.ggml.*` metadata, the inverse of
//! `gguf_tokenizer.rs`: what llama.cpp's converter writes for the same
//! vocabulary, so llama.cpp and Kiln read the written file back as the same
//! tokenizer.
//!
//! Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) are written as
//! `gpt2`: every token by id (ids the vocabulary lacks below `vocab_size`
//! become `[PAD<id>]`, type UNUSED, as llama.cpp pads), special added tokens
//! CONTROL, other added tokens USER_DEFINED, the merges, and the
//! `tokenizer.ggml.pre` whose split is the tokenizer's own (the split is
//! compared with the one each known `pre` name reads back as; a split no
//! name gives is refused, since a reader would tokenize differently). A
//! Unicode NFC normalizer (Qwen's) is dropped, as llama.cpp's converter
//! does: text already in NFC, which is nearly all text, tokenizes the same.
//! SentencePiece vocabularies (Llama 2, Gemma) are not written yet.

use kiln_formats::MetaValue;
use serde_json::Value;

use crate::error::{Result, TextError};
use crate::gguf_tokenizer::byte_level_pre_tokenizer;
use crate::tokenizer::Tokenizer;

const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_UNUSED: i32 = 5;

/// The `tokenizer.ggml.pre` names tried, in order, for a byte-level split.
const PRE_NAMES: &[&str] = &[
    "smollm",
    "qwen2",
    "llama-bpe",
    "tekken",
    "gpt-4o",
    "qwen35",
    "gpt-2",
];

fn unsupported(what: impl Into<String>) -> TextError {
    TextError::GgufWrite(what.into())
}

/// What decides how a pre-tokenizer splits: its kind, pattern and flags,
/// without the offsets bookkeeping (`trim_offsets`), which never changes ids.
fn split_signature(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| k.as_str() != "trim_offsets")
                .map(|(k, v)| (k.clone(), split_signature(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(split_signature).collect()),
        other => other.clone(),
    }
}

/// The `pre` name whose split is `pre_tokenizer`'s.
fn pre_name(pre_tokenizer: &Value) -> Result<&'static str> {
    let want = split_signature(pre_tokenizer);
    for name in PRE_NAMES {
        let candidate = byte_level_pre_tokenizer(name)
            .map_err(|e| unsupported(format!("building the {name} split: {e}")))?;
        let got = serde_json::to_value(&candidate)
            .map_err(|e| unsupported(format!("serializing the {name} split: {e}")))?;
        if split_signature(&got) == want {
            return Ok(name);
        }
    }
    Err(unsupported(format!(
        "the tokenizer's pre-tokenizer {pre_tokenizer} is none that GGUF names \
         (known: {}); a GGUF reader would split text differently",
        PRE_NAMES.join(", ")
    )))
}

fn string(s: impl Into<String>) -> MetaValue {
    MetaValue::String(s.into())
}

impl Tokenizer {
    /// This tokenizer as GGUF metadata for a model whose embedding has
    /// `vocab_size` rows (see the module documentation for what is written
    /// and what is refused).
    pub fn gguf_metadata(&self, vocab_size: usize) -> Result<Vec<(String, MetaValue)>> {
        let json = serde_json::to_value(self.inner())
            .map_err(|e| unsupported(format!("serializing the tokenizer: {e}")))?;
        let model = &json["model"];
        if model["type"] != "BPE" || model["byte_fallback"] == true {
            return Err(unsupported(format!(
                "only byte-level BPE tokenizers are written to GGUF (this one is {} {}), \
                 not SentencePiece-style vocabularies yet",
                model["type"],
                if model["byte_fallback"] == true {
                    "with byte fallback"
                } else {
                    ""
                }
            )));
        }
        match &json["normalizer"] {
            Value::Null => {}
            n if n["type"] == "NFC" => {}
            n => {
                return Err(unsupported(format!(
                    "the tokenizer's normalizer {n} has no GGUF form"
                )))
            }
        }
        let pre = pre_name(&json["pre_tokenizer"])?;

        let n = vocab_size.max(self.vocab_size());
        let mut tokens: Vec<Option<String>> = vec![None; n];
        let mut types = vec![TOKEN_TYPE_NORMAL; n];
        let vocab = model["vocab"]
            .as_object()
            .ok_or_else(|| unsupported("the BPE model has no vocabulary"))?;
        for (token, id) in vocab {
            let id = id.as_u64().unwrap_or(u64::MAX) as usize;
            if id >= n {
                return Err(unsupported(format!("token {token:?} has id {id} ≥ {n}")));
            }
            // A `[PAD<id>]` filler read from a GGUF stays a filler.
            if *token == format!("[PAD{id}]") {
                types[id] = TOKEN_TYPE_UNUSED;
            }
            tokens[id] = Some(token.clone());
        }
        for (id, added) in self.inner().get_added_tokens_decoder() {
            let id = id as usize;
            if id >= n {
                return Err(unsupported(format!(
                    "added token {:?} has id {id} ≥ {n}",
                    added.content
                )));
            }
            tokens[id] = Some(added.content.clone());
            types[id] = if added.special {
                TOKEN_TYPE_CONTROL
            } else {
                TOKEN_TYPE_USER_DEFINED
            };
        }
        let tokens: Vec<MetaValue> = tokens
            .into_iter()
            .enumerate()
            .map(|(id, t)| {
                string(t.unwrap_or_else(|| {
                    types[id] = TOKEN_TYPE_UNUSED;
                    format!("[PAD{id}]")
                }))
            })
            .collect();
        let merges = model["merges"]
            .as_array()
            .ok_or_else(|| unsupported("the BPE model has no merges"))?
            .iter()
            .map(|m| match m {
                Value::String(s) => Ok(string(s.clone())),
                Value::Array(p) if p.len() == 2 => Ok(string(format!(
                    "{} {}",
                    p[0].as_str().unwrap_or_default(),
                    p[1].as_str().unwrap_or_default()
                ))),
                other => Err(unsupported(format!("merge {other} is not a pair"))),
            })
            .collect::<Result<Vec<_>>>()?;

        let mut out = vec![
            ("tokenizer.ggml.model".to_string(), string("gpt2")),
            ("tokenizer.ggml.pre".to_string(), string(pre)),
            (
                "tokenizer.ggml.tokens".to_string(),
                MetaValue::Array(tokens),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
            ),
            (
                "tokenizer.ggml.merges".to_string(),
                MetaValue::Array(merges),
            ),
        ];
        for (key, id) in [
            ("bos_token_id", self.bos_id()),
            ("eos_token_id", self.eos_id()),
            ("unknown_token_id", self.unk_id()),
            ("padding_token_id", self.pad_id()),
        ] {
            if let Some(id) = id {
                out.push((format!("tokenizer.ggml.{key}"), MetaValue::U32(id)));
            }
        }
        out.push((
            "tokenizer.ggml.add_bos_token".to_string(),
            MetaValue::Bool(self.add_bos()),
        ));
        out.push((
            "tokenizer.ggml.add_eos_token".to_string(),
            MetaValue::Bool(false),
        ));
        let templates = self.chat_templates();
        if let Some(t) = &templates.default {
            out.push(("tokenizer.chat_template".to_string(), string(t.clone())));
        }
        if !templates.named.is_empty() {
            let names = templates
                .named
                .iter()
                .map(|(n, _)| string(n.clone()))
                .collect();
            out.push((
                "tokenizer.chat_templates".to_string(),
                MetaValue::Array(names),
            ));
            for (name, t) in &templates.named {
                out.push((format!("tokenizer.chat_template.{name}"), string(t.clone())));
            }
        }
        Ok(out)
    }
}
