//! Models: configuration, shared layers, and the model families.
//!
//! Models are short forward passes over the shared layers in [`layers`],
//! written against `kiln_tensor::Backend`; no model names a concrete backend.
//! Weights are addressed by their Hugging Face names through
//! `kiln_formats::WeightSource`, whatever the file format. Adding a family is
//! one file in `families/` plus one line in [`registry`].
//!
//! Main types: [`CausalLm`], [`ModelConfig`], [`load_model`].

pub mod config;
pub mod error;
pub mod families;
pub mod layers;
pub mod random;
pub mod registry;

use std::sync::Arc;

use kiln_tensor::{Backend, KvCache, Tensor};

pub use config::{ModelConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use registry::{load_model, tensor_shapes};

/// A decoder-only language model.
pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The backend the weights live on.
    fn backend(&self) -> &Arc<dyn Backend>;

    /// A KV cache for one sequence of up to `capacity` tokens.
    fn new_kv_cache(&self, capacity: usize) -> Result<KvCache>;

    /// Run `tokens` at positions `start_pos..`, writing their keys and values
    /// into `cache`, and return logits `[n - logits_from, vocab]` for the
    /// tokens from index `logits_from` on.
    fn forward(
        &self,
        tokens: &[u32],
        start_pos: usize,
        cache: &mut KvCache,
        logits_from: usize,
    ) -> Result<Tensor>;
}
