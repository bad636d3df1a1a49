//! The one error type of this crate.
//!
//! Validation errors carry the OpenAI parameter name where there is one, so that the
//! server can fill the `param` field of its error body without parsing messages.

use thiserror::Error;

/// Everything that can go wrong when validating [`crate::SamplingParams`] or sampling.
///
/// Variants produced by [`crate::SamplingParams::validate`] describe bad user input and
/// map to HTTP 400. The others ([`SamplingError::LogitsLenMismatch`],
/// [`SamplingError::HistoryTokenOutOfVocab`], [`SamplingError::NoCandidates`]) come from
/// [`crate::Sampler::sample`] and mean the engine passed inconsistent data.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SamplingError {
    /// A numeric parameter is outside its allowed range, or is NaN.
    #[error("`{param}` must be in {range}, got {value}")]
    OutOfRange {
        /// The OpenAI name of the parameter, e.g. `top_p`.
        param: &'static str,
        /// The value that was given, widened to `f64` (NaN stays NaN).
        value: f64,
        /// The allowed range in interval notation, e.g. `(0, 1]`.
        range: &'static str,
    },
    /// The vocabulary size given to validation is zero.
    #[error("vocabulary size must be positive")]
    EmptyVocab,
    /// A `logit_bias` entry names a token the model does not have.
    #[error("`logit_bias` names token {token_id}, but the vocabulary has {vocab_size} tokens")]
    LogitBiasTokenOutOfVocab {
        /// The offending token id.
        token_id: u32,
        /// The number of tokens in the vocabulary.
        vocab_size: usize,
    },
    /// A `logit_bias` value is outside [-100, 100] or is NaN.
    #[error("`logit_bias` for token {token_id} must be in [-100, 100], got {value}")]
    LogitBiasValueOutOfRange {
        /// The token the bias applies to.
        token_id: u32,
        /// The bias that was given.
        value: f32,
    },
    /// The same token appears twice in `logit_bias`.
    #[error("`logit_bias` names token {token_id} more than once")]
    DuplicateLogitBias {
        /// The repeated token id.
        token_id: u32,
    },
    /// More top logprobs were requested than are supported.
    #[error("`logprobs` must be at most {max}, got {requested}")]
    TooManyLogprobs {
        /// The number of alternatives requested.
        requested: usize,
        /// The largest number supported.
        max: usize,
    },
    /// `max_tokens` is zero.
    #[error("`max_tokens` must be at least 1, got 0")]
    ZeroMaxTokens,
    /// A stop string is empty; it would match before any text.
    #[error("stop string {stop_idx} is empty")]
    EmptyStopString {
        /// The position of the empty string in `stop`.
        stop_idx: usize,
    },
    /// A `stop_token_ids` entry names a token the model does not have.
    #[error("`stop_token_ids` names token {token_id}, but the vocabulary has {vocab_size} tokens")]
    StopTokenOutOfVocab {
        /// The offending token id.
        token_id: u32,
        /// The number of tokens in the vocabulary.
        vocab_size: usize,
    },
    /// A repetition guard is configured so that it would fire on ordinary text.
    #[error("`{param}` must be at least {min}, got {value}")]
    GuardTooSmall {
        /// The name of the guard field, e.g. `max_consecutive_identical`.
        param: &'static str,
        /// The value that was given.
        value: usize,
        /// The smallest value accepted.
        min: usize,
    },
    /// The logits slice does not have one entry per vocabulary token.
    #[error("expected {expected} logits (one per vocabulary token), got {actual}")]
    LogitsLenMismatch {
        /// The vocabulary size the sampler was built for.
        expected: usize,
        /// The length of the slice that was passed.
        actual: usize,
    },
    /// A prompt or generated token in the history is outside the vocabulary.
    #[error("history token {token_id} is outside the vocabulary of {vocab_size} tokens")]
    HistoryTokenOutOfVocab {
        /// The offending token id.
        token_id: u32,
        /// The number of tokens in the vocabulary.
        vocab_size: usize,
    },
    /// Every logit is `-inf` or NaN after processing, so no token can be chosen.
    #[error("no token can be sampled: every logit is -inf or NaN")]
    NoCandidates,
}
