//! The bridge from the engine's blocking [`RequestStream`] to async
//! handlers. One `spawn_blocking` task per request renders and tokenizes the
//! prompt, submits it (admission may wait for a step), then forwards each
//! event into a tokio channel. When the handler or the SSE body is dropped
//! (the client went away), the forward fails, the task drops the stream, and
//! the engine cancels the request and frees its blocks at the next step.

use std::sync::Arc;

use kiln_engine::{EngineHandle, Event, GenerationRequest, LoadedModel, RequestStream};
use kiln_sampling::SamplingParams;
use tokio::sync::{mpsc, oneshot, watch};

use crate::errors::ApiError;
use crate::metrics::Metrics;
use crate::state::AppState;

/// Events buffered between the engine and a slow client.
const EVENT_BUFFER: usize = 256;

/// What a request's preparation produced: the prompt and whatever else the
/// route needs later (the prompt text for `echo`, for example).
pub struct Prepared<T> {
    pub prompt: Vec<u32>,
    pub extra: T,
}

/// A request admitted by the engine.
pub struct Admitted<T> {
    pub extra: T,
    pub events: EventReceiver,
}

/// The events of one admitted request, as an async receiver. Dropping it
/// cancels the request.
pub struct EventReceiver {
    rx: mpsc::Receiver<Event>,
    cancel: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
}

impl EventReceiver {
    /// The next event; `None` when the engine stopped or the server is
    /// cancelling in-flight requests at shutdown. Finished requests are
    /// counted in the metrics here.
    pub async fn next(&mut self) -> Option<Event> {
        let event = tokio::select! {
            ev = self.rx.recv() => ev,
            _ = cancelled(&mut self.cancel) => None,
        };
        if let Some(Event::Finished { usage, .. }) = &event {
            self.metrics.record_usage(usage);
        }
        event
    }
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
}

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
    let engine = state.engine.clone();
    let (ready_tx, ready_rx) = oneshot::channel();
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    tokio::task::spawn_blocking(move || {
        let stream = match admit(&engine, generate, prepare) {
            Ok((extra, stream)) => {
                if ready_tx.send(Ok(extra)).is_err() {
                    return; // The client left while we prepared: cancel.
                }
                stream
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        for event in stream {
            if tx.blocking_send(event).is_err() {
                return; // The receiver is gone: dropping `stream` cancels.
            }
        }
    });
    let extra = ready_rx
        .await
        .map_err(|_| ApiError::Internal("the request's task ended before admission".into()))??;
    Ok(Admitted {
        extra,
        events: EventReceiver {
            rx,
            cancel: state.cancel.clone(),
            metrics: state.metrics.clone(),
        },
    })
}

fn admit<T, F>(
    engine: &EngineHandle,
    generate: Generate,
    prepare: F,
) -> Result<(T, RequestStream), ApiError>
where
    F: FnOnce(&LoadedModel) -> Result<Prepared<T>, ApiError>,
{
    let model = engine.model();
    let Prepared { prompt, extra } = prepare(model)?;
    check_context(prompt.len(), model.context_length())?;
    let stream = engine.submit(GenerationRequest {
        skip_special_tokens: generate.skip_special_tokens,
        ..GenerationRequest::new(prompt, generate.params)
    })?;
    Ok((extra, stream))
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
                "the prompt has {prompt_tokens} tokens, but the model's context is \
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
}
