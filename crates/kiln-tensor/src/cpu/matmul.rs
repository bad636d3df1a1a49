//! Dense f32 products for the CPU backend: `out = x · wᵀ`.
//!
//! Every output element is one dot product computed in a fixed order that
//! does not depend on how many rows are in the batch or where a row sits in
//! it: 16 lanes, lane `l` accumulating the products at `k ≡ l (mod 16)` in
//! ascending `k`, the lanes summed by a fixed tree, then the tail (`k` past
//! the last multiple of 16) added in order (the AVX-512 path sums the lanes
//! with its own fixed shuffle order; the AVX2 path keeps the tree but fuses
//! each multiply-add). Each CPU runs one path, detected at run time (AVX-512,
//! else AVX2 with FMA, else portable code). Rows are computed in register
//! tiles of up to 4 × 4 dot products for speed, but tiling only changes which
//! dots run together, never their arithmetic. So a token's logits are
//! bit-identical whether it runs alone, batched with other requests, or after
//! a cached prefix: the determinism the engine promises on CPU rests here.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Lanes of one accumulator.
const LANES: usize = 16;
/// Output rows (of `w`) per parallel task.
pub(crate) const W_ROWS_PER_TASK: usize = 64;
/// Input rows (of `x`) kept hot while a task sweeps its weight rows.
const X_ROWS_PER_BLOCK: usize = 64;
/// Register tile.
const TILE: usize = 4;

pub(crate) type TileFn = unsafe fn(&TileArgs);

/// One register tile: `ri × rj` dots of length `k`.
pub(crate) struct TileArgs {
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
    matmul_t_with(tile_fn(), x, n, k, w, m)
}

/// [`matmul_t`] with a given register tile.
pub(crate) fn matmul_t_with(
    tile: TileFn,
    x: &[f32],
    n: usize,
    k: usize,
    w: &[f32],
    m: usize,
) -> Vec<f32> {
    assert!(
        x.len() == n * k && w.len() == m * k,
        "matmul_t: operand sizes; this is a bug"
    );
    let mut out = vec![0f32; n * m];
    if n == 0 || m == 0 {
        return out;
    }
    // Tasks own disjoint column ranges of `out`; pass its address as usize so
    // the closure is Send.
    let out_addr = out.as_mut_ptr() as usize;
    (0..m.div_ceil(W_ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let j0 = task * W_ROWS_PER_TASK;
            let j1 = (j0 + W_ROWS_PER_TASK).min(m);
            // SAFETY: rows j0..j1 of w are inside it, and the task writes
            // only columns j0..j1 of `out`, which no other task writes.
            unsafe {
                panel(
                    tile,
                    x,
                    n,
                    k,
                    &w[j0 * k..j1 * k],
                    (out_addr as *mut f32).wrapping_add(j0),
                    m,
                )
            };
        });
    out
}

/// Every dot of the `n` rows of `x` with the rows of `w` (a contiguous
/// panel of `w.len() / k` weight rows), written to `out[i * out_stride + j]`
/// for panel row `j`: the x rows in blocks kept hot, register tiles inside.
///
/// # Safety
/// `out` must be valid for writes at every such index, and no other thread
/// may write them meanwhile.
pub(crate) unsafe fn panel(
    tile: TileFn,
    x: &[f32],
    n: usize,
    k: usize,
    w: &[f32],
    out: *mut f32,
    out_stride: usize,
) {
    let rows = w.len() / k.max(1);
    for i0 in (0..n).step_by(X_ROWS_PER_BLOCK) {
        let i1 = (i0 + X_ROWS_PER_BLOCK).min(n);
        for jt in (0..rows).step_by(TILE) {
            for it in (i0..i1).step_by(TILE) {
                let args = TileArgs {
                    // SAFETY (all three pointers): it < n, jt < rows, so the
                    // offsets are inside `x`, `w` and (by the caller) `out`.
                    x: unsafe { x.as_ptr().add(it * k) },
                    x_stride: k,
                    w: unsafe { w.as_ptr().add(jt * k) },
                    w_stride: k,
                    k,
                    out: out.wrapping_add(it * out_stride + jt),
                    out_stride,
                    ri: TILE.min(i1 - it),
                    rj: TILE.min(rows - jt),
                };
                // SAFETY: the tile reads ri rows of x and rj rows of w of
                // length k, and writes ri × rj elements the caller owns.
                unsafe { tile(&args) };
            }
        }
    }
}

/// The register tile this CPU runs.
pub(crate) fn tile_fn() -> TileFn {
    static TILE_FN: OnceLock<TileFn> = OnceLock::new();
    *TILE_FN.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if runs_avx512() {
                return avx512::tile;
            }
            if avx2::detected() {
                return avx2::tile;
            }
        }
        tile_portable
    })
}

/// Whether [`tile_fn`] is the AVX-512 tile (products that must give its
/// bits — the fused block products — run only then).
pub(crate) fn runs_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
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
            if avx2::detected() {
                return avx2::dot;
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

/// AVX2 with FMA: the portable lane structure (16 lanes as two 8-lane
/// registers, summed by the same pairwise tree), each multiply-add fused.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{TileArgs, LANES};

    pub fn detected() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// The 16 lanes `lo ‖ hi` summed by the portable tree: lane i += lane
    /// i + 8, then i + 4, i + 2, i + 1.
    #[target_feature(enable = "avx2,fma")]
    fn reduce(lo: __m256, hi: __m256) -> f32 {
        let v8 = _mm256_add_ps(lo, hi);
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        let v1 = _mm_add_ss(v2, _mm_shuffle_ps::<0b01>(v2, v2));
        _mm_cvtss_f32(v1)
    }

    /// One dot product (the 1 × 1 tile).
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let k = a.len().min(b.len());
        let args = TileArgs {
            x: a.as_ptr(),
            x_stride: k,
            w: b.as_ptr(),
            w_stride: k,
            k,
            out: std::ptr::null_mut(),
            out_stride: 0,
            ri: 1,
            rj: 1,
        };
        let mut s = 0f32;
        // SAFETY: only selected after detecting avx2 and fma; one row of
        // each operand of length k, one output written to `s`.
        unsafe {
            tile_n::<1, 1>(&TileArgs {
                out: &mut s,
                ..args
            })
        };
        s
    }

    /// Up to 4 × 4 dot products: one row of x against up to 4 rows of w, or
    /// 2 × 2 sub-tiles (what fits in sixteen registers).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile(a: &TileArgs) {
        if a.ri == 1 {
            match a.rj {
                4 => unsafe { tile_n::<1, 4>(a) },
                3 => unsafe { tile_n::<1, 3>(a) },
                2 => unsafe { tile_n::<1, 2>(a) },
                _ => unsafe { tile_n::<1, 1>(a) },
            }
            return;
        }
        for i in (0..a.ri).step_by(2) {
            for j in (0..a.rj).step_by(2) {
                let sub = TileArgs {
                    // SAFETY: i < ri and j < rj, inside the caller's tile.
                    x: unsafe { a.x.add(i * a.x_stride) },
                    w: unsafe { a.w.add(j * a.w_stride) },
                    out: unsafe { a.out.add(i * a.out_stride + j) },
                    ri: 2.min(a.ri - i),
                    rj: 2.min(a.rj - j),
                    ..*a
                };
                match (sub.ri, sub.rj) {
                    (2, 2) => unsafe { tile_n::<2, 2>(&sub) },
                    (2, _) => unsafe { tile_n::<2, 1>(&sub) },
                    (_, 2) => unsafe { tile_n::<1, 2>(&sub) },
                    _ => unsafe { tile_n::<1, 1>(&sub) },
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_n<const RI: usize, const RJ: usize>(a: &TileArgs) {
        let k16 = a.k / LANES * LANES;
        let mut acc = [[[_mm256_setzero_ps(); 2]; RJ]; RI];
        let mut c = 0;
        while c < k16 {
            let mut xv = [[_mm256_setzero_ps(); 2]; RI];
            for (i, x) in xv.iter_mut().enumerate() {
                // SAFETY: row i < ri of x, columns c..c+16 <= k.
                unsafe {
                    x[0] = _mm256_loadu_ps(a.x.add(i * a.x_stride + c));
                    x[1] = _mm256_loadu_ps(a.x.add(i * a.x_stride + c + 8));
                }
            }
            for j in 0..RJ {
                // SAFETY: row j < rj of w, columns c..c+16 <= k.
                let (wlo, whi) = unsafe {
                    (
                        _mm256_loadu_ps(a.w.add(j * a.w_stride + c)),
                        _mm256_loadu_ps(a.w.add(j * a.w_stride + c + 8)),
                    )
                };
                for i in 0..RI {
                    acc[i][j][0] = _mm256_fmadd_ps(xv[i][0], wlo, acc[i][j][0]);
                    acc[i][j][1] = _mm256_fmadd_ps(xv[i][1], whi, acc[i][j][1]);
                }
            }
            c += LANES;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, acc_ij) in row.iter().enumerate() {
                let mut s = reduce(acc_ij[0], acc_ij[1]);
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

/// Every register tile this CPU can run, by name (for tests).
#[cfg(test)]
pub(crate) fn tile_paths() -> Vec<(&'static str, TileFn)> {
    let mut v: Vec<(&'static str, TileFn)> = vec![("portable", tile_portable)];
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::detected() {
            v.push(("avx2", avx2::tile));
        }
        if runs_avx512() {
            v.push(("avx512", avx512::tile));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path this CPU can run: (name, tile, dot).
    fn paths() -> Vec<(&'static str, TileFn, DotFn)> {
        let mut v: Vec<(&'static str, TileFn, DotFn)> =
            vec![("portable", tile_portable, dot_portable)];
        #[cfg(target_arch = "x86_64")]
        {
            if avx2::detected() {
                v.push(("avx2", avx2::tile, avx2::dot));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(("avx512", avx512::tile, avx512::dot));
            }
        }
        v
    }

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
        for (path, tile, _) in paths() {
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
                let got = matmul_t_with(tile, &x, n, k, &w, m);
                let want = naive(&x, n, k, &w, m);
                for (g, e) in got.iter().zip(&want) {
                    assert!(
                        (*g as f64 - e).abs() < 1e-3 * (1.0 + e.abs()),
                        "{path} {n}x{k}x{m}: {g} vs {e}"
                    );
                }
            }
        }
    }

    #[test]
    fn each_row_is_bit_identical_whatever_the_batch() {
        let (k, m) = (200, 75);
        let w = pseudo(m * k, 5);
        let x = pseudo(9 * k, 6);
        for (path, tile, dot) in paths() {
            let batched = matmul_t_with(tile, &x, 9, k, &w, m);
            for i in 0..9 {
                let alone = matmul_t_with(tile, &x[i * k..(i + 1) * k], 1, k, &w, m);
                assert!(
                    alone == batched[i * m..(i + 1) * m],
                    "{path}: row {i} differs alone vs batched"
                );
                for j in 0..m {
                    assert_eq!(
                        dot(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]),
                        alone[j],
                        "{path}: the dot product agrees with the tile"
                    );
                }
            }
        }
    }

    #[test]
    fn the_avx2_path_sums_in_the_portable_order() {
        // The same lanes and tree; only the fused multiply-add could round
        // differently, and with products exact in f32 (b is 1 or 0.5) it
        // does not, while the sums of values of very different magnitude
        // round, so any other summation order shows in the bits.
        let a: Vec<f32> = (0..1003)
            .map(|i| (((i * 7) % 19) as f32 - 9.0) * 2f32.powi((i * 3) % 41 - 20))
            .collect();
        let b: Vec<f32> = (0..1003)
            .map(|i| if i % 3 == 0 { 0.5 } else { 1.0 })
            .collect();
        let mut reversed = a.clone();
        reversed.reverse();
        let mut rb = b.clone();
        rb.reverse();
        assert_ne!(
            dot_portable(&a, &b),
            dot_portable(&reversed, &rb),
            "the data is order-sensitive"
        );
        for (path, _, dot) in paths() {
            assert_eq!(dot(&a, &b), dot_portable(&a, &b), "{path}");
        }
    }

    #[test]
    fn dot_variants_agree() {
        let a = pseudo(1000, 3);
        let b = pseudo(1000, 4);
        let p = dot_portable(&a, &b);
        for (path, _, dot) in paths() {
            let f = dot(&a, &b);
            assert!((p - f).abs() < 1e-3, "{path}: {p} vs {f}");
        }
        let f = dot_fn()(&a, &b);
        assert!((p - f).abs() < 1e-3, "{p} vs {f}");
    }
}
