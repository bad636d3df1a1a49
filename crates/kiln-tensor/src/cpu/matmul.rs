//! Dense f32 products for the CPU backend: `out = x · wᵀ`.
//!
//! Every output element is one dot product computed in a fixed order that
//! does not depend on how many rows are in the batch or where a row sits in
//! it: 16 lanes, lane `l` accumulating the products at `k ≡ l (mod 16)` in
//! ascending `k`, the lanes summed by a fixed tree, then the tail (`k` past
//! the last multiple of 16) added in order (the AVX-512 path sums the lanes
//! with its own fixed shuffle order). Rows are computed in register
//! tiles of up to 4 × 4 dot products for speed, but tiling only changes which
//! dots run together, never their arithmetic. So a token's logits are
//! bit-identical whether it runs alone, batched with other requests, or after
//! a cached prefix: the determinism the engine promises on CPU rests here.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Lanes of one accumulator.
const LANES: usize = 16;
/// Output rows (of `w`) per parallel task.
const W_ROWS_PER_TASK: usize = 64;
/// Input rows (of `x`) kept hot while a task sweeps its weight rows.
const X_ROWS_PER_BLOCK: usize = 64;
/// Register tile.
const TILE: usize = 4;

type TileFn = unsafe fn(&TileArgs);

/// One register tile: `ri × rj` dots of length `k`.
struct TileArgs {
    x: *const f32,
    x_stride: usize,
    w: *const f32,
    w_stride: usize,
    k: usize,
    out: *mut f32,
    out_stride: usize,
    ri: usize,
    rj: usize,
}

/// `out[n, m] = x[n, k] · w[m, k]ᵀ`.
pub fn matmul_t(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f32> {
    assert!(
        x.len() == n * k && w.len() == m * k,
        "matmul_t: operand sizes; this is a bug"
    );
    let mut out = vec![0f32; n * m];
    if n == 0 || m == 0 {
        return out;
    }
    let tile = tile_fn();
    // Tasks own disjoint column ranges of `out`; pass its address as usize so
    // the closure is Send.
    let out_addr = out.as_mut_ptr() as usize;
    (0..m.div_ceil(W_ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let j0 = task * W_ROWS_PER_TASK;
            let j1 = (j0 + W_ROWS_PER_TASK).min(m);
            for i0 in (0..n).step_by(X_ROWS_PER_BLOCK) {
                let i1 = (i0 + X_ROWS_PER_BLOCK).min(n);
                for jt in (j0..j1).step_by(TILE) {
                    for it in (i0..i1).step_by(TILE) {
                        let args = TileArgs {
                            // SAFETY (all three pointers): it < n, jt < m, so the
                            // offsets are inside `x`, `w` and `out`.
                            x: unsafe { x.as_ptr().add(it * k) },
                            x_stride: k,
                            w: unsafe { w.as_ptr().add(jt * k) },
                            w_stride: k,
                            k,
                            out: (out_addr as *mut f32).wrapping_add(it * m + jt),
                            out_stride: m,
                            ri: TILE.min(i1 - it),
                            rj: TILE.min(j1 - jt),
                        };
                        // SAFETY: the tile reads ri rows of x and rj rows of w of
                        // length k, and writes ri × rj elements of `out` in this
                        // task's own columns [j0, j1).
                        unsafe { tile(&args) };
                    }
                }
            }
        });
    out
}

fn tile_fn() -> TileFn {
    static TILE_FN: OnceLock<TileFn> = OnceLock::new();
    *TILE_FN.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return avx512::tile;
            }
        }
        tile_portable
    })
}

/// The portable tile: the same lane structure with plain multiply-adds.
unsafe fn tile_portable(a: &TileArgs) {
    for i in 0..a.ri {
        for j in 0..a.rj {
            // SAFETY: guaranteed by the caller (see matmul_t).
            let (xr, wr) = unsafe {
                (
                    std::slice::from_raw_parts(a.x.add(i * a.x_stride), a.k),
                    std::slice::from_raw_parts(a.w.add(j * a.w_stride), a.k),
                )
            };
            let s = dot_portable(xr, wr);
            unsafe { *a.out.add(i * a.out_stride + j) = s };
        }
    }
}

/// Sum of 16 lanes by a fixed pairwise tree.
#[inline(always)]
fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0]
}

/// The portable dot product with the documented order.
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len().min(b.len());
    let k16 = k / LANES * LANES;
    let mut acc = [0f32; LANES];
    for c in (0..k16).step_by(LANES) {
        for l in 0..LANES {
            acc[l] += a[c + l] * b[c + l];
        }
    }
    let mut s = reduce_lanes(acc);
    for t in k16..k {
        s += a[t] * b[t];
    }
    s
}

type DotFn = fn(&[f32], &[f32]) -> f32;

/// The fastest dot product this CPU supports, with the documented order.
pub fn dot_fn() -> DotFn {
    static DOT: OnceLock<DotFn> = OnceLock::new();
    *DOT.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return avx512::dot;
            }
        }
        dot_portable
    })
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{TileArgs, LANES};

    /// Sum the lanes of `v` with the in-register reduction (a fixed order of
    /// shuffles: deterministic, though not the portable tree's order).
    #[target_feature(enable = "avx512f")]
    fn reduce(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }

    /// One dot product (the 1 × 1 tile).
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        #[target_feature(enable = "avx512f")]
        unsafe fn inner(a: &[f32], b: &[f32]) -> f32 {
            let k = a.len().min(b.len());
            let k16 = k / LANES * LANES;
            let mut acc = _mm512_setzero_ps();
            let mut c = 0;
            while c < k16 {
                // SAFETY: c + 16 <= k16 <= len of both.
                unsafe {
                    acc = _mm512_fmadd_ps(
                        _mm512_loadu_ps(a.as_ptr().add(c)),
                        _mm512_loadu_ps(b.as_ptr().add(c)),
                        acc,
                    );
                }
                c += LANES;
            }
            let mut s = reduce(acc);
            for t in k16..k {
                s += a[t] * b[t];
            }
            s
        }
        // SAFETY: only selected after detecting avx512f.
        unsafe { inner(a, b) }
    }

    /// Up to 4 × 4 dot products sharing their loads.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile(a: &TileArgs) {
        match (a.ri, a.rj) {
            (4, 4) => unsafe { tile_n::<4, 4>(a) },
            (1, 4) => unsafe { tile_n::<1, 4>(a) },
            (ri, rj) => {
                // Edge tiles: one row of x at a time, up to 4 rows of w.
                for i in 0..ri {
                    let sub = TileArgs {
                        x: unsafe { a.x.add(i * a.x_stride) },
                        out: unsafe { a.out.add(i * a.out_stride) },
                        ri: 1,
                        rj,
                        ..*a
                    };
                    match rj {
                        4 => unsafe { tile_n::<1, 4>(&sub) },
                        3 => unsafe { tile_n::<1, 3>(&sub) },
                        2 => unsafe { tile_n::<1, 2>(&sub) },
                        _ => unsafe { tile_n::<1, 1>(&sub) },
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn tile_n<const RI: usize, const RJ: usize>(a: &TileArgs) {
        let k16 = a.k / LANES * LANES;
        let mut acc = [[_mm512_setzero_ps(); RJ]; RI];
        let mut c = 0;
        while c < k16 {
            let mut wv = [_mm512_setzero_ps(); RJ];
            for (j, w) in wv.iter_mut().enumerate() {
                // SAFETY: row j < rj of w, columns c..c+16 < k.
                *w = unsafe { _mm512_loadu_ps(a.w.add(j * a.w_stride + c)) };
            }
            for (i, row) in acc.iter_mut().enumerate() {
                // SAFETY: row i < ri of x, columns c..c+16 < k.
                let xv = unsafe { _mm512_loadu_ps(a.x.add(i * a.x_stride + c)) };
                for (j, acc_ij) in row.iter_mut().enumerate() {
                    *acc_ij = _mm512_fmadd_ps(xv, wv[j], *acc_ij);
                }
            }
            c += LANES;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, acc_ij) in row.iter().enumerate() {
                let mut s = reduce(*acc_ij);
                for t in k16..a.k {
                    // SAFETY: t < k.
                    unsafe { s += *a.x.add(i * a.x_stride + t) * *a.w.add(j * a.w_stride + t) };
                }
                // SAFETY: (i, j) inside the tile the caller owns.
                unsafe { *a.out.add(i * a.out_stride + j) = s };
            }
        }
    }
}

// TileArgs is plain data for one call; the raw pointers never outlive it.
impl Clone for TileArgs {
    fn clone(&self) -> Self {
        *self
    }
}
impl Copy for TileArgs {}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f64> {
        let mut out = vec![0f64; n * m];
        for i in 0..n {
            for j in 0..m {
                out[i * m + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
            }
        }
        out
    }

    fn pseudo(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matmul_matches_naive_for_all_tile_shapes() {
        for &(n, k, m) in &[
            (1, 67, 45),
            (1, 576, 1536),
            (3, 33, 17),
            (17, 128, 96),
            (64, 64, 64),
            (130, 70, 131),
        ] {
            let x = pseudo(n * k, 1);
            let w = pseudo(m * k, 2);
            let got = matmul_t(&x, n, k, &w, m);
            let want = naive(&x, n, k, &w, m);
            for (g, e) in got.iter().zip(&want) {
                assert!(
                    (*g as f64 - e).abs() < 1e-3 * (1.0 + e.abs()),
                    "{n}x{k}x{m}: {g} vs {e}"
                );
            }
        }
    }

    #[test]
    fn each_row_is_bit_identical_whatever_the_batch() {
        let (k, m) = (200, 75);
        let w = pseudo(m * k, 5);
        let x = pseudo(9 * k, 6);
        let batched = matmul_t(&x, 9, k, &w, m);
        for i in 0..9 {
            let alone = matmul_t(&x[i * k..(i + 1) * k], 1, k, &w, m);
            assert!(
                alone == batched[i * m..(i + 1) * m],
                "row {i} differs alone vs batched"
            );
            let dot = dot_fn();
            assert_eq!(
                dot(&x[i * k..(i + 1) * k], &w[..k]),
                alone[0],
                "dot_fn agrees with the tile"
            );
        }
    }

    #[test]
    fn dot_variants_agree() {
        let a = pseudo(1000, 3);
        let b = pseudo(1000, 4);
        let p = dot_portable(&a, &b);
        let f = dot_fn()(&a, &b);
        assert!((p - f).abs() < 1e-3, "{p} vs {f}");
    }
}
