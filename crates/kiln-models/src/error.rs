//! Errors of the model layer.

use kiln_formats::FormatError;
use kiln_tensor::TensorError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error("config: {key}: {what}")]
    Config { key: String, what: String },
    #[error("unsupported model type {model_type:?} (supported: {supported})")]
    UnsupportedModel {
        model_type: String,
        supported: String,
    },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
