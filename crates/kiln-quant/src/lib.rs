//! Block-quantized weight formats.
//!
//! A weight matrix in a [`QuantFormat`] is rows of whole blocks, each block
//! a few scales and packed small integers (GGML's layouts, which GGUF files
//! store), or plain F16 / BF16. This crate owns what a format *is*: its
//! geometry ([`QuantFormat`]), the reference value of every element
//! ([`dequant`], the definition every fast kernel is checked against), and
//! the quantizers that write blocks. It knows nothing of
//! files, devices or models.

pub mod dequant;
mod format;
mod matrix;
pub mod quantize;
mod random;

pub use format::QuantFormat;
pub use matrix::{QuantMatrix, SharedBytes};
pub use quantize::{parse_quantize_type, quantize, QUANTIZE_FORMATS};
pub use random::random_blocks;
