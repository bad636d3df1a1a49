//! LoRA deltas (`lora.cu`): every adapter and packed part of one
//! [`kiln_tensor::Ops::lora_add`] in a shrink and an expand launch over
//! segments (one adapter's projection over one contiguous run of rows).
//! Steps with adapters run eagerly (`step::meta::is_graphable`), so the
//! segments travel as a kernel parameter. Steps of at least
//! `CudaOptions::lora_mma_rows` rows (prefill) and ranks up to 64 take the
//! tensor-core pair, the others the CUDA-core pair.

use std::sync::Arc;

use cudarc::driver::{DeviceRepr, LaunchConfig};
use kiln_tensor::{DType, LoraDelta, Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, wrap};

const MAX_SEGS: usize = 32;
const SHRINK_ROWS: usize = 8;
const SHRINK_K: usize = 512;
const EXPAND_ROWS: usize = 16;
const MMA_MAX_R: usize = 64;
const MMA_ROWS: usize = 64;
const MMA_COLS: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Seg {
    a: u64,
    b: u64,
    scale: f32,
    row0: i32,
    rows: i32,
    col0: i32,
    cols: i32,
    r: i32,
    t_off: i64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Segs {
    s: [Seg; MAX_SEGS],
    t_stride: i64,
    k: i32,
    width: i32,
    num_kc: i32,
}

// SAFETY: plain C data, laid out as `LoraSegs` in lora.cu.
unsafe impl DeviceRepr for Segs {}

pub(crate) fn lora_add(
    cuda: &CudaBackend,
    y: &Tensor,
    x: &Tensor,
    deltas: &[LoraDelta<'_>],
) -> Result<Tensor> {
    lora_add_rows(cuda, y, x, deltas, cuda.options.lora_mma_rows)
}

/// [`lora_add`] with steps of at least `mma_rows` rows on the tensor-core
/// pair (cuda-check runs both pairs whatever the option says).
pub(crate) fn lora_add_rows(
    cuda: &CudaBackend,
    y: &Tensor,
    x: &Tensor,
    deltas: &[LoraDelta<'_>],
    mma_rows: usize,
) -> Result<Tensor> {
    let (n, width) = y.dims2("lora_add")?;
    let (nx, k) = x.dims2("lora_add")?;
    let shape_err = |detail: String| TensorError::Shape {
        op: "lora_add",
        detail,
    };
    if nx != n {
        return Err(shape_err(format!("{nx} rows of x for {n} of y")));
    }
    if k % 8 != 0 {
        return Err(TensorError::Unsupported {
            backend: "cuda",
            what: format!("LoRA on a projection of {k} inputs (a multiple of 8 runs)"),
        });
    }
    let mut segs = Vec::new();
    for d in deltas {
        let (r, ka) = d.proj.a.dims2("lora_add")?;
        let (o, rb) = d.proj.b.dims2("lora_add")?;
        if ka != k || rb != r || o != d.cols.len() || d.cols.end > width || r == 0 {
            return Err(shape_err(format!(
                "A [{r}, {ka}] and B [{o}, {rb}] for x [{n}, {k}] into columns {:?} of {width}",
                d.cols
            )));
        }
        if d.proj.a.dtype() != DType::BF16 || d.proj.b.dtype() != DType::BF16 {
            return Err(shape_err("adapter matrices not in bf16".into()));
        }
        let (a, b) = (ptr(&d.proj.a, "lora_add")?, ptr(&d.proj.b, "lora_add")?);
        for rows in d.rows.iter().filter(|r| !r.is_empty()) {
            if rows.end > n {
                return Err(shape_err(format!("rows {rows:?} of {n}")));
            }
            segs.push(Seg {
                a,
                b,
                scale: d.proj.scale,
                row0: rows.start as i32,
                rows: rows.len() as i32,
                col0: d.cols.start as i32,
                cols: o as i32,
                r: r as i32,
                t_off: 0,
            });
        }
    }
    // In place when the product is this call's alone (it is, from
    // `Linear::forward_lora`); else on a copy.
    let out = if Arc::strong_count(y.storage()) == 1 {
        y.clone()
    } else {
        let buf = cuda.alloc(n * width, "LoRA output")?;
        cuda.dev.dtod(buf.ptr, ptr(y, "lora_add")?, n * width * 2)?;
        wrap(vec![n, width], buf)
    };
    let (xp, yp) = (ptr(x, "lora_add")?, ptr(&out, "lora_add")?);
    let max_rank = segs.iter().map(|s| s.r as usize).max().unwrap_or(0);
    let mma = n >= mma_rows && max_rank <= MMA_MAX_R;
    let num_kc = if mma { 1 } else { k.div_ceil(SHRINK_K) };
    for chunk in segs.chunks(MAX_SEGS) {
        let mut p = Segs {
            s: [Seg::default(); MAX_SEGS],
            t_stride: 0,
            k: k as i32,
            width: width as i32,
            num_kc: num_kc as i32,
        };
        let (mut off, mut max_rows, mut max_cols, mut max_r) = (0i64, 0usize, 0usize, 0usize);
        for (dst, s) in p.s.iter_mut().zip(chunk) {
            *dst = Seg { t_off: off, ..*s };
            off += s.rows as i64 * s.r as i64;
            max_rows = max_rows.max(s.rows as usize);
            max_cols = max_cols.max(s.cols as usize);
            max_r = max_r.max(s.r as usize);
        }
        p.t_stride = off;
        let t = cuda
            .dev
            .alloc(num_kc * off as usize, 4, "LoRA low-rank rows")?;
        let (shrink, expand, names) = if mma {
            let block = (128, 1, 1);
            (
                LaunchConfig {
                    grid_dim: (chunk.len() as u32, max_rows.div_ceil(MMA_ROWS) as u32, 1),
                    block_dim: block,
                    shared_mem_bytes: 0,
                },
                LaunchConfig {
                    grid_dim: (
                        chunk.len() as u32,
                        max_cols.div_ceil(MMA_COLS) as u32,
                        max_rows.div_ceil(MMA_ROWS) as u32,
                    ),
                    block_dim: block,
                    shared_mem_bytes: 0,
                },
                ("lora_shrink_mma_bf16", "lora_expand_mma_bf16"),
            )
        } else {
            let smem = (EXPAND_ROWS * max_r * 4) as u32;
            if smem > 48 * 1024 {
                return Err(TensorError::Unsupported {
                    backend: "cuda",
                    what: format!("LoRA rank {max_r} (up to 768 runs)"),
                });
            }
            (
                LaunchConfig {
                    grid_dim: (
                        chunk.len() as u32,
                        num_kc as u32,
                        max_rows.div_ceil(SHRINK_ROWS) as u32,
                    ),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                LaunchConfig {
                    grid_dim: (
                        chunk.len() as u32,
                        max_cols.div_ceil(256) as u32,
                        max_rows.div_ceil(EXPAND_ROWS) as u32,
                    ),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: smem,
                },
                ("lora_shrink_bf16", "lora_expand_bf16"),
            )
        };
        // SAFETY: every segment's rows lie in x [n, k] and y [n, width],
        // its columns in y's, its A [r, k] and B [cols, r] are bf16 device
        // tensors held by `deltas`; t holds num_kc * t_stride floats.
        unsafe {
            cuda.dev
                .launch(cuda.dev.func(names.0)?)
                .arg(&xp)
                .arg(&t.ptr)
                .arg(&p)
                .launch(shrink)
                .map_err(dev_err)?;
            cuda.dev
                .launch(cuda.dev.func(names.1)?)
                .arg(&yp)
                .arg(&t.ptr)
                .arg(&p)
                .launch(expand)
                .map_err(dev_err)?;
        }
    }
    Ok(out)
}
