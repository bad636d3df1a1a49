//! Products with block-format weights on the CPU, and the row lookups of
//! block embedding tables.
//!
//! The blocks stay as the file stores them (in place in the mapped file).
//! A product dequantizes a panel of weight rows into a small f32 buffer —
//! four rows for decode-sized batches, so they stay in L1; up to 64 rows
//! for larger ones, dequantized once and reused by every row of `x` — and
//! runs the dense product's register tiles over it
//! ([`super::matmul::panel`]). The dequantized values are the reference
//! values of [`kiln_quant::dequant`] bit for bit (the vectorized
//! dequantizers do the same f32 operations in the same order), and every
//! dot is the dense product's, so a block weight's product is exactly the
//! dense product of its dequantized matrix: bit-identical whatever the
//! batch, and every golden the dequantized model meets still holds.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use kiln_quant::{QuantFormat, QuantMatrix};
use rayon::prelude::*;

use super::matmul::{panel, runs_avx512, tile_fn, TileFn, W_ROWS_PER_TASK};

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
    #[cfg(target_arch = "x86_64")]
    if n <= avx512::MAX_ROWS && runs_avx512() {
        if let Some(f) = avx512::fused_fn(w.format()) {
            // SAFETY: passed through from the caller; the fused products
            // give the AVX-512 tile's bits, and that tile is the one in use.
            return unsafe { fused(f, x, n, w, out, out_stride) };
        }
    }
    // SAFETY: passed through from the caller.
    unsafe { matmul_with(tile_fn(), row_fn(w.format()), x, n, w, out, out_stride) }
}

/// [`matmul`] for a few rows of `x` by a product that dequantizes in
/// registers, in parallel over tasks of weight rows.
///
/// # Safety
/// As [`matmul`], and `n <= avx512::MAX_ROWS`.
#[cfg(target_arch = "x86_64")]
unsafe fn fused(
    f: avx512::FusedFn,
    x: &[f32],
    n: usize,
    w: &QuantMatrix,
    out: *mut f32,
    out_stride: usize,
) {
    let m = w.rows();
    if n == 0 || m == 0 || w.cols() == 0 {
        return;
    }
    let out_addr = out as usize;
    (0..m.div_ceil(W_ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let j0 = task * W_ROWS_PER_TASK;
            let j1 = (j0 + W_ROWS_PER_TASK).min(m);
            // SAFETY: this task alone writes columns j0..j1 of `out`.
            unsafe { f(x, n, w, j0..j1, out_addr as *mut f32, out_stride) };
        });
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
    let d = table.cols();
    let row = row_fn(table.format());
    let start = out.len();
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows()) {
        return Some(bad);
    }
    out.resize(start + ids.len() * d, 0.0);
    for (&id, dst) in ids.iter().zip(out[start..].chunks_exact_mut(d)) {
        row(table, id as usize, dst);
    }
    None
}

/// Whether this CPU has a vectorized dequantizer for `format` (else the
/// reference one runs), for reports.
pub fn vectorized(format: QuantFormat) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2::row_fn(format).is_some()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = format;
        false
    }
}

#[cfg(test)]
mod tests;
