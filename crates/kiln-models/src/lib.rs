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
pub mod lora;
pub mod random;
pub mod registry;
pub mod tp;

use std::sync::Arc;

use kiln_tensor::{Backend, ForwardBatch, KvCache, Tensor};

pub use config::{ModelConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use layers::{LoadProgress, WeightBytes};
pub use registry::{
    decode_share, family, load_model, load_model_with_progress, stored_blocks, tensor_shapes,
};
pub use tp::{load_tensor_parallel, TensorParallelLm, TpShard};

/// A decoder-only language model.
pub trait CausalLm: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The backend the weights live on.
    fn backend(&self) -> &Arc<dyn Backend>;

    /// The part of the model one device holds: [`CausalLm::config`], but
    /// for a tensor-parallel model one rank's (its KV heads are what a
    /// device's pool holds a token).
    fn rank_config(&self) -> &ModelConfig {
        self.config()
    }

    /// What the weight matrices take on the backend, by storage (`None`:
    /// a model that does not count them, as a test's stand-in).
    fn weight_bytes(&self) -> Option<&WeightBytes> {
        None
    }

    /// A paged KV cache of `num_blocks` blocks of `block_size` tokens (by
    /// default laid out as [`ModelConfig::kv_layout`] says: a block holds
    /// one group's layers).
    fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        Ok(self
            .backend()
            .alloc_kv_cache(self.config().kv_pool_shape(num_blocks, block_size))?)
    }

    /// [`CausalLm::new_kv_cache`] with room for the recurrent state of
    /// `max_seqs` sequences when the model has recurrent layers (by default
    /// it has none, and this is `new_kv_cache`).
    fn new_cache(&self, num_blocks: usize, block_size: usize, max_seqs: usize) -> Result<KvCache> {
        let _ = max_seqs;
        self.new_kv_cache(num_blocks, block_size)
    }

    /// Bytes of recurrent state one sequence holds (0: no recurrent layers).
    fn state_bytes_per_seq(&self) -> u64 {
        0
    }

    /// A KV cache for one sequence of up to `max_tokens` tokens run with
    /// [`ForwardBatch::single`] batches.
    fn kv_cache_for_tokens(&self, max_tokens: usize, block_size: usize) -> Result<KvCache> {
        let (spec, _) = self.config().kv_layout(block_size);
        self.new_kv_cache(
            spec.groups.len() * max_tokens.div_ceil(block_size),
            block_size,
        )
    }

    /// Run one step: every sequence's new tokens, writing their keys and
    /// values into `cache`, returning logits `[batch.logits_rows.len(), vocab]`.
    fn forward(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor>;

    /// Run one step as [`CausalLm::forward`] does, returning instead the
    /// final hidden states of `batch.logits_rows` — the last layer's output
    /// after the model's final norm, transformers' `last_hidden_state` —
    /// `[rows, hidden_size]`: what an embedding head pools.
    fn hidden_states(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        let _ = (batch, cache);
        Err(ModelError::Config {
            key: "model_type".into(),
            what: format!("{} does not return hidden states", self.config().model_type),
        })
    }

    /// Multi-token-prediction heads the model runs (0: none): a head
    /// guesses the token two after a position from that position's final
    /// hidden state and the token after it ([`CausalLm::mtp_forward`]).
    fn mtp_heads(&self) -> usize {
        0
    }

    /// A paged KV cache of `num_blocks` blocks of `block_size` for the MTP
    /// head's attention layer (its own, apart from the model's).
    fn new_mtp_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        let _ = (num_blocks, block_size);
        Err(self.no_mtp())
    }

    /// [`CausalLm::forward`]'s logits (the same bits) and, beside them,
    /// the final hidden state of every row of the batch, as
    /// [`CausalLm::hidden_states`] gives them (`[rows, hidden_size]`):
    /// what an MTP head reads.
    fn forward_with_hidden(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        let _ = (batch, cache);
        Err(self.no_mtp())
    }

    /// One pass of the MTP head over `batch`, whose row at position `p`
    /// holds the token after `p`, with `hidden` (`[rows, hidden_size]`) the
    /// final hidden state of `p` (the model's, or this head's own output
    /// for a guess after a guess); writes the head's keys and values at
    /// `p` into `cache` ([`CausalLm::new_mtp_cache`]). Returns, for
    /// `batch.logits_rows`, the logits of the token two after `p` and the
    /// head's hidden state.
    fn mtp_forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        cache: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        let _ = (batch, hidden, cache);
        Err(self.no_mtp())
    }

    #[doc(hidden)]
    fn no_mtp(&self) -> ModelError {
        ModelError::Config {
            key: "model_type".into(),
            what: format!(
                "{} has no multi-token-prediction head",
                self.config().model_type
            ),
        }
    }

    /// Whether the model has an output head to generate with (an encoder
    /// such as BERT only embeds).
    fn generates(&self) -> bool {
        true
    }

    /// Tokens routed to each expert of each sparse layer since the model
    /// loaded (empty: no sparse layers).
    fn expert_load(&self) -> Vec<Vec<u64>> {
        Vec::new()
    }

    /// The projections a LoRA adapter may adapt on this model (empty: the
    /// family runs no adapters).
    fn lora_targets(&self) -> Vec<LoraTarget> {
        Vec::new()
    }
}

/// A projection a LoRA adapter may adapt: its Hugging Face name (without
/// `.weight`) and dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraTarget {
    pub name: String,
    pub in_dim: usize,
    pub out_dim: usize,
}
