//! The ops, one module each: its kernels (`<op>.cu`) beside the launchers
//! that check shapes, pick a kernel and launch it. `backend.rs` maps the
//! `Backend` trait onto these functions.

pub(crate) mod activation;
pub(crate) mod argmax;
pub(crate) mod attention;
pub(crate) mod elementwise;
pub(crate) mod gather;
pub(crate) mod lora;
pub(crate) mod matmul;
pub(crate) mod mla;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod recurrent;
pub(crate) mod rope_kv_write;
pub(crate) mod sample;

use crate::driver::device::Device;
use crate::CudaError;

/// Per-kernel attributes the ops need once their kernels are loaded (shared
/// memory limits); a fast kernel the GPU cannot configure is left out, with
/// a warning, for its fallback.
pub(crate) fn configure(dev: &mut Device, warnings: &mut Vec<String>) -> Result<(), CudaError> {
    attention::configure(dev)?;
    matmul::configure(dev, warnings);
    recurrent::configure(dev, warnings);
    Ok(())
}
