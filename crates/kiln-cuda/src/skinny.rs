//! The skinny GEMM (`kernels/skinny.cu`): products of 9–64 activation rows
//! (decode batches past the GEMV kernels' 8), where cuBLAS streams the
//! weights at a fraction of the memory bandwidth. Each block streams 128
//! weight rows once through a cp.async pipeline and multiplies them against
//! every row of x on the tensor cores; narrow products split K across
//! blocks and reduce the partial sums deterministically. Same epilogues as
//! the GEMV kernels (bias, residual add, SiLU/GELU gate on the packed
//! gate/up weight). It is off by default: measured on an H200 at the 8B
//! shapes (M = 32, 64) it was slower end to end than cuBLAS (5,080 against
//! 7,386 tok/s at 64 concurrent requests), so `set_skinny_gemm_enabled(true)`
//! (`KILN_SKINNY_GEMM=1`) turns it on for tuning and A/B runs.

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::LaunchConfig;
use kiln_tensor::Result;

use crate::device::{dev_err, Device};
use crate::pool::DevBuf;
use crate::CudaBackend;

/// Row counts the skinny GEMM serves (above the GEMV kernels' 8).
pub(crate) const SKINNY_MIN_ROWS: usize = 9;
pub(crate) const SKINNY_MAX_ROWS: usize = 64;

/// Tile counters of split-K launches (one per block column; the kernel
/// leaves them zero).
const COUNTERS: usize = 16384;

/// Pipeline stages, weight rows per block and k per stage (as the kernel).
const STAGES: usize = 4;
const ROWS: usize = 128;
const CHUNK_K: usize = 64;

/// Dynamic shared memory of the kernel for `mt` (16, 32, 48, 64) rows.
pub(crate) fn smem_bytes(mt: usize) -> usize {
    STAGES * (ROWS * CHUNK_K / 8 + 8 * mt) * 16
}

/// The largest dynamic shared memory any variant uses (set at load).
pub(crate) const MAX_SMEM: usize = STAGES * (ROWS * CHUNK_K / 8 + 8 * SKINNY_MAX_ROWS) * 16;

/// The launch of a product: (kernel row tile mt, tiles, splits).
/// `out_cols` is N (the output columns; the gated modes read 2N weight
/// rows). Splits fill the GPU with at least one block per SM while each
/// split keeps at least 8 chunks (512 of K).
pub fn launch_shape(
    n: usize,
    k: usize,
    out_cols: usize,
    gated: bool,
    sms: usize,
) -> (usize, usize, usize) {
    let mt = n.next_multiple_of(16);
    let cols = if gated { ROWS / 2 } else { ROWS };
    let tiles = out_cols.div_ceil(cols);
    let chunks = k.div_ceil(CHUNK_K);
    let splits = if tiles > COUNTERS {
        1
    } else {
        sms.div_ceil(tiles).clamp(1, (chunks / 8).max(1))
    };
    (mt, tiles, splits)
}

/// The skinny GEMM's state in the backend: on/off, the SM count, and the
/// split-K tile counters (allocated and zeroed when the backend opens, so
/// recorded steps never allocate them).
pub(crate) struct Skinny {
    enabled: AtomicBool,
    sms: usize,
    counters: Option<DevBuf>,
}

impl Skinny {
    pub(crate) fn new(dev: &Device) -> Self {
        let sms = dev.sms;
        let counters = dev.alloc_zeroed(COUNTERS * 4, "skinny GEMM counters").ok();
        Skinny {
            enabled: AtomicBool::new(false),
            sms,
            counters,
        }
    }
}

impl CudaBackend {
    /// Run 9–64-row products with the skinny GEMM (on by default); off,
    /// they go to cuBLAS.
    pub fn set_skinny_gemm_enabled(&self, on: bool) {
        self.skinny.enabled.store(on, Ordering::Relaxed);
    }

    pub fn skinny_gemm_enabled(&self) -> bool {
        self.skinny.enabled.load(Ordering::Relaxed)
    }

    /// `out[n, out_cols] = x[n, k] · w[m, k]ᵀ` with a GEMV epilogue `mode`
    /// (0 none, 1 bias, 2 residual, 3 SiLU gate, 4 GELU gate; `extra` the
    /// bias or residual) by the skinny GEMM. Returns false when the shape
    /// is not for it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn skinny_gemm(
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
        if !(SKINNY_MIN_ROWS..=SKINNY_MAX_ROWS).contains(&n)
            || k == 0
            || !k.is_multiple_of(8)
            || out_cols == 0
            || out_cols > i32::MAX as usize / 2
            || !self.skinny_gemm_enabled()
        {
            return Ok(false);
        }
        let (mt, tiles, mut splits) = launch_shape(n, k, out_cols, mode >= 3, self.skinny.sms);
        let name = format!("skinny_gemm_bf16_m{mt}");
        if !self.dev.has(&name) {
            return Ok(false);
        }
        let counters = match &self.skinny.counters {
            Some(c) => c.ptr,
            None => {
                splits = 1;
                0
            }
        };
        // Partial sums of a split-K launch: every slot is written before it
        // is read, so a pooled buffer of any contents will do.
        let ws = if splits > 1 {
            Some(
                self.dev
                    .alloc(tiles * splits * mt * ROWS, 4, "skinny GEMM partial sums")?,
            )
        } else {
            None
        };
        let (wsp, cnt) = match &ws {
            Some(b) => (b.ptr, counters),
            None => (0u64, 0u64),
        };
        let (mi, ni, ki) = (n as i32, out_cols as i32, k as i32);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, splits as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem_bytes(mt) as u32,
        };
        let func = self.dev.func(&name)?;
        let mut b = self.dev.launch(func);
        b.arg(&x)
            .arg(&w)
            .arg(&out)
            .arg(&extra)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&mode)
            .arg(&wsp)
            .arg(&cnt);
        // SAFETY: x [n, k] with n <= mt, w [out_cols or 2 out_cols, k],
        // out [n, out_cols], extra as `mode` needs; k % 8 == 0; the dynamic
        // shared memory is within the attribute set at load; with splits > 1
        // ws holds tiles * splits * mt * 128 floats and the counters (zero
        // between launches, which are stream-ordered) tiles <= COUNTERS u32.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        drop(ws);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_shapes_of_the_8b_decode_products() {
        // qkv, o, gate_up (gated), down, lm_head at 64 rows on 132 SMs.
        assert_eq!(launch_shape(64, 4096, 6144, false, 132), (64, 48, 3));
        assert_eq!(launch_shape(64, 4096, 4096, false, 132), (64, 32, 5));
        assert_eq!(launch_shape(64, 4096, 14336, true, 132), (64, 224, 1));
        assert_eq!(launch_shape(64, 14336, 4096, false, 132), (64, 32, 5));
        assert_eq!(launch_shape(9, 4096, 49152, false, 132), (16, 384, 1));
        // Short K keeps at least 8 chunks a split.
        assert_eq!(launch_shape(33, 576, 100, false, 132), (48, 1, 1));
        assert_eq!(launch_shape(17, 1024, 100, false, 132), (32, 1, 2));
        assert_eq!(smem_bytes(64), 96 << 10);
        assert_eq!(MAX_SMEM, smem_bytes(64));
    }
}
