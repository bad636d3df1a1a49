//! The crate's error types, one per layer of use.
//!
//! [`ConfigError`] comes from building a scheduler and means the configuration or the
//! model's layer layout cannot be served. [`SubmitError`] is admission at submission:
//! the server maps [`SubmitError::Busy`] to 429/503 and the others to 400.
//! [`SchedulerError`] means the engine broke the step protocol or named an unknown
//! request; it is a bug in the caller, never caused by user input.

use thiserror::Error;

use crate::request::RequestId;

/// A scheduler or KV configuration that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A size or limit that must be at least 1 is 0.
    #[error("`{name}` must be positive")]
    MustBePositive {
        /// The configuration field.
        name: &'static str,
    },
    /// Block ids are `u32`, so the pool holds fewer than `u32::MAX` blocks.
    #[error("{num_blocks} KV blocks is more than the {} a pool can hold", u32::MAX - 1)]
    TooManyBlocks {
        /// The requested number of blocks.
        num_blocks: usize,
    },
    /// Fewer recurrent-state slots than running requests.
    #[error("{state_slots} recurrent-state slots for up to {max_num_seqs} running requests")]
    TooFewStateSlots {
        /// The configured slots.
        state_slots: usize,
        /// The running cap.
        max_num_seqs: usize,
    },
    /// The KV cache spec lists no layer groups.
    #[error("the KV cache spec has no layer groups")]
    NoLayerGroups,
    /// A layer group of a kind the KV manager cannot serve yet (recurrent state).
    #[error("layer group {group_idx} is {kind}, which the KV manager does not support yet")]
    UnsupportedLayerKind {
        /// The index of the group in the spec.
        group_idx: usize,
        /// The kind, in words.
        kind: &'static str,
    },
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum SubmitError {
    /// The prompt and the most tokens it may generate exceed the model's context.
    #[error(
        "the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, \
         {} in all, beyond the model's context of {max_model_len} tokens",
        prompt_tokens + max_tokens
    )]
    TooLong {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// The most tokens the request may generate.
        max_tokens: usize,
        /// The model's context length.
        max_model_len: usize,
    },
    /// At its longest the request needs more KV blocks than the whole pool holds, so
    /// it could never run even alone.
    #[error(
        "the request needs up to {blocks_needed} KV blocks but the pool has only \
         {pool_blocks}; shorten the prompt or max_tokens"
    )]
    ExceedsPool {
        /// Blocks for the prompt and all but the last generated token.
        blocks_needed: usize,
        /// Blocks in the whole pool.
        pool_blocks: usize,
    },
    /// The waiting queue is full; the request may be retried later.
    #[error("busy: {waiting} requests are waiting, the most allowed is {max_waiting}")]
    Busy {
        /// Requests waiting now.
        waiting: usize,
        /// The bound on the waiting queue.
        max_waiting: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is 0.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// A request with this id is already waiting or running.
    #[error("request {id} is already submitted")]
    DuplicateId {
        /// The id given twice.
        id: RequestId,
    },
}

/// A call that breaks the schedule/update protocol or names an unknown request.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// `schedule` was called while the previous step awaits its `update`.
    #[error("a step is in flight; call update before scheduling the next one")]
    StepInFlight,
    /// `update` was called with no step in flight.
    #[error("no step is in flight; call schedule first")]
    NoStepInFlight,
    /// The id names no waiting or running request.
    #[error("request {id} is not waiting or running")]
    UnknownRequest {
        /// The unknown id.
        id: RequestId,
    },
    /// A step result names a request that was not scheduled in the step.
    #[error("request {id} was not scheduled in this step")]
    NotScheduled {
        /// The request.
        id: RequestId,
    },
    /// A step result names the same request twice.
    #[error("request {id} has more than one result in this step")]
    DuplicateResult {
        /// The request.
        id: RequestId,
    },
    /// A request got a number of sampled tokens the step does not allow: at least
    /// one when the step computed its last known token (more when an output
    /// format forced them), none otherwise.
    #[error("request {id} got {got} sampled tokens, expected {expected}")]
    WrongTokenCount {
        /// The request.
        id: RequestId,
        /// Tokens the step allows.
        expected: usize,
        /// Tokens given.
        got: usize,
    },
}

/// Not enough free blocks for an allocation; nothing was allocated. The scheduler
/// answers it by preempting or by leaving a request waiting, never by failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("needs {needed} free KV blocks but {free} are free")]
pub(crate) struct OutOfBlocks {
    /// Free blocks the allocation needs.
    pub(crate) needed: usize,
    /// Free blocks there are.
    pub(crate) free: usize,
}
