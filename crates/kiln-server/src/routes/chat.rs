//! `POST /v1/chat/completions`: validate, render the template with the tools,
//! generate, and answer as one response or as an SSE stream; Hermes/Qwen
//! `<tool_call>` blocks in the output become `tool_calls`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled, SamplingParams};
use serde_json::Value;

use crate::errors::ApiError;
use crate::generation::{self, EventReceiver, Generate, Prepared};
use crate::json_body::{reject_unknown, ApiJson};
use crate::logprobs::TokenSpeller;
use crate::messages::{
    forced_call_format, template_messages, template_tools, tool_choice, ToolChoice,
};
use crate::openai_types::chat::{
    ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessageOut,
    ChunkChoice, Delta, FunctionCallOut, ToolCallOut,
};
use crate::openai_types::{new_id, unix_now, ChatLogprobs, UsageOut};
use crate::sampling::SamplingFields;
use crate::sse::{self, frame, StreamFormat};
use crate::state::AppState;
use crate::tool_calls::{self, ToolCall, ToolCallStream};

/// A chat request, checked.
struct ValidChat {
    messages: Value,
    tools: Option<Value>,
    /// The declared tools' names; tool calls are parsed from the output
    /// when there are any.
    tool_names: Vec<String>,
    parallel_tool_calls: bool,
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
    /// How many choices (`n`).
    n: usize,
    format: Option<kiln_structured::Format>,
}

fn validate(state: &AppState, mut req: ChatCompletionRequest) -> Result<ValidChat, ApiError> {
    let format = crate::structured::take_format(&mut req.extra)
        .map_err(|(param, reason)| ApiError::invalid(&param, reason))?;
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
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
    let format = forced.or(format);
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
    let max_tokens = req
        .max_completion_tokens
        .map(|n| (n, "max_completion_tokens"))
        .or(req.max_tokens.map(|n| (n, "max_tokens")));
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
    .into_params(state.vocab_size())?;
    Ok(ValidChat {
        messages: template_messages(&req.messages)?,
        tool_names,
        tools,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        params,
        stream: req.stream.unwrap_or(false),
        include_usage: req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        n,
        format,
    })
}

pub async fn handle(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let v = validate(&state, req)?;
    let (messages, tools) = (v.messages, v.tools);
    let want_logprobs = v.params.logprobs.is_some();
    let parse_tools = !v.tool_names.is_empty();
    let generate = Generate {
        params: v.params,
        skip_special_tokens: !parse_tools,
        format: v.format,
    };
    let admitted = generation::start_choices(&state, generate, v.n, move |model: &LoadedModel| {
        let prompt = generation::chat_prompt(model, messages, tools)?;
        Ok(Prepared { prompt, extra: () })
    })
    .await?;
    let out = ChatOutput {
        id: new_id("chatcmpl-"),
        created: unix_now(),
        model_name: state.model_name.clone(),
        model: state.engine.model().clone(),
        want_logprobs,
        parallel_tool_calls: v.parallel_tool_calls,
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
            tools: (0..v.n)
                .map(|_| parse_tools.then(|| ToolCallStream::new(v.tool_names.clone())))
                .collect(),
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
        out.collect(admitted.events, &v.tool_names).await
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
}

impl ChatOutput {
    fn logprobs(&self, sampled: Option<&Sampled>) -> Option<ChatLogprobs> {
        let sampled = sampled.filter(|_| self.want_logprobs)?;
        let entry = TokenSpeller::new(&self.model.tokenizer).chat_entry(sampled);
        Some(ChatLogprobs {
            content: vec![entry],
        })
    }

    fn tool_calls(&self, mut calls: Vec<ToolCall>, streaming: bool) -> Vec<ToolCallOut> {
        if !self.parallel_tool_calls {
            calls.truncate(1);
        }
        calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| ToolCallOut {
                index: streaming.then_some(i as u32),
                id: new_id("call_"),
                kind: "function",
                function: FunctionCallOut {
                    name: c.name,
                    arguments: c.arguments,
                },
            })
            .collect()
    }

    /// Gathers every choice's answer; tool calls are parsed when
    /// `tool_names` is not empty.
    async fn collect(
        self,
        events: EventReceiver,
        tool_names: &[String],
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
                let (content, calls) = if !tool_names.is_empty() {
                    let p = tool_calls::parse(&c.text, tool_names);
                    (p.content, self.tool_calls(p.calls, false))
                } else {
                    (Some(c.text), Vec::new())
                };
                let finish_reason = if calls.is_empty() {
                    c.finish_reason.as_openai_str()
                } else {
                    "tool_calls"
                };
                ChatChoice {
                    index: idx as u32,
                    message: ChatMessageOut {
                        role: "assistant",
                        content,
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
    /// Per choice, present when tool calls are parsed: holds text from
    /// `<tool_call>` on.
    tools: Vec<Option<ToolCallStream>>,
    include_usage: bool,
}

impl StreamFormat for ChatStream {
    fn on_token(&mut self, idx: usize, text: &str, sampled: Option<&Sampled>) -> Vec<Bytes> {
        let content = match self.tools.get_mut(idx).and_then(Option::as_mut) {
            Some(t) => t.push(text),
            None => text.to_string(),
        };
        let logprobs = self.out.logprobs(sampled);
        if content.is_empty() && logprobs.is_none() {
            return Vec::new();
        }
        let delta = Delta {
            content: Some(content),
            ..Delta::default()
        };
        vec![self
            .out
            .chunk(idx, delta, logprobs, None, self.include_usage)]
    }

    fn on_finish(&mut self, idx: usize, reason: FinishReason, _usage: &Usage) -> Vec<Bytes> {
        let mut frames = Vec::new();
        let mut finish_reason = reason.as_openai_str();
        if let Some(held) = self.tools.get_mut(idx).and_then(Option::take) {
            let (rest, calls) = held.finish();
            if !rest.is_empty() {
                let delta = Delta {
                    content: Some(rest),
                    ..Delta::default()
                };
                frames.push(self.out.chunk(idx, delta, None, None, self.include_usage));
            }
            let calls = self.out.tool_calls(calls, true);
            if !calls.is_empty() {
                finish_reason = "tool_calls";
                let delta = Delta {
                    tool_calls: calls,
                    ..Delta::default()
                };
                frames.push(self.out.chunk(idx, delta, None, None, self.include_usage));
            }
        }
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
