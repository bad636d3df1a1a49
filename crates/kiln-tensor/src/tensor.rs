//! The opaque tensor handle.

use std::any::Any;
use std::sync::Arc;

use crate::error::{Result, TensorError};

/// Element type of a tensor's storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

/// A row-major tensor whose storage belongs to one backend. Cloning is cheap
/// (the storage is shared); reshaping is free. Only the owning backend can
/// read the storage.
#[derive(Clone)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    storage: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:?}, {:?})", self.shape, self.dtype)
    }
}

impl Tensor {
    /// Wrap backend storage. Backends call this; model code never does.
    pub fn from_storage(
        shape: Vec<usize>,
        dtype: DType,
        storage: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Tensor {
            shape,
            dtype,
            storage,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The storage, for the owning backend to downcast.
    pub fn storage(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.storage
    }

    /// The same storage viewed with another shape of equal element count.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.num_elements() {
            return Err(TensorError::Shape {
                op: "reshape",
                detail: format!("{:?} to {:?}", self.shape, shape),
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            dtype: self.dtype,
            storage: self.storage.clone(),
        })
    }

    /// (rows, cols) of a 2-D tensor.
    pub fn dims2(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.shape[..] {
            [r, c] => Ok((r, c)),
            _ => Err(TensorError::Shape {
                op,
                detail: format!("expected 2 dimensions, got {:?}", self.shape),
            }),
        }
    }
}
