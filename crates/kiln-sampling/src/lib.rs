//! Sampling for Kiln: per-request parameters, the logit processors (bias and
//! penalties), a seeded host sampler with logprobs, stop strings over streamed text,
//! repetition guards and finish reasons.
//!
//! Everything here works on plain host data: a `&mut [f32]` row of logits, token ids
//! and text. This crate must not depend on tensors, devices, tokenizers, the engine
//! or the wire format (no serde); its only dependency is `thiserror`. A device
//! sampler (the CUDA backend's) takes [`Sampler::device_step`]'s data and must
//! reproduce the semantics documented in [`sampler`] (drawing in its *device order*);
//! the tests in `tests/statistical.rs` pin down the distributions.
//!
//! Main types:
//!
//! * [`SamplingParams`]: what a request asks for, with [`SamplingParams::validate`].
//! * [`Sampler`]: per-request state (RNG, penalty counts, scratch buffers);
//!   [`Sampler::sample`] turns logits and a [`History`] into a [`Sampled`] token.
//! * [`DeviceStep`]: one step's sampling data for a backend that samples where the
//!   logits are ([`Sampler::device_step`]).
//! * [`StopMatcher`]: withholds stop strings from streamed text.
//! * [`RepetitionGuard`]: ends generation stuck in a loop.
//! * [`SamplingDefaults`]: what a server fills in for fields a request leaves out
//!   (its flags, else the model's generation defaults, else llama.cpp's).
//! * [`FinishReason`]: why generation ended, with OpenAI's names.
//! * [`TokenId`]: the token id newtype shared by all Kiln crates.
//! * [`SamplingError`]: the crate's one error type.

#![warn(missing_docs)]

mod defaults;
mod device;
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

pub use defaults::{
    DefaultsSource, PartialSampling, SamplingDefaults, DEFAULT_LOOP_GUARD, LLAMA_CPP_DEFAULTS,
};
pub use device::DeviceStep;
pub use error::SamplingError;
pub use finish::FinishReason;
pub use guard::RepetitionGuard;
pub use params::{NgramRepeat, SamplingParams, TokenId, MAX_LOGPROBS, MAX_TEMPERATURE};
pub use sampler::{History, Sampled, Sampler};
pub use stop::{StopMatcher, StopOutput};
