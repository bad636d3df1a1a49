//! The tensor-free core of Kiln's engine: KV block bookkeeping with a
//! content-addressed prefix cache, and the scheduler that plans each step.
//!
//! The engine loop owns one [`Scheduler`] and drives it: [`Scheduler::submit`]
//! admits or refuses a request at once, [`Scheduler::schedule`] returns one plain
//! [`SchedulerOutput`] per step mapping requests to token counts under a token
//! budget (prompt chunks and decodes mixed; preemption by recompute when blocks run
//! out), the model runs it, [`Scheduler::update`] takes the sampled tokens, and
//! [`Scheduler::finish`] or [`Scheduler::cancel`] end requests.
//!
//! This crate must not depend on tensors, devices, tokenizers or the wire format:
//! its only dependencies are `thiserror` and `kiln-sampling` (for [`TokenId`]). A
//! [`BlockId`] is an index the backend maps to KV memory; the paged attention
//! kernels read the block tables handed out here. Everything is deterministic and
//! tested in milliseconds (`src/tests/`: data-driven traces, property tests and a
//! simulated model that checks every KV slot it reads).
//!
//! Main types:
//!
//! * [`Scheduler`], configured by [`SchedulerConfig`]; [`Request`] in,
//!   [`SchedulerOutput`] of [`ScheduledRequest`]s out, [`UpdateOutput`] and
//!   [`FinishedRequest`] back, [`SchedulerStats`] for metrics.
//! * [`KvManager`]: per-request block tables (one per layer group; sliding-window
//!   groups free the blocks that leave the window), prefix lookup at admission,
//!   registration of blocks as they fill.
//! * [`BlockPool`]: reference-counted blocks, the LRU queue of free blocks that keep
//!   their hash until reused, and the hash map of cached blocks with its collision
//!   check; [`BlockId`], [`BlockHash`].
//! * [`KvCacheSpec`]: the model's layer groups ([`LayerKind`]: full attention,
//!   sliding window, recurrent), where each layer lives ([`LayerSlot`]) and the
//!   block arithmetic of each kind.
//! * Errors: [`ConfigError`], [`SubmitError`] (admission, with the numbers),
//!   [`SchedulerError`] (protocol misuse by the engine).

#![warn(missing_docs)]

mod block_pool;
mod config;
mod error;
mod free_queue;
mod hash;
mod kv_manager;
mod kv_spec;
mod output;
mod request;
mod scheduler;

#[cfg(test)]
mod tests;

pub use block_pool::{BlockId, BlockPool, BlockPoolStats};
pub use config::{
    SchedulerConfig, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_WAITING,
    DEFAULT_STATE_CHECKPOINT_TOKENS,
};
pub use error::{ConfigError, SchedulerError, SubmitError};
pub use hash::{AdapterId, BlockHash};
pub use kiln_sampling::TokenId;
pub use kv_manager::{BlockTable, KvManager, PrefixCacheStats};
pub use kv_spec::{KvCacheSpec, LayerGroup, LayerKind, LayerSlot, DEFAULT_BLOCK_SIZE};
pub use output::{
    FinishedRequest, ScheduledRequest, SchedulerOutput, SchedulerStats, UpdateOutput,
};
pub use request::{Priority, Request, RequestId, RequestInfo, RequestStatus};
pub use scheduler::Scheduler;
