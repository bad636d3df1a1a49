//! `POST /v1/chat/completions`: validate, render the template with the tools,
//! generate, and answer as one response or as an SSE stream; tool calls in
//! the model's syntax become `tool_calls` and its reasoning
//! `reasoning_content`, the same pieces in both forms.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled, SamplingParams};
use serde_json::Value;

use crate::errors::ApiError;
use crate::generation::{self, ChatRender, EventReceiver, Generate};
use crate::json_body::{reject_unknown, ApiJson};
use crate::logprobs::TokenSpeller;
use crate::messages::{
    auto_call_format, forced_call_format, template_messages, template_tools, tool_choice,
    DeclaredTool, ToolChoice,
};
use crate::openai_types::chat::{
    ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessageOut,
    ChunkChoice, Delta, FunctionCallOut, FunctionDelta, ToolCallDelta, ToolCallOut,
};
use crate::openai_types::{new_id, unix_now, ChatLogprobs, UsageOut};
use crate::parse::{self, OutputParser, OutputSyntax, Piece, ToolCall};
use crate::sampling::SamplingFields;
use crate::sse::{self, frame, StreamFormat};
use crate::state::AppState;

/// A chat request, checked.
struct ValidChat {
    messages: Value,
    /// Tools (their calls are parsed from the output when declared) and
    /// template variables.
    render: ChatRender,
    parallel_tool_calls: bool,
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
    /// How many choices (`n`).
    n: usize,
    format: Option<kiln_structured::Format>,
    /// `tool_choice` forces a call (the format makes the answer one).
    forced_call: bool,
    /// The text of `prediction`.
    prediction: Option<String>,
}

fn validate(state: &AppState, mut req: ChatCompletionRequest) -> Result<ValidChat, ApiError> {
    let format = crate::structured::take_format(&mut req.extra)
        .map_err(|(param, reason)| ApiError::invalid(&param, reason))?;
    reject_unknown(&req.extra, "")?;
    let prediction = match req.prediction.as_ref().filter(|v| !v.is_null()) {
        Some(v) => Some(crate::openai_types::prediction_text(v)?),
        None => None,
    };
    state.check_model(req.model.as_deref())?;
    state.check_generates()?;
    let n = generation::choices(req.n)?;
    if req.store == Some(true) {
        return Err(ApiError::unsupported(
            "store",
            "Kiln stores nothing: `store` must be false",
        ));
    }
    if let Some(o) = &req.stream_options {
        reject_unknown(&o.extra, "stream_options.")?;
    }
    let choice = tool_choice(req.tool_choice.as_ref())?;
    let declared: Vec<(&str, Option<&Value>)> = req
        .tools
        .iter()
        .flatten()
        .map(|t| (t.function.name.as_str(), t.function.parameters.as_ref()))
        .collect();
    let forced = forced_call_format(&declared, &choice)?;
    if forced.is_some() && format.is_some() {
        return Err(ApiError::invalid(
            "tool_choice",
            "a forced tool call cannot be combined with an output format (`response_format`, `guided_*`)",
        ));
    }
    let forced_call = forced.is_some();
    let parallel_tool_calls = req.parallel_tool_calls.unwrap_or(true);
    // Strict tools under `auto`: every call the model opens holds.
    let auto_calls = match (&choice, &format, &req.tools) {
        (ToolChoice::Auto, None, Some(tools)) => {
            let declared: Vec<DeclaredTool> = tools
                .iter()
                .map(|t| DeclaredTool {
                    name: &t.function.name,
                    parameters: t.function.parameters.as_ref(),
                    strict: t.function.strict == Some(true),
                })
                .collect();
            auto_call_format(state, &declared, parallel_tool_calls)
        }
        _ => None,
    };
    let format = forced.or(format).or(auto_calls);
    let tool_choice_none = choice == ToolChoice::None;
    let (tools, tool_names) = match &req.tools {
        Some(t) if !t.is_empty() && !tool_choice_none => (
            Some(template_tools(t)?),
            t.iter().map(|t| t.function.name.clone()).collect(),
        ),
        _ => (None, Vec::new()),
    };
    let top_logprobs = match (req.logprobs, req.top_logprobs) {
        (_, Some(k)) if k < 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be at least 0, got {k}"),
            ))
        }
        (Some(true), k) => Some(k.unwrap_or(0) as usize),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs` set to true",
            ))
        }
        _ => None,
    };
    let max_tokens = crate::sampling::token_limit(
        &[
            (req.max_completion_tokens, "max_completion_tokens"),
            (req.max_tokens, "max_tokens"),
            (req.max_new_tokens, "max_new_tokens"),
        ],
        req.n_predict,
    );
    let params = SamplingFields {
        max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        logit_bias: req.logit_bias,
        seed: req.seed,
        stop: req.stop,
        stop_token_ids: req.stop_token_ids,
        ignore_eos: req.ignore_eos,
        logprobs: top_logprobs,
        max_temperature: crate::sampling::OPENAI_MAX_TEMPERATURE,
    }
    .into_params(state.vocab_size(), &state.sampling_defaults)?;
    let mut kwargs = req.chat_template_kwargs.unwrap_or_default();
    let mut enable_thinking = kwargs.get("enable_thinking").and_then(Value::as_bool);
    if let Some(effort) = req.reasoning_effort {
        if !["none", "minimal", "low", "medium", "high"].contains(&effort.as_str()) {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!(
                    "`reasoning_effort` must be none, minimal, low, medium or high, got `{effort}`"
                ),
            ));
        }
        if effort == "none" {
            enable_thinking = Some(false);
        }
        kwargs.insert("reasoning_effort".into(), Value::String(effort));
    }
    Ok(ValidChat {
        messages: template_messages(&req.messages)?,
        render: ChatRender {
            tools,
            tool_names,
            enable_thinking,
            kwargs,
            overrides: state.output,
        },
        parallel_tool_calls,
        params,
        stream: req.stream.unwrap_or(false),
        include_usage: req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        n,
        format,
        forced_call,
        prediction,
    })
}

pub async fn handle(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let requested = req.model.clone();
    let v = validate(&state, req)?;
    let adapter = state.resolve_adapter(requested.as_deref()).await?;
    let want_logprobs = v.params.logprobs.is_some();
    let parses = !v.render.tool_names.is_empty() || generation::thinks(&state);
    let generate = Generate {
        params: v.params,
        skip_special_tokens: !parses,
        format: v.format,
        adapter,
        prediction: v.prediction,
    };
    let (messages, render) = (v.messages, v.render);
    let admitted = generation::start_choices(&state, generate, v.n, move |model: &LoadedModel| {
        let prompt = generation::chat_prompt(model, messages, render)?;
        let syntax = prompt.syntax.clone();
        Ok(prompt.prepared(syntax))
    })
    .await?;
    let mut syntax: OutputSyntax = admitted.extra;
    syntax.forced_call = v.forced_call;
    let out = ChatOutput {
        id: new_id("chatcmpl-"),
        created: unix_now(),
        model_name: state.model_name.clone(),
        model: state.engine.model().clone(),
        want_logprobs,
        parallel_tool_calls: v.parallel_tool_calls,
        forced_call: v.forced_call,
    };
    if v.stream {
        let first = (0..v.n)
            .map(|idx| {
                let delta = Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..Delta::default()
                };
                out.chunk(idx, delta, None, None, v.include_usage)
            })
            .collect();
        let format = ChatStream {
            parsers: (0..v.n)
                .map(|_| (!syntax.is_plain()).then(|| OutputParser::new(&syntax)))
                .collect(),
            calls: vec![0; v.n],
            include_usage: v.include_usage,
            out,
        };
        Ok(sse::response(
            admitted.events,
            format,
            first,
            state.sse_keepalive,
        ))
    } else {
        out.collect(admitted.events, &syntax).await
    }
}

/// A choice's `finish_reason`: `tool_calls` when it called, except that a
/// forced call cut by `max_tokens` (the whole answer is the call) is
/// `length`, still a call.
fn finish_reason(reason: FinishReason, called: bool, forced_call: bool) -> &'static str {
    match reason {
        FinishReason::Length if forced_call || !called => "length",
        _ if called => "tool_calls",
        other => other.as_openai_str(),
    }
}

/// What every response and chunk of one request shares.
struct ChatOutput {
    id: String,
    created: u64,
    model_name: Arc<str>,
    model: Arc<LoadedModel>,
    want_logprobs: bool,
    parallel_tool_calls: bool,
    forced_call: bool,
}

impl ChatOutput {
    fn logprobs(&self, sampled: Option<&Sampled>) -> Option<ChatLogprobs> {
        let sampled = sampled.filter(|_| self.want_logprobs)?;
        let entry = TokenSpeller::new(&self.model.tokenizer).chat_entry(sampled);
        Some(ChatLogprobs {
            content: vec![entry],
        })
    }

    fn tool_calls(&self, mut calls: Vec<ToolCall>) -> Vec<ToolCallOut> {
        if !self.parallel_tool_calls {
            calls.truncate(1);
        }
        calls
            .into_iter()
            .map(|c| ToolCallOut {
                id: new_id("call_"),
                kind: "function",
                function: FunctionCallOut {
                    name: c.name,
                    arguments: c.arguments,
                },
            })
            .collect()
    }

    /// Gathers every choice's answer, read with `syntax`.
    async fn collect(
        self,
        events: EventReceiver,
        syntax: &OutputSyntax,
    ) -> Result<Response, ApiError> {
        let mut logprobs: Vec<Option<ChatLogprobs>> = (0..events.num_choices())
            .map(|_| self.want_logprobs.then(ChatLogprobs::default))
            .collect();
        let collected = events
            .collect_all(|idx, _, sampled| {
                let lp = logprobs.get_mut(idx).and_then(Option::as_mut);
                if let (Some(lp), Some(mut entry)) = (lp, self.logprobs(sampled)) {
                    lp.content.append(&mut entry.content);
                }
            })
            .await?;
        let usage = generation::total_usage(collected.iter().map(|c| &c.usage));
        let choices = collected
            .into_iter()
            .zip(logprobs)
            .enumerate()
            .map(|(idx, (c, logprobs))| {
                let (content, reasoning, calls) = if syntax.is_plain() {
                    (Some(c.text), None, Vec::new())
                } else {
                    let p = parse::parse(&c.text, syntax);
                    (p.content, p.reasoning, self.tool_calls(p.calls))
                };
                let finish_reason =
                    finish_reason(c.finish_reason, !calls.is_empty(), self.forced_call);
                ChatChoice {
                    index: idx as u32,
                    message: ChatMessageOut {
                        role: "assistant",
                        content,
                        reasoning_content: reasoning,
                        tool_calls: calls,
                    },
                    logprobs,
                    finish_reason,
                }
            })
            .collect();
        let body = ChatCompletion {
            id: self.id,
            object: "chat.completion",
            created: self.created,
            model: self.model_name.to_string(),
            choices,
            usage: UsageOut::from(&usage),
        };
        Ok(Json(body).into_response())
    }

    fn chunk(
        &self,
        idx: usize,
        delta: Delta,
        logprobs: Option<ChatLogprobs>,
        finish_reason: Option<&'static str>,
        include_usage: bool,
    ) -> Bytes {
        frame(&ChatCompletionChunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model_name,
            choices: vec![ChunkChoice {
                index: idx as u32,
                delta,
                logprobs,
                finish_reason,
            }],
            usage: include_usage.then_some(None),
        })
    }
}

/// The chat chunk shapes of an SSE stream.
struct ChatStream {
    out: ChatOutput,
    /// Per choice, present when the output is parsed (tools, reasoning).
    parsers: Vec<Option<OutputParser>>,
    /// Per choice: tool calls streamed so far.
    calls: Vec<u32>,
    include_usage: bool,
}

impl ChatStream {
    /// The chunks of decided pieces of choice `idx`.
    fn pieces(&mut self, idx: usize, pieces: Vec<Piece>, frames: &mut Vec<Bytes>) {
        for piece in pieces {
            let delta = match piece {
                Piece::Text(t) => Delta {
                    content: Some(t),
                    ..Delta::default()
                },
                Piece::Reasoning(r) => Delta {
                    reasoning_content: Some(r),
                    ..Delta::default()
                },
                Piece::CallOpen { name } => {
                    let Some(n) = self.calls.get_mut(idx) else {
                        continue;
                    };
                    let index = *n;
                    *n += 1;
                    Delta {
                        tool_calls: vec![ToolCallDelta {
                            index,
                            id: Some(new_id("call_")),
                            kind: Some("function"),
                            function: FunctionDelta {
                                name: Some(name),
                                arguments: String::new(),
                            },
                        }],
                        ..Delta::default()
                    }
                }
                Piece::CallArguments(arguments) => {
                    let Some(index) = self.calls.get(idx).and_then(|n| n.checked_sub(1)) else {
                        continue;
                    };
                    Delta {
                        tool_calls: vec![ToolCallDelta {
                            index,
                            id: None,
                            kind: None,
                            function: FunctionDelta {
                                name: None,
                                arguments,
                            },
                        }],
                        ..Delta::default()
                    }
                }
                Piece::Call(call) => {
                    let Some(n) = self.calls.get_mut(idx) else {
                        continue;
                    };
                    if *n > 0 && !self.out.parallel_tool_calls {
                        continue;
                    }
                    let index = *n;
                    *n += 1;
                    // As OpenAI streams a call: named first, then its arguments.
                    let named = ToolCallDelta {
                        index,
                        id: Some(new_id("call_")),
                        kind: Some("function"),
                        function: FunctionDelta {
                            name: Some(call.name),
                            arguments: String::new(),
                        },
                    };
                    let args = ToolCallDelta {
                        index,
                        id: None,
                        kind: None,
                        function: FunctionDelta {
                            name: None,
                            arguments: call.arguments,
                        },
                    };
                    for d in [named, args] {
                        let delta = Delta {
                            tool_calls: vec![d],
                            ..Delta::default()
                        };
                        frames.push(self.out.chunk(idx, delta, None, None, self.include_usage));
                    }
                    continue;
                }
            };
            frames.push(self.out.chunk(idx, delta, None, None, self.include_usage));
        }
    }
}

impl StreamFormat for ChatStream {
    fn on_token(&mut self, idx: usize, text: &str, sampled: Option<&Sampled>) -> Vec<Bytes> {
        let logprobs = self.out.logprobs(sampled);
        let mut frames = Vec::new();
        match self.parsers.get_mut(idx).and_then(Option::as_mut) {
            Some(p) => {
                let pieces = p.push(text);
                self.pieces(idx, pieces, &mut frames);
                if let Some(lp) = logprobs {
                    let delta = Delta::default();
                    frames.push(
                        self.out
                            .chunk(idx, delta, Some(lp), None, self.include_usage),
                    );
                }
            }
            None if !text.is_empty() || logprobs.is_some() => {
                let delta = Delta {
                    content: Some(text.to_string()),
                    ..Delta::default()
                };
                frames.push(
                    self.out
                        .chunk(idx, delta, logprobs, None, self.include_usage),
                );
            }
            None => {}
        }
        frames
    }

    fn on_finish(&mut self, idx: usize, reason: FinishReason, _usage: &Usage) -> Vec<Bytes> {
        let mut frames = Vec::new();
        if let Some(mut p) = self.parsers.get_mut(idx).and_then(Option::take) {
            let pieces = p.finish();
            self.pieces(idx, pieces, &mut frames);
        }
        let called = self.calls.get(idx).is_some_and(|&n| n > 0);
        let finish_reason = finish_reason(reason, called, self.out.forced_call);
        frames.push(self.out.chunk(
            idx,
            Delta::default(),
            None,
            Some(finish_reason),
            self.include_usage,
        ));
        frames
    }

    fn on_end(&mut self, usage: &Usage) -> Vec<Bytes> {
        if !self.include_usage {
            return Vec::new();
        }
        vec![frame(&ChatCompletionChunk {
            id: &self.out.id,
            object: "chat.completion.chunk",
            created: self.out.created,
            model: &self.out.model_name,
            choices: Vec::new(),
            usage: Some(Some(UsageOut::from(usage))),
        })]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_call_cut_short_finishes_with_length() {
        assert_eq!(finish_reason(FinishReason::Length, true, true), "length");
        assert_eq!(finish_reason(FinishReason::Stop, true, true), "tool_calls");
        // A complete call the model chose, then text cut short: the call.
        assert_eq!(
            finish_reason(FinishReason::Length, true, false),
            "tool_calls"
        );
        assert_eq!(finish_reason(FinishReason::Length, false, false), "length");
        assert_eq!(finish_reason(FinishReason::Stop, false, false), "stop");
    }
}
