//! Tensors and the backends that compute on them.
//!
//! Model code is written against the [`Backend`] traits and the opaque
//! [`Tensor`] handle; it never names a concrete backend. A backend owns the
//! storage behind its tensors (host memory for [`cpu::CpuBackend`], device
//! memory for the CUDA backend) and implements the traits [`Backend`]
//! bundles: [`Memory`], [`Ops`], [`Sampling`] and [`StepRecording`].
//! Projections hold a [`Weight`] and go through one op, [`Ops::matmul`],
//! with an optional norm prologue and bias/gate/residual epilogue. Ops a
//! family needs beyond the basics are [`extension`] ops, checked at load.
//! The CPU backend is the reference implementation every other backend is
//! tested against.
//!
//! This crate does not know about file formats, tokenizers, models or
//! requests. Main types: [`Tensor`], [`Weight`], [`Backend`], [`KvCache`],
//! [`AttentionParams`], [`TensorError`].

pub mod backend;
pub mod batch;
pub mod collective;
pub mod cpu;
pub mod error;
pub mod extension;
pub mod lora;
pub mod matmul;
pub mod mla;
pub mod moe;
pub mod profile;
pub mod recurrent;
pub mod tensor;
pub mod weight;

pub use backend::{
    check_attention_args, check_attention_shapes, check_rope_args, lora_apply_unfused, qkv_rope,
    Activation, AttentionParams, Backend, DeviceMemory, ForwardBatch, KvCache, KvPoolShape, Memory,
    Ops, QkNorm, RopeParams, SampleRow, SampledRow, Sampling, SeqSlice, SeqState, StepFn,
    StepRecording,
};
pub use collective::{Collectives, HostGroup, HostRank};
pub use error::{Result, TensorError};
pub use extension::{require_extensions, ExtensionOp, GeluErf, LayerNorm, SoftCap};
pub use kiln_quant::{QuantFormat, QuantMatrix, SharedBytes};
pub use lora::{LoraAdapter, LoraBatch, LoraDelta, LoraGroup, LoraProj};
pub use matmul::{matmul_unfused, Epilogue, NormPrologue};
pub use mla::{MlaKv, MlaOutput, MlaQuery};
pub use moe::{Expert, ExpertActivation, ExpertLoad, MoeLayer, Routing, Scoring, SharedExpert};
pub use recurrent::{GatedDeltaNet, RecurrentMixer, ShortConv, StateShape};
pub use tensor::{DType, Tensor};
pub use weight::{BlockPart, BlockWeight, Weight, WeightKind};

/// The traits a backend is made of, for code that calls their methods
/// on a concrete backend type (`dyn Backend` needs no import).
pub mod prelude {
    pub use crate::backend::{Backend, Memory, Ops, Sampling, StepRecording};
    pub use crate::collective::Collectives;
}
