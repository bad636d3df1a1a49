//! The CUDA backend's foundation: CUDA is loaded dynamically (the default
//! build compiles and runs on machines with no toolkit or driver, and says
//! so clearly instead of crashing), and Kiln's kernels — CUDA C in
//! `src/kernels/`, embedded in the binary — are compiled at run time with
//! NVRTC for the GPU's own architecture and cached on disk by source hash,
//! architecture and NVRTC version, so a second start compiles nothing.
//!
//! This crate must not depend on models, formats or requests; it provides
//! device code and [`CudaBackend`], an implementation of
//! `kiln_tensor::Backend`. Main types: [`CudaBackend`], [`KernelCompiler`],
//! [`CudaError`], [`MemorySnapshot`], and [`kernels::SOURCES`].

mod argmax;
mod attention;
pub mod backend;
pub mod compile;
mod device;
mod gemv;
pub mod graphs;
pub mod kernels;
pub mod meta;
mod norm_gemv;
pub mod options;
pub mod pool;
mod sample;
mod sample_check;
pub mod selfcheck;
mod staging;

pub use backend::CudaBackend;
pub use compile::{CompiledKernel, KernelCompiler};
pub use options::CudaOptions;
pub use pool::MemorySnapshot;

/// Why CUDA could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver: libcuda could not be loaded (is an NVIDIA driver installed and on the library path?)")]
    NoDriver,
    #[error("NVRTC (libnvrtc) could not be loaded: install the CUDA 13 NVRTC libraries and put them on LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("kernel {kernel} failed to compile for {arch}:\n{log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },
    #[error("CUDA: {0}")]
    Device(String),
    #[error("kernel cache {path}: {source}")]
    Cache {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded on this machine.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's (major, minor) version, if NVRTC loads.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_available() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}
