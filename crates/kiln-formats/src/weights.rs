//! Named host tensors and the [`WeightSource`] trait that model loaders read
//! through, so a model never knows whether its weights came from GGUF or
//! safetensors. Names are always Hugging Face names
//! (`model.layers.0.self_attn.q_proj.weight`).

use std::path::Path;

use kiln_quant::QuantMatrix;

use crate::error::Result;

/// A dense f32 tensor in host memory, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        HostTensor { shape, data }
    }

    pub fn num_elements(&self) -> usize {
        self.data.len()
    }
}

/// Storage type of a tensor on disk, for reporting and planning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// `F32`, `BF16`, `Q4_K`, ...
    pub dtype: String,
    pub num_bytes: u64,
}

/// A set of named tensors: a GGUF file or a safetensors directory.
pub trait WeightSource: Send + Sync {
    /// The file or directory the weights come from, for error messages.
    fn path(&self) -> &Path;
    /// Every tensor, by Hugging Face name.
    fn tensors(&self) -> Vec<StoredTensor>;
    /// Whether a tensor exists.
    fn contains(&self, name: &str) -> bool;
    /// Load one tensor as f32, dequantizing or converting as needed.
    fn load_f32(&self, name: &str) -> Result<HostTensor>;

    /// The tensor's bf16 bits with its shape, when it is stored as bf16
    /// (so a bf16 backend takes it without converting); `None` otherwise.
    fn load_bf16(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<u16>)>> {
        let _ = name;
        Ok(None)
    }

    /// The 2-D tensor `name` as its stored blocks, when the file stores it
    /// in a block format (GGUF's quantized types, F16, BF16), in the Hugging
    /// Face layout: read in place from the mapped file where that layout is
    /// the file's, copied only where rows must be reordered (`llama` GGUF
    /// q/k). `None` for other tensors.
    fn load_blocks(&self, name: &str) -> Result<Option<QuantMatrix>> {
        let _ = name;
        Ok(None)
    }

    /// The tensor's stored bytes with its dtype name and shape, whatever
    /// the dtype (MXFP4's `U8` blocks and scales); `None` where the source
    /// has no such view.
    fn load_bytes(&self, name: &str) -> Result<Option<(String, Vec<usize>, Vec<u8>)>> {
        let _ = name;
        Ok(None)
    }
}
