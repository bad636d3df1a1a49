//! Server-sent events: `data: {json}\n\n` frames from a request's events,
//! ending with `data: [DONE]` (or, for Anthropic, `event:`-named frames
//! and no end marker). Each API shapes its frames through
//! [`StreamFormat`]; this file owns the framing, the end of the stream and
//! the failure cases. Dropping the body (the client went away) drops the
//! [`EventReceiver`], which cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use kiln_engine::{Event, Usage};
use kiln_sampling::{FinishReason, Sampled};
use serde::Serialize;

use crate::errors::{ApiError, ErrorShape};
use crate::generation::EventReceiver;

/// How one API turns a request's events into SSE payloads.
pub trait StreamFormat: Send + 'static {
    /// Frames for the text a generated token released (or text flushed at
    /// the end, which has no `sampled`); usually zero or one.
    fn on_token(&mut self, text: &str, sampled: Option<&Sampled>) -> Vec<Bytes>;
    /// The last payloads: the finish reason, any held text, the usage.
    fn on_finish(&mut self, reason: FinishReason, usage: &Usage) -> Vec<Bytes>;
    /// The frame that reports a failure mid-stream.
    fn error_frame(&self, e: &ApiError) -> Bytes {
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
}

impl<F: StreamFormat> SseState<F> {
    async fn next_frame(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.queue.pop_front() {
                return Some(b);
            }
            if self.done {
                return None;
            }
            match self.events.next().await {
                Some(Event::Token { text, logprobs, .. }) => {
                    self.queue
                        .extend(self.format.on_token(&text, logprobs.as_ref()));
                }
                Some(Event::Progress) => {}
                Some(Event::Finished {
                    finish_reason,
                    usage,
                    ..
                }) => {
                    self.queue
                        .extend(self.format.on_finish(finish_reason, &usage));
                    self.end();
                }
                Some(Event::Failed { message }) => {
                    let e = ApiError::Internal(message);
                    self.queue.push_back(self.format.error_frame(&e));
                    self.end();
                }
                None => {
                    let e = ApiError::Unavailable(
                        "the request was cancelled: the server is shutting down".into(),
                    );
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

/// An SSE response: `first` frames, then the request's events as `format`
/// shapes them, then `[DONE]`.
pub fn response<F: StreamFormat>(events: EventReceiver, format: F, first: Vec<Bytes>) -> Response {
    let state = SseState {
        events,
        format,
        queue: first.into(),
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        s.next_frame()
            .await
            .map(|b| (Ok::<Bytes, Infallible>(b), s))
    });
    let mut r = Body::from_stream(stream).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}
