//! `POST /v1/responses`: the request, its input items and tools, the
//! response object, and the stream events. Kiln is stateless, so the
//! response echoes `store: false` and never a `previous_response_id`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string (one user message) or a list of input items.
    pub input: Option<Value>,
    /// A system message put before the input.
    pub instructions: Option<String>,
    pub tools: Option<Vec<ToolIn>>,
    /// `"auto"` or `"none"`; other choices are refused for now.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    /// Only `false` (nothing is stored).
    pub store: Option<bool>,
    /// Refused: there are no stored responses to continue from.
    pub previous_response_id: Option<Value>,
    /// Refused: there are no stored conversations.
    pub conversation: Option<Value>,
    /// Echoed in the response.
    pub metadata: Option<Map<String, Value>>,
    /// Echoed in the response.
    pub user: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One item of `input`: a message (with or without `"type": "message"`), a
/// `function_call` the model made earlier, or a `function_call_output`.
/// Which fields apply depends on the kind; the rest must be absent.
#[derive(Debug, Deserialize)]
pub struct InputItem {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub role: Option<String>,
    /// A string or a list of `input_text` / `output_text` parts.
    pub content: Option<Value>,
    pub call_id: Option<String>,
    pub name: Option<String>,
    /// JSON text, as the model produced it.
    pub arguments: Option<Value>,
    /// A string or a list of `input_text` parts.
    pub output: Option<Value>,
    /// Echoed back from earlier output items; not used.
    #[allow(dead_code)]
    pub id: Option<String>,
    /// Echoed back from earlier output items; not used.
    #[allow(dead_code)]
    pub status: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A tool definition. Only `function` tools are served; a definition is
/// echoed in the response as it was given.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct ToolIn {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
    #[serde(flatten, skip_serializing)]
    pub extra: Map<String, Value>,
}

/// The response object, returned whole or carried by the stream's
/// lifecycle events.
#[derive(Debug, Serialize)]
pub struct ResponseObject<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: &'static str,
    pub error: Option<ResponseError>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<&'a str>,
    pub max_output_tokens: Option<i64>,
    pub model: &'a str,
    pub output: &'a [OutputItem],
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<&'a str>,
    pub store: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub tool_choice: &'static str,
    pub tools: &'a [ToolIn],
    pub metadata: &'a Map<String, Value>,
    pub user: Option<&'a str>,
    pub text: TextConfig,
    pub truncation: &'static str,
    pub usage: Option<ResponseUsage>,
}

#[derive(Debug, Serialize)]
pub struct ResponseError {
    pub code: &'static str,
    pub message: String,
}

#[derive(Debug, Serialize)]
pub struct IncompleteDetails {
    pub reason: &'static str,
}

/// `{"format": {"type": "text"}}`: output is plain text.
#[derive(Debug, Serialize)]
pub struct TextConfig {
    pub format: TextFormat,
}

#[derive(Debug, Serialize)]
pub struct TextFormat {
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// One output item.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Message {
        id: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: &'static str,
        role: &'static str,
        content: Vec<OutputText>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        /// JSON text.
        arguments: String,
        status: &'static str,
    },
}

/// An `output_text` content part.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputText {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
    pub annotations: Vec<Value>,
    pub logprobs: Vec<Value>,
}

impl OutputText {
    pub fn new(text: String) -> Self {
        OutputText {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: usize,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct InputTokensDetails {
    /// Input tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct OutputTokensDetails {
    /// Always 0: Kiln does not separate reasoning from the answer.
    pub reasoning_tokens: usize,
}

impl From<&kiln_engine::Usage> for ResponseUsage {
    fn from(u: &kiln_engine::Usage) -> Self {
        ResponseUsage {
            input_tokens: u.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: u.cached_tokens,
            },
            output_tokens: u.completion_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
            },
            total_tokens: u.prompt_tokens + u.completion_tokens,
        }
    }
}

/// One stream event: its body, tagged with its `type`, and its place in the
/// stream.
#[derive(Debug, Serialize)]
pub struct StreamEvent<'a> {
    #[serde(flatten)]
    pub body: EventBody<'a>,
    pub sequence_number: u64,
}

#[derive(Debug, Serialize)]
#[serde(tag = "type")]
pub enum EventBody<'a> {
    #[serde(rename = "response.created")]
    Created { response: ResponseObject<'a> },
    #[serde(rename = "response.in_progress")]
    InProgress { response: ResponseObject<'a> },
    #[serde(rename = "response.completed")]
    Completed { response: ResponseObject<'a> },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: ResponseObject<'a> },
    #[serde(rename = "response.failed")]
    Failed { response: ResponseObject<'a> },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        output_index: usize,
        item: &'a OutputItem,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        output_index: usize,
        item: &'a OutputItem,
    },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        delta: &'a str,
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        text: &'a str,
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: &'a str,
        output_index: usize,
        delta: &'a str,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: &'a str,
        output_index: usize,
        name: &'a str,
        arguments: &'a str,
    },
}

impl EventBody<'_> {
    /// The event's `type`, also its SSE `event:` name.
    pub fn name(&self) -> &'static str {
        match self {
            EventBody::Created { .. } => "response.created",
            EventBody::InProgress { .. } => "response.in_progress",
            EventBody::Completed { .. } => "response.completed",
            EventBody::Incomplete { .. } => "response.incomplete",
            EventBody::Failed { .. } => "response.failed",
            EventBody::OutputItemAdded { .. } => "response.output_item.added",
            EventBody::OutputItemDone { .. } => "response.output_item.done",
            EventBody::ContentPartAdded { .. } => "response.content_part.added",
            EventBody::ContentPartDone { .. } => "response.content_part.done",
            EventBody::OutputTextDelta { .. } => "response.output_text.delta",
            EventBody::OutputTextDone { .. } => "response.output_text.done",
            EventBody::FunctionCallArgumentsDelta { .. } => {
                "response.function_call_arguments.delta"
            }
            EventBody::FunctionCallArgumentsDone { .. } => "response.function_call_arguments.done",
        }
    }
}
