//! Sampling for Kiln: per-request parameters, the logit processors (bias and
//! penalties), a seeded host sampler with logprobs, stop strings over streamed text,
//! repetition guards and finish reasons.
//!
//! Everything here works on plain host data: a `&mut [f32]` row of logits, token ids
//! and text. This crate must not depend on tensors, devices, tokenizers, the engine
//! or the wire format (no serde); its only dependency is `thiserror`. A GPU sampler
//! will come later and must reproduce the semantics documented in [`sampler`] and
//! [`stop`]; the tests in `tests/statistical.rs` pin down the distributions.
//!
//! Main types:
//!
//! * [`SamplingParams`]: what a request asks for, with [`SamplingParams::validate`].
//! * [`Sampler`]: per-request state (RNG, penalty counts, scratch buffers);
//!   [`Sampler::sample`] turns logits and a [`History`] into a [`Sampled`] token.
//! * [`StopMatcher`]: withholds stop strings from streamed text.
//! * [`RepetitionGuard`]: ends generation stuck in a loop.
//! * [`FinishReason`]: why generation ended, with OpenAI's names.
//! * [`TokenId`]: the token id newtype shared by all Kiln crates.
//! * [`SamplingError`]: the crate's one error type.

#![warn(missing_docs)]

mod error;
mod finish;
mod guard;
mod logprobs;
mod params;
mod processors;
mod rng;
pub mod sampler;
pub mod stop;
mod truncation;

pub use error::SamplingError;
pub use finish::FinishReason;
pub use guard::RepetitionGuard;
pub use params::{NgramRepeat, SamplingParams, TokenId, MAX_LOGPROBS, MAX_TEMPERATURE};
pub use sampler::{History, Sampled, Sampler};
pub use stop::{StopMatcher, StopOutput};
