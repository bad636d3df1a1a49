//! `POST /v1/completions`: a raw prompt (text or token ids), optionally
//! echoed, answered as one response or as an SSE stream.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{Event, LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled, MAX_LOGPROBS};
use serde_json::Value;

use crate::errors::ApiError;
use crate::generation::{self, Generate, Prepared};
use crate::json_body::{reject_unknown, ApiJson};
use crate::logprobs::TokenSpeller;
use crate::openai_types::completions::{Completion, CompletionChoice, CompletionRequest};
use crate::openai_types::{new_id, unix_now, CompletionLogprobs, UsageOut};
use crate::sampling::SamplingFields;
use crate::sse::{self, frame, StreamFormat};
use crate::state::AppState;

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: i64 = 16;

/// One prompt, as text or as token ids.
#[derive(Debug, PartialEq)]
enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

fn prompt_input(prompt: Value, vocab_size: usize) -> Result<PromptInput, ApiError> {
    let shape = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, a list of token ids, or a one-element list of either",
        )
    };
    let empty = || ApiError::invalid("prompt", "`prompt` is empty");
    let input = match prompt {
        Value::String(s) => PromptInput::Text(s),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            let mut ids = Vec::with_capacity(items.len());
            for (i, v) in items.iter().enumerate() {
                match v.as_u64().filter(|&id| id < vocab_size as u64) {
                    Some(id) => ids.push(id as u32),
                    None => {
                        return Err(ApiError::invalid(
                            format!("prompt[{i}]"),
                            format!(
                                "`prompt[{i}]` is {v}, not a token id of this model's \
                                 vocabulary of {vocab_size}"
                            ),
                        ))
                    }
                }
            }
            PromptInput::Tokens(ids)
        }
        Value::Array(mut items) if items.len() == 1 => match items.pop() {
            Some(inner @ (Value::String(_) | Value::Array(_))) => {
                return prompt_input(inner, vocab_size)
            }
            _ => return Err(shape()),
        },
        Value::Array(_) => {
            return Err(ApiError::unsupported(
                "prompt",
                "batched prompts are not supported yet: send one prompt per request",
            ))
        }
        _ => return Err(shape()),
    };
    match &input {
        PromptInput::Text(s) if s.is_empty() => Err(empty()),
        PromptInput::Tokens(t) if t.is_empty() => Err(empty()),
        _ => Ok(input),
    }
}

pub async fn handle(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
    if let Some(o) = &req.stream_options {
        reject_unknown(&o.extra, "stream_options.")?;
    }
    if let Some(n) = req.n.filter(|&n| n != 1) {
        return Err(ApiError::unsupported(
            "n",
            format!("only one choice per request is supported (`n` = 1), got {n}"),
        ));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if !(0..=MAX_LOGPROBS as i64).contains(&k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be in [0, {MAX_LOGPROBS}], got {k}"),
            ))
        }
        Some(k) => Some(k as usize),
    };
    let echo = req.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::unsupported(
            "echo",
            "`echo` with `logprobs` needs prompt logprobs, which Kiln does not compute yet",
        ));
    }
    let params = SamplingFields {
        max_tokens: Some((req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS), "max_tokens")),
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
        logprobs,
        max_temperature: crate::sampling::OPENAI_MAX_TEMPERATURE,
    }
    .into_params(state.vocab_size())?;
    let prompt = prompt_input(req.prompt, state.vocab_size())?;
    let generate = Generate {
        params,
        skip_special_tokens: true,
    };
    let admitted = generation::start(&state, generate, move |model: &LoadedModel| {
        let (ids, text) = match prompt {
            PromptInput::Text(s) => (model.tokenizer.encode(&s, true)?, s),
            PromptInput::Tokens(ids) if echo => {
                let text = model.tokenizer.decode(&ids, false)?;
                (ids, text)
            }
            PromptInput::Tokens(ids) => (ids, String::new()),
        };
        Ok(Prepared {
            prompt: ids,
            extra: echo.then_some(text),
        })
    })
    .await?;
    let mut out = CompletionOutput {
        id: new_id("cmpl-"),
        created: unix_now(),
        model_name: state.model_name.clone(),
        model: state.engine.model().clone(),
        logprobs: logprobs.map(|_| CompletionLogprobs::default()),
        text: admitted.extra.unwrap_or_default(),
        include_usage: req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    };
    if req.stream.unwrap_or(false) {
        let mut first = Vec::new();
        if !out.text.is_empty() {
            first.push(out.chunk(out.text.clone(), None, None));
        }
        return Ok(sse::response(admitted.events, out, first));
    }
    let mut events = admitted.events;
    loop {
        match events.next().await {
            Some(Event::Token { text, logprobs, .. }) => {
                out.push(&text, logprobs.as_ref());
            }
            Some(Event::Progress) => {}
            Some(Event::Finished {
                finish_reason,
                usage,
                ..
            }) => return Ok(out.response(finish_reason, &usage)),
            Some(Event::Failed { message }) => return Err(ApiError::Internal(message)),
            None => {
                return Err(ApiError::Unavailable(
                    "the request was cancelled: the server is shutting down".into(),
                ))
            }
        }
    }
}

/// The text and logprobs of one request, as they accumulate.
struct CompletionOutput {
    id: String,
    created: u64,
    model_name: Arc<str>,
    model: Arc<LoadedModel>,
    /// Accumulated (non-streaming) or per-chunk (streaming) logprobs.
    logprobs: Option<CompletionLogprobs>,
    /// The text so far, echoed prompt included; its length is the next
    /// token's `text_offset`.
    text: String,
    include_usage: bool,
}

impl CompletionOutput {
    fn push(&mut self, text: &str, sampled: Option<&Sampled>) {
        if let (Some(lp), Some(s)) = (self.logprobs.as_mut(), sampled) {
            TokenSpeller::new(&self.model.tokenizer).push_completion(lp, s, self.text.len());
        }
        self.text.push_str(text);
    }

    fn response(self, reason: FinishReason, usage: &Usage) -> Response {
        Json(Completion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model_name,
            choices: vec![CompletionChoice {
                index: 0,
                text: self.text,
                logprobs: self.logprobs,
                finish_reason: Some(reason.as_openai_str()),
            }],
            usage: Some(Some(UsageOut::from(usage))),
        })
        .into_response()
    }

    fn chunk(
        &self,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> Bytes {
        frame(&Completion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model_name,
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs,
                finish_reason,
            }],
            usage: self.include_usage.then_some(None),
        })
    }
}

impl StreamFormat for CompletionOutput {
    fn on_token(&mut self, text: &str, sampled: Option<&Sampled>) -> Vec<Bytes> {
        let mut logprobs = None;
        if let (Some(_), Some(s)) = (self.logprobs.as_ref(), sampled) {
            let mut lp = CompletionLogprobs::default();
            TokenSpeller::new(&self.model.tokenizer).push_completion(&mut lp, s, self.text.len());
            logprobs = Some(lp);
        }
        self.text.push_str(text);
        if text.is_empty() && logprobs.is_none() {
            return Vec::new();
        }
        vec![self.chunk(text.to_string(), logprobs, None)]
    }

    fn on_finish(&mut self, reason: FinishReason, usage: &Usage) -> Vec<Bytes> {
        let mut frames = vec![self.chunk(String::new(), None, Some(reason.as_openai_str()))];
        if self.include_usage {
            frames.push(frame(&Completion {
                id: &self.id,
                object: "text_completion",
                created: self.created,
                model: &self.model_name,
                choices: Vec::new(),
                usage: Some(Some(UsageOut::from(usage))),
            }));
        }
        frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        let p = |v: Value| prompt_input(v, 100);
        assert_eq!(p(json!("hi")).unwrap(), PromptInput::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), PromptInput::Tokens(vec![1, 2]));
        assert_eq!(p(json!([[3]])).unwrap(), PromptInput::Tokens(vec![3]));
        assert_eq!(p(json!(["x"])).unwrap(), PromptInput::Text("x".into()));
        let param = |v: Value| p(v).unwrap_err().body()["error"]["param"].clone();
        assert_eq!(param(json!([1, 100])), json!("prompt[1]"));
        assert_eq!(param(json!([1, -1])), json!("prompt[1]"));
        assert_eq!(param(json!(["a", "b"])), json!("prompt"));
        assert_eq!(param(json!("")), json!("prompt"));
        assert_eq!(param(json!([])), json!("prompt"));
        assert_eq!(param(json!({"a": 1})), json!("prompt"));
    }
}
