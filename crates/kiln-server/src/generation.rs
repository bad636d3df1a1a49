//! The bridge from the engine's blocking [`RequestStream`] to async
//! handlers. One `spawn_blocking` task per request renders and tokenizes the
//! prompt, submits it (admission may wait for a step), then forwards each
//! event into a tokio channel. When the handler or the SSE body is dropped
//! (the client went away), the forward fails, the task drops the stream, and
//! the engine cancels the request and frees its blocks at the next step.

use std::sync::Arc;
use std::time::Instant;

use kiln_engine::{
    EngineHandle, Event, GenerationRequest, LoadedModel, ReasoningTags, RequestStream, Usage,
};
use kiln_sampling::{FinishReason, Sampled, SamplingParams};
use serde_json::{Map, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::access_log::{self, Record};
use crate::errors::ApiError;
use crate::metrics::Metrics;
use crate::parse::{OutputOverrides, OutputSyntax, ThinkSyntax, ToolSyntax};
use crate::state::AppState;

/// Events buffered between the engine and a slow client.
const EVENT_BUFFER: usize = 256;

/// What a request's preparation produced: the prompt and whatever else the
/// route needs later (the prompt text for `echo`, for example).
pub struct Prepared<T> {
    pub prompt: Vec<u32>,
    pub extra: T,
    /// The reasoning block an output format must leave alone, when the
    /// model thinks.
    pub reasoning: Option<ReasoningTags>,
}

impl<T> Prepared<T> {
    pub fn new(prompt: Vec<u32>, extra: T) -> Self {
        Prepared {
            prompt,
            extra,
            reasoning: None,
        }
    }
}

/// A request admitted by the engine.
pub struct Admitted<T> {
    pub extra: T,
    pub events: EventReceiver,
}

/// The events of one admitted request (all its choices when `n` > 1, each
/// tagged with its choice's index), as an async receiver. Dropping it
/// cancels every choice.
pub struct EventReceiver {
    rx: mpsc::Receiver<(usize, Event)>,
    cancel: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    /// When generation started (before rendering and tokenizing).
    started: Instant,
    /// Per choice: when its last token arrived.
    last_token: Vec<Option<Instant>>,
    /// The request's access-log record, noting tokens and usage.
    access: Option<Arc<Record>>,
}

impl EventReceiver {
    /// How many choices (engine requests) this receiver carries.
    pub fn num_choices(&self) -> usize {
        self.last_token.len()
    }

    /// The next event and its choice's index; `None` when the engine
    /// stopped or the server is cancelling in-flight requests at shutdown.
    /// Latencies and the usage of finished requests are recorded here.
    pub async fn next_indexed(&mut self) -> Option<(usize, Event)> {
        let item = tokio::select! {
            ev = self.rx.recv() => ev,
            _ = cancelled(&mut self.cancel) => None,
        };
        if let Some((idx, event)) = &item {
            self.observe(*idx, event);
        }
        item
    }

    fn observe(&mut self, idx: usize, event: &Event) {
        let now = Instant::now();
        let latency = &self.metrics.latency;
        match event {
            // Text flushed at the end (no token id) is not a token.
            Event::Token { token_id, .. } if *token_id != u32::MAX => {
                if let Some(access) = &self.access {
                    access.token(now);
                }
                let Some(last) = self.last_token.get_mut(idx) else {
                    return;
                };
                match last.replace(now) {
                    Some(prev) => latency.inter_token.observe((now - prev).as_secs_f64()),
                    None => latency
                        .time_to_first_token
                        .observe((now - self.started).as_secs_f64()),
                }
            }
            Event::Finished {
                usage,
                timings,
                finish_reason,
            } => {
                if let Some(access) = &self.access {
                    access.finished(usage, *finish_reason);
                }
                self.metrics.record_usage(usage);
                latency.queue.observe(timings.queue_seconds);
                latency
                    .end_to_end
                    .observe((now - self.started).as_secs_f64());
            }
            _ => {}
        }
    }

    /// Gathers the whole answer of a one-choice request; `on_token` sees
    /// each token's text and, when logprobs were asked for, what was
    /// sampled.
    pub async fn collect(
        self,
        mut on_token: impl FnMut(&str, Option<&Sampled>),
    ) -> Result<Collected, ApiError> {
        let mut all = self.collect_all(|_, t, s| on_token(t, s)).await?;
        all.pop()
            .ok_or_else(|| ApiError::Internal("a request without a choice".into()))
    }

    /// Gathers every choice's answer, in index order; `on_token` sees the
    /// choice's index, each token's text and what was sampled.
    pub async fn collect_all(
        mut self,
        mut on_token: impl FnMut(usize, &str, Option<&Sampled>),
    ) -> Result<Vec<Collected>, ApiError> {
        let mut texts = vec![String::new(); self.num_choices()];
        let mut done: Vec<Option<Collected>> = vec![None; self.num_choices()];
        while done.iter().any(Option::is_none) {
            let Some((idx, event)) = self.next_indexed().await else {
                return Err(cancelled_error());
            };
            let (Some(text), Some(slot)) = (texts.get_mut(idx), done.get_mut(idx)) else {
                continue;
            };
            match event {
                Event::Token {
                    text: t, logprobs, ..
                } => {
                    on_token(idx, &t, logprobs.as_ref());
                    text.push_str(&t);
                }
                Event::Progress => {}
                Event::Finished {
                    finish_reason,
                    usage,
                    ..
                } => {
                    *slot = Some(Collected {
                        text: std::mem::take(text),
                        finish_reason,
                        usage,
                    })
                }
                Event::Failed { message, retryable } => return Err(failure(message, retryable)),
            }
        }
        Ok(done.into_iter().flatten().collect())
    }
}

/// The usage of a request with several choices: the prompt counted once
/// (with the first choice's cached tokens), the completions summed.
pub fn total_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>) -> Usage {
    let mut total = Usage::default();
    for (i, u) in usages.into_iter().enumerate() {
        if i == 0 {
            total.prompt_tokens = u.prompt_tokens;
            total.cached_tokens = u.cached_tokens;
        }
        total.completion_tokens += u.completion_tokens;
        total.draft_tokens += u.draft_tokens;
        total.accepted_draft_tokens += u.accepted_draft_tokens;
    }
    total
}

/// A whole answer.
#[derive(Clone)]
pub struct Collected {
    pub text: String,
    pub finish_reason: FinishReason,
    pub usage: Usage,
}

/// The error of a request that ended without finishing: the engine stopped
/// or the server cancelled it at shutdown.
pub fn cancelled_error() -> ApiError {
    ApiError::Unavailable("the request was cancelled: the server is shutting down".into())
}

/// How to render a chat prompt besides its messages.
#[derive(Debug, Clone, Default)]
pub struct ChatRender {
    /// Tool definitions for the template.
    pub tools: Option<Value>,
    /// The declared tools' names: their calls are parsed from the output
    /// (none: no tool parsing).
    pub tool_names: Vec<String>,
    /// The template's `enable_thinking` switch.
    pub enable_thinking: Option<bool>,
    /// Further template variables (`chat_template_kwargs`,
    /// `reasoning_effort`).
    pub kwargs: Map<String, Value>,
    /// The server's say on the output syntax.
    pub overrides: OutputOverrides,
}

/// A rendered, tokenized chat prompt and how to read what follows it.
pub struct ChatPrompt {
    pub tokens: Vec<u32>,
    pub syntax: OutputSyntax,
}

impl ChatPrompt {
    /// The prompt, prepared: an output format applies after the reasoning.
    pub fn prepared<T>(self, extra: T) -> Prepared<T> {
        let reasoning = self.syntax.think.as_ref().map(|(t, opened)| ReasoningTags {
            open: t.open.clone(),
            close: t.close.clone(),
            opened: *opened,
        });
        Prepared {
            prompt: self.tokens,
            extra,
            reasoning,
        }
    }
}

/// The model's chat template source (empty when it has none).
pub fn template_source(model: &LoadedModel) -> &str {
    model.tokenizer.chat_template().unwrap_or_default()
}

/// The tool-call syntax the model writes: as the server says, else the one
/// its template teaches.
pub fn tool_syntax(model: &LoadedModel, overrides: &OutputOverrides) -> ToolSyntax {
    overrides
        .tool_syntax
        .unwrap_or_else(|| ToolSyntax::detect(template_source(model)))
}

/// Whether the model writes reasoning blocks: as the server says, else
/// when its template mentions them.
pub fn thinks(state: &AppState) -> bool {
    let template = template_source(state.engine.model());
    harmony(template)
        || state
            .output
            .reasoning
            .unwrap_or_else(|| ThinkSyntax::detect(template).is_some())
}

/// Whether the template writes gpt-oss's harmony messages (channels).
pub fn harmony(template: &str) -> bool {
    template.contains("<|channel|>")
}

/// Renders template `messages` (with `render`'s tools and variables) with
/// the generation prompt and tokenizes the result: the prompt of every
/// chat-style route, with the syntax its output is read with.
pub fn chat_prompt(
    model: &LoadedModel,
    messages: Value,
    render: ChatRender,
) -> Result<ChatPrompt, ApiError> {
    let mut ctx = model.tokenizer.chat_context(messages);
    ctx.tools = render.tools;
    ctx.add_generation_prompt = true;
    ctx.enable_thinking = render.enable_thinking;
    ctx.extra.extend(render.kwargs);
    let rendered = model.render_chat_with(&ctx)?;
    let template = template_source(model);
    let think = match render.overrides.reasoning {
        Some(false) => None,
        Some(true) => ThinkSyntax::detect("<think>"),
        None => ThinkSyntax::detect(template),
    }
    .map(|t| {
        let opened = rendered.trim_end().ends_with(&t.open);
        (t, opened)
    });
    let syntax = tool_syntax(model, &render.overrides);
    let tools = (!render.tool_names.is_empty()).then_some((syntax, render.tool_names));
    Ok(ChatPrompt {
        tokens: model.tokenizer.encode(&rendered, false)?,
        syntax: match harmony(template) {
            true => OutputSyntax {
                harmony: true,
                tools,
                ..OutputSyntax::default()
            },
            false => OutputSyntax {
                think,
                tools,
                forced_call: false,
                harmony: false,
            },
        },
    })
}

/// Resolves when `cancel` becomes true; never if its sender is gone.
async fn cancelled(cancel: &mut watch::Receiver<bool>) {
    if cancel.wait_for(|&c| c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// How to generate, besides the prompt.
pub struct Generate {
    pub params: SamplingParams,
    /// Leave special tokens out of the text. Tool-call parsing turns it
    /// off: some vocabularies spell `<tool_call>` as a special token.
    pub skip_special_tokens: bool,
    /// The output format the request asked for, if any.
    pub format: Option<kiln_structured::Format>,
    /// The LoRA adapter the request's `model` names, if any.
    pub adapter: Option<std::sync::Arc<kiln_engine::LoraAdapter>>,
    /// The output the client predicts (OpenAI's `prediction`), verified
    /// as draft tokens.
    pub prediction: Option<String>,
}

/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 8;

/// Prepares (off the async threads), checks the context length, submits,
/// and returns once the engine has admitted or refused the request.
pub async fn start<T, F>(
    state: &AppState,
    generate: Generate,
    prepare: F,
) -> Result<Admitted<T>, ApiError>
where
    T: Send + 'static,
    F: FnOnce(&LoadedModel) -> Result<Prepared<T>, ApiError> + Send + 'static,
{
    start_choices(state, generate, 1, prepare).await
}

/// Like [`start`], for `n` choices of one prompt: the prompt is prepared
/// once and submitted `n` times, choice `i` seeded with the request's seed
/// plus `i` (so a seeded request is reproducible and its first choice is
/// the one `n` = 1 gives). Every choice is admitted or none is.
pub async fn start_choices<T, F>(
    state: &AppState,
    generate: Generate,
    n: usize,
    prepare: F,
) -> Result<Admitted<T>, ApiError>
where
    T: Send + 'static,
    F: FnOnce(&LoadedModel) -> Result<Prepared<T>, ApiError> + Send + 'static,
{
    let started = Instant::now();
    let n = n.clamp(1, MAX_CHOICES);
    let engine = state.engine.clone();
    let runtime = tokio::runtime::Handle::current();
    let (ready_tx, ready_rx) = oneshot::channel();
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    tokio::task::spawn_blocking(move || {
        let (extra, mut streams) = match admit(&engine, generate, n, prepare) {
            Ok(admitted) => admitted,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        if ready_tx.send(Ok(extra)).is_err() {
            return; // The client left while we prepared: cancel.
        }
        // Choice 0 is forwarded on this thread, the others on their own.
        let first = streams.remove(0);
        for (i, stream) in streams.into_iter().enumerate() {
            let tx = tx.clone();
            runtime.spawn_blocking(move || forward(i + 1, stream, &tx));
        }
        forward(0, first, &tx);
    });
    let extra = ready_rx
        .await
        .map_err(|_| ApiError::Internal("the request's task ended before admission".into()))??;
    let access = access_log::current();
    if let Some(access) = &access {
        access.admitted();
    }
    Ok(Admitted {
        extra,
        events: EventReceiver {
            rx,
            cancel: state.cancel.clone(),
            metrics: state.metrics.clone(),
            started,
            last_token: vec![None; n],
            access,
        },
    })
}

/// How often a request that has no event yet (queued, or in a long
/// prefill) checks whether its client is still there.
const CLIENT_CHECK: std::time::Duration = std::time::Duration::from_millis(200);

/// Sends a stream's events, tagged with `idx`, until it ends or the
/// receiver is gone — also while no event comes, so a request whose client
/// left while queued is dropped from the queue (dropping `stream` cancels
/// the request).
fn forward(idx: usize, stream: RequestStream, tx: &mpsc::Sender<(usize, Event)>) {
    loop {
        match stream.next_event_timeout(CLIENT_CHECK) {
            Ok(Some(event)) => {
                if tx.blocking_send((idx, event)).is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Err(()) if tx.is_closed() => return,
            Err(()) => {}
        }
    }
}

fn admit<T, F>(
    engine: &EngineHandle,
    generate: Generate,
    n: usize,
    prepare: F,
) -> Result<(T, Vec<RequestStream>), ApiError>
where
    F: FnOnce(&LoadedModel) -> Result<Prepared<T>, ApiError>,
{
    let model = engine.model();
    let Prepared {
        prompt,
        extra,
        reasoning,
    } = prepare(model)?;
    check_context(prompt.len(), engine.context_length())?;
    let prediction = match &generate.prediction {
        Some(p) => Some(model.tokenizer.encode(p, false)?),
        None => None,
    };
    let mut streams = Vec::with_capacity(n);
    for i in 0..n {
        let mut params = generate.params.clone();
        params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
        // A refusal drops the streams already admitted, which cancels them.
        streams.push(engine.submit(GenerationRequest {
            skip_special_tokens: generate.skip_special_tokens,
            format: generate.format.clone(),
            reasoning: reasoning.clone(),
            adapter: generate.adapter.clone(),
            prediction: prediction.clone(),
            ..GenerationRequest::new(prompt.clone(), params)
        })?);
    }
    Ok((extra, streams))
}

/// Reads `n` from a request: absent means 1; at most [`MAX_CHOICES`].
pub fn choices(n: Option<i64>) -> Result<usize, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
        )),
    }
}

/// Refuses a prompt that leaves no room in the context for one token.
pub fn check_context(prompt_tokens: usize, context_length: usize) -> Result<(), ApiError> {
    if prompt_tokens == 0 {
        return Err(ApiError::InvalidRequest {
            message: "the prompt is empty: at least one token is needed".into(),
            param: None,
        });
    }
    if prompt_tokens >= context_length {
        return Err(ApiError::ContextLengthExceeded {
            message: format!(
                "the prompt has {prompt_tokens} tokens, but the served context is \
                 {context_length} tokens (at most {} prompt tokens leave room to generate)",
                context_length.saturating_sub(1)
            ),
            param: None,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_check_gives_the_numbers() {
        assert!(check_context(10, 11).is_ok());
        let msg = check_context(9000, 8192).unwrap_err().to_string();
        assert!(msg.contains("9000") && msg.contains("8192"), "{msg}");
        assert!(check_context(0, 8192).is_err());
    }

    #[test]
    fn choices_are_bounded() {
        assert_eq!(choices(None).unwrap(), 1);
        assert_eq!(choices(Some(8)).unwrap(), 8);
        for bad in [0, -1, 9, i64::MAX] {
            let e = choices(Some(bad)).unwrap_err();
            assert_eq!(e.body()["error"]["param"], "n", "{bad}");
        }
    }

    #[test]
    fn usage_counts_the_prompt_once() {
        let u = |p, c, k| Usage {
            prompt_tokens: p,
            cached_tokens: c,
            completion_tokens: k,
            ..Usage::default()
        };
        let total = total_usage(&[u(10, 0, 3), u(10, 8, 5)]);
        assert_eq!(total, u(10, 0, 8));
        assert_eq!(total_usage(&[]), Usage::default());
    }
}

/// A request the engine failed: 503 when the engine failed and restarts
/// (retrying may succeed), 500 for this request alone.
pub(crate) fn failure(message: String, retryable: bool) -> ApiError {
    match retryable {
        true => ApiError::Unavailable(message),
        false => ApiError::Internal(message),
    }
}
