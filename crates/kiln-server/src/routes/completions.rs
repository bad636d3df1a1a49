//! `POST /v1/completions`: a raw prompt (text or token ids), optionally
//! echoed, answered as one response or as an SSE stream.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled, MAX_LOGPROBS};
use serde_json::Value;

use crate::errors::ApiError;
use crate::generation::{self, Collected, Generate, Prepared};
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
    ApiJson(mut req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let format = crate::structured::take_format(&mut req.extra)
        .map_err(|(param, reason)| ApiError::invalid(&param, reason))?;
    reject_unknown(&req.extra, "")?;
    let adapter = state.resolve_adapter(req.model.as_deref()).await?;
    state.check_generates()?;
    if let Some(o) = &req.stream_options {
        reject_unknown(&o.extra, "stream_options.")?;
    }
    let n = generation::choices(req.n)?;
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
        max_tokens: crate::sampling::token_limit(
            &[
                (req.max_tokens, "max_tokens"),
                (req.max_new_tokens, "max_new_tokens"),
            ],
            req.n_predict,
        )
        // `n_predict: -1` asks for no limit (the context bounds it).
        .or((!req.n_predict.is_some_and(|n| n < 0)).then_some((DEFAULT_MAX_TOKENS, "max_tokens"))),
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
    .into_params(state.vocab_size(), &state.sampling_defaults)?;
    let prompt = prompt_input(req.prompt, state.vocab_size())?;
    let generate = Generate {
        params,
        skip_special_tokens: true,
        format,
        adapter,
        prediction: None,
    };
    let admitted = generation::start_choices(&state, generate, n, move |model: &LoadedModel| {
        let (ids, text) = match prompt {
            PromptInput::Text(s) => (model.tokenizer.encode(&s, true)?, s),
            PromptInput::Tokens(ids) if echo => {
                let text = model.tokenizer.decode(&ids, false)?;
                (ids, text)
            }
            PromptInput::Tokens(ids) => (ids, String::new()),
        };
        Ok(Prepared::new(ids, echo.then_some(text)))
    })
    .await?;
    let echoed = admitted.extra.unwrap_or_default();
    let mut out = CompletionOutput {
        id: new_id("cmpl-"),
        created: unix_now(),
        model_name: state.model_name.clone(),
        model: state.engine.model().clone(),
        choices: (0..n)
            .map(|_| ChoiceText {
                text: echoed.clone(),
                logprobs: logprobs.map(|_| CompletionLogprobs::default()),
            })
            .collect(),
        include_usage: req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
    };
    if req.stream.unwrap_or(false) {
        let mut first = Vec::new();
        if !echoed.is_empty() {
            for idx in 0..n {
                first.push(out.chunk(idx, echoed.clone(), None, None));
            }
        }
        return Ok(sse::response(
            admitted.events,
            out,
            first,
            state.sse_keepalive,
        ));
    }
    let collected = admitted
        .events
        .collect_all(|idx, text, sampled| out.push(idx, text, sampled))
        .await?;
    Ok(out.response(&collected))
}

/// The text and logprobs of every choice of one request, as they
/// accumulate.
struct CompletionOutput {
    id: String,
    created: u64,
    model_name: Arc<str>,
    model: Arc<LoadedModel>,
    choices: Vec<ChoiceText>,
    include_usage: bool,
}

/// One choice so far.
struct ChoiceText {
    /// The text so far, echoed prompt included; its length is the next
    /// token's `text_offset`.
    text: String,
    /// Accumulated (non-streaming) logprobs; when streaming, present only
    /// to say they were asked for.
    logprobs: Option<CompletionLogprobs>,
}

impl CompletionOutput {
    fn push(&mut self, idx: usize, text: &str, sampled: Option<&Sampled>) {
        let Some(choice) = self.choices.get_mut(idx) else {
            return;
        };
        if let (Some(lp), Some(s)) = (choice.logprobs.as_mut(), sampled) {
            TokenSpeller::new(&self.model.tokenizer).push_completion(lp, s, choice.text.len());
        }
        choice.text.push_str(text);
    }

    fn response(self, collected: &[Collected]) -> Response {
        let usage = generation::total_usage(collected.iter().map(|c| &c.usage));
        let choices = self
            .choices
            .into_iter()
            .zip(collected)
            .enumerate()
            .map(|(idx, (choice, c))| CompletionChoice {
                index: idx as u32,
                text: choice.text,
                logprobs: choice.logprobs,
                finish_reason: Some(c.finish_reason.as_openai_str()),
            })
            .collect();
        Json(Completion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model_name,
            choices,
            usage: Some(Some(UsageOut::from(&usage))),
        })
        .into_response()
    }

    fn chunk(
        &self,
        idx: usize,
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
                index: idx as u32,
                text,
                logprobs,
                finish_reason,
            }],
            usage: self.include_usage.then_some(None),
        })
    }
}

impl StreamFormat for CompletionOutput {
    fn on_token(&mut self, idx: usize, text: &str, sampled: Option<&Sampled>) -> Vec<Bytes> {
        let Some(choice) = self.choices.get_mut(idx) else {
            return Vec::new();
        };
        let mut logprobs = None;
        if let (Some(_), Some(s)) = (choice.logprobs.as_ref(), sampled) {
            let mut lp = CompletionLogprobs::default();
            TokenSpeller::new(&self.model.tokenizer).push_completion(&mut lp, s, choice.text.len());
            logprobs = Some(lp);
        }
        choice.text.push_str(text);
        if text.is_empty() && logprobs.is_none() {
            return Vec::new();
        }
        vec![self.chunk(idx, text.to_string(), logprobs, None)]
    }

    fn on_finish(&mut self, idx: usize, reason: FinishReason, _usage: &Usage) -> Vec<Bytes> {
        vec![self.chunk(idx, String::new(), None, Some(reason.as_openai_str()))]
    }

    fn on_end(&mut self, usage: &Usage) -> Vec<Bytes> {
        if !self.include_usage {
            return Vec::new();
        }
        vec![frame(&Completion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: &self.model_name,
            choices: Vec::new(),
            usage: Some(Some(UsageOut::from(usage))),
        })]
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
