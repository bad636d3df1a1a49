//! `POST /v1/responses`, the OpenAI Responses API, stateless: the input
//! items become template messages, generation goes through the same bridge
//! as chat, and `<tool_call>` blocks in the output become `function_call`
//! items. Streamed, the answer is the Responses API's typed events, each
//! with its `sequence_number`, ending with `response.completed` (or
//! `response.incomplete` / `response.failed`) and no `[DONE]`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled, SamplingParams};
use serde_json::{Map, Value};

use crate::errors::ApiError;
use crate::generation::{self, ChatRender, Generate};
use crate::json_body::{reject_unknown, ApiJson};
use crate::messages::{auto_call_format, tool_choice_is_none, DeclaredTool};
use crate::openai_types::responses::{
    EventBody, IncompleteDetails, OutputItem, OutputText, ResponseError, ResponseObject,
    ResponseUsage, ResponsesRequest, StreamEvent, TextConfig, TextFormat, ToolIn,
};
use crate::openai_types::{new_id, unix_now};
use crate::parse::{self, OutputParser, OutputSyntax, Piece, ToolCall};
use crate::responses_input::{template_function_tools, template_input};
use crate::sampling::{SamplingFields, OPENAI_MAX_TEMPERATURE};
use crate::sse::{self, event_frame, StreamFormat};
use crate::state::AppState;

const STATELESS: &str = "Kiln is stateless: it stores no responses or conversations";

/// A Responses request, checked.
struct ValidResponses {
    messages: Value,
    tools: Option<Value>,
    /// The declared tools' names; tool calls are parsed when there are any.
    tool_names: Vec<String>,
    params: SamplingParams,
    stream: bool,
    echo: Echo,
    format: Option<kiln_structured::Format>,
}

/// The request fields the response object repeats.
struct Echo {
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    parallel_tool_calls: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    tool_choice: &'static str,
    tools: Vec<ToolIn>,
    metadata: Map<String, Value>,
    user: Option<String>,
    /// `text.format.type` as asked.
    format_type: &'static str,
}

fn validate(state: &AppState, mut req: ResponsesRequest) -> Result<ValidResponses, ApiError> {
    let (format, format_type) = crate::structured::take_text_format(&mut req.extra)
        .map_err(|(param, reason)| ApiError::invalid(&param, reason))?;
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
    state.check_generates()?;
    if req.store == Some(true) {
        return Err(ApiError::unsupported(
            "store",
            format!("{STATELESS}, so `store` must be false or absent"),
        ));
    }
    for (param, value) in [
        ("previous_response_id", &req.previous_response_id),
        ("conversation", &req.conversation),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::unsupported(
                param,
                format!(
                    "{STATELESS}, so `{param}` cannot be used: send the whole \
                     conversation in `input`"
                ),
            ));
        }
    }
    let tool_choice_none = tool_choice_is_none(req.tool_choice.as_ref())?;
    let Some(input) = &req.input else {
        return Err(ApiError::invalid("input", "`input` is required"));
    };
    let messages = template_input(req.instructions.as_deref(), input)?;
    let declared = req.tools.unwrap_or_default();
    // Checked even when `tool_choice` is "none": a bad definition is refused either way.
    let (tools, tool_names) = template_function_tools(&declared)?;
    let (tools, tool_names) = if declared.is_empty() || tool_choice_none {
        (None, Vec::new())
    } else {
        (Some(tools), tool_names)
    };
    let parallel_tool_calls = req.parallel_tool_calls.unwrap_or(true);
    // Strict tools (the Responses API's default) hold every call opened.
    let format = match format {
        None if !tool_names.is_empty() => {
            let strict: Vec<DeclaredTool> = declared
                .iter()
                .filter_map(|t| {
                    Some(DeclaredTool {
                        name: t.name.as_deref()?,
                        parameters: t.parameters.as_ref(),
                        strict: t.strict.unwrap_or(true),
                    })
                })
                .collect();
            auto_call_format(state, &strict, parallel_tool_calls)
        }
        format => format,
    };
    let params = SamplingFields {
        max_tokens: req.max_output_tokens.map(|n| (n, "max_output_tokens")),
        temperature: req.temperature,
        top_p: req.top_p,
        max_temperature: OPENAI_MAX_TEMPERATURE,
        ..SamplingFields::default()
    }
    .into_params(state.vocab_size(), &state.sampling_defaults)?;
    Ok(ValidResponses {
        messages,
        tools,
        tool_names,
        params,
        stream: req.stream.unwrap_or(false),
        echo: Echo {
            instructions: req.instructions,
            max_output_tokens: req.max_output_tokens,
            parallel_tool_calls,
            temperature: req.temperature,
            top_p: req.top_p,
            tool_choice: if tool_choice_none { "none" } else { "auto" },
            tools: declared,
            metadata: req.metadata.unwrap_or_default(),
            user: req.user,
            format_type,
        },
        format,
    })
}

pub async fn handle(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let requested = req.model.clone();
    let v = validate(&state, req)?;
    let adapter = state.resolve_adapter(requested.as_deref()).await?;
    let parses = !v.tool_names.is_empty() || generation::thinks(&state);
    let generate = Generate {
        params: v.params,
        skip_special_tokens: !parses,
        format: v.format,
        adapter,
        prediction: None,
    };
    let render = ChatRender {
        tools: v.tools,
        tool_names: v.tool_names,
        overrides: state.output,
        ..ChatRender::default()
    };
    let messages = v.messages;
    let admitted = generation::start(&state, generate, move |model: &LoadedModel| {
        let prompt = generation::chat_prompt(model, messages, render)?;
        let syntax = prompt.syntax.clone();
        Ok(prompt.prepared(syntax))
    })
    .await?;
    let syntax = admitted.extra;
    let out = ResponseOutput {
        id: new_id("resp_"),
        created_at: unix_now(),
        model_name: state.model_name.clone(),
        echo: v.echo,
    };
    if v.stream {
        let mut format = ResponsesStream::new(out, &syntax);
        let first = format.start();
        return Ok(sse::response(
            admitted.events,
            format,
            first,
            state.sse_keepalive,
        ));
    }
    let collected = admitted.events.collect(|_, _| {}).await?;
    let pieces = parse::parse(&collected.text, &syntax).pieces;
    let (status, incomplete) = status(collected.finish_reason);
    // The items a stream gives: a message per run of text (closed as
    // complete when a call follows), a function call per call.
    let mut output = Vec::new();
    let mut calls = 0;
    for piece in pieces {
        match piece {
            Piece::Text(text) if !text.is_empty() => {
                output.push(message_item(new_id("msg_"), text, "completed"));
            }
            Piece::Call(call) if calls == 0 || out.echo.parallel_tool_calls => {
                calls += 1;
                output.push(call_item(new_id("fc_"), call, "completed"));
            }
            _ => {}
        }
    }
    match output.last_mut() {
        Some(OutputItem::Message { status: s, .. }) => *s = item_status(status),
        Some(_) => {}
        None => output.push(message_item(
            new_id("msg_"),
            String::new(),
            item_status(status),
        )),
    }
    let body = out.object(status, &output, Some(&collected.usage));
    Ok(Json(ResponseObject {
        incomplete_details: incomplete,
        ..body
    })
    .into_response())
}

/// The response's `status` and `incomplete_details` for how generation
/// ended.
fn status(reason: FinishReason) -> (&'static str, Option<IncompleteDetails>) {
    match reason {
        FinishReason::Length => (
            "incomplete",
            Some(IncompleteDetails {
                reason: "max_output_tokens",
            }),
        ),
        _ => ("completed", None),
    }
}

/// An item's status at the end of a response with `status`.
fn item_status(status: &'static str) -> &'static str {
    if status == "incomplete" {
        "incomplete"
    } else {
        "completed"
    }
}

fn message_item(id: String, text: String, status: &'static str) -> OutputItem {
    OutputItem::Message {
        id,
        status,
        role: "assistant",
        content: vec![OutputText::new(text)],
    }
}

fn call_item(id: String, call: ToolCall, status: &'static str) -> OutputItem {
    OutputItem::FunctionCall {
        id,
        call_id: new_id("call_"),
        name: call.name,
        arguments: call.arguments,
        status,
    }
}

/// What the response object and every event of one request share.
struct ResponseOutput {
    id: String,
    created_at: u64,
    model_name: Arc<str>,
    echo: Echo,
}

impl ResponseOutput {
    fn object<'a>(
        &'a self,
        status: &'static str,
        output: &'a [OutputItem],
        usage: Option<&Usage>,
    ) -> ResponseObject<'a> {
        let e = &self.echo;
        ResponseObject {
            id: &self.id,
            object: "response",
            created_at: self.created_at,
            status,
            error: None,
            incomplete_details: None,
            instructions: e.instructions.as_deref(),
            max_output_tokens: e.max_output_tokens,
            model: &self.model_name,
            output,
            parallel_tool_calls: e.parallel_tool_calls,
            previous_response_id: None,
            store: false,
            temperature: e.temperature,
            top_p: e.top_p,
            tool_choice: e.tool_choice,
            tools: &e.tools,
            metadata: &e.metadata,
            user: e.user.as_deref(),
            text: TextConfig {
                format: TextFormat {
                    kind: e.format_type,
                },
            },
            truncation: "disabled",
            usage: usage.map(ResponseUsage::from),
        }
    }
}

/// The message being streamed: where it is in `output`, and its text so far.
struct OpenMessage {
    output_index: usize,
    id: String,
    text: String,
}

/// The Responses API's stream events.
struct ResponsesStream {
    out: ResponseOutput,
    /// Present when the output is parsed (tools, reasoning; reasoning is
    /// not part of a Responses answer and is left out).
    parser: OutputParser,
    calls: usize,
    /// The output items so far, as the final response will list them.
    output: Vec<OutputItem>,
    message: Option<OpenMessage>,
    sequence_number: u64,
}

/// One `event: {type}` frame, numbered.
fn frame(sequence_number: &mut u64, body: EventBody<'_>) -> Bytes {
    let name = body.name();
    let event = StreamEvent {
        body,
        sequence_number: *sequence_number,
    };
    *sequence_number += 1;
    event_frame(name, &event)
}

impl ResponsesStream {
    fn new(out: ResponseOutput, syntax: &OutputSyntax) -> Self {
        ResponsesStream {
            out,
            parser: OutputParser::new(syntax),
            calls: 0,
            output: Vec::new(),
            message: None,
            sequence_number: 0,
        }
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<Bytes> {
        let mut frames = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(text) if !text.is_empty() => frames.extend(self.text_delta(&text)),
                Piece::Call(call) if self.calls == 0 || self.out.echo.parallel_tool_calls => {
                    self.calls += 1;
                    frames.extend(self.close_message("completed"));
                    frames.extend(self.call(new_id("fc_"), call));
                }
                _ => {}
            }
        }
        frames
    }

    /// `response.created` and `response.in_progress`.
    fn start(&mut self) -> Vec<Bytes> {
        let seq = &mut self.sequence_number;
        vec![
            frame(
                seq,
                EventBody::Created {
                    response: self.out.object("in_progress", &[], None),
                },
            ),
            frame(
                seq,
                EventBody::InProgress {
                    response: self.out.object("in_progress", &[], None),
                },
            ),
        ]
    }

    /// Opens the message item and its text part, once.
    fn open_message(&mut self) -> Vec<Bytes> {
        if self.message.is_some() {
            return Vec::new();
        }
        let output_index = self.output.len();
        let id = new_id("msg_");
        self.output.push(OutputItem::Message {
            id: id.clone(),
            status: "in_progress",
            role: "assistant",
            content: Vec::new(),
        });
        let seq = &mut self.sequence_number;
        let frames = vec![
            frame(
                seq,
                EventBody::OutputItemAdded {
                    output_index,
                    item: &self.output[output_index],
                },
            ),
            frame(
                seq,
                EventBody::ContentPartAdded {
                    item_id: &id,
                    output_index,
                    content_index: 0,
                    part: OutputText::new(String::new()),
                },
            ),
        ];
        self.message = Some(OpenMessage {
            output_index,
            id,
            text: String::new(),
        });
        frames
    }

    fn text_delta(&mut self, text: &str) -> Vec<Bytes> {
        let mut frames = self.open_message();
        if let Some(m) = self.message.as_mut() {
            m.text.push_str(text);
            frames.push(frame(
                &mut self.sequence_number,
                EventBody::OutputTextDelta {
                    item_id: &m.id,
                    output_index: m.output_index,
                    content_index: 0,
                    delta: text,
                    logprobs: Vec::new(),
                },
            ));
        }
        frames
    }

    /// Closes the message item with its whole text.
    fn close_message(&mut self, status: &'static str) -> Vec<Bytes> {
        let Some(m) = self.message.take() else {
            return Vec::new();
        };
        let seq = &mut self.sequence_number;
        let (item_id, output_index) = (m.id.as_str(), m.output_index);
        let mut frames = vec![
            frame(
                seq,
                EventBody::OutputTextDone {
                    item_id,
                    output_index,
                    content_index: 0,
                    text: &m.text,
                    logprobs: Vec::new(),
                },
            ),
            frame(
                seq,
                EventBody::ContentPartDone {
                    item_id,
                    output_index,
                    content_index: 0,
                    part: OutputText::new(m.text.clone()),
                },
            ),
        ];
        self.output[output_index] = message_item(m.id.clone(), m.text.clone(), status);
        frames.push(frame(
            seq,
            EventBody::OutputItemDone {
                output_index,
                item: &self.output[output_index],
            },
        ));
        frames
    }

    /// One `function_call` item: added, its arguments in one delta, done.
    fn call(&mut self, id: String, call: ToolCall) -> Vec<Bytes> {
        let output_index = self.output.len();
        let done = call_item(id, call, "completed");
        let OutputItem::FunctionCall {
            id,
            call_id,
            name,
            arguments,
            ..
        } = &done
        else {
            return Vec::new(); // `call_item` makes function calls only.
        };
        let started = OutputItem::FunctionCall {
            id: id.clone(),
            call_id: call_id.clone(),
            name: name.clone(),
            arguments: String::new(),
            status: "in_progress",
        };
        let seq = &mut self.sequence_number;
        let frames = vec![
            frame(
                seq,
                EventBody::OutputItemAdded {
                    output_index,
                    item: &started,
                },
            ),
            frame(
                seq,
                EventBody::FunctionCallArgumentsDelta {
                    item_id: id,
                    output_index,
                    delta: arguments,
                },
            ),
            frame(
                seq,
                EventBody::FunctionCallArgumentsDone {
                    item_id: id,
                    output_index,
                    name,
                    arguments,
                },
            ),
            frame(
                seq,
                EventBody::OutputItemDone {
                    output_index,
                    item: &done,
                },
            ),
        ];
        self.output.push(done);
        frames
    }
}

impl StreamFormat for ResponsesStream {
    fn on_token(&mut self, _choice: usize, text: &str, _sampled: Option<&Sampled>) -> Vec<Bytes> {
        let pieces = self.parser.push(text);
        self.pieces(pieces)
    }

    fn on_finish(&mut self, _choice: usize, reason: FinishReason, usage: &Usage) -> Vec<Bytes> {
        let pieces = self.parser.finish();
        let mut frames = self.pieces(pieces);
        if self.output.is_empty() {
            // Every answer has a message, if an empty one.
            frames.extend(self.open_message());
        }
        let (status, incomplete) = status(reason);
        frames.extend(self.close_message(item_status(status)));
        let response = ResponseObject {
            incomplete_details: incomplete,
            ..self.out.object(status, &self.output, Some(usage))
        };
        let body = if status == "incomplete" {
            EventBody::Incomplete { response }
        } else {
            EventBody::Completed { response }
        };
        frames.push(frame(&mut self.sequence_number, body));
        frames
    }

    fn error_frame(&mut self, e: &ApiError) -> Bytes {
        let response = ResponseObject {
            error: Some(ResponseError {
                code: "server_error",
                message: e.to_string(),
            }),
            ..self.out.object("failed", &self.output, None)
        };
        frame(&mut self.sequence_number, EventBody::Failed { response })
    }

    fn end_frame(&self) -> Option<Bytes> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::ToolSyntax;
    use serde_json::json;

    fn stream(tool_names: Vec<String>, parallel_tool_calls: bool) -> ResponsesStream {
        let out = ResponseOutput {
            id: "resp_1".into(),
            created_at: 1,
            model_name: "m".into(),
            echo: Echo {
                instructions: None,
                max_output_tokens: None,
                parallel_tool_calls,
                temperature: None,
                top_p: None,
                tool_choice: "auto",
                tools: Vec::new(),
                metadata: Map::new(),
                user: None,
                format_type: "text",
            },
        };
        let syntax = OutputSyntax {
            think: None,
            tools: Some((ToolSyntax::Hermes, tool_names)),
            forced_call: false,
            harmony: false,
        };
        ResponsesStream::new(out, &syntax)
    }

    /// `(event name, data)` of each frame; the name must be the data's type.
    fn parse(frames: &[Bytes]) -> Vec<(String, Value)> {
        frames
            .iter()
            .map(|f| {
                let s = std::str::from_utf8(f).expect("utf-8");
                let mut lines = s.lines();
                let name = lines.next().and_then(|l| l.strip_prefix("event: "));
                let data = lines.next().and_then(|l| l.strip_prefix("data: "));
                let data: Value = serde_json::from_str(data.expect("data")).expect("json");
                let name = name.expect("event name").to_string();
                assert_eq!(data["type"], name.as_str());
                (name, data)
            })
            .collect()
    }

    const USAGE: Usage = Usage {
        prompt_tokens: 10,
        cached_tokens: 4,
        completion_tokens: 20,
        draft_tokens: 0,
        accepted_draft_tokens: 0,
    };

    const CALL: &str =
        r#"<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>"#;

    #[test]
    fn text_then_a_call_streams_both_items_in_order() {
        let mut s = stream(vec!["get_weather".into()], true);
        let mut frames = s.start();
        frames.extend(s.on_token(0, "Let me check. ", None));
        frames.extend(s.on_token(0, CALL, None));
        frames.extend(s.on_finish(0, FinishReason::Stop, &USAGE));
        let evs = parse(&frames);
        let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (_, d)) in evs.iter().enumerate() {
            assert_eq!(d["sequence_number"], i as u64);
        }
        assert_eq!(evs[0].1["response"]["status"], "in_progress");
        assert_eq!(evs[0].1["response"]["output"], json!([]));
        // The text sent is never changed: `done` repeats the deltas.
        // Blanks before a call are dropped, in the delta and in `done` alike.
        assert_eq!(evs[4].1["delta"], "Let me check.");
        assert_eq!(evs[5].1["text"], "Let me check.");
        let call = &evs[11].1["item"];
        assert_eq!(call["type"], "function_call");
        assert_eq!(call["name"], "get_weather");
        assert_eq!(evs[8].1["item"]["arguments"], "");
        assert_eq!(evs[8].1["output_index"], 1);
        assert_eq!(evs[10].1["item_id"], call["id"]);
        assert_eq!(
            serde_json::from_str::<Value>(call["arguments"].as_str().unwrap_or("")).ok(),
            Some(json!({"city": "Paris"}))
        );
        let done = &evs[12].1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "Let me check.");
        assert_eq!(done["output"][0]["status"], "completed");
        assert_eq!(&done["output"][1], call);
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(done["usage"]["total_tokens"], 30);
        assert!(s.end_frame().is_none());
    }

    #[test]
    fn an_answer_cut_short_is_incomplete_and_one_call_without_parallel() {
        let mut s = stream(vec![], true);
        let evs = parse(&s.on_finish(0, FinishReason::Length, &USAGE));
        // An empty answer still has its (empty) message.
        assert_eq!(evs[0].0, "response.output_item.added");
        let last = &evs[evs.len() - 1];
        assert_eq!(last.0, "response.incomplete");
        assert_eq!(last.1["response"]["status"], "incomplete");
        assert_eq!(
            last.1["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        assert_eq!(last.1["response"]["output"][0]["status"], "incomplete");

        let mut s = stream(vec!["get_weather".into()], false);
        s.on_token(0, &format!("{CALL}{CALL}"), None);
        let evs = parse(&s.on_finish(0, FinishReason::Stop, &USAGE));
        let output = &evs[evs.len() - 1].1["response"]["output"];
        assert_eq!(output.as_array().map(Vec::len), Some(1), "{output}");
        assert_eq!(output[0]["type"], "function_call");
    }

    #[test]
    fn a_failure_mid_stream_is_response_failed() {
        let mut s = stream(vec![], true);
        s.start();
        s.on_token(0, "Hel", None);
        let evs = parse(&[s.error_frame(&ApiError::Internal("boom".into()))]);
        assert_eq!(evs[0].0, "response.failed");
        assert_eq!(evs[0].1["sequence_number"], 5);
        assert_eq!(evs[0].1["response"]["status"], "failed");
        assert_eq!(evs[0].1["response"]["error"]["code"], "server_error");
    }
}
