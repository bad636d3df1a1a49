//! `POST /v1/messages` and `POST /v1/messages/count_tokens`, the Anthropic
//! Messages API over the same pieces as the OpenAI chat route: template
//! messages, sampling fields, the generation bridge, SSE framing, and
//! `<tool_call>` parsing (calls become `tool_use` blocks). Errors are
//! answered in Anthropic's shape.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled, SamplingParams};
use serde_json::{json, Value};

use crate::anthropic_messages::{template_anthropic_tools, template_conversation};
use crate::anthropic_types::{
    BlockDelta, ContentBlockOut, CountTokensOut, MessageOut, MessagesRequest, UsageOut,
};
use crate::errors::{AnthropicError, ApiError, ErrorShape};
use crate::generation::{self, ChatRender, EventReceiver, Generate};
use crate::json_body::{reject_unknown, ApiJson};
use crate::messages::{auto_call_format, forced_call_format, DeclaredTool, ToolChoice};
use crate::openai_types::new_id;
use crate::parse::{self, OutputParser, OutputSyntax, Piece, ToolCall};
use crate::sampling::SamplingFields;
use crate::sse::{self, event_frame, StreamFormat};
use crate::state::AppState;

/// What the template renders: the messages and the declared tools.
struct Conversation {
    messages: Value,
    /// Tools (their calls are parsed when declared) and the thinking switch.
    render: ChatRender,
    /// The call format `tool_choice` any/tool enforces, or the one strict
    /// tools set under `auto`.
    format: Option<kiln_structured::Format>,
    /// `tool_choice` any/tool: the whole answer is one call.
    forced_call: bool,
}

/// The parts of a request that make the prompt, checked; shared with
/// `count_tokens`.
fn conversation(state: &AppState, req: &MessagesRequest) -> Result<Conversation, ApiError> {
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
    state.check_generates()?;
    let choice = match req
        .tool_choice
        .as_ref()
        .map(|c| (c.kind.as_str(), c.name.as_ref()))
    {
        None | Some(("auto", _)) => ToolChoice::Auto,
        Some(("none", _)) => ToolChoice::None,
        Some(("any", _)) => ToolChoice::Required,
        Some(("tool", Some(name))) => ToolChoice::Named(name.clone()),
        Some(("tool", None)) => {
            return Err(ApiError::invalid(
                "tool_choice.name",
                "`tool_choice.name` is required with type `tool`",
            ))
        }
        Some((other, _)) => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                format!("`tool_choice.type` must be auto, none, any or tool, got `{other}`"),
            ))
        }
    };
    // `any` and `tool` are enforced: the output is a valid call by construction.
    let declared: Vec<(&str, Option<&Value>)> = req
        .tools
        .iter()
        .flatten()
        .map(|t| (t.name.as_str(), Some(&t.input_schema)))
        .collect();
    let format = forced_call_format(&declared, &choice)?;
    let forced_call = format.is_some();
    let format = match (&choice, &req.tools) {
        (ToolChoice::Auto, Some(tools)) if format.is_none() => {
            let strict: Vec<DeclaredTool> = tools
                .iter()
                .map(|t| DeclaredTool {
                    name: &t.name,
                    parameters: Some(&t.input_schema),
                    strict: t.strict == Some(true),
                })
                .collect();
            let parallel = !req
                .tool_choice
                .as_ref()
                .and_then(|c| c.disable_parallel_tool_use)
                .unwrap_or(false);
            auto_call_format(&state, &strict, parallel)
        }
        _ => format,
    };
    let tool_choice_none = choice == ToolChoice::None;
    let (tools, tool_names) = match &req.tools {
        Some(t) if !t.is_empty() && !tool_choice_none => (
            Some(template_anthropic_tools(t)?),
            t.iter().map(|t| t.name.clone()).collect(),
        ),
        _ => (None, Vec::new()),
    };
    let enable_thinking = match &req.thinking {
        None | Some(Value::Null) => None,
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled") => Some(true),
            Some("disabled") => Some(false),
            _ => {
                return Err(ApiError::invalid(
                    "thinking.type",
                    "`thinking.type` must be enabled or disabled",
                ))
            }
        },
    };
    Ok(Conversation {
        messages: template_conversation(req.system.as_ref(), &req.messages)?,
        render: ChatRender {
            tools,
            tool_names,
            enable_thinking,
            overrides: state.output,
            ..ChatRender::default()
        },
        format,
        forced_call,
    })
}

fn sampling(
    state: &AppState,
    req: MessagesRequest,
) -> Result<(SamplingParams, Vec<String>), ApiError> {
    let Some(max_tokens) = req.max_tokens else {
        return Err(ApiError::invalid("max_tokens", "`max_tokens` is required"));
    };
    let stop_sequences = req.stop_sequences.unwrap_or_default();
    let params = SamplingFields {
        max_tokens: Some((max_tokens, "max_tokens")),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: (!stop_sequences.is_empty()).then(|| json!(stop_sequences)),
        max_temperature: crate::sampling::ANTHROPIC_MAX_TEMPERATURE,
        ..SamplingFields::default()
    }
    .into_params(state.vocab_size(), &state.sampling_defaults)?;
    Ok((params, stop_sequences))
}

pub async fn handle(
    State(state): State<AppState>,
    req: Result<ApiJson<MessagesRequest>, ApiError>,
) -> Result<Response, AnthropicError> {
    let ApiJson(req) = req?;
    let conv = conversation(&state, &req)?;
    let adapter = state.resolve_adapter(req.model.as_deref()).await?;
    let stream = req.stream.unwrap_or(false);
    let (params, stop_sequences) = sampling(&state, req)?;
    let parses = !conv.render.tool_names.is_empty() || generation::thinks(&state);
    let forced_call = conv.forced_call;
    let generate = Generate {
        params,
        skip_special_tokens: !parses,
        format: conv.format,
        adapter,
        prediction: None,
    };
    let (messages, render) = (conv.messages, conv.render);
    let admitted = generation::start(&state, generate, move |model: &LoadedModel| {
        let prompt = generation::chat_prompt(model, messages, render)?;
        let extra = (prompt.tokens.len(), prompt.syntax.clone());
        Ok(prompt.prepared(extra))
    })
    .await?;
    let (prompt_tokens, mut syntax) = admitted.extra;
    syntax.forced_call = forced_call;
    let out = MessageOutput {
        id: new_id("msg_"),
        model_name: state.model_name.clone(),
        stop_sequences,
        forced_call,
    };
    if stream {
        let start = out.message(Vec::new(), None, None, usage_out(prompt_tokens, 0, 0));
        let first = vec![
            event_frame(
                "message_start",
                &json!({"type": "message_start", "message": start}),
            ),
            ping_frame(),
        ];
        let format = MessagesStream::new(out, &syntax);
        Ok(sse::response(
            admitted.events,
            format,
            first,
            state.sse_keepalive,
        ))
    } else {
        Ok(out.collect(admitted.events, &syntax).await?)
    }
}

pub async fn count_tokens(
    State(state): State<AppState>,
    req: Result<ApiJson<MessagesRequest>, ApiError>,
) -> Result<Json<CountTokensOut>, AnthropicError> {
    let ApiJson(req) = req?;
    let conv = conversation(&state, &req)?;
    let engine = state.engine.clone();
    let prompt = tokio::task::spawn_blocking(move || {
        generation::chat_prompt(engine.model(), conv.messages, conv.render)
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))??;
    Ok(Json(CountTokensOut {
        input_tokens: prompt.tokens.len(),
    }))
}

fn usage_out(input_tokens: usize, cached_tokens: usize, output_tokens: usize) -> UsageOut {
    UsageOut {
        input_tokens,
        output_tokens,
        cache_read_input_tokens: cached_tokens,
        cache_creation_input_tokens: 0,
    }
}

fn usage_from(u: &Usage) -> UsageOut {
    usage_out(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
}

/// A parsed call as a `tool_use` block; arguments that are not a JSON
/// object are passed as `{"arguments": text}`.
fn tool_use_block(call: ToolCall) -> ContentBlockOut {
    let input = match serde_json::from_str::<Value>(&call.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({"arguments": call.arguments}),
    };
    ContentBlockOut::ToolUse {
        id: new_id("toolu_"),
        name: call.name,
        input,
    }
}

/// What the response and every event of one request share.
struct MessageOutput {
    id: String,
    model_name: Arc<str>,
    /// The request's stop sequences, to name the one that matched.
    stop_sequences: Vec<String>,
    /// The answer is one forced call.
    forced_call: bool,
}

impl MessageOutput {
    fn message(
        &self,
        content: Vec<ContentBlockOut>,
        stop_reason: Option<&'static str>,
        stop_sequence: Option<String>,
        usage: UsageOut,
    ) -> MessageOut<'_> {
        MessageOut {
            id: &self.id,
            kind: "message",
            role: "assistant",
            model: &self.model_name,
            content,
            stop_reason,
            stop_sequence,
            usage,
        }
    }

    /// `stop_reason` and `stop_sequence` for how generation ended.
    fn stop(&self, reason: FinishReason, called_tools: bool) -> (&'static str, Option<String>) {
        match reason {
            // A forced call cut short is still a `tool_use` block, marked
            // by `max_tokens`.
            FinishReason::Length if self.forced_call => ("max_tokens", None),
            _ if called_tools => ("tool_use", None),
            FinishReason::Length => ("max_tokens", None),
            FinishReason::StopString(i) => ("stop_sequence", self.stop_sequences.get(i).cloned()),
            FinishReason::Stop | FinishReason::Repetition | FinishReason::Cancelled => {
                ("end_turn", None)
            }
        }
    }

    async fn collect(
        self,
        events: EventReceiver,
        syntax: &OutputSyntax,
    ) -> Result<Response, ApiError> {
        let collected = events.collect(|_, _| {}).await?;
        let (text, reason, usage) = (collected.text, collected.finish_reason, collected.usage);
        let pieces = parse::parse(&text, syntax).pieces;
        let called = pieces.iter().any(|p| matches!(p, Piece::Call(_)));
        let (stop_reason, stop_sequence) = self.stop(reason, called);
        let content = pieces.into_iter().map(block_of).collect();
        let body = self.message(
            content,
            Some(stop_reason),
            stop_sequence,
            usage_from(&usage),
        );
        Ok(Json(body).into_response())
    }
}

/// The content block of a whole piece.
fn block_of(piece: Piece) -> ContentBlockOut {
    match piece {
        Piece::Text(text) => ContentBlockOut::Text { text },
        Piece::Reasoning(thinking) => ContentBlockOut::Thinking {
            thinking,
            signature: String::new(),
        },
        Piece::Call(call) => tool_use_block(call),
        // A whole answer holds calls whole (`Parsed` joins the parts).
        Piece::CallOpen { name } => tool_use_block(ToolCall {
            name,
            arguments: String::new(),
        }),
        Piece::CallArguments(text) => ContentBlockOut::Text { text },
    }
}

/// The kinds of streamed content blocks that take several deltas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    /// A forced call, its input streamed as it is written.
    ToolUse,
}

/// Anthropic's stream events: one content block per run of reasoning or
/// text and one `tool_use` block per call, in the order the model wrote
/// them (the blocks of the whole response), then `message_delta` and
/// `message_stop`.
struct MessagesStream {
    out: MessageOutput,
    /// Present when the output is parsed (tools, reasoning).
    parser: OutputParser,
    /// The open reasoning or text block.
    open: Option<BlockKind>,
    num_blocks: usize,
    called: bool,
}

impl MessagesStream {
    fn new(out: MessageOutput, syntax: &OutputSyntax) -> Self {
        MessagesStream {
            out,
            parser: OutputParser::new(syntax),
            open: None,
            num_blocks: 0,
            called: false,
        }
    }

    fn close(&mut self, frames: &mut Vec<Bytes>) {
        if self.open.take().is_some() {
            frames.push(block_stop(self.num_blocks - 1));
        }
    }

    /// Opens a block of `kind` unless one is open; returns its index.
    fn open(&mut self, kind: BlockKind, frames: &mut Vec<Bytes>) -> usize {
        if self.open != Some(kind) {
            self.close(frames);
            let start = match kind {
                BlockKind::Text => ContentBlockOut::Text {
                    text: String::new(),
                },
                BlockKind::Thinking => ContentBlockOut::Thinking {
                    thinking: String::new(),
                    signature: String::new(),
                },
                // Calls open with their name (`Piece::CallOpen`), not here.
                BlockKind::ToolUse => ContentBlockOut::ToolUse {
                    id: new_id("toolu_"),
                    name: String::new(),
                    input: json!({}),
                },
            };
            frames.push(block_start(self.num_blocks, &start));
            self.num_blocks += 1;
            self.open = Some(kind);
        }
        self.num_blocks - 1
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<Bytes> {
        let mut frames = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) if text.is_empty() => {}
                Piece::Text(text) => {
                    let index = self.open(BlockKind::Text, &mut frames);
                    frames.push(block_delta(index, BlockDelta::TextDelta { text }));
                }
                Piece::Reasoning(thinking) => {
                    let index = self.open(BlockKind::Thinking, &mut frames);
                    frames.push(block_delta(index, BlockDelta::ThinkingDelta { thinking }));
                }
                Piece::CallOpen { name } => {
                    self.close(&mut frames);
                    self.called = true;
                    let start = ContentBlockOut::ToolUse {
                        id: new_id("toolu_"),
                        name,
                        input: json!({}),
                    };
                    frames.push(block_start(self.num_blocks, &start));
                    self.num_blocks += 1;
                    self.open = Some(BlockKind::ToolUse);
                }
                Piece::CallArguments(partial_json) => {
                    if self.open == Some(BlockKind::ToolUse) {
                        let index = self.num_blocks - 1;
                        frames.push(block_delta(
                            index,
                            BlockDelta::InputJsonDelta { partial_json },
                        ));
                    }
                }
                Piece::Call(call) => {
                    self.close(&mut frames);
                    self.called = true;
                    let index = self.num_blocks;
                    self.num_blocks += 1;
                    let ContentBlockOut::ToolUse { id, name, input } = tool_use_block(call) else {
                        continue;
                    };
                    let start = ContentBlockOut::ToolUse {
                        id,
                        name,
                        input: json!({}),
                    };
                    frames.push(block_start(index, &start));
                    let partial_json = input.to_string();
                    frames.push(block_delta(
                        index,
                        BlockDelta::InputJsonDelta { partial_json },
                    ));
                    frames.push(block_stop(index));
                }
            }
        }
        frames
    }
}

fn block_start(index: usize, block: &ContentBlockOut) -> Bytes {
    event_frame(
        "content_block_start",
        &json!({"type": "content_block_start", "index": index, "content_block": block}),
    )
}

fn block_delta(index: usize, delta: BlockDelta) -> Bytes {
    event_frame(
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": index, "delta": delta}),
    )
}

fn block_stop(index: usize) -> Bytes {
    event_frame(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": index}),
    )
}

impl StreamFormat for MessagesStream {
    fn on_token(&mut self, _choice: usize, text: &str, _sampled: Option<&Sampled>) -> Vec<Bytes> {
        let pieces = self.parser.push(text);
        self.pieces(pieces)
    }

    fn on_finish(&mut self, _choice: usize, reason: FinishReason, usage: &Usage) -> Vec<Bytes> {
        let pieces = self.parser.finish();
        let mut frames = self.pieces(pieces);
        self.close(&mut frames);
        let (stop_reason, stop_sequence) = self.out.stop(reason, self.called);
        frames.push(event_frame(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage_from(usage),
            }),
        ));
        frames.push(event_frame(
            "message_stop",
            &json!({"type": "message_stop"}),
        ));
        frames
    }

    fn error_frame(&mut self, e: &ApiError) -> Bytes {
        event_frame("error", &e.body_in(ErrorShape::Anthropic))
    }

    fn end_frame(&self) -> Option<Bytes> {
        None
    }

    fn keepalive_frame(&self) -> Option<Bytes> {
        Some(ping_frame())
    }
}

/// Anthropic's `ping` event: sent after `message_start` and as keep-alive.
fn ping_frame() -> Bytes {
    event_frame("ping", &json!({"type": "ping"}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::ToolSyntax;

    /// `(event name, data)` of each frame.
    fn parse(frames: &[Bytes]) -> Vec<(String, Value)> {
        frames
            .iter()
            .map(|f| {
                let s = std::str::from_utf8(f).expect("utf-8");
                let mut lines = s.lines();
                let name = lines.next().and_then(|l| l.strip_prefix("event: "));
                let data = lines.next().and_then(|l| l.strip_prefix("data: "));
                let data: Value = serde_json::from_str(data.expect("data")).expect("json");
                (name.expect("event name").to_string(), data)
            })
            .collect()
    }

    fn stream(tool_names: Vec<String>) -> MessagesStream {
        let out = MessageOutput {
            id: "msg_1".into(),
            model_name: "m".into(),
            stop_sequences: Vec::new(),
            forced_call: false,
        };
        let syntax = OutputSyntax {
            think: None,
            tools: Some((ToolSyntax::Hermes, tool_names)),
            forced_call: false,
            harmony: false,
        };
        MessagesStream::new(out, &syntax)
    }

    #[test]
    fn a_streamed_tool_call_becomes_a_tool_use_block() {
        let mut s = stream(vec!["get_weather".into()]);
        let mut frames = s.on_token(0, "Let me check. ", None);
        frames.extend(s.on_token(
            0,
            r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>"#,
            None,
        ));
        let usage = Usage {
            prompt_tokens: 10,
            cached_tokens: 4,
            completion_tokens: 20,
            ..Usage::default()
        };
        frames.extend(s.on_finish(0, FinishReason::Stop, &usage));
        let evs = parse(&frames);
        let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        let text: String = evs
            .iter()
            .filter(|(_, d)| d["index"] == 0 && d["delta"]["type"] == "text_delta")
            .filter_map(|(_, d)| d["delta"]["text"].as_str())
            .collect();
        assert_eq!(text.trim(), "Let me check.");
        let block = &evs[3].1["content_block"];
        assert_eq!(
            (block["type"].clone(), block["name"].clone()),
            (json!("tool_use"), json!("get_weather"))
        );
        assert_eq!(block["input"], json!({}));
        assert_eq!(evs[3].1["index"], 1);
        let partial = evs[4].1["delta"]["partial_json"]
            .as_str()
            .unwrap_or_default();
        assert_eq!(
            serde_json::from_str::<Value>(partial).ok(),
            Some(json!({"city": "Paris"}))
        );
        assert_eq!(evs[6].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(evs[6].1["usage"]["output_tokens"], 20);
        assert_eq!(evs[6].1["usage"]["cache_read_input_tokens"], 4);
        assert!(s.end_frame().is_none());
    }

    #[test]
    fn stop_reasons_name_the_sequence() {
        let out = MessageOutput {
            id: "msg_1".into(),
            model_name: "m".into(),
            stop_sequences: vec!["a".into(), "b".into()],
            forced_call: false,
        };
        assert_eq!(
            out.stop(FinishReason::StopString(1), false),
            ("stop_sequence", Some("b".into()))
        );
        assert_eq!(out.stop(FinishReason::Length, false), ("max_tokens", None));
        assert_eq!(out.stop(FinishReason::Stop, false), ("end_turn", None));
        assert_eq!(out.stop(FinishReason::Stop, true), ("tool_use", None));
        assert_eq!(out.stop(FinishReason::Length, true), ("tool_use", None));
        let forced = MessageOutput {
            forced_call: true,
            ..out
        };
        assert_eq!(
            forced.stop(FinishReason::Length, true),
            ("max_tokens", None)
        );
        assert_eq!(forced.stop(FinishReason::Stop, true), ("tool_use", None));
    }
}
