//! `POST /v1/completions`: the request, the response and the stream chunks
//! (which have the response's shape).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{CompletionLogprobs, StreamOptions, UsageOut};

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, a list of token ids, or a one-element list of either.
    pub prompt: Value,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub echo: Option<bool>,
    /// How many top alternatives to return with each token (0 returns only
    /// the sampled token's logprob).
    pub logprobs: Option<i64>,
    pub n: Option<i64>,
    pub max_tokens: Option<i64>,
    /// llama.cpp's token limit (negative: no limit).
    pub n_predict: Option<i64>,
    /// Text Generation Inference's token limit.
    pub max_new_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Also under llama.cpp's and Ollama's name, `repeat_penalty`.
    #[serde(alias = "repeat_penalty")]
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    /// Accepted and not used.
    #[allow(dead_code)]
    pub user: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A response, and (with `usage` absent) each streamed chunk.
#[derive(Debug, Serialize)]
pub struct Completion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}
