//! The Anthropic Messages wire format: the request of `POST /v1/messages`
//! (and of `/v1/messages/count_tokens`), the response, and the stream
//! events. Like the OpenAI types, request structs keep the fields they do
//! not name in `extra`, so unknown parameters are refused by name.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    /// Required by `/v1/messages`; not by `count_tokens`.
    pub max_tokens: Option<i64>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub messages: Vec<MessageIn>,
    pub tools: Option<Vec<ToolIn>>,
    pub tool_choice: Option<ToolChoiceIn>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    /// Accepted and not used.
    #[allow(dead_code)]
    pub metadata: Option<Value>,
    pub stream: Option<bool>,
    /// `{"type": "enabled", "budget_tokens": n}` or `{"type": "disabled"}`:
    /// the template's thinking switch.
    pub thinking: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
}

#[derive(Debug, Deserialize)]
pub struct MessageIn {
    pub role: Role,
    /// A string or a list of content blocks.
    pub content: Value,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct ToolIn {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Value,
    /// Calls hold to `input_schema` (strict tool use).
    pub strict: Option<bool>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct ToolChoiceIn {
    /// `auto`, `none`, `any` or `tool`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The tool `tool` forces.
    pub name: Option<String>,
    /// Accepted; only one tool call is rendered per block anyway.
    #[allow(dead_code)]
    pub disable_parallel_tool_use: Option<bool>,
}

/// A response, and the `message` of `message_start`.
#[derive(Debug, Serialize)]
pub struct MessageOut<'a> {
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: &'a str,
    pub content: Vec<ContentBlockOut>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: UsageOut,
}

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlockOut {
    Text {
        text: String,
    },
    /// The model's reasoning (Kiln signs nothing: `signature` is empty).
    Thinking {
        thinking: String,
        signature: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct UsageOut {
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub cache_read_input_tokens: usize,
    pub cache_creation_input_tokens: usize,
}

/// The `delta` of `content_block_delta`.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    TextDelta { text: String },
    ThinkingDelta { thinking: String },
    InputJsonDelta { partial_json: String },
}

/// `count_tokens`'s answer.
#[derive(Debug, Serialize)]
pub struct CountTokensOut {
    pub input_tokens: usize,
}
