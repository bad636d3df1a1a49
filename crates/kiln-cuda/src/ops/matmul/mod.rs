//! Matrix products `x · wᵀ` with their epilogues (bias, residual add, gated
//! activation) and, in `norm_prologue`, an RMSNorm prologue: up to
//! [`GEMV_MAX_ROWS`] rows the direct-load tensor-core GEMV (`gemv.cu`),
//! larger products cuBLAS (`cublas.rs`) with the epilogue as separate
//! kernels; block-quantized weights in `blocks.rs` (`blocks.cu`).

use cudarc::driver::LaunchConfig;
use kiln_tensor::{Activation, Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, wrap, Device};
use crate::ops::activation::act_code;

pub(crate) mod blocks;
mod cublas;
mod lt;
pub(crate) mod norm_prologue;

pub(crate) use cublas::{gemm, gemm_ld, grouped_gemm, Problem};
pub(crate) use lt::Lt;

/// Largest row count served by the GEMV kernels.
pub(crate) const GEMV_MAX_ROWS: usize = 8;

impl CudaBackend {
    /// `out[n, m] = x[n, k] · w[m, k]ᵀ` with a GEMV epilogue `mode`
    /// (0 none, 1 bias, 2 residual, 3 SiLU gate, 4 GELU gate); `out_cols`
    /// is m, or m / 2 for the gated modes.
    /// Returns false when the shape is not for it (cuBLAS then).
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
        let name = format!("gemv_direct_bf16_m{n}");
        if n == 0 || n > GEMV_MAX_ROWS || !k.is_multiple_of(8) || !self.dev.has(&name) {
            return Ok(false);
        }
        let (ni, ki) = (out_cols as i32, k as i32);
        // Tiles of 16 (or 8) output columns, at most one wave of blocks
        // (`direct_launch`); no split-K (slower on every decode shape
        // measured).
        let (grid, mode) = self.direct_launch(out_cols, mode);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
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
        // SAFETY: x [n, k], w [m, k], out [n, out_cols], extra as `mode`
        // needs.
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(true)
    }

    /// The direct-load GEMV's launch for `out_cols` outputs in `mode`: its
    /// grid (at most one wave of resident blocks that loop over the tiles,
    /// carrying their loads from one tile into the next) and mode argument;
    /// the tile width is [`direct_tiles`]'s, or the one
    /// [`crate::CudaOptions::direct_cols`] sets.
    pub(crate) fn direct_launch(&self, out_cols: usize, mode: i32) -> (u32, i32) {
        let (cols, mode) = match self.options.direct_cols {
            Some(8) if mode < 3 => (8, mode | 8),
            Some(16) if mode < 3 => (16, mode),
            _ => direct_tiles(out_cols, mode, self.dev.sms),
        };
        let tiles = out_cols.div_ceil(cols);
        let grid = tiles.min(self.dev.sms * DIRECT_BLOCKS_PER_SM);
        (grid.max(1) as u32, mode)
    }
}

pub(crate) fn linear(
    cuda: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (n, k, m) = linear_dims(x, w)?;
    let out = cuda.alloc(n * m, "a projection")?;
    let (xp, wp) = (ptr(x, "linear")?, ptr(w, "linear")?);
    if let Some(b) = bias {
        if b.num_elements() != m {
            return Err(TensorError::Shape {
                op: "linear",
                detail: format!("bias of {} for {m} outputs", b.num_elements()),
            });
        }
    }
    let (mode, extra) = match bias {
        Some(b) => (1, ptr(b, "linear bias")?),
        None => (0, 0),
    };
    if !cuda.gemv(xp, wp, out.ptr, extra, n, k, m, mode)? {
        gemm(&cuda.dev, xp, wp, out.ptr, n, k, m, 0.0)?;
        if let Some(b) = bias {
            crate::ops::elementwise::add_bias(cuda, out.ptr, b, n, m)?;
        }
    }
    Ok(wrap(vec![n, m], out))
}

pub(crate) fn linear_add(
    cuda: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
) -> Result<Tensor> {
    let (n, k, m) = linear_dims(x, w)?;
    if residual.shape() != [n, m] {
        return Err(TensorError::Shape {
            op: "linear_add",
            detail: format!("residual {:?} for [{n}, {m}]", residual.shape()),
        });
    }
    let out = cuda.alloc(n * m, "a projection")?;
    let (xp, wp, rp) = (
        ptr(x, "linear")?,
        ptr(w, "linear")?,
        ptr(residual, "linear")?,
    );
    if bias.is_none() && cuda.gemv(xp, wp, out.ptr, rp, n, k, m, 2)? {
        return Ok(wrap(vec![n, m], out));
    }
    cuda.dev.dtod(out.ptr, rp, n * m * 2)?;
    gemm(&cuda.dev, xp, wp, out.ptr, n, k, m, 1.0)?;
    if let Some(b) = bias {
        crate::ops::elementwise::add_bias(cuda, out.ptr, b, n, m)?;
    }
    Ok(wrap(vec![n, m], out))
}

pub(crate) fn gated_linear(
    cuda: &CudaBackend,
    x: &Tensor,
    w_gate_up: &Tensor,
    act: Activation,
) -> Result<Tensor> {
    let (n, k, two_i) = linear_dims(x, w_gate_up)?;
    let inter = two_i / 2;
    if two_i % 2 != 0 {
        return Err(TensorError::Shape {
            op: "gated_linear",
            detail: format!("{two_i} packed gate/up rows"),
        });
    }
    let (xp, wp) = (ptr(x, "gated_linear")?, ptr(w_gate_up, "gated_linear")?);
    let out = cuda.alloc(n * inter, "an MLP activation")?;
    if cuda.gemv(xp, wp, out.ptr, 0, n, k, inter, 3 + act_code(act))? {
        return Ok(wrap(vec![n, inter], out));
    }
    let gu = cuda.alloc(n * two_i, "an MLP projection")?;
    gemm(&cuda.dev, xp, wp, gu.ptr, n, k, two_i, 0.0)?;
    crate::ops::activation::gated_packed(cuda, &wrap(vec![n, two_i], gu), act)
}

pub(crate) fn linear_dims(x: &Tensor, w: &Tensor) -> Result<(usize, usize, usize)> {
    let (n, k) = x.dims2("linear")?;
    let (m, kw) = w.dims2("linear")?;
    if k != kw {
        return Err(TensorError::Shape {
            op: "linear",
            detail: format!("x {:?} · w {:?}ᵀ", x.shape(), w.shape()),
        });
    }
    Ok((n, k, m))
}

/// The fused norm kernels' shared memory is above the default limit: raise
/// it at load, leaving out (with a warning) any the GPU cannot give it.
pub(crate) fn configure(dev: &mut Device, warnings: &mut Vec<String>) {
    norm_prologue::configure(dev, warnings);
    blocks::configure(dev, warnings);
}

/// Resident blocks per multiprocessor of the direct-load GEMV (its
/// `KILN_DIRECT_MIN_BLOCKS`).
const DIRECT_BLOCKS_PER_SM: usize = 2;

/// The direct-load GEMV's tile width for `out_cols` outputs in epilogue
/// `mode`, and the mode argument that asks for it: gated products always run
/// 8-column tiles (gate and up rows in one tile); the others 16 columns,
/// unless twice as many 8-column blocks fill the GPU's last wave of resident
/// blocks clearly better (6,144 qkv outputs on 132 SMs: 384 blocks leave the
/// second wave 45 % full, 768 fill their third to 91 %).
pub(crate) fn direct_tiles(out_cols: usize, mode: i32, sms: usize) -> (usize, i32) {
    if mode >= 3 {
        return (8, mode);
    }
    let slots = (sms * DIRECT_BLOCKS_PER_SM).max(1);
    let fill = |blocks: usize| blocks as f64 / (blocks.div_ceil(slots) * slots) as f64;
    if fill(out_cols.div_ceil(8)) > fill(out_cols.div_ceil(16)) + 0.05 {
        (8, mode | 8)
    } else {
        (16, mode)
    }
}

#[cfg(test)]
mod tests {
    use super::direct_tiles;

    #[test]
    fn tile_width_follows_the_last_wave() {
        // H200: 132 SMs, 264 resident blocks.
        assert_eq!(direct_tiles(6144, 0, 132), (8, 8)); // 384 vs 768 blocks
        assert_eq!(direct_tiles(4096, 2, 132), (16, 2)); // 256 blocks: one wave
        assert_eq!(direct_tiles(49152, 0, 132), (16, 0)); // 3,072: 97 % either way
        assert_eq!(direct_tiles(14336, 3, 132), (8, 3)); // gated: always 8
        assert_eq!(direct_tiles(576, 1, 132), (8, 9)); // SmolLM2: 36 vs 72 blocks
        assert_eq!(direct_tiles(100, 0, 0), (16, 0)); // no SM count: one slot, every wave full
    }
}
