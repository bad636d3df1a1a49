//! LoRA deltas (`lora.cu`): every adapter and packed part of one
//! [`kiln_tensor::Ops::lora_add`] in a shrink and an expand launch over
//! segments (one adapter's projection over one contiguous run of rows).
//! Steps with adapters run eagerly (`step::meta::is_graphable`), so the
//! segments travel as a kernel parameter. Steps of at least
//! `CudaOptions::lora_mma_rows` rows (prefill) and ranks up to 64 take the
//! tensor-core pair, the others the CUDA-core pair (its expand one column a
//! thread, or 8 with `CudaOptions::lora_expand8`). `lora_apply` takes the
//! product's gated activation or residual sum into the CUDA-core expand.

use std::sync::Arc;

use cudarc::driver::{DeviceRepr, LaunchConfig};
use kiln_tensor::{DType, Epilogue, LoraDelta, Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, wrap};

const MAX_SEGS: usize = 32;
const SHRINK_ROWS: usize = 8;
const SHRINK_K: usize = 512;
const EXPAND_ROWS: usize = 16;
/// Rows a tile and columns a block of the 8-column expands (128 threads).
const EXPAND8_ROWS: usize = 8;
const EXPAND8_COLS: usize = 1024;
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
    let o = &cuda.options;
    lora_add_rows(cuda, y, x, deltas, o.lora_mma_rows, o.lora_expand8)
}

/// The segments of `deltas` over `y [n, width]` and `x [n, k]`: one a run of rows.
fn segments(y: &Tensor, x: &Tensor, deltas: &[LoraDelta<'_>]) -> Result<(usize, usize, Vec<Seg>)> {
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
    Ok((n, k, segs))
}

/// One launch's segments (up to `MAX_SEGS`) with their places in t, the
/// largest run of rows, of columns and rank.
fn pack(chunk: &[Seg], k: usize, width: usize, num_kc: usize) -> (Segs, usize, usize, usize) {
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
    (p, max_rows, max_cols, max_r)
}

/// The CUDA-core expands, one column a thread or 8 (`wide`): entry
/// points (in place, with the epilogue), rows a tile, columns a block,
/// threads a block.
struct Expand {
    names: (&'static str, &'static str),
    rows: usize,
    cols: usize,
    threads: u32,
}

fn expand_kind(wide: bool) -> Expand {
    match wide {
        false => Expand {
            names: ("lora_expand_bf16", "lora_expand_epi_bf16"),
            rows: EXPAND_ROWS,
            cols: 256,
            threads: 256,
        },
        true => Expand {
            names: ("lora_expand8_bf16", "lora_expand8_epi_bf16"),
            rows: EXPAND8_ROWS,
            cols: EXPAND8_COLS,
            threads: 128,
        },
    }
}

/// The expand's shared memory for rank `max_r` (CUDA-core kernels).
fn expand_smem(ex: &Expand, max_r: usize) -> Result<u32> {
    let smem = ex.rows * max_r * 4;
    if smem > 48 * 1024 {
        return Err(TensorError::Unsupported {
            backend: "cuda",
            what: format!(
                "LoRA rank {max_r} (up to {} runs)",
                48 * 1024 / (4 * ex.rows)
            ),
        });
    }
    Ok(smem as u32)
}

/// `lora_add_rows` for one launch's segments on the CUDA cores: x A^T into t.
fn shrink(
    cuda: &CudaBackend,
    xp: u64,
    t: u64,
    p: &Segs,
    segs: usize,
    max_rows: usize,
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (
            segs as u32,
            p.num_kc as u32,
            max_rows.div_ceil(SHRINK_ROWS) as u32,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every segment's rows lie in x [n, k]; its A [r, k] is a bf16
    // device tensor held by the caller's deltas; t holds num_kc * t_stride floats.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("lora_shrink_bf16")?)
            .arg(&xp)
            .arg(&t)
            .arg(p)
            .launch(cfg)
            .map_err(dev_err)
    }
}

/// [`kiln_tensor::Ops::lora_apply`]: the gated activation or the residual
/// sum in the expand's pass over the output (`lora_expand_epi_bf16`: rows
/// of no adapter too) when the step takes the CUDA-core kernels in one
/// launch; else the deltas, then those ops apart. The same bits either way.
pub(crate) fn lora_apply(
    cuda: &CudaBackend,
    y: &Tensor,
    x: &Tensor,
    deltas: &[LoraDelta<'_>],
    after: Epilogue<'_>,
    mma_rows: usize,
    wide: bool,
) -> Result<Tensor> {
    if after.gated.is_none() && after.residual.is_none() && after.bias.is_none() {
        return lora_add_rows(cuda, y, x, deltas, mma_rows, wide);
    }
    let ex = expand_kind(wide);
    let (n, k, segs) = segments(y, x, deltas)?;
    let width = y.dims2("lora_apply")?.1;
    let max_rank = segs.iter().map(|s| s.r as usize).max().unwrap_or(0);
    let mma = n >= mma_rows && max_rank <= MMA_MAX_R;
    if after.bias.is_some() || mma || segs.len() > MAX_SEGS || n == 0 || !cuda.dev.has(ex.names.1) {
        // The deltas by lora_add_rows, with the same kernels.
        let y = lora_add_rows(cuda, y, x, deltas, mma_rows, wide)?;
        return kiln_tensor::lora_apply_unfused(cuda, &y, x, &[], after);
    }
    let out_w = match after.gated {
        Some(_) if width % 2 != 0 => {
            return Err(TensorError::Shape {
                op: "lora_apply",
                detail: format!("{width} packed gate/up columns"),
            })
        }
        Some(_) => width / 2,
        None => width,
    };
    let resid = match after.residual {
        Some(r) if r.shape() != [n, out_w] => {
            return Err(TensorError::Shape {
                op: "lora_apply",
                detail: format!("residual {:?} for [{n}, {out_w}]", r.shape()),
            })
        }
        Some(r) => ptr(r, "lora_apply")?,
        None => 0,
    };
    let num_kc = k.div_ceil(SHRINK_K);
    let (p, max_rows, _, max_r) = pack(&segs, k, width, num_kc);
    let smem = expand_smem(&ex, max_r.max(1))?;
    let t = cuda.dev.alloc(
        (num_kc * p.t_stride as usize).max(1),
        4,
        "LoRA low-rank rows",
    )?;
    let xp = ptr(x, "lora_apply")?;
    if !segs.is_empty() {
        shrink(cuda, xp, t.ptr, &p, segs.len(), max_rows)?;
    }
    let out = cuda.alloc(n * out_w, "LoRA output")?;
    let yp = ptr(y, "lora_apply")?;
    let act = after.gated.map_or(-1, crate::ops::activation::act_code);
    let (nr, ns) = (n as i32, segs.len() as i32);
    let cfg = LaunchConfig {
        grid_dim: (
            out_w.div_ceil(ex.cols) as u32,
            n.div_ceil(ex.rows) as u32,
            1,
        ),
        block_dim: (ex.threads, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: y [n, width], out [n, out_w], resid (if not null) [n, out_w];
    // the segments' rows, columns, B [cols, r] and t as in lora_add_rows.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func(ex.names.1)?)
            .arg(&yp)
            .arg(&out.ptr)
            .arg(&resid)
            .arg(&t.ptr)
            .arg(&p)
            .arg(&nr)
            .arg(&ns)
            .arg(&act)
            .launch(cfg)
            .map_err(dev_err)?;
    }
    Ok(wrap(vec![n, out_w], out))
}

/// [`lora_add`] with steps of at least `mma_rows` rows on the tensor-core
/// pair, the others' expand one column a thread or 8 (`wide`) (cuda-check
/// runs every kernel whatever the options say).
pub(crate) fn lora_add_rows(
    cuda: &CudaBackend,
    y: &Tensor,
    x: &Tensor,
    deltas: &[LoraDelta<'_>],
    mma_rows: usize,
    wide: bool,
) -> Result<Tensor> {
    let ex = expand_kind(wide);
    let (n, k, segs) = segments(y, x, deltas)?;
    let width = y.dims2("lora_add")?.1;
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
        let (p, max_rows, max_cols, max_r) = pack(chunk, k, width, num_kc);
        let t = cuda
            .dev
            .alloc(num_kc * p.t_stride as usize, 4, "LoRA low-rank rows")?;
        let expand = if mma {
            let block = (128, 1, 1);
            let shrink = LaunchConfig {
                grid_dim: (chunk.len() as u32, max_rows.div_ceil(MMA_ROWS) as u32, 1),
                block_dim: block,
                shared_mem_bytes: 0,
            };
            // SAFETY: as `shrink`; one chunk of k.
            unsafe {
                cuda.dev
                    .launch(cuda.dev.func("lora_shrink_mma_bf16")?)
                    .arg(&xp)
                    .arg(&t.ptr)
                    .arg(&p)
                    .launch(shrink)
                    .map_err(dev_err)?;
            }
            (
                LaunchConfig {
                    grid_dim: (
                        chunk.len() as u32,
                        max_cols.div_ceil(MMA_COLS) as u32,
                        max_rows.div_ceil(MMA_ROWS) as u32,
                    ),
                    block_dim: block,
                    shared_mem_bytes: 0,
                },
                "lora_expand_mma_bf16",
            )
        } else {
            shrink(cuda, xp, t.ptr, &p, chunk.len(), max_rows)?;
            (
                LaunchConfig {
                    grid_dim: (
                        chunk.len() as u32,
                        max_cols.div_ceil(ex.cols) as u32,
                        max_rows.div_ceil(ex.rows) as u32,
                    ),
                    block_dim: (ex.threads, 1, 1),
                    shared_mem_bytes: expand_smem(&ex, max_r)?,
                },
                ex.names.0,
            )
        };
        // SAFETY: every segment's rows lie in y [n, width], its columns in
        // y's, its B [cols, r] is a bf16 device tensor held by `deltas`;
        // t holds num_kc * t_stride floats written by the shrink.
        unsafe {
            cuda.dev
                .launch(cuda.dev.func(expand.1)?)
                .arg(&yp)
                .arg(&t.ptr)
                .arg(&p)
                .launch(expand.0)
                .map_err(dev_err)?;
        }
    }
    Ok(out)
}
