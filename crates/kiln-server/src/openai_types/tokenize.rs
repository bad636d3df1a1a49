//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::chat::{ChatMessageIn, ToolIn};

/// Either `prompt` or `messages`.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    /// For `prompt`: run the tokenizer's post-processor (BOS). Default true.
    pub add_special_tokens: Option<bool>,
    /// For `messages`: end with the assistant header. Default true.
    pub add_generation_prompt: Option<bool>,
    pub tools: Option<Vec<ToolIn>>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: usize,
    pub max_model_len: usize,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}
