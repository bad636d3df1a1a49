//! The OpenAI wire format: request bodies as they arrive and response bodies
//! as they leave. Only this crate derives `Serialize`/`Deserialize` for API
//! types; handlers turn requests into validated engine types at once.
//!
//! Every request struct keeps the fields it does not name in `extra`, so
//! that an unknown or unsupported parameter is refused by name
//! ([`crate::json_body::reject_unknown`]) instead of silently ignored.

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod responses;
pub mod tokenize;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use kiln_engine::Usage;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `usage` in responses.
#[derive(Debug, Clone, Serialize)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    /// Present when drafts were verified (a `prediction`, or the server's
    /// speculative decoding): how many were accepted and rejected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionTokensDetails {
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

impl From<&Usage> for UsageOut {
    fn from(u: &Usage) -> Self {
        UsageOut {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
            completion_tokens_details: (u.draft_tokens > 0).then(|| CompletionTokensDetails {
                accepted_prediction_tokens: u.accepted_draft_tokens,
                rejected_prediction_tokens: u.draft_tokens - u.accepted_draft_tokens,
            }),
        }
    }
}

/// The text of OpenAI's `prediction` (Predicted Outputs): `{"type":
/// "content", "content": ...}` with a string or a list of text parts.
pub fn prediction_text(v: &Value) -> Result<String, crate::errors::ApiError> {
    let bad = |why: &str| crate::errors::ApiError::invalid("prediction", why.to_string());
    let o = v
        .as_object()
        .ok_or_else(|| bad("`prediction` must be an object"))?;
    if o.get("type").and_then(Value::as_str) != Some("content") {
        return Err(bad("`prediction.type` must be \"content\""));
    }
    if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "type" | "content")) {
        return Err(crate::errors::ApiError::invalid(
            &format!("prediction.{k}"),
            format!("unknown field `prediction.{k}`"),
        ));
    }
    match o.get("content") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    _ => Err(bad(
                        "`prediction.content` parts must be {\"type\": \"text\", \"text\": ...}",
                    )),
                },
            )
            .collect::<Result<Vec<&str>, _>>()
            .map(|t| t.concat()),
        _ => Err(bad(
            "`prediction.content` must be a string or a list of text parts",
        )),
    }
}

/// Chat `logprobs`: one entry per generated token.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// Legacy completions `logprobs`: parallel lists.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The context length served (a vLLM extension clients use).
    pub max_model_len: usize,
    /// What requests get for the sampling fields they leave out (Kiln's).
    pub sampling_defaults: SamplingDefaultsOut,
    /// For a LoRA adapter: the model it adapts (vLLM's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// For a LoRA adapter: its directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
}

/// The server's sampling defaults as `/v1/models` and `/stats` show them.
#[derive(Debug, Serialize)]
pub struct SamplingDefaultsOut {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub max_tokens: Option<usize>,
    /// `model` (its generation config) or `llama.cpp`.
    pub source: &'static str,
    /// Fields set by `kiln serve` flags.
    pub set_by_flags: Vec<&'static str>,
    /// The repetition guard: `[longest n-gram, copies]`, or null when off.
    pub repetition_guard: Option<[usize; 2]>,
}

impl From<&kiln_sampling::SamplingDefaults> for SamplingDefaultsOut {
    fn from(d: &kiln_sampling::SamplingDefaults) -> Self {
        SamplingDefaultsOut {
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            min_p: d.min_p,
            repetition_penalty: d.repetition_penalty,
            max_tokens: d.max_tokens,
            source: match d.source {
                kiln_sampling::DefaultsSource::Model => "model",
                kiln_sampling::DefaultsSource::LlamaCpp => "llama.cpp",
            },
            set_by_flags: d.overridden.clone(),
            repetition_guard: d.loop_guard.map(|g| [g.ngram_len, g.num_repeats]),
        }
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh id such as `chatcmpl-5f0c...` (for `prefix` `chatcmpl-`): a
/// per-process random key hashed with a counter.
pub fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let a = h.finish();
    h.write_u64(a);
    format!("{prefix}{a:016x}{:08x}", h.finish() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_distinct() {
        let a = new_id("chatcmpl-");
        let b = new_id("chatcmpl-");
        assert_ne!(a, b);
        assert!(a.starts_with("chatcmpl-") && a.len() == "chatcmpl-".len() + 24);
    }
}
