//! The HTTP server: the OpenAI API (`/v1/chat/completions` with tools and
//! SSE streaming, `/v1/completions`, the stateless Responses API
//! `/v1/responses`, `/v1/models`), the Anthropic Messages
//! API (`/v1/messages`, streamed or not, and `/v1/messages/count_tokens`),
//! `/tokenize` and
//! `/detokenize`, and operations (`/health`, `/stats`, `/metrics`), on
//! axum/tokio over a running engine's [`kiln_engine::EngineHandle`].
//!
//! The wire format lives here and nowhere else: requests are parsed into
//! validated engine types (`SamplingParams`, token ids, template messages)
//! at the door, unknown or unsupported parameters are refused by name, and
//! every error becomes an HTTP status and the OpenAI or Anthropic error body
//! in one place ([`ApiError`]). Blocking work (template rendering, tokenization,
//! admission, reading the engine's event stream) runs on blocking threads,
//! never on the async executor; a client that goes away drops its stream,
//! which cancels its request in the engine.
//!
//! This crate reads no environment variables and prints nothing; it does
//! not touch tensors, models or the scheduler's internals — only the
//! engine's handle, stats and events.
//!
//! Logging goes through `tracing` (the binary installs the subscriber):
//! one line per request (target `kiln::access`), a throughput line while
//! the engine has work (`kiln::throughput`), and what a shutdown waits for
//! (`kiln::server`).
//!
//! The server can start before its model is ready ([`serve_loading`] with a
//! [`Readiness`]): it answers 503 until the engine is handed over.
//!
//! Main items: [`serve`], [`serve_on`], [`serve_loading`], [`run`],
//! [`ServerConfig`], [`Readiness`], [`ApiError`], [`Metrics`].

mod access_log;
mod anthropic_messages;
mod anthropic_types;
mod connections;
mod dispatch;
mod errors;
mod generation;
mod guard;
mod histogram;
mod json_body;
mod limits;
mod loading;
mod logprobs;
mod messages;
mod metrics;
mod openai_types;
mod parse;
pub mod pool;
mod responses_input;
mod routes;
mod sampling;
mod server;
mod sse;
mod state;
mod structured;
mod throughput;

pub use dispatch::ServedModel;
pub use errors::ApiError;
pub use loading::Readiness;
pub use metrics::Metrics;
pub use parse::{OutputOverrides, ToolSyntax};
pub use server::{
    bind, run, serve, serve_loading, serve_on, shutdown_signal, PoolSpec, ServerConfig, ServerError,
};
