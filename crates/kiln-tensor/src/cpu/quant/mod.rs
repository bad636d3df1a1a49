//! Products with block-format weights on the CPU, and the row lookups of
//! block embedding tables.
//!
//! The quantized formats are repacked once at load into 16-row groups
//! ([`packed`]: measured 1.5–2× the decode throughput of reading the
//! file's rows in place, and the same layout feeds the batched GEMM), and
//! the file's pages are let go. Every output is summed in the one order
//! [`packed`] defines — whatever the batch, the path (decode kernel or
//! GEMM) or the instruction set — so a row's bits do not depend on what
//! it is batched with.
//!
//! F16, BF16 and FP8 stay as the file stores them (in place in the mapped
//! file): a product converts a panel of rows into a small f32 buffer —
//! four rows for decode-sized batches, up to 64 for larger ones, reused by
//! every row of `x` — and runs the dense product's register tiles over it
//! ([`super::matmul::panel`]), so it is exactly the dense product of the
//! widened matrix.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod bf16;
mod codes;
pub(crate) mod limbs;
pub(crate) mod packed;
#[cfg(target_arch = "x86_64")]
mod packed_avx2;
#[cfg(target_arch = "x86_64")]
mod packed_avx512;

use limbs::Limbs;
pub use packed::packed_bytes;
use packed::{Packed, LANES};

use kiln_quant::{QuantFormat, QuantMatrix};
use rayon::prelude::*;

use super::matmul::{panel, tile_fn, TileFn, W_ROWS_PER_TASK};

/// A block matrix as the CPU stores it: repacked into 16-row groups
/// ([`packed`]) for the quantized formats, as the file stores it (in place
/// in the mapping) for F16 and BF16.
pub(crate) enum Stored {
    Packed(Packed),
    Raw(QuantMatrix),
}

impl Stored {
    /// `m` as the CPU keeps it; a repacked matrix lets go of the file's
    /// pages it was read from.
    pub(crate) fn new(m: QuantMatrix) -> Stored {
        // MXFP4 with a scale no f16 holds: bf16, which holds every value.
        let m = match m.format() == QuantFormat::MXFP4 && !packed::mxfp4_scales_fit(&m) {
            true => as_bf16(&m),
            false => m,
        };
        match packed::pack(&m) {
            Some(p) => {
                m.release_pages();
                Stored::Packed(p)
            }
            None => Stored::Raw(m),
        }
    }

    pub(crate) fn rows(&self) -> usize {
        match self {
            Stored::Packed(p) => p.rows,
            Stored::Raw(m) => m.rows(),
        }
    }

    pub(crate) fn num_bytes(&self) -> usize {
        match self {
            Stored::Packed(p) => p.num_bytes(),
            Stored::Raw(m) => m.num_bytes(),
        }
    }

    /// Rows `ids` dequantized and appended to `out`, as [`lookup`].
    pub(crate) fn lookup(&self, ids: &[u32], out: &mut Vec<f32>) -> Option<u32> {
        match self {
            Stored::Raw(m) => lookup(m, ids, out),
            Stored::Packed(p) => lookup_rows((p.rows, p.cols), ids, out, |r, dst| {
                p.dequantize_row(r, dst)
            }),
        }
    }
}

/// `x · wᵀ` for a weight stacked from `parts` by rows, into `out` (`n`
/// rows, `out_stride` apart): the packed parts in one parallel region, the
/// others each in turn.
///
/// # Safety
/// `out` is valid for writes at the `n` rows of the stacked width, and
/// nobody else writes there meanwhile; every part is `x`'s width.
pub(crate) unsafe fn matmul_stacked(
    parts: &[&Stored],
    x: &[f32],
    n: usize,
    out: *mut f32,
    out_stride: usize,
    mode: CpuMatmul,
) {
    let mut packed = Vec::new();
    let mut col = 0;
    for part in parts {
        match part {
            Stored::Packed(p) => packed.push((p, col)),
            // SAFETY: columns col..col + rows of each output row are the
            // part's, inside the stacked width.
            Stored::Raw(m) => unsafe { matmul(x, n, m, out.wrapping_add(col), out_stride) },
        }
        col += part.rows();
    }
    // SAFETY: as above, for the packed parts at their columns.
    unsafe { packed_matmul_on(Isa::best(), &packed, x, n, out, out_stride, mode) };
}

/// How the CPU multiplies activations by packed weights (`--cpu-matmul`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuMatmul {
    /// f32 activations, every output summed in the one defined order
    /// (batch-invariant, the goldens' numerics).
    #[default]
    Exact,
    /// Products of at least [`FAST_MIN_ROWS`] rows (prefill, batches)
    /// in bf16 ([`FastKernel`]): weights dequantized to bf16 and
    /// activations rounded to bf16, products summed in f32; decode rows
    /// stay exact. A row's result then depends on how many rows share its
    /// product, so it is not batch-invariant. Where the CPU has neither
    /// AMX-BF16 (granted) nor AVX512-BF16 this is [`CpuMatmul::Exact`].
    Fast,
}

impl CpuMatmul {
    /// Whether the fast path runs here (AMX-BF16 detected and granted, or
    /// AVX512-BF16).
    pub fn fast_available() -> bool {
        FastKernel::best().is_some()
    }

    /// The kernel `fast` runs on here, by name (`None`: it runs exact).
    pub fn fast_kernel_name() -> Option<&'static str> {
        FastKernel::best().map(|k| match k {
            #[cfg(target_arch = "x86_64")]
            FastKernel::Amx => "AMX-BF16",
            #[cfg(target_arch = "x86_64")]
            FastKernel::Avx512Bf16 => "AVX512-BF16",
        })
    }
}

/// The kernels of [`CpuMatmul::Fast`]; both multiply the same bf16 panels
/// ([`bf16`]) and sum in f32, in different orders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FastKernel {
    /// AMX tiles (`amx.rs`): Intel Sapphire Rapids and later.
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// `vdpbf16ps` register tiles (`bf16.rs`): AMD Zen 4 and later, and
    /// Intel CPUs with AVX512-BF16 but no AMX.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
}

impl FastKernel {
    /// Every one this CPU runs, fastest first (AMX only once Linux granted
    /// its tile state). A kernel needs the AVX-512 packed path too.
    pub(crate) fn available() -> Vec<FastKernel> {
        #[allow(unused_mut)]
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if Isa::best() == Isa::Avx512 {
            if amx::available() {
                v.push(FastKernel::Amx);
            }
            if bf16::available() {
                v.push(FastKernel::Avx512Bf16);
            }
        }
        v
    }

    /// The fastest (detected once).
    pub(crate) fn best() -> Option<FastKernel> {
        static BEST: std::sync::OnceLock<Option<FastKernel>> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| FastKernel::available().first().copied())
    }
}

/// Rows of `x` up to which a packed product runs the decode kernel (codes
/// converted in registers, per row of `x`); above, the GEMM over panels,
/// whose unpacking of each pair of groups costs about two decode rows.
/// Measured on the Sapphire Rapids dev VM (2 threads, 8960 × 1536 from
/// DRAM, `examples/cpu_quant_gemv`), decode kernel vs GEMM in µs: Q4_K
/// 497/750 at 3 rows, 649/935 at 4, 932/1050 at 6, 1349/1370 at 9; Q6_K
/// 928/1166 at 5, 1516/1534 at 8; Q5_K 975/1154 at 5, 1614/1511 at 8;
/// Q8_0 789/1116 at 5. Speculative decodes verify a few rows a request.
const GEMV_ROWS: usize = 6;
/// Rows from which `--cpu-matmul fast` takes the bf16 kernels (the
/// threshold it had when the exact decode kernel stopped at two rows; not
/// re-measured against the wider exact decode path).
const FAST_MIN_ROWS: usize = 3;

/// The instruction sets a packed product runs on; each gives the same
/// bits (the order is [`packed`]'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    /// The fastest this CPU has (detected once).
    pub(crate) fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Isa::available()[0])
    }

    /// Every one this CPU runs, fastest first.
    pub(crate) fn available() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if packed_avx512::detected() {
                v.push(Isa::Avx512);
            }
            if packed_avx2::detected() {
                v.push(Isa::Avx2);
            }
        }
        v.push(Isa::Portable);
        v
    }
}

/// `out[i * out_stride + j] = x[i] · w[j]` for a packed `w`, in the order
/// [`packed`] defines (the same bits for every `n`, path and ISA).
///
/// # Safety
/// As [`matmul`].
#[cfg(test)]
pub(crate) unsafe fn packed_matmul(
    p: &Packed,
    x: &[f32],
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
    // SAFETY: passed through.
    unsafe {
        packed_matmul_on(
            Isa::best(),
            &[(p, 0)],
            x,
            n,
            out,
            out_stride,
            CpuMatmul::Exact,
        )
    }
}

/// [`packed_matmul`] of several packed matrices of one width stacked by
/// rows (`parts`: each with the output column its first row goes to), in
/// one parallel region, on a given instruction set.
///
/// # Safety
/// As [`matmul`] for every part at its columns, and this CPU runs `isa`.
pub(crate) unsafe fn packed_matmul_on(
    isa: Isa,
    parts: &[(&Packed, usize)],
    x: &[f32],
    n: usize,
    out: *mut f32,
    out_stride: usize,
    mode: CpuMatmul,
) {
    let k = parts.first().map(|(p, _)| p.cols).unwrap_or(0);
    if n == 0 || k == 0 {
        return;
    }
    if mode == CpuMatmul::Fast && n >= FAST_MIN_ROWS && isa == Isa::Avx512 {
        if let Some(kernel) = FastKernel::best() {
            // SAFETY: passed through; the kernel runs here.
            unsafe { fast_matmul(kernel, parts, x, n, out, out_stride) };
            return;
        }
    }
    // x split into limbs once per sub-block size among the parts (q/k/v
    // or gate/up in one format share them).
    let mut by_size: Vec<Limbs> = Vec::new();
    for (p, _) in parts {
        if !by_size.iter().any(|l| l.sub == p.scheme.sub) {
            by_size.push(Limbs::new(x, n, k, p.scheme.sub));
        }
    }
    let limbs: Vec<&Limbs> = parts
        .iter()
        .map(|(p, _)| {
            by_size
                .iter()
                .find(|l| l.sub == p.scheme.sub)
                .expect("split for every sub-block size above; this is a bug")
        })
        .collect();
    let threads = rayon::current_num_threads().max(1);
    let total_groups: usize = parts.iter().map(|(p, _)| p.groups).sum();
    if total_groups == 0 {
        return;
    }
    let out_addr = out as usize;
    if n <= GEMV_ROWS || isa == Isa::Portable {
        // Tasks of whole groups, about four per thread over all parts, in
        // fours where there are enough (the decode kernel takes four groups
        // at a time; a lone group's two FMA chains wait on latency).
        let chunk = total_groups.div_ceil(4 * threads).max(1);
        let chunk = if chunk >= 4 {
            chunk.next_multiple_of(4)
        } else {
            chunk
        };
        let tasks: Vec<(usize, std::ops::Range<usize>)> = parts
            .iter()
            .enumerate()
            .flat_map(|(i, (p, _))| {
                (0..p.groups)
                    .step_by(chunk)
                    .map(move |g0| (i, g0..(g0 + chunk).min(p.groups)))
            })
            .collect();
        tasks.into_par_iter().for_each(|(i, g)| {
            let (p, col) = parts[i];
            let xl = limbs[i];
            for t in 0..n {
                let o = (out_addr as *mut f32).wrapping_add(t * out_stride + col + g.start * LANES);
                // SAFETY: the CPU runs `isa`; row t of x exists; this task
                // alone writes these columns of row t.
                unsafe {
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512 => packed_avx512::gemv_groups(p, g.clone(), xl, t, o),
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => packed_avx2::gemv_groups(p, g.clone(), xl, t, o),
                        Isa::Portable => {
                            let len = (g.end * LANES).min(p.rows) - g.start * LANES;
                            p.gemv_portable(
                                g.clone(),
                                xl,
                                t,
                                std::slice::from_raw_parts_mut(o, len),
                            )
                        }
                    }
                }
            }
        });
        return;
    }
    // Tasks of a pair of groups, split over rows of x until there are
    // about four per thread.
    let pairs: usize = parts.iter().map(|(p, _)| p.groups.div_ceil(2)).sum();
    let splits = (4 * threads).div_ceil(pairs).clamp(1, n.div_ceil(8));
    let tasks = pair_tasks(parts, splits);
    tasks.into_par_iter().for_each(|(i, q, split)| {
        let (p, col) = parts[i];
        let g = (q * 2)..((q + 1) * 2).min(p.groups);
        let rows = (n * split / splits)..(n * (split + 1) / splits);
        let o = (out_addr as *mut f32).wrapping_add(col + g.start * LANES);
        // SAFETY: the CPU runs `isa`; this task alone writes rows `rows`
        // of the group's columns.
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => {
                    packed_avx512::gemm_block(p, g.clone(), rows, limbs[i], o, out_stride)
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => packed_avx2::gemm_block(p, g.clone(), rows, limbs[i], o, out_stride),
                Isa::Portable => unreachable!("the portable product is row by row"),
            }
        };
    });
}

/// GEMM tasks `(part, pair of groups, split)`: every pair of groups of
/// every part, each in `splits` slices of the rows.
fn pair_tasks(parts: &[(&Packed, usize)], splits: usize) -> Vec<(usize, usize, usize)> {
    parts
        .iter()
        .enumerate()
        .flat_map(|(i, (p, _))| {
            (0..p.groups.div_ceil(2)).flat_map(move |q| (0..splits).map(move |s| (i, q, s)))
        })
        .collect()
}

/// [`packed_matmul_on`] for `--cpu-matmul fast` on `kernel`: x rounded
/// to bf16 once (padded with zero rows to whole AMX tile blocks), then
/// tasks of a pair of groups over slices of the rows, about four per
/// thread.
///
/// # Safety
/// As [`packed_matmul_on`]; `kernel` is one of [`FastKernel::available`].
pub(crate) unsafe fn fast_matmul(
    kernel: FastKernel,
    parts: &[(&Packed, usize)],
    x: &[f32],
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let k = parts[0].0.cols;
        let blocks = n.div_ceil(amx::ROW_BLOCK);
        let mut xb = vec![0u16; blocks * amx::ROW_BLOCK * k];
        // SAFETY: every kernel runs on AVX-512F CPUs.
        unsafe { bf16::round_to_bf16(&x[..n * k], &mut xb) };
        let threads = rayon::current_num_threads().max(1);
        let pairs: usize = parts.iter().map(|(p, _)| p.groups.div_ceil(2)).sum();
        let units = match kernel {
            FastKernel::Amx => blocks,
            FastKernel::Avx512Bf16 => n.div_ceil(8),
        };
        let splits = (4 * threads).div_ceil(pairs.max(1)).clamp(1, units);
        let tasks = pair_tasks(parts, splits);
        let (out_addr, xba) = (out as usize, xb.as_ptr() as usize);
        tasks.into_par_iter().for_each(|(i, q, split)| {
            let (p, col) = parts[i];
            let g = (q * 2)..((q + 1) * 2).min(p.groups);
            let o = (out_addr as *mut f32).wrapping_add(col + g.start * LANES);
            let xb = xba as *const u16;
            // SAFETY: the kernel runs here; this task alone writes its
            // rows in the group's columns.
            unsafe {
                match kernel {
                    FastKernel::Amx => {
                        let bl = (blocks * split / splits)..(blocks * (split + 1) / splits);
                        amx::gemm_block(p, g, bl, n, xb, o, out_stride)
                    }
                    FastKernel::Avx512Bf16 => {
                        let rows = (n * split / splits)..(n * (split + 1) / splits);
                        bf16::gemm_block(p, g, rows, xb, o, out_stride)
                    }
                }
            };
        });
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kernel, parts, x, n, out, out_stride);
        unreachable!("no fast kernel off x86_64");
    }
}

/// Dequantizes row `r` of a matrix into `out` (`cols` long).
pub(crate) type RowFn = fn(&QuantMatrix, usize, &mut [f32]);

/// Rows of `x` up to which a panel is four weight rows (kept in L1).
const DECODE_ROWS: usize = 4;
/// The most f32 elements a large-batch panel holds (256 KiB, inside L2).
const PANEL_ELEMS: usize = 64 * 1024;

/// The fastest row dequantizer this CPU has for `format`.
pub(crate) fn row_fn(format: QuantFormat) -> RowFn {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(f) = avx2::row_fn(format) {
            return f;
        }
    }
    reference_row
}

/// The reference dequantizer, row by row.
pub(crate) fn reference_row(m: &QuantMatrix, r: usize, out: &mut [f32]) {
    m.dequantize_row(r, out);
}

/// `out[i * out_stride + j] = x[i] · w[j]` for the `n` rows of `x` (`k`
/// wide, `k == w.cols()`) and every row `j` of `w`.
///
/// # Safety
/// `out` must be valid for writes at every such index and not written by
/// anyone else meanwhile.
pub(crate) unsafe fn matmul(
    x: &[f32],
    n: usize,
    w: &QuantMatrix,
    out: *mut f32,
    out_stride: usize,
) {
    // SAFETY: passed through from the caller.
    unsafe { matmul_with(tile_fn(), row_fn(w.format()), x, n, w, out, out_stride) }
}

/// [`matmul`] with a given register tile and row dequantizer.
///
/// # Safety
/// As [`matmul`].
pub(crate) unsafe fn matmul_with(
    tile: TileFn,
    row: RowFn,
    x: &[f32],
    n: usize,
    w: &QuantMatrix,
    out: *mut f32,
    out_stride: usize,
) {
    let (m, k) = (w.rows(), w.cols());
    if n == 0 || m == 0 || k == 0 {
        return;
    }
    let panel_rows = if n <= DECODE_ROWS {
        4
    } else {
        (PANEL_ELEMS / k).clamp(4, W_ROWS_PER_TASK) / 4 * 4
    };
    let out_addr = out as usize;
    (0..m.div_ceil(W_ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let j0 = task * W_ROWS_PER_TASK;
            let j1 = (j0 + W_ROWS_PER_TASK).min(m);
            let mut buf = vec![0f32; panel_rows.min(j1 - j0) * k];
            for p0 in (j0..j1).step_by(panel_rows) {
                let p1 = (p0 + panel_rows).min(j1);
                let buf = &mut buf[..(p1 - p0) * k];
                for (r, dst) in (p0..p1).zip(buf.chunks_exact_mut(k)) {
                    row(w, r, dst);
                }
                // SAFETY: this task alone writes columns j0..j1 of `out`,
                // and p0..p1 lies inside them.
                unsafe {
                    panel(
                        tile,
                        x,
                        n,
                        k,
                        buf,
                        (out_addr as *mut f32).wrapping_add(p0),
                        out_stride,
                    )
                };
            }
        });
}

/// Rows `ids` of `table`, dequantized, appended to `out`; `None` names the
/// first id outside the table.
pub(crate) fn lookup(table: &QuantMatrix, ids: &[u32], out: &mut Vec<f32>) -> Option<u32> {
    let row = row_fn(table.format());
    lookup_rows((table.rows(), table.cols()), ids, out, |r, dst| {
        row(table, r, dst)
    })
}

/// Rows `ids` of a `(rows, cols)` table, each written by `row(r, dst)`,
/// appended to `out`; `None` names the first id outside the table (and
/// nothing is appended).
fn lookup_rows(
    (rows, cols): (usize, usize),
    ids: &[u32],
    out: &mut Vec<f32>,
    row: impl Fn(usize, &mut [f32]),
) -> Option<u32> {
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= rows) {
        return Some(bad);
    }
    let start = out.len();
    out.resize(start + ids.len() * cols, 0.0);
    for (&id, dst) in ids.iter().zip(out[start..].chunks_exact_mut(cols)) {
        row(id as usize, dst);
    }
    None
}

#[cfg(test)]
mod tests;

/// `m`'s values as a BF16 matrix (exact for formats whose values bf16
/// holds, MXFP4's).
fn as_bf16(m: &QuantMatrix) -> QuantMatrix {
    let values = m.dequantize();
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    QuantMatrix::new(
        QuantFormat::BF16,
        m.rows(),
        m.cols(),
        kiln_quant::SharedBytes::from_vec(bytes),
    )
    .expect("a bf16 matrix of the same shape; this is a bug")
}
