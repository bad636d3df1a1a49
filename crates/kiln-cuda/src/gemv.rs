//! The decode-sized products' routing for [`CudaBackend`]: up to
//! `GEMV_MAX_ROWS` rows the GEMV kernels (the direct-load one for plain,
//! bias and residual products, the pipelined one for the gated ones), 9–64
//! rows the skinny GEMM where it is on; the caller falls back to cuBLAS.

use cudarc::driver::LaunchConfig;
use kiln_tensor::Result;

use crate::backend::{CudaBackend, GEMV_MAX_ROWS};
use crate::device::dev_err;

impl CudaBackend {
    /// `out[n, m] = x[n, k] · w[m, k]ᵀ` with a GEMV epilogue `mode`
    /// (0 none, 1 bias, 2 residual, 3 SiLU gate, 4 GELU gate); `out_cols`
    /// is m, or m / 2 for the gated modes; 9–64 rows go to the skinny GEMM.
    /// Returns false when the shape is for neither (cuBLAS then).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv(
        &self,
        x: u64,
        w: u64,
        out: u64,
        extra: u64,
        n: usize,
        k: usize,
        out_cols: usize,
        mode: i32,
    ) -> Result<bool> {
        if n > GEMV_MAX_ROWS {
            return self.skinny_gemm(x, w, out, extra, n, k, out_cols, mode);
        }
        // Plain, bias and residual products use the direct-load kernel; the
        // gated ones the pipelined kernel (each measured faster there).
        let direct = mode <= 2 || self.dev.gated_direct;
        let name = if direct {
            format!("gemv_direct_bf16_m{n}")
        } else {
            format!("gemv_bf16_m{n}")
        };
        if n == 0 || n > GEMV_MAX_ROWS || !k.is_multiple_of(8) || !self.dev.has(&name) {
            return Ok(false);
        }
        let (ni, ki, splits, null) = (out_cols as i32, k as i32, 1i32, 0u64);
        // One block per 16 output columns; no split-K (slower on every
        // decode shape measured).
        let cfg = LaunchConfig {
            grid_dim: (out_cols.div_ceil(16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let func = self.dev.func(&name)?;
        let mut b = self.dev.launch(func);
        b.arg(&x)
            .arg(&w)
            .arg(&out)
            .arg(&extra)
            .arg(&ni)
            .arg(&ki)
            .arg(&mode);
        if !direct {
            b.arg(&splits).arg(&null).arg(&null);
        }
        // SAFETY: x [n, k], w [m, k], out [n, out_cols], extra as `mode`
        // needs; the direct kernel takes the first seven arguments only.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(true)
    }
}
