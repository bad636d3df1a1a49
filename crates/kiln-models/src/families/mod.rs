//! Model families. Each is one file that owns its definition: the
//! `config.json` keys only it reads, its per-layer KV layout, the weights
//! it expects and its forward pass. [`crate::registry`] lists one
//! [`Family`] descriptor a family.

use std::sync::Arc;

use kiln_formats::{StoredTensor, WeightSource};
use kiln_tensor::Backend;
use serde_json::Value;

use crate::config::{FamilyLayers, ModelConfig};
use crate::error::Result;
use crate::layers::LoadProgress;
use crate::CausalLm;

pub mod bert;
pub mod deepseek;
pub mod gemma3;
pub mod gemma4;
pub mod gpt_oss;
pub mod lfm2;
pub mod llama;
pub mod moe;
pub mod qwen3_5;

/// The keys only one family reads, parsed by that family's file.
#[derive(Debug, Clone, PartialEq)]
pub enum FamilyConfig {
    Bert(bert::BertConfig),
    Llama(llama::LlamaConfig),
    Gemma3(gemma3::Gemma3Config),
    Gemma4(gemma4::Gemma4Config),
    Moe(moe::MoeConfig),
    Deepseek(deepseek::DeepseekConfig),
    GptOss(gpt_oss::GptOssConfig),
    Qwen35(qwen3_5::Qwen35Config),
    Lfm2(lfm2::Lfm2Config),
}

/// A family as the registry sees it: its name, the `model_type`s it
/// serves, and its entry points.
pub struct Family {
    /// The family's name (`llama`, `gemma3`), shown by `kiln ls`.
    pub name: &'static str,
    /// The `config.json` `model_type`s it serves.
    pub model_types: &'static [&'static str],
    /// `tie_word_embeddings` when `config.json` leaves it out (its
    /// transformers config class's default).
    pub tied_by_default: bool,
    /// Parse its own keys of `config.json` given the layer count and
    /// head dimension: its [`FamilyConfig`], one [`LayerKind`] a layer, and
    /// each layer's KV shape where they differ.
    pub parse: fn(&Value, usize, usize) -> Result<FamilyLayers>,
    /// Every weight a checkpoint of the config holds: name and shape.
    pub tensor_shapes: fn(&ModelConfig) -> Result<Vec<(String, Vec<usize>)>>,
    /// Check the config against a checkpoint's tensor table before loading.
    pub check_weights: fn(&ModelConfig, &[StoredTensor]) -> Result<()>,
    /// Blocks a checkpoint stores under names of its own rather than
    /// `tensor_shapes`' (gpt-oss's MXFP4 `*_blocks`): for one stored
    /// tensor, each weight of `tensor_shapes` it holds with its block
    /// format, rows and columns — what `fit` and `kiln bench` count.
    pub stored_blocks: fn(&StoredTensor) -> Vec<StoredBlocks>,
    /// How its tensors split over tensor-parallel ranks (`None`: it runs
    /// on one backend only).
    pub tensor_parallel: Option<&'static crate::tp::TensorParallel>,
    /// Load the model onto a backend.
    pub load: fn(
        Arc<dyn Backend>,
        &dyn WeightSource,
        ModelConfig,
        Option<LoadProgress<'_>>,
    ) -> Result<Box<dyn CausalLm>>,
}

/// A weight of [`Family::tensor_shapes`] held as blocks of `format`,
/// `[rows, cols]`, inside a tensor stored under another name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBlocks {
    pub name: String,
    pub format: kiln_tensor::QuantFormat,
    pub rows: usize,
    pub cols: usize,
}

/// [`Family::stored_blocks`] of a family whose checkpoints name every
/// weight as `tensor_shapes` does.
pub fn no_stored_blocks(_: &StoredTensor) -> Vec<StoredBlocks> {
    Vec::new()
}

/// What a family's step returns for the batch's `logits_rows`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepOutput {
    /// Through the final norm and the output head.
    Logits,
    /// Through the final norm only ([`CausalLm::hidden_states`]).
    Hidden,
}

/// A one-layer paged KV cache of `kv_row`-wide rows for a model's MTP
/// head ([`CausalLm::new_mtp_cache`]).
pub(crate) fn mtp_cache(
    b: &dyn kiln_tensor::Backend,
    kv_row: usize,
    num_blocks: usize,
    block_size: usize,
) -> Result<kiln_tensor::KvCache> {
    Ok(b.alloc_kv_cache(kiln_tensor::KvPoolShape {
        num_layers: 1,
        num_groups: 1,
        num_blocks,
        block_size,
        kv_row,
    })?)
}

/// [`CausalLm::forward_with_hidden`] from the trunk's output `x`: the
/// logits of `rows` through `norm` fused into `lm_head` (the bits
/// `forward` computes) and every row's normed hidden state.
pub(crate) fn logits_and_hidden(
    b: &dyn kiln_tensor::Backend,
    x: &kiln_tensor::Tensor,
    rows: &[u32],
    norm: &crate::layers::RmsNorm,
    lm_head: &crate::layers::Linear,
) -> Result<(kiln_tensor::Tensor, kiln_tensor::Tensor)> {
    let last = b.gather_rows(x, rows)?;
    let logits = lm_head.forward(b, &last, crate::layers::Fuse::norm(norm))?;
    Ok((logits, norm.forward(b, x)?))
}

/// The error of a family's entry point handed another family's config:
/// the registry never does this.
pub(crate) fn wrong_family(cfg: &ModelConfig, family: &str) -> crate::error::ModelError {
    crate::error::ModelError::Config {
        key: "model_type".into(),
        what: format!(
            "{:?} was parsed as {:?}, not as the {family} family; this is a bug",
            cfg.model_type, cfg.family
        ),
    }
}

/// Runs a family's forward `step` through the backend's step recording
/// ([`kiln_tensor::StepRecording::run_step`]), which may record and replay
/// it; model errors inside the step travel as tensor errors.
pub(crate) fn run_step(
    backend: &dyn kiln_tensor::Backend,
    batch: &kiln_tensor::ForwardBatch,
    cache: &mut kiln_tensor::KvCache,
    step: impl Fn(
            &kiln_tensor::ForwardBatch,
            &mut kiln_tensor::KvCache,
        ) -> crate::Result<kiln_tensor::Tensor>
        + Sync,
) -> crate::Result<kiln_tensor::Tensor> {
    let mut step = |batch: &kiln_tensor::ForwardBatch,
                    cache: &mut kiln_tensor::KvCache|
     -> kiln_tensor::Result<kiln_tensor::Tensor> {
        step(batch, cache).map_err(|e| match e {
            crate::error::ModelError::Tensor(t) => t,
            other => kiln_tensor::TensorError::Device {
                backend: "model",
                message: other.to_string(),
            },
        })
    };
    Ok(backend.run_step(batch, cache, &mut step)?)
}
