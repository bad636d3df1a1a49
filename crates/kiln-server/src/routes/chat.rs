//! `POST /v1/chat/completions`: validate, render the template with the tools,
//! generate, and answer as one response or as an SSE stream; Hermes/Qwen
//! `<tool_call>` blocks in the output become `tool_calls`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{Event, LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled, SamplingParams};
use serde_json::Value;

use crate::errors::ApiError;
use crate::generation::{self, EventReceiver, Generate, Prepared};
use crate::json_body::{reject_unknown, ApiJson};
use crate::logprobs::TokenSpeller;
use crate::messages::{template_messages, template_tools};
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
}

fn validate(state: &AppState, req: ChatCompletionRequest) -> Result<ValidChat, ApiError> {
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
    if let Some(n) = req.n.filter(|&n| n != 1) {
        return Err(ApiError::unsupported(
            "n",
            format!("only one choice per request is supported (`n` = 1), got {n}"),
        ));
    }
    if req.store == Some(true) {
        return Err(ApiError::unsupported(
            "store",
            "Kiln stores nothing: `store` must be false",
        ));
    }
    if let Some(o) = &req.stream_options {
        reject_unknown(&o.extra, "stream_options.")?;
    }
    let tool_choice_none = match &req.tool_choice {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "auto" => false,
        Some(Value::String(s)) if s == "none" => true,
        Some(other) => {
            return Err(ApiError::unsupported(
                "tool_choice",
                format!("`tool_choice` must be \"auto\" or \"none\" for now, got {other}"),
            ))
        }
    };
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
    };
    let admitted = generation::start(&state, generate, move |model: &LoadedModel| {
        let mut ctx = model.tokenizer.chat_context(messages);
        ctx.tools = tools;
        ctx.add_generation_prompt = true;
        let rendered = model.render_chat_with(&ctx)?;
        let prompt = model.tokenizer.encode(&rendered, false)?;
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
        let first = out.chunk(
            Delta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..Delta::default()
            },
            None,
            None,
            v.include_usage,
        );
        let format = ChatStream {
            tools: parse_tools.then(|| ToolCallStream::new(v.tool_names)),
            include_usage: v.include_usage,
            out,
        };
        Ok(sse::response(admitted.events, format, vec![first]))
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

    /// Gathers the whole answer; tool calls are parsed when `tool_names`
    /// is not empty.
    async fn collect(
        self,
        mut events: EventReceiver,
        tool_names: &[String],
    ) -> Result<Response, ApiError> {
        let mut text = String::new();
        let mut logprobs = self.want_logprobs.then(ChatLogprobs::default);
        let (reason, usage) = loop {
            match events.next().await {
                Some(Event::Token {
                    text: t,
                    logprobs: s,
                    ..
                }) => {
                    text.push_str(&t);
                    if let (Some(lp), Some(mut entry)) =
                        (logprobs.as_mut(), self.logprobs(s.as_ref()))
                    {
                        lp.content.append(&mut entry.content);
                    }
                }
                Some(Event::Progress) => {}
                Some(Event::Finished {
                    finish_reason,
                    usage,
                    ..
                }) => break (finish_reason, usage),
                Some(Event::Failed { message }) => return Err(ApiError::Internal(message)),
                None => return Err(cancelled()),
            }
        };
        let (content, calls) = if !tool_names.is_empty() {
            let p = tool_calls::parse(&text, tool_names);
            (p.content, self.tool_calls(p.calls, false))
        } else {
            (Some(text), Vec::new())
        };
        let finish_reason = if calls.is_empty() {
            reason.as_openai_str()
        } else {
            "tool_calls"
        };
        let body = ChatCompletion {
            id: self.id,
            object: "chat.completion",
            created: self.created,
            model: self.model_name.to_string(),
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut {
                    role: "assistant",
                    content,
                    tool_calls: calls,
                },
                logprobs,
                finish_reason,
            }],
            usage: UsageOut::from(&usage),
        };
        Ok(Json(body).into_response())
    }

    fn chunk(
        &self,
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
                index: 0,
                delta,
                logprobs,
                finish_reason,
            }],
            usage: include_usage.then_some(None),
        })
    }
}

fn cancelled() -> ApiError {
    ApiError::Unavailable("the request was cancelled: the server is shutting down".into())
}

/// The chat chunk shapes of an SSE stream.
struct ChatStream {
    out: ChatOutput,
    /// Present when tool calls are parsed: holds text from `<tool_call>` on.
    tools: Option<ToolCallStream>,
    include_usage: bool,
}

impl StreamFormat for ChatStream {
    fn on_token(&mut self, text: &str, sampled: Option<&Sampled>) -> Vec<Bytes> {
        let content = match self.tools.as_mut() {
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
        vec![self.out.chunk(delta, logprobs, None, self.include_usage)]
    }

    fn on_finish(&mut self, reason: FinishReason, usage: &Usage) -> Vec<Bytes> {
        let mut frames = Vec::new();
        let mut finish_reason = reason.as_openai_str();
        if let Some(held) = self.tools.take() {
            let (rest, calls) = held.finish();
            if !rest.is_empty() {
                let delta = Delta {
                    content: Some(rest),
                    ..Delta::default()
                };
                frames.push(self.out.chunk(delta, None, None, self.include_usage));
            }
            let calls = self.out.tool_calls(calls, true);
            if !calls.is_empty() {
                finish_reason = "tool_calls";
                let delta = Delta {
                    tool_calls: calls,
                    ..Delta::default()
                };
                frames.push(self.out.chunk(delta, None, None, self.include_usage));
            }
        }
        frames.push(self.out.chunk(
            Delta::default(),
            None,
            Some(finish_reason),
            self.include_usage,
        ));
        if self.include_usage {
            frames.push(frame(&ChatCompletionChunk {
                id: &self.out.id,
                object: "chat.completion.chunk",
                created: self.out.created,
                model: &self.out.model_name,
                choices: Vec::new(),
                usage: Some(Some(UsageOut::from(usage))),
            }));
        }
        frames
    }
}
