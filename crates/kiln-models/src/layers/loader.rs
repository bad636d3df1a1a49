//! Loading named weights from a [`WeightSource`] onto a backend, checking
//! each tensor's shape against what the model expects.

use std::sync::Arc;

use kiln_formats::{FormatError, WeightSource};
use kiln_tensor::{Backend, Tensor};

use crate::error::Result;

pub struct WeightLoader<'a> {
    pub backend: &'a Arc<dyn Backend>,
    pub source: &'a dyn WeightSource,
}

impl<'a> WeightLoader<'a> {
    pub fn new(backend: &'a Arc<dyn Backend>, source: &'a dyn WeightSource) -> Self {
        WeightLoader { backend, source }
    }

    /// Load `name`, which must have `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if !self.source.contains(name) {
            return Err(FormatError::MissingTensor {
                path: self.source.path().to_path_buf(),
                tensor: name.to_string(),
            }
            .into());
        }
        let host = self.source.load_f32(name)?;
        if host.shape != shape {
            return Err(FormatError::ShapeMismatch {
                path: self.source.path().to_path_buf(),
                tensor: name.to_string(),
                found: host.shape,
                expected: shape.to_vec(),
            }
            .into());
        }
        Ok(self.backend.upload(&host.shape, &host.data)?)
    }

    /// Load `name` if the source has it.
    pub fn optional(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.source.contains(name) {
            self.tensor(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}
