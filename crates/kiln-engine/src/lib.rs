//! The engine: a model loaded with its tokenizer, chat template and stop
//! tokens ([`LoadedModel`]), and generation of one request at a time with
//! streaming callbacks ([`LoadedModel::generate`]).
//!
//! The engine reads no environment variables and prints nothing; the binary
//! and the server decide how to present what it returns. Continuous batching
//! and the paged KV cache come with the engine-core work; the request,
//! event and result types here are the ones that design keeps.
//!
//! Main types: [`LoadedModel`], [`GenerationRequest`], [`TokenEvent`],
//! [`Generation`], [`Timings`], [`EngineError`].

pub mod convert;
mod engine;
mod error;
mod events;
mod generate;
mod load;
mod process;
mod session;

pub use engine::{Engine, EngineConfig, EngineHandle, RequestStream};
pub use error::{EngineError, Result};
pub use events::{Event, RequestTimings, Usage};
pub use generate::{Generation, GenerationRequest, Timings, TokenEvent};
pub use load::LoadedModel;
pub use session::{ChatSession, ChatTurn, TOOL_ERROR_MARKER};
