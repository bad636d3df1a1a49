//! [`Weight`]: the stored form of a projection's matrix, as a backend
//! holds it, and [`WeightKind`], what a backend is asked whether it can
//! multiply by.

use crate::error::{Result, TensorError};
use crate::tensor::{DType, Tensor};

/// A projection's weight, `[out, in]` in Hugging Face layout. Today every
/// weight is a dense tensor; a block-quantized kind (the file's raw blocks,
/// their format and the logical shape) becomes one more variant here, one
/// more [`WeightKind`], and one more arm in the backends that multiply by
/// it. Code outside this crate matches it with a catch-all arm.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Weight {
    /// A dense tensor in whatever element type the backend stores.
    Dense(Tensor),
}

/// What a [`Weight`] is, for a backend to say whether it can multiply by
/// it ([`crate::Memory::supports_weight`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WeightKind {
    Dense(DType),
}

impl std::fmt::Display for WeightKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightKind::Dense(d) => write!(f, "dense {d:?}"),
        }
    }
}

impl From<Tensor> for Weight {
    fn from(t: Tensor) -> Self {
        Weight::Dense(t)
    }
}

impl Weight {
    /// The logical `[out, in]` shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Weight::Dense(t) => t.shape(),
        }
    }

    pub fn kind(&self) -> WeightKind {
        match self {
            Weight::Dense(t) => WeightKind::Dense(t.dtype()),
        }
    }

    /// `(out, in)` of a 2-D weight.
    pub fn dims2(&self, op: &'static str) -> Result<(usize, usize)> {
        match self {
            Weight::Dense(t) => t.dims2(op),
        }
    }

    /// The dense tensor, for ops that only multiply dense weights. Once
    /// there are other kinds they are [`TensorError::Unsupported`] here (the
    /// loader has checked the backend first, so only a backend's own mistake
    /// reaches that).
    pub fn dense(&self, op: &'static str) -> Result<&Tensor> {
        let _ = op;
        match self {
            Weight::Dense(t) => Ok(t),
        }
    }
}

/// The error for a weight of `kind` that `backend` cannot multiply by.
pub fn unsupported_weight(backend: &'static str, kind: WeightKind) -> TensorError {
    TensorError::Unsupported {
        backend,
        what: format!("{kind} weights"),
    }
}
