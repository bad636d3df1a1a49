//! Weight formats: GGUF files and Hugging Face safetensors directories.
//!
//! This crate turns files on disk into named host tensors and model metadata.
//! It knows nothing of devices, models' forward passes or tokenizers' logic;
//! it only reads and writes bytes. Main types: [`GgufFile`] (metadata, tensor
//! table, mapped bytes, dequantization), [`GgufWeights`] (a GGUF file seen
//! through Hugging Face names), [`SafetensorsDir`] (a Hugging Face model
//! directory), the [`WeightSource`] trait both implement, [`write_hf_dir`]
//! (export to a Hugging Face directory), [`GgmlType`], [`FormatError`].
//!
//! Invariants: every byte offset read from a file is bounds-checked at open,
//! so a truncated or corrupt file gives a [`FormatError`] naming the file and
//! tensor, never a panic.

pub mod dequant;
pub mod dtype;
pub mod error;
pub mod gguf;
pub mod gguf_hf;
pub mod gguf_write;
mod quantized_st;
pub mod quantizing;
pub mod safetensors_dir;
pub mod safetensors_write;
pub mod weights;

pub use dtype::GgmlType;
pub use error::{FormatError, Result};
pub use gguf::{GgufFile, GgufMetadata, GgufTensorInfo, MetaValue};
pub use gguf_hf::GgufWeights;
pub use gguf_write::{write_gguf, write_gguf_shapes, GgufTensorPlan};
pub use quantizing::{QuantMix, Quantizing};
pub use safetensors_dir::SafetensorsDir;
pub use safetensors_write::{
    write_hf_dir, write_hf_dir_with, write_safetensors, HfDirOptions, SafetensorsDtype,
};
pub use weights::{HostTensor, StoredTensor, WeightSource};
