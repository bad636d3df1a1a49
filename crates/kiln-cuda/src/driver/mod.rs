//! The driver layer: the CUDA context and its one stream ([`device`]), the
//! caching allocator ([`pool`]), pinned weight uploads ([`staging`]) and
//! run-time compilation with NVRTC ([`compile`]), and kernel launches
//! (`device::Launch`). It knows no op, model or step: nothing here imports
//! from the layers above (`ops`, `step`, the backend).

pub mod compile;
pub(crate) mod device;
pub mod pool;
pub(crate) mod staging;

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

/// GPUs the driver sees (0 without a driver).
pub fn device_count() -> usize {
    if !driver_available() {
        return 0;
    }
    cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
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
