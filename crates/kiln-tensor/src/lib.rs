//! Tensors and the backends that compute on them.
//!
//! Model code is written against the [`Backend`] trait and the opaque
//! [`Tensor`] handle; it never names a concrete backend. A backend owns the
//! storage behind its tensors (host memory for [`cpu::CpuBackend`], device
//! memory for the CUDA backend later) and implements every op. The CPU
//! backend is the reference implementation every other backend is tested
//! against.
//!
//! This crate does not know about file formats, tokenizers, models or
//! requests. Main types: [`Tensor`], [`Backend`], [`KvCache`],
//! [`AttentionParams`], [`TensorError`].

pub mod backend;
pub mod cpu;
pub mod error;
pub mod profile;
pub mod tensor;

pub use backend::{
    check_attention_args, check_attention_shapes, check_rope_args, Activation, AttentionParams,
    Backend, DeviceMemory, ForwardBatch, KvCache, KvPoolShape, QkNorm, RopeParams, SampleRow,
    SampledRow, SeqSlice,
};
pub use error::{Result, TensorError};
pub use tensor::{DType, Tensor};
