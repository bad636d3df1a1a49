//! Server-sent events: `data: {json}\n\n` frames from a request's events,
//! ending with `data: [DONE]` (or, for Anthropic, `event:`-named frames
//! and no end marker). Each API shapes its frames through
//! [`StreamFormat`]; this file owns the framing, the end of the stream and
//! the failure cases, the interleaving of a request's choices (`n` > 1), and
//! keep-alive: when no frame was sent for the configured interval (a request
//! waiting in the queue or in a long prefill), a comment line `: ping` (or
//! the API's own ping event) goes out so proxies and clients keep the
//! connection. Dropping the body (the client went away) drops the
//! [`EventReceiver`], which cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use kiln_engine::{Event, Usage};
use kiln_sampling::{FinishReason, Sampled};
use serde::Serialize;

use crate::errors::{ApiError, ErrorShape};
use crate::generation::{cancelled_error, total_usage, EventReceiver};
use tokio::time::Instant;

/// How one API turns a request's events into SSE payloads.
pub trait StreamFormat: Send + 'static {
    /// Frames for the text a generated token of choice `choice` released
    /// (or text flushed at the end, which has no `sampled`); usually zero
    /// or one.
    fn on_token(&mut self, choice: usize, text: &str, sampled: Option<&Sampled>) -> Vec<Bytes>;
    /// The last payloads of choice `choice`: its finish reason, any held
    /// text, and (for APIs with one choice) the usage.
    fn on_finish(&mut self, choice: usize, reason: FinishReason, usage: &Usage) -> Vec<Bytes>;
    /// Payloads after every choice finished, given their total usage.
    fn on_end(&mut self, _usage: &Usage) -> Vec<Bytes> {
        Vec::new()
    }
    /// The frame sent when nothing else was for the keep-alive interval
    /// (`None`: the format has none, and nothing is sent).
    fn keepalive_frame(&self) -> Option<Bytes> {
        Some(Bytes::from_static(b": ping\n\n"))
    }
    /// The response's content type.
    fn content_type(&self) -> &'static str {
        "text/event-stream"
    }
    /// The frame that reports a failure mid-stream.
    fn error_frame(&mut self, e: &ApiError) -> Bytes {
        Bytes::from(format!("data: {}\n\n", e.body()))
    }
    /// The frame after the last one, if the API has one (`data: [DONE]`).
    fn end_frame(&self) -> Option<Bytes> {
        Some(Bytes::from_static(DONE))
    }
}

/// One `data:` frame.
pub fn frame(payload: &impl Serialize) -> Bytes {
    match serde_json::to_string(payload) {
        Ok(json) => Bytes::from(format!("data: {json}\n\n")),
        Err(e) => Bytes::from(format!(
            "data: {}\n\n",
            ApiError::Internal(e.to_string()).body()
        )),
    }
}

/// One `event: {name}` frame (Anthropic's streams name every event).
pub fn event_frame(name: &str, payload: &impl Serialize) -> Bytes {
    match serde_json::to_string(payload) {
        Ok(json) => Bytes::from(format!("event: {name}\ndata: {json}\n\n")),
        Err(e) => Bytes::from(format!(
            "event: error\ndata: {}\n\n",
            ApiError::Internal(e.to_string()).body_in(ErrorShape::Anthropic)
        )),
    }
}

const DONE: &[u8] = b"data: [DONE]\n\n";

struct SseState<F> {
    events: EventReceiver,
    format: F,
    queue: VecDeque<Bytes>,
    done: bool,
    /// Each choice's usage once it finished.
    usages: Vec<Option<Usage>>,
    /// A keep-alive frame goes out when nothing was sent for this long
    /// (never when zero).
    keepalive: Duration,
    last_sent: Instant,
}

impl<F: StreamFormat> SseState<F> {
    async fn next_frame(&mut self) -> Option<Bytes> {
        let frame = self.produce().await;
        self.last_sent = Instant::now();
        frame
    }

    async fn produce(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.queue.pop_front() {
                return Some(b);
            }
            if self.done {
                return None;
            }
            let item = if self.keepalive.is_zero() {
                self.events.next_indexed().await
            } else {
                let deadline = self.last_sent + self.keepalive;
                // `next_indexed` loses nothing when the deadline wins.
                match tokio::time::timeout_at(deadline, self.events.next_indexed()).await {
                    Ok(item) => item,
                    // (A format without keep-alives streams with none: `response`.)
                    Err(_) => return Some(self.format.keepalive_frame().unwrap_or_default()),
                }
            };
            match item {
                Some((idx, Event::Token { text, logprobs, .. })) => {
                    self.queue
                        .extend(self.format.on_token(idx, &text, logprobs.as_ref()));
                }
                Some((_, Event::Progress)) => {}
                Some((
                    idx,
                    Event::Finished {
                        finish_reason,
                        usage,
                        ..
                    },
                )) => {
                    self.queue
                        .extend(self.format.on_finish(idx, finish_reason, &usage));
                    if let Some(slot) = self.usages.get_mut(idx) {
                        *slot = Some(usage);
                    }
                    if self.usages.iter().all(Option::is_some) {
                        let total = total_usage(self.usages.iter().flatten());
                        self.queue.extend(self.format.on_end(&total));
                        self.end();
                    }
                }
                Some((_, Event::Failed { message, retryable })) => {
                    let e = crate::generation::failure(message, retryable);
                    self.queue.push_back(self.format.error_frame(&e));
                    self.end();
                }
                None => {
                    let e = cancelled_error();
                    self.queue.push_back(self.format.error_frame(&e));
                    self.end();
                }
            }
        }
    }

    fn end(&mut self) {
        self.queue.extend(self.format.end_frame());
        self.done = true;
    }
}

/// An SSE response: `first` frames, then the request's events (every
/// choice's, interleaved as they come) as `format` shapes them, with a
/// keep-alive frame after each `keepalive` of silence, then `[DONE]`.
pub fn response<F: StreamFormat>(
    events: EventReceiver,
    format: F,
    first: Vec<Bytes>,
    keepalive: Duration,
) -> Response {
    let content_type = format.content_type();
    let keepalive = match format.keepalive_frame() {
        Some(_) => keepalive,
        None => Duration::ZERO,
    };
    let state = SseState {
        usages: vec![None; events.num_choices()],
        events,
        format,
        queue: first.into(),
        done: false,
        keepalive,
        last_sent: Instant::now(),
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        s.next_frame()
            .await
            .map(|b| (Ok::<Bytes, Infallible>(b), s))
    });
    let mut r = Body::from_stream(stream).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}
