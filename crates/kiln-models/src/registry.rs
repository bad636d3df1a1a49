//! The one table from `model_type` to model family.

use std::sync::Arc;

use kiln_formats::WeightSource;
use kiln_tensor::Backend;

use crate::config::{ModelConfig, LLAMA_FAMILY};
use crate::error::{ModelError, Result};
use crate::families;
use crate::layers::LoadProgress;
use crate::CausalLm;

/// The Kiln family that serves `model_type` (`None`: Kiln cannot load it).
pub fn family(model_type: &str) -> Option<&'static str> {
    LLAMA_FAMILY.contains(&model_type).then_some("llama")
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
    if LLAMA_FAMILY.contains(&config.model_type.as_str()) {
        // The configuration must match the tensor table before a byte is
        // allocated for it.
        families::llama::check_weights(&config, &source.tensors())?;
        return Ok(Box::new(families::llama::Llama::load(
            backend, source, config, progress,
        )?));
    }
    Err(ModelError::UnsupportedModel {
        model_type: config.model_type,
        supported: LLAMA_FAMILY.join(", "),
    })
}

/// Every weight the model `config` describes must have: name and shape.
pub fn tensor_shapes(config: &ModelConfig) -> Result<Vec<(String, Vec<usize>)>> {
    if LLAMA_FAMILY.contains(&config.model_type.as_str()) {
        return Ok(families::llama::tensor_shapes(config));
    }
    Err(ModelError::UnsupportedModel {
        model_type: config.model_type.clone(),
        supported: LLAMA_FAMILY.join(", "),
    })
}
