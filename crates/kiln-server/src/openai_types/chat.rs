//! `POST /v1/chat/completions`: the request, the response and the stream
//! chunks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{ChatLogprobs, StreamOptions, UsageOut};

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub tools: Option<Vec<ToolIn>>,
    /// `"auto"` or `"none"`; other choices are refused for now.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub max_tokens: Option<i64>,
    /// llama.cpp's token limit (negative: no limit).
    pub n_predict: Option<i64>,
    /// Text Generation Inference's token limit.
    pub max_new_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
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
    /// A string or a list of strings.
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Accepted and not used.
    #[allow(dead_code)]
    pub user: Option<String>,
    /// Accepted and not used.
    #[allow(dead_code)]
    pub metadata: Option<Value>,
    /// Only `false` (nothing is stored).
    pub store: Option<bool>,
    /// Variables for the chat template (`enable_thinking`, ...).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Passed to the template; `none` also turns thinking off.
    pub reasoning_effort: Option<String>,
    /// Predicted Outputs: `{"type": "content", "content": ...}`, the
    /// answer the client expects (verified as draft tokens).
    pub prediction: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: Role,
    /// A string, a list of content parts, or null.
    #[serde(default)]
    pub content: Option<Value>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ToolCallIn>>,
    pub tool_call_id: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct ToolCallIn {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
pub struct FunctionCallIn {
    pub name: String,
    /// JSON text as OpenAI sends it (an object is accepted too).
    pub arguments: Value,
}

/// A tool definition; passed to the chat template as given.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ToolIn {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDefIn,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct FunctionDefIn {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A non-streaming response.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageOut,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    pub content: Option<String>,
    /// The model's reasoning, split from the answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    pub arguments: String,
}

/// One streamed chunk (`chat.completion.chunk`).
#[derive(Debug, Serialize)]
pub struct ChatCompletionChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChunkChoice>,
    /// With `include_usage`: `null` on every chunk but the last, which has
    /// no choices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A streamed piece of a tool call: the first names it, the next carry
/// its arguments.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}
