//! What the engine streams back for each request.

use kiln_sampling::{FinishReason, Sampled};

/// Token counts of a finished request, as the APIs report them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Draft tokens verified for the request (speculative decoding) and
    /// how many of them were accepted.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
}

/// Where a request's time went, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RequestTimings {
    /// Submission until its first step.
    pub queue_seconds: f64,
    /// First step until its first token.
    pub prefill_seconds: f64,
    /// First token until the last.
    pub decode_seconds: f64,
}

/// One streamed event of a request.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Event {
    /// A generated token and the text it released (possibly empty).
    Token {
        token_id: u32,
        text: String,
        /// Present when the request asked for logprobs.
        logprobs: Option<Sampled>,
    },
    /// A step computed part of the prompt (sent so a dropped stream is
    /// noticed during long prefills; carries nothing).
    Progress,
    /// The request ended; nothing follows.
    Finished {
        finish_reason: FinishReason,
        usage: Usage,
        timings: RequestTimings,
    },
    /// The request failed inside the engine; nothing follows. `retryable`
    /// when the engine itself failed and is restarting (the same request
    /// may succeed again), not for a failure of this request alone.
    Failed { message: String, retryable: bool },
}
