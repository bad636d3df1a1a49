//! The one table from `model_type` to model family: one line a family.

use std::sync::Arc;

use kiln_formats::WeightSource;
use kiln_tensor::Backend;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::families::{self, Family};
use crate::layers::LoadProgress;
use crate::CausalLm;

/// Every family Kiln serves.
pub static FAMILIES: &[&Family] = &[
    &families::llama::FAMILY,
    &families::moe::FAMILY,
    &families::deepseek::FAMILY,
    &families::gpt_oss::FAMILY,
    &families::gemma3::FAMILY,
    &families::gemma4::FAMILY,
    &families::qwen3_5::FAMILY,
    &families::lfm2::FAMILY,
    &families::bert::FAMILY,
];

/// The family descriptor that serves `model_type`.
pub fn find(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_types.contains(&model_type))
}

/// Every `model_type` Kiln serves, comma-separated, for messages.
pub fn supported_model_types() -> String {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The Kiln family that serves `model_type` (`None`: Kiln cannot load it).
pub fn family(model_type: &str) -> Option<&'static str> {
    find(model_type).map(|f| f.name)
}

fn family_of(config: &ModelConfig) -> Result<&'static Family> {
    find(&config.model_type).ok_or_else(|| ModelError::UnsupportedModel {
        model_type: config.model_type.clone(),
        supported: supported_model_types(),
    })
}

/// Load the model `config` describes from `source` onto `backend`.
pub fn load_model(
    backend: Arc<dyn Backend>,
    source: &dyn WeightSource,
    config: ModelConfig,
) -> Result<Box<dyn CausalLm>> {
    load_model_with_progress(backend, source, config, None)
}

/// [`load_model`], reporting (bytes loaded, total bytes) after every tensor.
pub fn load_model_with_progress(
    backend: Arc<dyn Backend>,
    source: &dyn WeightSource,
    config: ModelConfig,
    progress: Option<LoadProgress<'_>>,
) -> Result<Box<dyn CausalLm>> {
    let family = family_of(&config)?;
    // The configuration must match the tensor table before a byte is
    // allocated for it.
    (family.check_weights)(&config, &source.tensors())?;
    (family.load)(backend, source, config, progress)
}

/// The weights of [`tensor_shapes`] that the stored tensor `t` holds as
/// blocks under another name (see [`crate::families::Family::stored_blocks`]).
pub fn stored_blocks(
    config: &ModelConfig,
    t: &kiln_formats::StoredTensor,
) -> Result<Vec<crate::families::StoredBlocks>> {
    Ok((family_of(config)?.stored_blocks)(t))
}

/// Every weight the model `config` describes must have: name and shape.
pub fn tensor_shapes(config: &ModelConfig) -> Result<Vec<(String, Vec<usize>)>> {
    (family_of(config)?.tensor_shapes)(config)
}

/// The share of weight `name` of `config` one decode token reads: all of
/// most weights, none of an embedding table the output does not share (its
/// row is looked up), `top_k / num_experts` of a sparse layer's experts.
pub fn decode_share(config: &ModelConfig, name: &str) -> f64 {
    if name == "model.embed_tokens.weight" && !config.tie_word_embeddings {
        return 0.0;
    }
    // A multi-token-prediction head runs only when speculation asks it:
    // Qwen3.5's `mtp.*`, DeepSeek-style layers past the decoder's.
    let layer = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse::<usize>().ok());
    if name.starts_with("mtp.") || layer.is_some_and(|l| l >= config.num_layers) {
        return 0.0;
    }
    match &config.family {
        families::FamilyConfig::Moe(m) => m.decode_share(name),
        families::FamilyConfig::Deepseek(d) => d.decode_share(name),
        families::FamilyConfig::GptOss(g) if name.contains(".experts.") => {
            g.top_k as f64 / g.num_experts as f64
        }
        families::FamilyConfig::Lfm2(l) if name.contains(".experts.") => {
            l.moe.map_or(1.0, |m| m.top_k as f64 / m.num_experts as f64)
        }
        families::FamilyConfig::Qwen35(q) if name.contains(".experts.") => {
            q.moe.map_or(1.0, |m| m.top_k as f64 / m.num_experts as f64)
        }
        _ => 1.0,
    }
}
