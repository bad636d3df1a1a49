//! Chat sessions: a conversation kept on the caller's side and continued
//! turn by turn (a user message, or a tool result). Every turn renders the
//! whole conversation and submits it; the engine's prefix cache finds the
//! earlier turns' KV blocks, so only the new turn's tokens are prefilled —
//! and any client that resends a whole conversation gets the same reuse.

use kiln_sampling::{FinishReason, SamplingParams};
use serde_json::{json, Value};

use crate::engine::{EngineHandle, RequestStream};
use crate::error::{EngineError, Result};
use crate::events::{Event, RequestTimings, Usage};
use crate::generate::GenerationRequest;

/// Put in front of a tool result's content, inside the rendered tool turn,
/// when the tool reported an error (`is_error`), so the model can tell a
/// failed call from a successful one whatever its template.
pub const TOOL_ERROR_MARKER: &str = "[tool error] ";

/// The result of one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTurn {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    /// `usage.cached_tokens` is how much of the conversation came from the cache.
    pub usage: Usage,
    pub timings: RequestTimings,
}

/// A conversation with a model served by an engine.
pub struct ChatSession {
    engine: EngineHandle,
    messages: Vec<Value>,
    tools: Option<Value>,
    params: SamplingParams,
}

impl ChatSession {
    /// A session over `messages` (system and earlier turns), not yet run.
    pub fn new(engine: EngineHandle, messages: Vec<Value>, params: SamplingParams) -> Self {
        ChatSession {
            engine,
            messages,
            tools: None,
            params,
        }
    }

    /// Tool definitions rendered into every turn.
    pub fn with_tools(mut self, tools: Value) -> Self {
        self.tools = Some(tools);
        self
    }

    /// The conversation so far, assistant turns included.
    pub fn messages(&self) -> &[Value] {
        &self.messages
    }

    /// Generate the assistant's reply to the conversation as it stands (the
    /// first turn of a session started with a user message).
    pub fn start(&mut self) -> Result<ChatTurn> {
        let stream = self.submit()?;
        self.finish_turn(stream, &mut |_| {})
    }

    /// [`ChatSession::start`], calling `on_text` with each piece of text.
    pub fn start_streaming(&mut self, on_text: &mut dyn FnMut(&str)) -> Result<ChatTurn> {
        let stream = self.submit()?;
        self.finish_turn(stream, on_text)
    }

    /// Add a user message and generate the reply.
    pub fn continue_user(&mut self, content: &str) -> Result<ChatTurn> {
        self.messages
            .push(json!({"role": "user", "content": content}));
        self.start()
    }

    /// Add a tool result and generate the reply; `is_error` marks the result
    /// as a failure inside the rendered tool turn.
    pub fn continue_tool(
        &mut self,
        tool_call_id: &str,
        content: &str,
        is_error: bool,
    ) -> Result<ChatTurn> {
        self.messages
            .push(tool_message(tool_call_id, content, is_error));
        self.start()
    }

    /// Streaming variants call `on_text` with each piece of text as it comes.
    pub fn continue_user_streaming(
        &mut self,
        content: &str,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<ChatTurn> {
        self.messages
            .push(json!({"role": "user", "content": content}));
        let stream = self.submit()?;
        self.finish_turn(stream, on_text)
    }

    pub fn continue_tool_streaming(
        &mut self,
        tool_call_id: &str,
        content: &str,
        is_error: bool,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<ChatTurn> {
        self.messages
            .push(tool_message(tool_call_id, content, is_error));
        let stream = self.submit()?;
        self.finish_turn(stream, on_text)
    }

    /// The prompt token ids of the conversation as it stands.
    pub fn prompt_ids(&self) -> Result<Vec<u32>> {
        let model = self.engine.model();
        let mut ctx = model
            .tokenizer
            .chat_context(Value::Array(self.messages.clone()));
        ctx.tools = self.tools.clone();
        ctx.add_generation_prompt = true;
        let rendered = model.render_chat_with(&ctx)?;
        Ok(model.tokenizer.encode(&rendered, false)?)
    }

    fn submit(&self) -> Result<RequestStream> {
        let req = GenerationRequest::new(self.prompt_ids()?, self.params.clone());
        self.engine.submit(req)
    }

    fn finish_turn(
        &mut self,
        stream: RequestStream,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<ChatTurn> {
        let mut text = String::new();
        let mut token_ids = Vec::new();
        for event in stream {
            match event {
                Event::Token {
                    token_id, text: t, ..
                } => {
                    if token_id != u32::MAX {
                        token_ids.push(token_id);
                    }
                    on_text(&t);
                    text.push_str(&t);
                }
                Event::Progress => {}
                Event::Finished {
                    finish_reason,
                    usage,
                    timings,
                } => {
                    self.messages
                        .push(json!({"role": "assistant", "content": text}));
                    return Ok(ChatTurn {
                        text,
                        token_ids,
                        finish_reason,
                        usage,
                        timings,
                    });
                }
                Event::Failed { message, .. } => return Err(EngineError::Failed(message)),
            }
        }
        Err(EngineError::EngineStopped)
    }
}

fn tool_message(tool_call_id: &str, content: &str, is_error: bool) -> Value {
    let content = if is_error {
        format!("{TOOL_ERROR_MARKER}{content}")
    } else {
        content.to_string()
    };
    json!({"role": "tool", "tool_call_id": tool_call_id, "content": content})
}
