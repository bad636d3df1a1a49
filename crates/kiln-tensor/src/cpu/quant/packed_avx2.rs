//! AVX2 + FMA (+ F16C) products with [`Packed`] weights: each 16-row
//! group as two 8-lane halves, in the order [`super::packed`] defines, so
//! a row's bits are those of the AVX-512 and portable code.

use std::arch::x86_64::*;

use super::packed::{nibble_line, Packed, ScaleKind, LANES};

const HALF: usize = 8;
/// Elements of `k` a GEMM panel covers.
const KC: usize = 256;
/// Rows of `x` per GEMM register tile.
const MAX_T: usize = 4;

/// Whether this CPU runs these kernels.
pub(crate) fn detected() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn factor(p: &Packed, d: &[u16], m: &[i8], g: usize, j: usize, h: usize) -> __m256 {
    // SAFETY: d_index/m_index name 16 entries inside the buffers.
    unsafe {
        let dv = _mm256_cvtph_ps(_mm_loadu_si128(
            d.as_ptr().add(p.d_index(g, j) + h * HALF) as *const __m128i
        ));
        match p.scheme.scales {
            ScaleKind::F16 => dv,
            ScaleKind::Super { .. } => {
                let mv = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    m.as_ptr().add(p.m_index(g, j) + h * HALF) as *const __m128i,
                ));
                _mm256_mul_ps(dv, _mm256_cvtepi32_ps(mv))
            }
        }
    }
}

/// The 16-entry nibble table as two halves.
#[target_feature(enable = "avx2")]
unsafe fn tables(p: &Packed) -> (__m256, __m256) {
    // SAFETY: the table has 16 entries.
    unsafe {
        (
            _mm256_loadu_ps(p.scheme.table.as_ptr()),
            _mm256_loadu_ps(p.scheme.table.as_ptr().add(HALF)),
        )
    }
}

#[inline(always)]
unsafe fn lut(idx: __m256i, t: (__m256, __m256)) -> __m256 {
    // SAFETY: plain register ops (AVX2, enabled by every caller).
    unsafe {
        let lo = _mm256_permutevar8x32_ps(t.0, idx);
        let hi = _mm256_permutevar8x32_ps(t.1, idx);
        _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)))
    }
}

/// The values of elements `k` (even) and `k + 1` in half `h` of a group
/// whose codes start at `base`.
#[inline(always)]
unsafe fn pair<const NIB: bool>(
    base: *const u8,
    k: usize,
    h: usize,
    t: (__m256, __m256),
) -> (__m256, __m256) {
    // SAFETY: the caller's k lies inside the group's codes.
    unsafe {
        if NIB {
            // Lanes h·8.. of the run's words (see `packed`'s layout).
            let v = _mm256_loadu_si256(base.add(nibble_line(k) + h * HALF * 4) as *const __m256i);
            let c = _mm256_srl_epi32(v, _mm_cvtsi32_si128((4 * (k % 8)) as i32));
            (lut(c, t), lut(_mm256_srli_epi32(c, 4), t))
        } else {
            let at = |k: usize| {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    base.add(k * LANES + h * HALF) as *const __m128i,
                )))
            };
            (at(k), at(k + 1))
        }
    }
}

/// The lanes of half `h` of group `g` that are matrix rows, as a mask.
#[inline]
#[target_feature(enable = "avx2")]
fn half_mask(p: &Packed, g: usize, h: usize) -> __m256i {
    let valid = p.rows.saturating_sub(g * LANES + h * HALF).min(HALF) as i32;
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(valid),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// `G` groups from `g0` times one row of `x`, into `out`.
///
/// # Safety
/// AVX2, FMA, F16C; as [`super::packed_avx512`]'s decode product.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<const G: usize, const NIB: bool>(
    p: &Packed,
    g0: usize,
    x: *const f32,
    sx: *const f32,
    out: *mut f32,
) {
    // SAFETY: as the function's contract.
    unsafe {
        let gcb = p.group_code_bytes();
        let t = tables(p);
        let s = p.scheme.sub;
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); G];
            for j in 0..p.subs {
                let mut e = [_mm256_setzero_ps(); G];
                let mut o = [_mm256_setzero_ps(); G];
                for pp in 0..s / 2 {
                    let k = j * s + 2 * pp;
                    let xe = _mm256_set1_ps(*x.add(k));
                    let xo = _mm256_set1_ps(*x.add(k + 1));
                    for gi in 0..G {
                        let base = p.codes.as_ptr().add((g0 + gi) * gcb);
                        let (lo, hi) = pair::<NIB>(base, k, h, t);
                        e[gi] = _mm256_fmadd_ps(lo, xe, e[gi]);
                        o[gi] = _mm256_fmadd_ps(hi, xo, o[gi]);
                    }
                }
                for gi in 0..G {
                    let sc = factor(p, &p.scale_d, &p.scale_m, g0 + gi, j, h);
                    acc[gi] = _mm256_fmadd_ps(sc, _mm256_add_ps(e[gi], o[gi]), acc[gi]);
                    if p.scheme.offsets {
                        let of = factor(p, &p.offs_d, &p.offs_m, g0 + gi, j, h);
                        acc[gi] = _mm256_fmadd_ps(of, _mm256_set1_ps(*sx.add(j)), acc[gi]);
                    }
                }
            }
            for (gi, a) in acc.iter().enumerate() {
                let mask = half_mask(p, g0 + gi, h);
                _mm256_maskstore_ps(out.add(gi * LANES + h * HALF), mask, *a);
            }
        }
    }
}

/// Groups `groups` times one row of `x`, two groups at a time.
///
/// # Safety
/// AVX2, FMA, F16C; as [`super::packed_avx512::gemv_groups`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv_groups(
    p: &Packed,
    groups: std::ops::Range<usize>,
    x: *const f32,
    sx: *const f32,
    out: *mut f32,
) {
    // SAFETY: passed through.
    unsafe {
        let mut g = groups.start;
        while g < groups.end {
            let o = out.add((g - groups.start) * LANES);
            let two = groups.end - g >= 2;
            match (two, p.scheme.nibble) {
                (true, true) => gemv::<2, true>(p, g, x, sx, o),
                (true, false) => gemv::<2, false>(p, g, x, sx, o),
                (false, true) => gemv::<1, true>(p, g, x, sx, o),
                (false, false) => gemv::<1, false>(p, g, x, sx, o),
            }
            g += if two { 2 } else { 1 };
        }
    }
}

/// One register tile of `T` rows of `x` on one half of a group's panel.
///
/// # Safety
/// AVX2, FMA; as [`super::packed_avx512`]'s tile, for 8 lanes.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const T: usize>(
    panel: *const f32,
    sc: *const f32,
    of: *const f32,
    nj: usize,
    s: usize,
    (x, xs): (*const f32, usize),
    (sx, sxs): (*const f32, usize),
    (out, os): (*mut f32, usize),
    first: bool,
    mask: __m256i,
) {
    // SAFETY: as the function's contract.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); T];
        if !first {
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_maskload_ps(out.add(t * os), mask);
            }
        }
        for jj in 0..nj {
            let mut e = [_mm256_setzero_ps(); T];
            let mut o = [_mm256_setzero_ps(); T];
            for pp in 0..s / 2 {
                let kk = jj * s + 2 * pp;
                let we = _mm256_loadu_ps(panel.add(kk * LANES));
                let wo = _mm256_loadu_ps(panel.add((kk + 1) * LANES));
                for t in 0..T {
                    let xr = x.add(t * xs + kk);
                    e[t] = _mm256_fmadd_ps(we, _mm256_set1_ps(*xr), e[t]);
                    o[t] = _mm256_fmadd_ps(wo, _mm256_set1_ps(*xr.add(1)), o[t]);
                }
            }
            let scv = _mm256_loadu_ps(sc.add(jj * LANES));
            for t in 0..T {
                acc[t] = _mm256_fmadd_ps(scv, _mm256_add_ps(e[t], o[t]), acc[t]);
            }
            if !of.is_null() {
                let ofv = _mm256_loadu_ps(of.add(jj * LANES));
                for (t, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(ofv, _mm256_set1_ps(*sx.add(t * sxs + jj)), *a);
                }
            }
        }
        for (t, a) in acc.iter().enumerate() {
            _mm256_maskstore_ps(out.add(t * os), mask, *a);
        }
    }
}

/// As [`super::packed_avx512::gemm_block`], with 8-lane tiles.
///
/// # Safety
/// AVX2, FMA, F16C; as [`super::packed_avx512::gemm_block`].
#[target_feature(enable = "avx2,fma,f16c")]
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
    let s = p.scheme.sub;
    let kc = KC.min(p.cols);
    let mut panel = super::packed::Lines::new(ng * kc);
    let mut scales = super::packed::Lines::new(ng * (kc / s));
    let mut offs = super::packed::Lines::new(if p.scheme.offsets { ng * (kc / s) } else { 0 });
    // SAFETY: as the function's contract; the panel, scales and offsets
    // are filled for exactly the elements the tiles read.
    unsafe {
        let t = tables(p);
        let gcb = p.group_code_bytes();
        for k0 in (0..p.cols).step_by(kc) {
            let k1 = (k0 + kc).min(p.cols);
            let (j0, nj) = (k0 / s, (k1 - k0) / s);
            for (gi, g) in groups.clone().enumerate() {
                let base = p.codes.as_ptr().add(g * gcb);
                let dst = panel.as_mut_ptr().add(gi * kc * LANES);
                for h in 0..2 {
                    for k in (k0..k1).step_by(2) {
                        let (lo, hi) = if p.scheme.nibble {
                            pair::<true>(base, k, h, t)
                        } else {
                            pair::<false>(base, k, h, t)
                        };
                        _mm256_storeu_ps(dst.add((k - k0) * LANES + h * HALF), lo);
                        _mm256_storeu_ps(dst.add((k - k0 + 1) * LANES + h * HALF), hi);
                    }
                    for jj in 0..nj {
                        let at = (gi * (kc / s) + jj) * LANES + h * HALF;
                        let v = factor(p, &p.scale_d, &p.scale_m, g, j0 + jj, h);
                        _mm256_storeu_ps(scales.as_mut_ptr().add(at), v);
                        if p.scheme.offsets {
                            let v = factor(p, &p.offs_d, &p.offs_m, g, j0 + jj, h);
                            _mm256_storeu_ps(offs.as_mut_ptr().add(at), v);
                        }
                    }
                }
            }
            for t0 in rows.clone().step_by(MAX_T) {
                let nt = (rows.end - t0).min(MAX_T);
                for (gi, g) in groups.clone().enumerate() {
                    for h in 0..2 {
                        let at = gi * (kc / s) * LANES + h * HALF;
                        let of = if p.scheme.offsets {
                            offs.as_ptr().add(at)
                        } else {
                            std::ptr::null()
                        };
                        let args = (
                            panel.as_ptr().add(gi * kc * LANES + h * HALF),
                            scales.as_ptr().add(at),
                            of,
                            nj,
                            s,
                            (x.add(t0 * p.cols + k0), p.cols),
                            (sx.wrapping_add(t0 * p.subs + j0), p.subs),
                            (
                                out.add(t0 * out_stride + (g - groups.start) * LANES + h * HALF),
                                out_stride,
                            ),
                            k0 == 0,
                            half_mask(p, g, h),
                        );
                        macro_rules! run {
                            ($t:literal) => {
                                tile::<$t>(
                                    args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7,
                                    args.8, args.9,
                                )
                            };
                        }
                        match nt {
                            4 => run!(4),
                            3 => run!(3),
                            2 => run!(2),
                            _ => run!(1),
                        }
                    }
                }
            }
        }
    }
}
