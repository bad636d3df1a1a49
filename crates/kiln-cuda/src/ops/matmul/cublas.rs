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

/// One product of [`grouped_gemm`]: `out[n, m] = x[n, k] · w[m, k]ᵀ`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Problem {
    pub w: u64,
    pub x: u64,
    pub out: u64,
    pub n: usize,
}

/// Products of one shape but for their row counts (a Mixture-of-Experts
/// layer's experts over their rows), bf16 in and out, f32 accumulation: one
/// cuBLAS grouped launch, or one product each where the library has no
/// grouped GEMM for them.
pub(crate) fn grouped_gemm(dev: &Device, problems: &[Problem], k: usize, m: usize) -> Result<()> {
    let problems: Vec<Problem> = problems.iter().copied().filter(|p| p.n > 0).collect();
    if problems.is_empty() || m == 0 {
        return Ok(());
    }
    let g = problems.len();
    let ptrs: Vec<u64> = [
        problems.iter().map(|p| p.w).collect::<Vec<_>>(),
        problems.iter().map(|p| p.x).collect(),
        problems.iter().map(|p| p.out).collect(),
    ]
    .concat();
    let table = dev.alloc(3 * g, 8, "grouped product pointers")?;
    dev.htod(table.ptr, &ptrs)?;
    let op_t = vec![blas_sys::cublasOperation_t::CUBLAS_OP_T; g];
    let op_n = vec![blas_sys::cublasOperation_t::CUBLAS_OP_N; g];
    let ms = vec![m as i32; g];
    let ns: Vec<i32> = problems.iter().map(|p| p.n as i32).collect();
    let ks = vec![k as i32; g];
    let (alphas, betas) = (vec![1f32; g], vec![0f32; g]);
    let ones = vec![1i32; g];
    let bf = blas_sys::cudaDataType::CUDA_R_16BF;
    // SAFETY: the host arrays hold g entries each; the device table holds g
    // pointers each of weights [m, k], inputs [n_i, k] and outputs [n_i, m]
    // (bf16), all held by the caller until the stream has run the product.
    let status = unsafe {
        blas_sys::cublasGemmGroupedBatchedEx(
            *dev.blas.handle(),
            op_t.as_ptr(),
            op_n.as_ptr(),
            ms.as_ptr(),
            ns.as_ptr(),
            ks.as_ptr(),
            alphas.as_ptr() as *const c_void,
            table.ptr as *const *const c_void,
            bf,
            ks.as_ptr(),
            (table.ptr + 8 * g as u64) as *const *const c_void,
            bf,
            ks.as_ptr(),
            betas.as_ptr() as *const c_void,
            (table.ptr + 16 * g as u64) as *const *mut c_void,
            bf,
            ms.as_ptr(),
            g as i32,
            ones.as_ptr(),
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    };
    if status == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    for p in &problems {
        gemm(dev, p.x, p.w, p.out, p.n, k, m, 0.0)?;
    }
    Ok(())
}
