//! Weight formats: GGUF files and Hugging Face safetensors directories.
//!
//! This crate turns files on disk into named host tensors and model metadata.
//! It knows nothing of devices, models' forward passes or tokenizers' logic;
//! it only reads and writes bytes. Main types: [`GgufFile`] (metadata, tensor
//! table, mapped bytes, dequantization), [`GgmlType`], [`FormatError`].
//!
//! Invariants: every byte offset read from a file is bounds-checked at open,
//! so a truncated or corrupt file gives a [`FormatError`] naming the file and
//! tensor, never a panic.

pub mod dequant;
pub mod dtype;
pub mod error;
pub mod gguf;
pub mod gguf_hf;
pub mod weights;

pub use dtype::GgmlType;
pub use error::{FormatError, Result};
pub use gguf::{GgufFile, GgufMetadata, GgufTensorInfo, MetaValue};
pub use gguf_hf::GgufWeights;
pub use weights::{HostTensor, StoredTensor, WeightSource};
