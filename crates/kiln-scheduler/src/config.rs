//! The scheduler's configuration: the KV layout, the pool size and the limits.

use crate::kv_spec::KvCacheSpec;

/// The default token budget of a step.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;
/// The default cap on running requests.
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;
/// The default bound on the waiting queue.
pub const DEFAULT_MAX_WAITING: usize = 1024;

/// Tokens between recurrent-state snapshots by default (eight 16-token blocks).
pub const DEFAULT_STATE_CHECKPOINT_TOKENS: usize = 128;

/// What the scheduler serves and its limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// The model's KV cache layout.
    pub kv_cache: KvCacheSpec,
    /// Blocks in the pool (what fits in KV memory).
    pub num_blocks: usize,
    /// The model's context: prompt plus generated tokens.
    pub max_model_len: usize,
    /// The token budget of one step.
    pub max_num_batched_tokens: usize,
    /// The most running requests.
    pub max_num_seqs: usize,
    /// The most waiting requests accepted by `submit`; preempted requests return to
    /// the queue even beyond it.
    pub max_waiting: usize,
    /// Recurrent-state slots (a hybrid model's recurrent layers keep a fixed-size
    /// state a request beside the KV blocks): 0 for a model without recurrent
    /// layers, else at least `max_num_seqs`. Each running request holds one
    /// ([`crate::ScheduledRequest::state_slot`]); a request that has one finds no
    /// prefix-cache hits unless a snapshot of the state at the hit's end was kept
    /// (`state_snapshots`).
    pub state_slots: usize,
    /// Recurrent-state snapshot slots beside the running ones: the state of a
    /// request after every `state_checkpoint_tokens` tokens, at its prompt's
    /// last full block and (a slot it holds while it runs) at the last block
    /// boundary it passed before leaving, kept for later requests with the same
    /// prefix, which resume from the deepest one their block hits reach (least
    /// recently used first out).
    pub state_snapshots: usize,
    /// Tokens between snapshots, a multiple of the block size.
    pub state_checkpoint_tokens: usize,
    /// Spare recurrent-state slots for speculative decodes (0: requests with
    /// recurrent state ignore proposals). A speculative decode of such a
    /// request writes its state to a spare slot and leaves the one it
    /// started from: when every draft is accepted the spare becomes the
    /// request's slot, else the step's accepted tokens are computed again
    /// from the state before it (the state cannot step back).
    pub state_spare_slots: usize,
}

impl SchedulerConfig {
    /// A configuration with the default budget, running cap and queue bound.
    pub fn new(kv_cache: KvCacheSpec, num_blocks: usize, max_model_len: usize) -> Self {
        SchedulerConfig {
            kv_cache,
            num_blocks,
            max_model_len,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_waiting: DEFAULT_MAX_WAITING,
            state_slots: 0,
            state_snapshots: 0,
            state_checkpoint_tokens: DEFAULT_STATE_CHECKPOINT_TOKENS,
            state_spare_slots: 0,
        }
    }
}
