//! [`Weight`]: the stored form of a projection's matrix, as a backend
//! holds it, and [`WeightKind`], what a backend is asked whether it can
//! multiply by.

use std::any::Any;
use std::sync::Arc;

use kiln_quant::QuantFormat;

use crate::error::{Result, TensorError};
use crate::tensor::{DType, Tensor};

/// A projection's weight, `[out, in]` in Hugging Face layout: a dense
/// tensor, or the file's blocks as they are stored. Code outside this
/// crate matches it with a catch-all arm.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Weight {
    /// A dense tensor in whatever element type the backend stores.
    Dense(Tensor),
    /// Rows in block formats (GGUF's quantized layouts, F16, BF16), never
    /// expanded: the backend's product reads the blocks.
    Blocks(BlockWeight),
}

/// What a [`Weight`] is, for a backend to say whether it can multiply by
/// it ([`crate::Memory::supports_weight`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WeightKind {
    Dense(DType),
    Blocks(QuantFormat),
}

impl std::fmt::Display for WeightKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightKind::Dense(d) => write!(f, "dense {d:?}"),
            WeightKind::Blocks(q) => write!(f, "{q} block"),
        }
    }
}

impl From<Tensor> for Weight {
    fn from(t: Tensor) -> Self {
        Weight::Dense(t)
    }
}

/// Rows `[rows, cols]` of one format, stored by a backend
/// ([`crate::Memory::upload_blocks`]); its storage is the backend's own.
#[derive(Clone)]
pub struct BlockPart {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    bytes: usize,
    storage: Arc<dyn Any + Send + Sync>,
}

impl BlockPart {
    /// A part whose `storage` holds `rows × cols` elements of `format` in
    /// `bytes` bytes, in a form only the backend that made it reads.
    pub fn from_storage(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        bytes: usize,
        storage: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        BlockPart {
            format,
            rows,
            cols,
            bytes,
            storage,
        }
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Stored bytes.
    pub fn num_bytes(&self) -> usize {
        self.bytes
    }

    pub fn storage(&self) -> &(dyn Any + Send + Sync) {
        self.storage.as_ref()
    }
}

impl std::fmt::Debug for BlockPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BlockPart({} × {} {})",
            self.rows, self.cols, self.format
        )
    }
}

/// A block weight: parts stacked by rows, all of one width. A packed
/// product (q/k/v, gate/up) whose parts the file stores in different
/// formats keeps each part as it is.
#[derive(Debug, Clone)]
pub struct BlockWeight {
    shape: Vec<usize>,
    parts: Vec<BlockPart>,
}

impl BlockWeight {
    /// The parts stacked, or a shape error when they are not all as wide.
    pub fn new(parts: Vec<BlockPart>) -> Result<Self> {
        let cols = parts.first().map(|p| p.cols).unwrap_or(0);
        if parts.is_empty() || parts.iter().any(|p| p.cols != cols) {
            return Err(TensorError::Shape {
                op: "block weight",
                detail: format!("parts {parts:?} are not one width"),
            });
        }
        Ok(BlockWeight {
            shape: vec![parts.iter().map(|p| p.rows).sum(), cols],
            parts,
        })
    }

    pub fn parts(&self) -> &[BlockPart] {
        &self.parts
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Stored bytes of every part.
    pub fn num_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.bytes).sum()
    }
}

impl Weight {
    /// The logical `[out, in]` shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Weight::Dense(t) => t.shape(),
            Weight::Blocks(b) => b.shape(),
        }
    }

    /// The kind of the weight (of its first part, for blocks: a backend
    /// that takes some formats and not others is asked per part as each is
    /// stored).
    pub fn kind(&self) -> WeightKind {
        match self {
            Weight::Dense(t) => WeightKind::Dense(t.dtype()),
            Weight::Blocks(b) => WeightKind::Blocks(b.parts[0].format),
        }
    }

    /// `(out, in)` of a 2-D weight.
    pub fn dims2(&self, op: &'static str) -> Result<(usize, usize)> {
        match self {
            Weight::Dense(t) => t.dims2(op),
            Weight::Blocks(b) => Ok((b.shape[0], b.shape[1])),
        }
    }

    /// The dense tensor, for ops that only multiply dense weights; blocks
    /// are [`TensorError::Unsupported`] here (the loader has checked the
    /// backend first, so only a backend's own mistake reaches that).
    pub fn dense(&self, op: &'static str) -> Result<&Tensor> {
        match self {
            Weight::Dense(t) => Ok(t),
            Weight::Blocks(_) => Err(TensorError::Unsupported {
                backend: "this backend",
                what: format!("{} weights in {op}", self.kind()),
            }),
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
