//! Block-quantized weights on the device (`blocks.cu`): GGUF matrices
//! kept in their formats, never expanded. Upload splits each block's bytes
//! into an aligned body array and a meta (scale) array (the same bytes,
//! reordered); products of up to [`GEMV_MAX_ROWS`] rows stream the blocks
//! and multiply their integer codes with x staged as exact integers
//! (`qgemv_<fmt>_m{M}`: dp4a, with the norm prologue, the gate and the
//! residual fused; FP8's on the tensor cores, `fp8.cu`), larger ones dequantize
//! slabs of rows to bf16 for cuBLAS; embedding lookups dequantize the rows
//! they need.

use std::sync::Arc;

use cudarc::driver::LaunchConfig;
use kiln_tensor::{
    Activation, BlockPart, BlockWeight, Epilogue, NormPrologue, QuantFormat, QuantMatrix, Result,
    Tensor, TensorError, WeightKind,
};

use super::{gemm_ld, lt, GEMV_MAX_ROWS};
use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, elems_cfg, ptr, wrap};
use crate::driver::pool::DevBuf;
use crate::ops::activation::act_code;
use crate::ops::norm::norm_threads;

/// A matrix's blocks on the device: bodies from the buffer's start, metas
/// from `meta_off`.
pub(crate) struct DeviceBlocks {
    buf: DevBuf,
    meta_off: usize,
    name: &'static str,
    /// The part's rows.
    rows: usize,
}

/// Byte ranges of a GGUF block, by format: its kernel name, the body (the
/// ranges in this order) and the meta part.
type Ranges = &'static [(usize, usize)];

fn spec(f: QuantFormat) -> Option<(&'static str, Ranges, Ranges)> {
    use QuantFormat::*;
    Some(match f {
        Q8_0 => ("q8_0", &[(2, 34)], &[(0, 2)]),
        Q4_0 => ("q4_0", &[(2, 18)], &[(0, 2)]),
        Q4_1 => ("q4_1", &[(4, 20)], &[(0, 4)]),
        // Quants, then the high-bit word.
        Q5_0 => ("q5_0", &[(6, 22), (2, 6)], &[(0, 2)]),
        Q5_1 => ("q5_1", &[(8, 24), (4, 8)], &[(0, 4)]),
        IQ4NL => ("iq4_nl", &[(2, 18)], &[(0, 2)]),
        MXFP4 => ("mxfp4", &[(1, 17)], &[(0, 1)]),
        // Scales and quants; d, dmin.
        Q2K => ("q2_k", &[(0, 80)], &[(80, 84)]),
        // hmask and quants; the 12 scale bytes and d (only 2-byte aligned).
        Q3K => ("q3_k", &[(0, 96)], &[(96, 110)]),
        Q4K => ("q4_k", &[(0, 144)], &[]),
        Q5K => ("q5_k", &[(0, 176)], &[]),
        // ql, qh, scales; d apart (a 210-byte block is only 2-byte aligned).
        Q6K => ("q6_k", &[(0, 208)], &[(208, 210)]),
        // Four runs of quants; d and the zero point (and its pad byte).
        Q4Z => ("q4_z", &[(4, 68)], &[(0, 4)]),
        Q4Z32 => ("q4_z32", &[(4, 20)], &[(0, 4)]),
        // The 128 E4M3 bytes (a row's contiguous); the f32 scale.
        FP8 => ("fp8", &[(4, 132)], &[(0, 4)]),
        _ => return None,
    })
}

/// Scales from one run of 128 to the next in an FP8 part of `rows` rows
/// (`fp8.cu`'s `scale_stride`).
pub(crate) fn fp8_scale_stride(rows: usize) -> usize {
    rows.next_multiple_of(4)
}

fn span(r: Ranges) -> usize {
    r.iter().map(|(a, b)| b - a).sum()
}

/// Whether `f`'s kernels were compiled and loaded.
pub(crate) fn supported(cuda: &CudaBackend, f: QuantFormat) -> bool {
    spec(f).is_some_and(|(name, _, _)| {
        cuda.dev.has(&format!("qgemv_{name}_m1")) && cuda.dev.has(&format!("dequant_{name}_bf16"))
    })
}

fn unsupported(f: QuantFormat) -> TensorError {
    kiln_tensor::weight::unsupported_weight(crate::driver::device::NAME, WeightKind::Blocks(f))
}

/// A `[rows, cols]` matrix's blocks (`bytes`) as the device keeps them:
/// every block's body ranges in block order, then from the returned offset
/// the metas — FP8's scales run-major, `[cols / 128][rows padded to 4]`
/// (`fp8_scale_stride`: the layout of cuBLASLt's 1x128 block scaling, which
/// the decode kernel reads too), every other format's in block order.
fn device_layout(
    f: QuantFormat,
    body: Ranges,
    meta: Ranges,
    rows: usize,
    cols: usize,
    bytes: &[u8],
) -> (Vec<u8>, usize) {
    let raw = f.block_bytes();
    let blocks = bytes.len() / raw;
    let (bs, ms) = (span(body), span(meta));
    let meta_off = (blocks * bs).next_multiple_of(256);
    let nb = cols / f.block_size();
    let fp8 = f == QuantFormat::FP8;
    let ss = fp8_scale_stride(rows);
    let meta_len = if fp8 { nb * ss * ms } else { blocks * ms };
    let mut host = vec![0u8; meta_off + meta_len];
    let (bodies, metas) = host.split_at_mut(meta_off);
    for (g, blk) in bytes.chunks_exact(raw).enumerate() {
        let mut o = g * bs;
        for &(a, b) in body {
            bodies[o..o + b - a].copy_from_slice(&blk[a..b]);
            o += b - a;
        }
        let mut o = if fp8 {
            (g % nb * ss + g / nb) * ms
        } else {
            g * ms
        };
        for &(a, b) in meta {
            metas[o..o + b - a].copy_from_slice(&blk[a..b]);
            o += b - a;
        }
    }
    (host, meta_off)
}

/// `m`'s blocks split into bodies and metas, on the device.
pub(crate) fn upload(cuda: &CudaBackend, m: QuantMatrix) -> Result<BlockPart> {
    let f = m.format();
    if !supported(cuda, f) {
        return Err(unsupported(f));
    }
    let (name, body, meta) = spec(f).ok_or_else(|| unsupported(f))?;
    debug_assert_eq!(span(body) + span(meta), f.block_bytes());
    cuda.no_upload_while_recording("a weight upload")?;
    let (rows, cols) = (m.rows(), m.cols());
    let (host, meta_off) = device_layout(f, body, meta, rows, cols, &m.rows_bytes(0..rows));
    let buf = cuda.dev.alloc_exact(host.len().max(1), "a block weight")?;
    cuda.dev.htod(buf.ptr, &host)?;
    m.release_pages();
    let stored = host.len();
    Ok(BlockPart::from_storage(
        f,
        rows,
        cols,
        stored,
        Arc::new(DeviceBlocks {
            buf,
            meta_off,
            name,
            rows,
        }),
    ))
}

/// Where a part's block bodies and metas start on the device.
pub(crate) fn body_and_meta(part: &BlockPart) -> Result<(u64, u64)> {
    let d = device(part)?;
    Ok((d.body(), d.meta()))
}

fn device(part: &BlockPart) -> Result<&DeviceBlocks> {
    part.storage()
        .downcast_ref::<DeviceBlocks>()
        .ok_or_else(|| dev_err(format!("{part:?} is not stored on this GPU")))
}

impl DeviceBlocks {
    fn body(&self) -> u64 {
        self.buf.ptr
    }

    fn meta(&self) -> u64 {
        self.buf.ptr + self.meta_off as u64
    }

    /// `out[r, :] = W[ids[r] or row0 + r, :]` as bf16 for `rows_out` rows of `k`.
    fn dequant(
        &self,
        cuda: &CudaBackend,
        ids: u64,
        out: u64,
        k: usize,
        rows_out: usize,
        row0: usize,
    ) -> Result<()> {
        if rows_out == 0 {
            return Ok(());
        }
        let func = cuda.dev.func(&format!("dequant_{}_bf16", self.name))?;
        let (ki, ro, r0, rows) = (k as i32, rows_out as i64, row0 as i64, self.rows as i64);
        let (body, meta) = (self.body(), self.meta());
        let mut b = cuda.dev.launch(func);
        b.arg(&body)
            .arg(&meta)
            .arg(&ids)
            .arg(&out)
            .arg(&ki)
            .arg(&ro)
            .arg(&r0)
            .arg(&rows);
        // SAFETY: rows named (ids < rows, checked by the callers, or
        // row0 + rows_out <= rows) of a [rows, k] matrix; out [rows_out, k].
        unsafe { b.launch(elems_cfg(rows_out * k / 32)) }.map_err(dev_err)
    }
}

/// Rows of the block table `w` `[vocab, d]` for `ids`, dequantized.
pub(crate) fn embedding(cuda: &CudaBackend, w: &BlockWeight, ids: &[u32]) -> Result<Tensor> {
    let [vocab, d] = [w.shape()[0], w.shape()[1]];
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(TensorError::Shape {
            op: "embedding",
            detail: format!("token id {bad} outside vocabulary of {vocab}"),
        });
    }
    let [part] = w.parts() else {
        return Err(dev_err("an embedding table stored in several parts"));
    };
    let out = cuda.alloc(ids.len() * d, "embeddings")?;
    if !ids.is_empty() {
        let dids = cuda.dev_u32(ids, |m| m.tok)?;
        device(part)?.dequant(cuda, dids.ptr, out.ptr, d, ids.len(), 0)?;
    }
    Ok(wrap(vec![ids.len(), d], out))
}

/// Weight rows dequantized at a time for the tensor-core path (a 64 MiB
/// bf16 slab at most).
const SLAB_ELEMS: usize = 32 << 20;

/// Dynamic shared memory the decode kernels may use (their attribute is
/// raised to this at load): two blocks an SM on an H100/H200.
pub(crate) const QGEMV_MAX_SMEM: usize = 96 << 10;

/// Shared memory of a decode launch over `m` rows of `k`: the staged rows
/// (two one-byte limbs an element, rows padded to 128 bytes), their
/// 16-element sums and 32-element scales, the norm's partial sums and
/// inverse RMS.
fn qgemv_smem(m: usize, k: usize) -> usize {
    m * (2 * k.next_multiple_of(128) + k / 4 + k / 8 + 32 * 4 + 4)
}

/// Shared memory of an FP8 decode launch (`fp8.cu`): the staged f16 rows,
/// 16 bytes of padding each.
fn fp8_smem(m: usize, k: usize) -> usize {
    m * (2 * k + 16)
}

/// Dynamic shared memory of format `name`'s decode kernel over `m` rows of `k`.
fn decode_smem(name: &str, m: usize, k: usize) -> usize {
    match name {
        "fp8" => fp8_smem(m, k),
        _ => qgemv_smem(m, k),
    }
}

/// Up to three parts of one format, as the decode kernel takes them
/// (`blocks_detail::Parts`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Parts {
    body: [u64; 3],
    meta: [u64; 3],
    rows: [i32; 3],
}

// SAFETY: plain data laid out as the kernel's struct (three pointers,
// three pointers, three ints, padded to 8 bytes).
unsafe impl cudarc::driver::DeviceRepr for Parts {}

/// The weight's parts in runs of one format (at most three parts each),
/// with each run's first row.
fn runs(w: &BlockWeight) -> Result<Vec<(usize, Parts, &'static str)>> {
    let mut out: Vec<(usize, Parts, &'static str, usize)> = Vec::new();
    let mut row0 = 0;
    for part in w.parts() {
        let d = device(part)?;
        match out.last_mut() {
            Some((_, p, name, used)) if *name == d.name && *used < 3 => {
                p.body[*used] = d.body();
                p.meta[*used] = d.meta();
                p.rows[*used] = part.rows() as i32;
                *used += 1;
            }
            _ => {
                let mut p = Parts::default();
                p.body[0] = d.body();
                p.meta[0] = d.meta();
                p.rows[0] = part.rows() as i32;
                out.push((row0, p, d.name, 1));
            }
        }
        row0 += part.rows();
    }
    Ok(out.into_iter().map(|(r, p, n, _)| (r, p, n)).collect())
}

/// One decode launch: `out[r, ldo]` (from `out` on) for `n` rows of `x`.
#[allow(clippy::too_many_arguments)]
fn qgemv(
    cuda: &CudaBackend,
    name: &str,
    n: usize,
    x: u64,
    norm: Option<(u64, f32, f32)>,
    parts: &Parts,
    out: u64,
    residual: u64,
    k: usize,
    ldo: usize,
    gated: Option<Activation>,
) -> Result<()> {
    let total: usize = parts.rows.iter().map(|&r| r as usize).sum();
    let rows_out = if gated.is_some() { total / 2 } else { total };
    // One wave: every block resident from the start, its ring of loads
    // running on from row to row (dp4a kernels: a row a warp; FP8: a tile of
    // 16 rows a block, 8 gated. Tiles of 8 where 16 would leave the last wave
    // mostly empty measured no faster: 265.4 against 267.8 tok/s without).
    let work = match name {
        "fp8" if gated.is_none() => rows_out.div_ceil(16),
        _ => rows_out.div_ceil(8),
    };
    let grid = work
        .min(cuda.dev.sms.max(1) * cuda.options.qgemv_blocks_per_sm.max(1))
        .max(1);
    let func = cuda.dev.func(&format!("qgemv_{name}_m{n}"))?;
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: decode_smem(name, n, k) as u32,
    };
    let (nw, eps, off) = norm.unwrap_or((0, 0.0, 0.0));
    let nt = norm_threads(k) as i32;
    let (ki, ldoi) = (k as i32, ldo as i32);
    let (g, act) = match gated {
        Some(a) => (1i32, act_code(a)),
        None => (0, 0),
    };
    let mut b = cuda.dev.launch(func);
    b.arg(&x)
        .arg(&nw)
        .arg(&eps)
        .arg(&off)
        .arg(&nt)
        .arg(parts)
        .arg(&out)
        .arg(&residual)
        .arg(&ki)
        .arg(&ldoi)
        .arg(&g)
        .arg(&act);
    // SAFETY: x [n, k] (16-byte aligned, checked), norm_w [k]; the parts'
    // blocks hold their rows × k; out and residual n rows of ldo from these
    // pointers; shared memory within the attribute set at load (checked by
    // the caller).
    unsafe { b.launch(cfg) }.map_err(dev_err)
}

/// `epilogue(prologue(x) · wᵀ)` for a block weight. Up to
/// [`GEMV_MAX_ROWS`] rows: the decode kernels with the norm, a residual
/// and (when every part is of one format) the gate fused, a run of parts
/// of one format a launch. Larger: the norm by its own kernel, slabs of
/// dequantized rows through cuBLAS, bias, gate and residual after.
pub(crate) fn matmul(
    cuda: &CudaBackend,
    x: &Tensor,
    w: &BlockWeight,
    prologue: Option<NormPrologue<'_>>,
    epilogue: Epilogue<'_>,
) -> Result<Tensor> {
    let (n, k) = x.dims2("matmul")?;
    let (m, kw) = (w.shape()[0], w.shape()[1]);
    if k != kw {
        return Err(TensorError::Shape {
            op: "matmul",
            detail: format!("x {:?} · w {:?}ᵀ", x.shape(), w.shape()),
        });
    }
    let Epilogue {
        bias,
        gated,
        residual,
    } = epilogue;
    if gated.is_some() && m % 2 != 0 {
        return Err(TensorError::Shape {
            op: "matmul",
            detail: format!("{m} packed gate/up rows"),
        });
    }
    let width = if gated.is_some() { m / 2 } else { m };
    if let Some(r) = residual {
        if r.shape() != [n, width] {
            return Err(TensorError::Shape {
                op: "matmul",
                detail: format!("residual {:?} for [{n}, {width}]", r.shape()),
            });
        }
    }
    if let Some(b) = bias {
        if b.num_elements() != m {
            return Err(TensorError::Shape {
                op: "matmul",
                detail: format!("bias of {} for {m} outputs", b.num_elements()),
            });
        }
    }
    if let Some(p) = prologue {
        if p.weight.num_elements() != k {
            return Err(TensorError::Shape {
                op: "matmul",
                detail: format!("norm weight {:?} for rows of {k}", p.weight.shape()),
            });
        }
    }
    if n == 0 {
        return Ok(wrap(vec![0, width], cuda.alloc(0, "a projection")?));
    }
    let xp = ptr(x, "matmul")?;
    let norm = prologue
        .map(|p| Ok::<_, TensorError>((ptr(p.weight, "matmul")?, p.eps, p.offset)))
        .transpose()?;
    let runs = runs(w)?;
    let smem = |r: usize| {
        runs.iter()
            .map(|(_, _, name)| decode_smem(name, r, k))
            .max()
            .unwrap_or(0)
    };
    let decode = n <= GEMV_MAX_ROWS
        && xp % 16 == 0
        && norm.is_none_or(|(nw, _, _)| nw % 16 == 0)
        && smem(1) <= QGEMV_MAX_SMEM;
    if decode && bias.is_none() {
        let fuse_gate = gated.is_some() && runs.len() == 1;
        let out_cols = if fuse_gate { width } else { m };
        let fused_residual = residual.filter(|_| gated.is_none() || fuse_gate);
        let out = cuda.alloc(n * out_cols, "a projection")?;
        let rp = fused_residual.map(|r| ptr(r, "matmul")).transpose()?;
        // Rows of x a launch takes: as many as its shared memory holds.
        let per = (1..=n)
            .rev()
            .find(|&r| smem(r) <= QGEMV_MAX_SMEM)
            .unwrap_or(1);
        let mut first = 0;
        while first < n {
            let rows = per.min(n - first);
            let xo = xp + (2 * first * k) as u64;
            for (row0, parts, name) in &runs {
                let col = if fuse_gate { 0 } else { *row0 };
                let o = out.ptr + (2 * (first * out_cols + col)) as u64;
                let res = rp
                    .map(|r| r + (2 * (first * out_cols + col)) as u64)
                    .unwrap_or(0);
                let g = if fuse_gate { gated } else { None };
                qgemv(cuda, name, rows, xo, norm, parts, o, res, k, out_cols, g)?;
            }
            first += rows;
        }
        let y = wrap(vec![n, out_cols], out);
        return match (gated, fuse_gate, residual) {
            (Some(act), false, r) => {
                let y = crate::ops::activation::gated_packed(cuda, &y, act)?;
                match r {
                    Some(r) => crate::ops::elementwise::add(cuda, r, &y),
                    None => Ok(y),
                }
            }
            _ => Ok(y),
        };
    }
    // Larger batches (or a bias): the norm, then dequantized slabs through cuBLAS.
    // (`normed` lives until the products below have read it.)
    let normed = prologue
        .map(|p| crate::ops::norm::rms_norm(cuda, x, p.weight, p.eps, p.offset))
        .transpose()?;
    let xp = match &normed {
        Some(t) => ptr(t, "matmul")?,
        None => xp,
    };
    let fused_residual = residual.filter(|_| bias.is_none() && gated.is_none());
    let out = cuda.alloc(n * m, "a projection")?;
    let beta = match fused_residual {
        Some(r) => {
            cuda.dev.dtod(out.ptr, ptr(r, "matmul")?, n * m * 2)?;
            1.0
        }
        None => 0.0,
    };
    // FP8 parts (of rows a multiple of 16) on the FP8 tensor cores: the rows
    // of x in fours quantized once, the last one to three rows through the
    // decode kernel; every other part (and any shape cuBLASLt has no
    // algorithm for) as dequantized slabs through cuBLAS.
    let n_lt = n - n % 4;
    let fp8_parts = w
        .parts()
        .iter()
        .any(|p| p.format() == QuantFormat::FP8 && lt::fp8_rows_ok(p.rows()));
    let xq = if fp8_parts && n_lt > 0 && cuda.fp8_tensor_cores() {
        Some(quant_e4m3_rows(cuda, xp, n_lt, k)?)
    } else {
        None
    };
    let widest = w.parts().iter().map(|p| p.rows()).max().unwrap_or(0);
    let slab_rows = (SLAB_ELEMS / k.max(1)).clamp(1, widest.max(1));
    let mut scratch = None;
    let mut row0 = 0usize;
    for part in w.parts() {
        let d = device(part)?;
        let o = out.ptr + 2 * row0 as u64;
        let on_lt = match (&xq, &cuda.dev.lt) {
            (Some((codes, scales)), Some(lt))
                if d.name == "fp8" && lt::fp8_rows_ok(part.rows()) =>
            {
                lt::fp8_product(
                    &cuda.dev,
                    lt,
                    &lt::Fp8Product {
                        w: d.body(),
                        w_scales: d.meta(),
                        x: codes.ptr,
                        x_scales: scales.ptr,
                        out: o,
                        n: n_lt,
                        k,
                        m: part.rows(),
                        ldc: m,
                        beta,
                    },
                )?
            }
            _ => false,
        };
        if on_lt {
            if n > n_lt {
                let parts = Parts {
                    body: [d.body(), 0, 0],
                    meta: [d.meta(), 0, 0],
                    rows: [part.rows() as i32, 0, 0],
                };
                // As many rows a launch as its shared memory holds.
                let per = (1..=n - n_lt)
                    .rev()
                    .find(|&r| decode_smem(d.name, r, k) <= QGEMV_MAX_SMEM)
                    .unwrap_or(1);
                let mut first = n_lt;
                while first < n {
                    let rows = per.min(n - first);
                    let o = o + (2 * first * m) as u64;
                    let res = if beta != 0.0 { o } else { 0 };
                    let xo = xp + (2 * first * k) as u64;
                    qgemv(cuda, d.name, rows, xo, None, &parts, o, res, k, m, None)?;
                    first += rows;
                }
            }
        } else {
            if scratch.is_none() {
                scratch = Some(cuda.alloc(slab_rows * k, "dequantized weights")?);
            }
            let scratch = scratch.as_ref().map(|t| t.ptr).unwrap_or(0);
            let mut r = 0;
            while r < part.rows() {
                let rows = slab_rows.min(part.rows() - r);
                d.dequant(cuda, 0, scratch, k, rows, r)?;
                gemm_ld(
                    &cuda.dev,
                    xp,
                    scratch,
                    o + 2 * r as u64,
                    n,
                    k,
                    rows,
                    m,
                    beta,
                )?;
                r += rows;
            }
        }
        row0 += part.rows();
    }
    let mut y = wrap(vec![n, m], out);
    if let Some(b) = bias {
        crate::ops::elementwise::add_bias(cuda, ptr(&y, "matmul")?, b, n, m)?;
    }
    if let Some(act) = gated {
        y = crate::ops::activation::gated_packed(cuda, &y, act)?;
    }
    match residual {
        Some(r) if fused_residual.is_none() => crate::ops::elementwise::add(cuda, r, &y),
        _ => Ok(y),
    }
}

/// `x [n, k]` bf16 as E4M3 codes `[n, k]` and their 1x128 scales
/// `[k / 128][n]` (`fp8.cu`'s `quant_e4m3_rows`), for cuBLASLt.
fn quant_e4m3_rows(cuda: &CudaBackend, x: u64, n: usize, k: usize) -> Result<(DevBuf, DevBuf)> {
    let codes = cuda.dev.alloc(n * k, 1, "FP8 activations")?;
    let scales = cuda.dev.alloc(n * (k / 128), 4, "FP8 activation scales")?;
    let func = cuda.dev.func("quant_e4m3_rows")?;
    let (ni, ki, ss) = (n as i64, k as i32, n as i64);
    let mut b = cuda.dev.launch(func);
    b.arg(&x)
        .arg(&codes.ptr)
        .arg(&scales.ptr)
        .arg(&ni)
        .arg(&ki)
        .arg(&ss);
    // SAFETY: x [n, k] bf16 (k a multiple of 128, 8-byte aligned rows),
    // codes [n, k], scales [k / 128][n]; a warp a run of 128.
    unsafe { b.launch(elems_cfg(n * (k / 128) * 32)) }.map_err(dev_err)?;
    Ok((codes, scales))
}

/// Raises the decode kernels' dynamic shared memory limit to
/// [`QGEMV_MAX_SMEM`]; a kernel the GPU cannot give it is left out (its
/// format's weights then load dense).
pub(crate) fn configure(dev: &mut crate::driver::device::Device, warnings: &mut Vec<String>) {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    dev.funcs.retain(|entry, f| {
        if !entry.starts_with("qgemv_") {
            return true;
        }
        match f.set_attribute(attr, QGEMV_MAX_SMEM as i32) {
            Ok(()) => true,
            Err(e) => {
                warnings.push(format!("{entry} unavailable: {e:?}"));
                false
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_splits_its_whole_block_and_names_compiled_kernels() {
        for f in QuantFormat::ALL {
            let Some((name, body, meta)) = spec(f) else {
                continue;
            };
            assert_eq!(span(body) + span(meta), f.block_bytes(), "{f}");
            assert!(crate::kernels::BLOCK_FORMATS.contains(&name), "{name}");
            // Bodies feed 128-bit loads (Q5_0/Q5_1's 20 bytes: 32-bit ones).
            assert!(span(body) % 16 == 0 || span(body) == 20, "{f}");
        }
        assert_eq!(
            QuantFormat::ALL
                .iter()
                .filter(|f| spec(**f).is_some())
                .count(),
            crate::kernels::BLOCK_FORMATS.len()
        );
    }

    /// FP8 on the device: a row's E4M3 bytes contiguous (cuBLASLt reads the
    /// bodies as a `[rows, cols]` matrix), its scales run-major over rows
    /// padded to 4; Q8_0's metas stay in block order.
    #[test]
    fn fp8_bodies_are_the_matrix_and_scales_run_major() {
        let (rows, cols) = (5usize, 256usize);
        let f = QuantFormat::FP8;
        let nb = cols / 128;
        // Block (r, b): scale bytes all 16 r + b, codes all 100 + 16 r + b.
        let mut bytes = Vec::new();
        for r in 0..rows {
            for b in 0..nb {
                let tag = (16 * r + b) as u8;
                bytes.extend([tag; 4]);
                bytes.extend([100 + tag; 128]);
            }
        }
        let (_, body, meta) = spec(f).unwrap();
        let (host, off) = device_layout(f, body, meta, rows, cols, &bytes);
        assert_eq!(fp8_scale_stride(rows), 8);
        assert_eq!(host.len(), off + nb * 8 * 4);
        for r in 0..rows {
            for k in 0..cols {
                assert_eq!(host[r * cols + k], 100 + (16 * r + k / 128) as u8);
            }
            for b in 0..nb {
                let at = off + (b * 8 + r) * 4;
                assert_eq!(host[at..at + 4], [(16 * r + b) as u8; 4]);
            }
        }
        // Rows past the last are padding, zero.
        assert!(host[off + 5 * 4..off + 8 * 4].iter().all(|&x| x == 0));
        let f = QuantFormat::Q8_0;
        let blk: Vec<u8> = (0..2 * 34).map(|i| i as u8).collect();
        let (_, body, meta) = spec(f).unwrap();
        let (host, off) = device_layout(f, body, meta, 1, 64, &blk);
        assert_eq!(host[..32], blk[2..34]);
        assert_eq!(host[32..64], blk[36..68]);
        assert_eq!(host[off..off + 4], [0, 1, 34, 35]);
    }
}
