//! Requests as the scheduler sees them: ids, priorities, what is submitted, and the
//! per-request state it keeps (all token ids and how many are computed).

use std::fmt;

use kiln_sampling::TokenId;

use crate::hash::{AdapterId, BlockHash};

/// The id of a request, chosen by the caller and unique among unfinished requests.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A priority class: lower is more urgent. Requests are served first come, first
/// served within a class; the default class is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Priority(pub i32);

/// A request as submitted to [`crate::Scheduler::submit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The caller's id for the request.
    pub id: RequestId,
    /// The prompt, already tokenized (at least one token).
    pub prompt_token_ids: Vec<TokenId>,
    /// The most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// The priority class.
    pub priority: Priority,
    /// A per-request salt mixed into every block hash: only requests with the same
    /// salt share cached blocks. Use one per tenant to keep tenants apart.
    pub cache_salt: Option<String>,
    /// The LoRA adapter the request runs with, mixed into every block hash.
    pub adapter_id: Option<AdapterId>,
}

impl Request {
    /// A request of the default priority with no salt and no adapter.
    pub fn new(id: RequestId, prompt_token_ids: Vec<TokenId>, max_tokens: usize) -> Self {
        Request {
            id,
            prompt_token_ids,
            max_tokens,
            priority: Priority::default(),
            cache_salt: None,
            adapter_id: None,
        }
    }
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// In the waiting queue: new, or preempted and waiting to be recomputed.
    Waiting,
    /// Admitted: it holds blocks and is scheduled whenever budget allows.
    Running,
}

/// A snapshot of one request's progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestInfo {
    /// Waiting or running.
    pub status: RequestStatus,
    /// Tokens in the prompt.
    pub num_prompt_tokens: usize,
    /// Tokens generated so far.
    pub num_output_tokens: usize,
    /// Tokens whose KV is computed (or scheduled in the step in flight).
    pub num_computed_tokens: usize,
    /// Prompt tokens found in the prefix cache at the first admission, `None` before
    /// it. Later re-admissions after preemption do not change it.
    pub num_cached_tokens: Option<usize>,
    /// How many times the request was preempted.
    pub num_preemptions: u32,
}

/// The scheduler's state for one unfinished request.
#[derive(Debug, Clone)]
pub(crate) struct RequestState {
    /// The prompt followed by the generated tokens.
    pub(crate) token_ids: Vec<TokenId>,
    pub(crate) num_prompt_tokens: usize,
    pub(crate) max_tokens: usize,
    pub(crate) root_hash: BlockHash,
    pub(crate) num_computed_tokens: usize,
    pub(crate) num_cached_tokens: Option<usize>,
    pub(crate) num_preemptions: u32,
    pub(crate) status: RequestStatus,
    /// The queue order: priority class, then submission order.
    pub(crate) order: QueueKey,
}

impl RequestState {
    pub(crate) fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Known tokens whose KV is not computed yet.
    pub(crate) fn num_remaining_tokens(&self) -> usize {
        self.token_ids.len() - self.num_computed_tokens
    }

    pub(crate) fn info(&self) -> RequestInfo {
        RequestInfo {
            status: self.status,
            num_prompt_tokens: self.num_prompt_tokens,
            num_output_tokens: self.num_output_tokens(),
            num_computed_tokens: self.num_computed_tokens,
            num_cached_tokens: self.num_cached_tokens,
            num_preemptions: self.num_preemptions,
        }
    }
}

/// The order of the waiting and running sets: priority class, then arrival, then id
/// (arrivals are unique, so the id only makes the key self-contained).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct QueueKey {
    pub(crate) priority: Priority,
    pub(crate) arrival: u64,
    pub(crate) id: RequestId,
}
