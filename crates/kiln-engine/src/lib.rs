//! The engine: a model loaded with its tokenizer, chat template and stop
//! tokens ([`LoadedModel`]); one request at a time with streaming callbacks
//! ([`LoadedModel::generate`]); and the engine loop ([`Engine`]), one thread
//! owning the scheduler, the paged KV cache and the model, serving many
//! requests with continuous batching, prefix reuse and preemption through
//! an [`EngineHandle`]. [`ChatSession`] continues conversations on top.
//!
//! The engine reads no environment variables and prints nothing; the binary
//! and the server decide how to present what it returns.
//!
//! Main types: [`LoadedModel`], [`Engine`], [`EngineHandle`],
//! [`RequestStream`], [`Event`], [`GenerationRequest`], [`ChatSession`],
//! [`EngineError`].

pub mod adapters;
pub mod convert;
pub mod embed;
mod engine;
mod error;
mod events;
mod gen_defaults;
mod generate;
mod load;
pub mod memory;
mod mtp;
mod process;
pub mod quantize;
mod session;
pub mod speculative;

pub use adapters::{AdapterInfo, Adapters};
pub use embed::{EmbedInput, Embedder, EmbeddingHead, Pooling};
pub use engine::remote::{report_load_failure, serve_worker, WorkerCommand};
#[cfg(feature = "fault-injection")]
pub use engine::FaultGate;
pub use engine::{
    Engine, EngineConfig, EngineHandle, EngineStats, EngineStatus, KvPlan, RequestStream,
    EXPERT_WINDOW_STEPS,
};
pub use error::{EngineError, Result};
pub use events::{Event, RequestTimings, Usage};
pub use generate::{Generation, GenerationRequest, Timings, TokenEvent};
pub use kiln_tensor::LoraAdapter;
pub use load::LoadedModel;
pub use memory::{FitInput, FitReport, MemoryTarget};
pub use process::ReasoningTags;
pub use session::{ChatSession, ChatTurn, TOOL_ERROR_MARKER};
pub use speculative::{SpeculativeConfig, SpeculativeMethod};
