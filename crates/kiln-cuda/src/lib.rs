//! The CUDA backend. CUDA is loaded dynamically (the default build compiles
//! and runs on machines with no toolkit or driver, and says so clearly
//! instead of crashing), and Kiln's kernels — CUDA C beside each op's
//! launcher in `src/ops/<op>/`, embedded in the binary ([`kernels`]) — are
//! compiled at run time with NVRTC for the GPU's own architecture and cached
//! on disk by source hash, architecture and NVRTC version, so a second start
//! compiles nothing.
//!
//! Layers, each importing only from those before it: [`driver`] (context,
//! stream, memory pool, NVRTC, launches), `ops` (one module per op: its
//! kernels and their launchers), `step` (a step's metadata and the CUDA
//! graphs decode steps are recorded as), and [`backend`] (the
//! `kiln_tensor::Backend` implementation, which only dispatches to them).
//! Every setting comes in as a [`CudaOptions`]; nothing here reads the
//! environment.
//!
//! This crate must not depend on models, formats or requests. Main types:
//! [`CudaBackend`], [`CudaOptions`], [`KernelCompiler`], [`CudaError`],
//! [`MemorySnapshot`], and [`kernels::SOURCES`].

pub mod backend;
pub mod collective;
pub mod driver;
pub mod kernels;
mod ops;
pub mod options;
pub mod selfcheck;
mod step;

pub use backend::CudaBackend;
pub use collective::{
    nccl_available, nccl_ranks, nccl_ranks_joining, nccl_unique_id, CudaGroup, NcclRank,
};
pub use driver::compile::{CompiledKernel, KernelCompiler};
pub use driver::pool::MemorySnapshot;
pub use driver::{device_count, driver_available, nvrtc_available, nvrtc_version, CudaError};
pub use options::CudaOptions;
