//! Products too large for the GEMV kernels, through cuBLAS.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as blas_sys};
use kiln_tensor::Result;

use crate::driver::device::{dev_err, Device};

/// `out[n, m] = x[n, k] · w[m, k]ᵀ + beta * out`, bf16 in and out, f32 accumulation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    dev: &Device,
    x: u64,
    w: u64,
    out: u64,
    n: usize,
    k: usize,
    m: usize,
    beta: f32,
) -> Result<()> {
    gemm_ld(dev, x, w, out, n, k, m, m, beta)
}

/// [`gemm`] into `m` columns of a wider output: row `i` of `out` starts
/// `ldc` elements after row `i - 1`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_ld(
    dev: &Device,
    x: u64,
    w: u64,
    out: u64,
    n: usize,
    k: usize,
    m: usize,
    ldc: usize,
    beta: f32,
) -> Result<()> {
    if n == 0 || m == 0 {
        return Ok(());
    }
    let alpha = 1f32;
    let bf = blas_sys::cudaDataType::CUDA_R_16BF;
    // SAFETY: the three pointers hold [m, k], [n, k] and n rows of ldc >= m bf16.
    unsafe {
        blas::gemm_ex(
            *dev.blas.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            m as i32,
            n as i32,
            k as i32,
            &alpha as *const f32 as *const c_void,
            w as *const c_void,
            bf,
            k as i32,
            x as *const c_void,
            bf,
            k as i32,
            &beta as *const f32 as *const c_void,
            out as *mut c_void,
            bf,
            ldc as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(dev_err)
}
