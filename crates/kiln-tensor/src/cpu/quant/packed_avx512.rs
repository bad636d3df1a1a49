//! AVX-512 products with [`Packed`] weights, in the order its module docs
//! define: a decode product that converts codes in registers, and a GEMM
//! that converts a panel of codes to f32 once and reuses it for every row
//! of `x`. Both give the portable code's bits lane for lane.

use std::arch::x86_64::*;

use super::packed::{nibble_line, Lines, Packed, ScaleKind, LANES};

/// Elements of `k` a GEMM tile covers at a time (a whole number of
/// sub-blocks).
const KC: usize = 128;
/// Rows of `x` whose accumulators stay in L1 while they sweep `k`.
const RB: usize = 32;
/// Rows of `x` per GEMM register tile.
const MAX_T: usize = 4;

#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn factor(p: &Packed, d: &[u16], m: &[i8], g: usize, j: usize) -> __m512 {
    // SAFETY: d_index/m_index name 16 entries inside the buffers.
    unsafe {
        let dv = _mm512_cvtph_ps(_mm256_loadu_si256(
            d.as_ptr().add(p.d_index(g, j)) as *const __m256i
        ));
        match p.scheme.scales {
            ScaleKind::F16 => dv,
            ScaleKind::Super { .. } => {
                let mv = _mm512_cvtepi8_epi32(_mm_loadu_si128(
                    m.as_ptr().add(p.m_index(g, j)) as *const __m128i
                ));
                _mm512_mul_ps(dv, _mm512_cvtepi32_ps(mv))
            }
        }
    }
}

/// The values of the codes of elements `k` (even) and `k + 1` of a group
/// whose codes start at `base`.
#[inline(always)]
pub(crate) unsafe fn pair<const NIB: bool>(
    base: *const u8,
    k: usize,
    table: __m512,
) -> (__m512, __m512) {
    // SAFETY: the caller's k lies inside the group's codes.
    unsafe {
        if NIB {
            // The run's 16 words (see `packed`'s layout), shifted to k.
            let v = _mm512_loadu_si512(base.add(nibble_line(k)) as *const __m512i);
            let c = _mm512_srl_epi32(v, _mm_cvtsi32_si128((4 * (k % 8)) as i32));
            (
                _mm512_permutexvar_ps(c, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table),
            )
        } else {
            let e = _mm512_cvtepi8_epi32(_mm_loadu_si128(base.add(k * LANES) as *const __m128i));
            let o =
                _mm512_cvtepi8_epi32(_mm_loadu_si128(base.add((k + 1) * LANES) as *const __m128i));
            (_mm512_cvtepi32_ps(e), _mm512_cvtepi32_ps(o))
        }
    }
}

/// Lanes of group `g` that are rows of the matrix.
pub(crate) fn lane_mask(p: &Packed, g: usize) -> __mmask16 {
    let valid = (p.rows - g * LANES).min(LANES);
    ((1u32 << valid) - 1) as __mmask16
}

/// `G` groups from `g0` times one row `x` (with its sub-block sums `sx`),
/// written to `out` (row `g0 · 16` first).
///
/// # Safety
/// AVX-512F; groups `g0..g0 + G` exist; `x` holds `p.cols`, `sx`
/// `p.subs` (when the format has offsets); `out` is writable for the
/// groups' matrix rows.
#[target_feature(enable = "avx512f")]
unsafe fn gemv<const G: usize, const NIB: bool>(
    p: &Packed,
    g0: usize,
    x: *const f32,
    sx: *const f32,
    out: *mut f32,
) {
    // SAFETY: as the function's contract; every index stays inside the
    // groups' codes and scales.
    unsafe {
        let gcb = p.group_code_bytes();
        let codes = p.codes.as_ptr().add(g0 * gcb);
        let table = _mm512_loadu_ps(p.scheme.table.as_ptr());
        let s = p.scheme.sub;
        let mut acc = [_mm512_setzero_ps(); G];
        for j in 0..p.subs {
            let mut e = [_mm512_setzero_ps(); G];
            let mut o = [_mm512_setzero_ps(); G];
            if NIB {
                // A run of 8 elements a load: element 8m + t is the words
                // shifted by 4t; the even ones feed `e`, the odd `o`, in
                // ascending k as below.
                for m in 0..s / 8 {
                    let k0 = j * s + 8 * m;
                    let xs: [__m512; 8] = std::array::from_fn(|t| _mm512_set1_ps(*x.add(k0 + t)));
                    for gi in 0..G {
                        let line = codes.add(gi * gcb + nibble_line(k0));
                        let v = _mm512_loadu_si512(line as *const __m512i);
                        macro_rules! step {
                            ($t:literal, $acc:ident) => {
                                $acc[gi] = _mm512_fmadd_ps(
                                    _mm512_permutexvar_ps(
                                        _mm512_srli_epi32::<{ 4 * $t }>(v),
                                        table,
                                    ),
                                    xs[$t],
                                    $acc[gi],
                                );
                            };
                        }
                        e[gi] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, table), xs[0], e[gi]);
                        step!(1, o);
                        step!(2, e);
                        step!(3, o);
                        step!(4, e);
                        step!(5, o);
                        step!(6, e);
                        step!(7, o);
                    }
                }
            } else {
                for pp in 0..s / 2 {
                    let k = j * s + 2 * pp;
                    let xe = _mm512_set1_ps(*x.add(k));
                    let xo = _mm512_set1_ps(*x.add(k + 1));
                    for gi in 0..G {
                        let (lo, hi) = pair::<NIB>(codes.add(gi * gcb), k, table);
                        e[gi] = _mm512_fmadd_ps(lo, xe, e[gi]);
                        o[gi] = _mm512_fmadd_ps(hi, xo, o[gi]);
                    }
                }
            }
            for gi in 0..G {
                let sc = factor(p, &p.scale_d, &p.scale_m, g0 + gi, j);
                acc[gi] = _mm512_fmadd_ps(sc, _mm512_add_ps(e[gi], o[gi]), acc[gi]);
                if p.scheme.offsets {
                    let of = factor(p, &p.offs_d, &p.offs_m, g0 + gi, j);
                    acc[gi] = _mm512_fmadd_ps(of, _mm512_set1_ps(*sx.add(j)), acc[gi]);
                }
            }
        }
        for (gi, a) in acc.iter().enumerate() {
            let g = g0 + gi;
            _mm512_mask_storeu_ps(out.add(gi * LANES), lane_mask(p, g), *a);
        }
    }
}

/// Groups `groups` times one row of `x`, four groups at a time.
///
/// # Safety
/// As [`gemv`] for every group of the range.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemv_groups(
    p: &Packed,
    groups: std::ops::Range<usize>,
    x: *const f32,
    sx: *const f32,
    out: *mut f32,
) {
    // SAFETY: passed through; each call covers groups inside the range.
    unsafe {
        let mut g = groups.start;
        while g < groups.end {
            let o = out.add((g - groups.start) * LANES);
            let left = groups.end - g;
            match (left, p.scheme.nibble) {
                (4.., true) => gemv::<4, true>(p, g, x, sx, o),
                (4.., false) => gemv::<4, false>(p, g, x, sx, o),
                (3, true) => gemv::<3, true>(p, g, x, sx, o),
                (3, false) => gemv::<3, false>(p, g, x, sx, o),
                (2, true) => gemv::<2, true>(p, g, x, sx, o),
                (2, false) => gemv::<2, false>(p, g, x, sx, o),
                (_, true) => gemv::<1, true>(p, g, x, sx, o),
                (_, false) => gemv::<1, false>(p, g, x, sx, o),
            }
            g += left.min(4);
        }
    }
}

/// One register tile: `T` rows of `x` against `G` adjacent groups' panels
/// (`ps` floats apart, their scales and offsets `ss` apart) of `nj`
/// sub-blocks, accumulated into `out` (loaded first unless `first`).
///
/// # Safety
/// AVX-512F; each panel holds `nj · s · 16` values, its `sc` (and `of`
/// when not null) `nj · 16`; `x` row `t` at `x + t·xs` holds the panel's
/// elements, `sx` row `t` at `sx + t·sxs` its sub-blocks; `out` row `t`
/// at `out + t·os` is writable for group `gi`'s lanes in `masks[gi]`
/// from `gi · 16`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn tile<const G: usize, const T: usize>(
    (panel, ps): (*const f32, usize),
    (sc, of, ss): (*const f32, *const f32, usize),
    nj: usize,
    s: usize,
    (x, xs): (*const f32, usize),
    (sx, sxs): (*const f32, usize),
    (out, os): (*mut f32, usize),
    first: bool,
    masks: [__mmask16; G],
) {
    // SAFETY: as the function's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); T]; G];
        if !first {
            for (gi, a) in acc.iter_mut().enumerate() {
                for (t, a) in a.iter_mut().enumerate() {
                    *a = _mm512_maskz_loadu_ps(masks[gi], out.add(t * os + gi * LANES));
                }
            }
        }
        for jj in 0..nj {
            let mut e = [[_mm512_setzero_ps(); T]; G];
            let mut o = [[_mm512_setzero_ps(); T]; G];
            for pp in 0..s / 2 {
                let kk = jj * s + 2 * pp;
                let mut we = [_mm512_setzero_ps(); G];
                let mut wo = [_mm512_setzero_ps(); G];
                for gi in 0..G {
                    we[gi] = _mm512_loadu_ps(panel.add(gi * ps + kk * LANES));
                    wo[gi] = _mm512_loadu_ps(panel.add(gi * ps + (kk + 1) * LANES));
                }
                for t in 0..T {
                    let xr = x.add(t * xs + kk);
                    let (xe, xo) = (_mm512_set1_ps(*xr), _mm512_set1_ps(*xr.add(1)));
                    for gi in 0..G {
                        e[gi][t] = _mm512_fmadd_ps(we[gi], xe, e[gi][t]);
                        o[gi][t] = _mm512_fmadd_ps(wo[gi], xo, o[gi][t]);
                    }
                }
            }
            for gi in 0..G {
                let scv = _mm512_loadu_ps(sc.add(gi * ss + jj * LANES));
                for t in 0..T {
                    acc[gi][t] =
                        _mm512_fmadd_ps(scv, _mm512_add_ps(e[gi][t], o[gi][t]), acc[gi][t]);
                }
                if !of.is_null() {
                    let ofv = _mm512_loadu_ps(of.add(gi * ss + jj * LANES));
                    for (t, a) in acc[gi].iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(ofv, _mm512_set1_ps(*sx.add(t * sxs + jj)), *a);
                    }
                }
            }
        }
        for (gi, a) in acc.iter().enumerate() {
            for (t, a) in a.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add(t * os + gi * LANES), masks[gi], *a);
            }
        }
    }
}

/// Groups `groups` (at most two) times rows `rows` of `x` (`n × cols`,
/// with sub-block sums `sx`, `n × subs`), into `out` (`out_stride` apart,
/// column 0 = the first row of `groups.start`).
///
/// The groups' codes are converted to f32 once, for all of `k` (a pair's
/// panel stays in L2); then blocks of [`RB`] rows of `x` run over it
/// [`KC`] elements at a time, accumulating in a buffer that stays in L1
/// (storing partial sums to `out` itself, whose lines are not cached, ran
/// at half the speed), and the buffer is copied out once per block.
///
/// # Safety
/// AVX-512F; `x`, `sx` hold those rows; `out` is writable at rows `rows`
/// for the groups' matrix rows and nobody else writes there meanwhile.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn gemm_block(
    p: &Packed,
    groups: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    x: *const f32,
    sx: *const f32,
    out: *mut f32,
    out_stride: usize,
) {
    let ng = groups.len();
    debug_assert!((1..=2).contains(&ng));
    let s = p.scheme.sub;
    let k = p.cols;
    let ss = p.subs * LANES;
    let mut panel = Lines::new(ng * k);
    let mut scales = Lines::new(ng * p.subs);
    let mut offs = Lines::new(if p.scheme.offsets { ng * p.subs } else { 0 });
    let mut acc = Lines::new(RB * ng);
    // SAFETY: as the function's contract; the panel, scales and offsets
    // are filled for exactly the elements the tiles read, and the tiles
    // write only the accumulator buffer.
    unsafe {
        let table = _mm512_loadu_ps(p.scheme.table.as_ptr());
        let gcb = p.group_code_bytes();
        for (gi, g) in groups.clone().enumerate() {
            let base = p.codes.as_ptr().add(g * gcb);
            let dst = panel.as_mut_ptr().add(gi * k * LANES);
            for kk in (0..k).step_by(2) {
                let (lo, hi) = if p.scheme.nibble {
                    pair::<true>(base, kk, table)
                } else {
                    pair::<false>(base, kk, table)
                };
                _mm512_storeu_ps(dst.add(kk * LANES), lo);
                _mm512_storeu_ps(dst.add((kk + 1) * LANES), hi);
            }
            for j in 0..p.subs {
                let at = gi * ss + j * LANES;
                let v = factor(p, &p.scale_d, &p.scale_m, g, j);
                _mm512_storeu_ps(scales.as_mut_ptr().add(at), v);
                if p.scheme.offsets {
                    let v = factor(p, &p.offs_d, &p.offs_m, g, j);
                    _mm512_storeu_ps(offs.as_mut_ptr().add(at), v);
                }
            }
        }
        let masks: [__mmask16; 2] = std::array::from_fn(|i| {
            if i < ng {
                lane_mask(p, groups.start + i)
            } else {
                0
            }
        });
        let all = [0xFFFFu16; 2];
        for r0 in rows.clone().step_by(RB) {
            let r1 = (r0 + RB).min(rows.end);
            for k0 in (0..k).step_by(KC) {
                let (j0, nj) = (k0 / s, (KC.min(k - k0)) / s);
                for t0 in (r0..r1).step_by(MAX_T) {
                    let nt = (r1 - t0).min(MAX_T);
                    let of = if p.scheme.offsets {
                        offs.as_ptr().add(j0 * LANES)
                    } else {
                        std::ptr::null()
                    };
                    let args = (
                        (panel.as_ptr().add(k0 * LANES), k * LANES),
                        (scales.as_ptr().add(j0 * LANES), of, ss),
                        nj,
                        s,
                        (x.add(t0 * k + k0), k),
                        (sx.wrapping_add(t0 * p.subs + j0), p.subs),
                        (acc.as_mut_ptr().add((t0 - r0) * ng * LANES), ng * LANES),
                        k0 == 0,
                    );
                    macro_rules! run {
                        ($g:literal, $t:literal) => {
                            tile::<$g, $t>(
                                args.0,
                                args.1,
                                args.2,
                                args.3,
                                args.4,
                                args.5,
                                args.6,
                                args.7,
                                [all[0]; $g],
                            )
                        };
                    }
                    match (ng, nt) {
                        (2, 4..) => run!(2, 4),
                        (2, 3) => run!(2, 3),
                        (2, 2) => run!(2, 2),
                        (2, _) => run!(2, 1),
                        (_, 4..) => run!(1, 4),
                        (_, 3) => run!(1, 3),
                        (_, 2) => run!(1, 2),
                        (_, _) => run!(1, 1),
                    }
                }
            }
            for t in r0..r1 {
                for (gi, &mask) in masks.iter().enumerate().take(ng) {
                    let v = _mm512_loadu_ps(acc.as_ptr().add(((t - r0) * ng + gi) * LANES));
                    _mm512_mask_storeu_ps(out.add(t * out_stride + gi * LANES), mask, v);
                }
            }
        }
    }
}

/// [`super::packed::sub_sums`] with vectors, in the same tree.
///
/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn sub_sums(x: &[f32], s: usize, out: &mut [f32]) {
    // SAFETY: each sub-block of `s` (16 or 32) elements lies inside `x`.
    unsafe {
        for (j, o) in out.iter_mut().enumerate() {
            let c = x.as_ptr().add(j * s);
            let v = if s == 32 {
                _mm512_add_ps(_mm512_loadu_ps(c), _mm512_loadu_ps(c.add(16)))
            } else {
                _mm512_loadu_ps(c)
            };
            let h8 = _mm256_add_ps(
                _mm512_castps512_ps256(v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
            );
            let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
            let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
            let h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
            *o = _mm_cvtss_f32(h1);
        }
    }
}
