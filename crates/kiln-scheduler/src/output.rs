//! The plain data the scheduler hands out: the plan of a step, what an update
//! finished, a finished request's summary, and the counters.

use std::ops::Range;

use kiln_sampling::TokenId;

use crate::kv_manager::{BlockTable, PrefixCacheStats};
use crate::request::RequestId;

/// One request's part of a step: compute KV (and, if `wants_logits`, logits) for
/// `num_new_tokens` tokens starting at position `num_computed_tokens`.
///
/// A prompt chunk, a whole prompt, a recompute after preemption and a decode all
/// have this shape; only the numbers differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// The request.
    pub id: RequestId,
    /// Tokens whose KV was computed before this step (cache hits included): the
    /// position of the first new token.
    pub num_computed_tokens: usize,
    /// Tokens to compute in this step (at least 1).
    pub num_new_tokens: usize,
    /// The ids of those tokens, `num_new_tokens` of them.
    pub new_token_ids: Vec<TokenId>,
    /// The request's block tables, one per layer group: entry `i` holds the
    /// group's KV of positions `i * block_size .. (i + 1) * block_size`. Each covers
    /// every position up to `num_computed_tokens + num_new_tokens`; a sliding-window
    /// group's entries before its window are freed (see [`BlockTable::first`]).
    pub block_tables: Vec<BlockTable>,
    /// The request's recurrent-state slot (a model with recurrent layers:
    /// [`crate::SchedulerConfig::state_slots`]), held from admission until the
    /// request finishes or is preempted (a preempted request recomputes from its
    /// first token, so its next slot starts from zeros).
    pub state_slot: Option<u32>,
    /// The snapshot slot whose state this step starts the request from (its
    /// first step after a prefix hit that resumes from a snapshot).
    pub state_restore: Option<u32>,
    /// `(tokens into this step, slot)`: snapshots of the request's state this
    /// step keeps ([`crate::SchedulerConfig::state_snapshots`]).
    pub state_snapshots: Vec<(usize, u32)>,
    /// True when this step computes the request's last known token: the engine
    /// samples one token from the last row's logits and passes it to
    /// [`crate::Scheduler::update`]. False for a prompt chunk that is not the last
    /// one, whose logits are discarded.
    pub wants_logits: bool,
    /// Draft tokens at the end of `new_token_ids` ([`crate::Scheduler::propose`]):
    /// a speculative decode computes the request's last known token and these
    /// guesses after it, and the engine wants the logits of all
    /// `num_draft_tokens + 1` last rows to verify them. 0 for every other step.
    pub num_draft_tokens: usize,
}

impl ScheduledRequest {
    /// The positions of the new tokens.
    pub fn positions(&self) -> Range<usize> {
        self.num_computed_tokens..self.num_computed_tokens + self.num_new_tokens
    }

    /// The KV slot of each new token in group `group`, `block_id * block_size +
    /// position % block_size`, where the backend writes its key and value.
    pub fn slot_mapping(&self, group: usize, block_size: usize) -> Vec<usize> {
        let table = &self.block_tables[group];
        self.positions()
            .map(|pos| {
                let block = table
                    .get(pos / block_size)
                    .expect("a new token's block is held; this is a bug");
                block.index() * block_size + pos % block_size
            })
            .collect()
    }
}

/// The plan of one step: which requests compute how many tokens. Requests appear
/// in the order they were scheduled: decodes, then continued prefills, then newly
/// admitted requests.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SchedulerOutput {
    /// The requests of this step.
    pub scheduled: Vec<ScheduledRequest>,
    /// Requests preempted by this step to free blocks: their blocks are released
    /// and they wait to be recomputed. Their streams simply pause.
    pub preempted: Vec<RequestId>,
    /// The sum of `num_new_tokens`, at most the token budget.
    pub num_batched_tokens: usize,
    /// Tokens per block, for slot arithmetic.
    pub block_size: usize,
}

impl SchedulerOutput {
    /// True when nothing was scheduled: no step is in flight and the engine waits
    /// for new requests.
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}

/// A request that left the scheduler, with what the engine reports as usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedRequest {
    /// The request.
    pub id: RequestId,
    /// Tokens in the prompt.
    pub num_prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache at the first admission (0 if it
    /// never ran).
    pub num_cached_tokens: usize,
    /// The generated tokens.
    pub output_token_ids: Vec<TokenId>,
    /// How many times it was preempted.
    pub num_preemptions: u32,
}

/// What an update did besides appending tokens.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UpdateOutput {
    /// Requests that reached `max_tokens` with this step's token and were finished
    /// (their blocks freed). The engine reports them as finished for length unless
    /// its own stop check also fired on that token.
    pub finished_by_length: Vec<FinishedRequest>,
}

/// Counters for the server's metrics, all since the scheduler was created except
/// the gauges (requests and blocks now).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct SchedulerStats {
    /// Requests waiting now (new or preempted).
    pub num_waiting: usize,
    /// Requests running now.
    pub num_running: usize,
    /// KV blocks referenced by running requests now.
    pub num_blocks_used: usize,
    /// KV blocks in the pool.
    pub num_blocks_total: usize,
    /// Blocks holding a cached prefix now (used or free).
    pub num_blocks_cached: usize,
    /// Prefix-cache lookups and hits.
    pub prefix_cache: PrefixCacheStats,
    /// Cached blocks reused for other content.
    pub num_evictions: u64,
    /// Preemptions.
    pub num_preemptions: u64,
    /// Prompt tokens of requests admitted for the first time.
    pub num_prompt_tokens: u64,
    /// Tokens appended by updates.
    pub num_generated_tokens: u64,
    /// Steps scheduled (non-empty outputs).
    pub num_steps: u64,
    /// Requests finished (by the engine or at `max_tokens`).
    pub num_finished: u64,
    /// Requests cancelled.
    pub num_cancelled: u64,
    /// Draft tokens scheduled for verification.
    pub num_draft_tokens: u64,
    /// Draft tokens the verification accepted.
    pub num_accepted_draft_tokens: u64,
    /// Speculative decodes (steps of one request with drafts).
    pub num_speculative_decodes: u64,
}
