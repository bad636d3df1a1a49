//! One log line per HTTP request, through `tracing` (target
//! `kiln::access`): method, route, served model, status, duration and, for
//! generations, prompt / cached / generated tokens, time to first token and
//! decode speed.
//!
//! A middleware opens a [`Record`] for every request and makes it the
//! task's current record while the handler runs; the generation bridge
//! picks it up ([`current`]) and notes tokens and usage as its events
//! pass. The line is written when the last holder lets go: for a plain
//! answer when the response leaves the middleware, for a stream when its
//! body ends or the client goes away. The live records are also the count
//! of requests in flight that a shutdown waits for.
//!
//! This module only emits events; the binary chooses where and how they
//! are written.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use kiln_engine::Usage;
use kiln_sampling::FinishReason;

/// The status logged for a request whose client left before the response
/// was ready (nginx's "client closed request").
const CLIENT_LEFT: u16 = 499;

tokio::task_local! {
    static CURRENT: Arc<Record>;
}

/// The access log's shared part: the served model's name and the number
/// of requests in flight. Cheap to clone.
#[derive(Clone)]
pub(crate) struct AccessLog {
    model_name: Arc<str>,
    in_flight: Arc<AtomicUsize>,
}

impl AccessLog {
    pub(crate) fn new(model_name: &str) -> Self {
        AccessLog {
            model_name: model_name.into(),
            in_flight: Arc::default(),
        }
    }

    /// The log of one model of a pool: its lines name `model_name`; the
    /// requests in flight are counted with every other model's.
    pub(crate) fn for_model(&self, model_name: &str) -> Self {
        AccessLog {
            model_name: model_name.into(),
            in_flight: self.in_flight.clone(),
        }
    }

    /// Requests received and not yet answered in full (streams included).
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// What is known about one request so far; logged when dropped.
pub(crate) struct Record {
    method: Method,
    route: String,
    model_name: Arc<str>,
    started: Instant,
    in_flight: Arc<AtomicUsize>,
    progress: Mutex<Progress>,
}

#[derive(Default)]
struct Progress {
    status: Option<u16>,
    /// Whether the request reached the engine.
    generated: bool,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Choices finished so far and their usage (the prompt counted once).
    num_finished: usize,
    usage: Usage,
    finish_reason: Option<FinishReason>,
}

/// The record of the request whose handler is running on this task, if any.
pub(crate) fn current() -> Option<Arc<Record>> {
    CURRENT.try_with(Arc::clone).ok()
}

impl Record {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        // A panic while holding the lock leaves plain counters behind.
        self.progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The engine admitted the request.
    pub(crate) fn admitted(&self) {
        self.progress().generated = true;
    }

    /// A token of any choice arrived.
    pub(crate) fn token(&self, at: Instant) {
        let mut p = self.progress();
        p.first_token.get_or_insert(at);
        p.last_token = Some(at);
    }

    /// A choice finished with `usage`.
    pub(crate) fn finished(&self, usage: &Usage, finish_reason: FinishReason) {
        let mut p = self.progress();
        if p.num_finished == 0 {
            p.usage.prompt_tokens = usage.prompt_tokens;
            p.usage.cached_tokens = usage.cached_tokens;
        }
        p.usage.completion_tokens += usage.completion_tokens;
        p.num_finished += 1;
        p.finish_reason = Some(finish_reason);
    }

    fn set_status(&self, status: u16) {
        self.progress().status = Some(status);
    }
}

/// The precise reason, where the wire format merges some (a repetition
/// guard and a stop string are both `stop` to OpenAI).
fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::StopString(_) => "stop_string",
        FinishReason::Length => "length",
        FinishReason::Repetition => "repetition",
        FinishReason::Cancelled => "cancelled",
    }
}

/// Milliseconds with one decimal.
fn millis(seconds: f64) -> f64 {
    (seconds * 10_000.0).round() / 10.0
}

impl Drop for Record {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let p = self.progress();
        let status = p.status.unwrap_or(CLIENT_LEFT);
        let duration_ms = millis(self.started.elapsed().as_secs_f64());
        let (method, route, model) = (self.method.as_str(), self.route.as_str(), &*self.model_name);
        if !p.generated {
            tracing::info!(
                target: "kiln::access",
                method = %method,
                route = %route,
                model = %model,
                status,
                duration_ms,
                "request"
            );
            return;
        }
        let ttft_ms = p
            .first_token
            .map_or(0.0, |t| millis((t - self.started).as_secs_f64()));
        // The decode rate: tokens after the first over the time they took.
        let tok_s = match (p.first_token, p.last_token) {
            (Some(first), Some(last)) if last > first => {
                let rate = p.usage.completion_tokens.saturating_sub(1) as f64
                    / (last - first).as_secs_f64();
                (rate * 10.0).round() / 10.0
            }
            _ => 0.0,
        };
        // No finish event: the client went away or the server stopped it.
        let finish = p.finish_reason.map_or("incomplete", finish_name);
        tracing::info!(
            target: "kiln::access",
            method = %method,
            route = %route,
            model = %model,
            status,
            prompt_tokens = p.usage.prompt_tokens,
            cached_tokens = p.usage.cached_tokens,
            generated_tokens = p.usage.completion_tokens,
            ttft_ms,
            tok_s,
            finish = %finish,
            duration_ms,
            "request"
        );
    }
}

/// The middleware: opens the request's record and runs the rest of the
/// router with it as the task's current record.
pub(crate) async fn record(State(log): State<AccessLog>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    log.in_flight.fetch_add(1, Ordering::SeqCst);
    let record = Arc::new(Record {
        method: req.method().clone(),
        route,
        model_name: log.model_name.clone(),
        started: Instant::now(),
        in_flight: log.in_flight.clone(),
        progress: Mutex::default(),
    });
    let response = CURRENT.scope(record.clone(), next.run(req)).await;
    record.set_status(response.status().as_u16());
    response
}
