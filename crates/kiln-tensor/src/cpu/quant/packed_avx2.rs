//! AVX2 + FMA (+ F16C) products with [`Packed`] weights and [`Limbs`]
//! activations: each 16-row group as two 8-lane halves, the byte products
//! by `vpmaddubsw` + `vpmaddwd` (exact: a pair of products stays inside
//! i16 for operands up to 127, and the wider Q8_0 / IQ4_NL operands are
//! split into their low 7 bits and their top bit), then the sub-block's
//! f32 steps of [`super::packed`] — so a row's bits are those of the
//! AVX-512 and portable code.

use std::arch::x86_64::*;

use super::limbs::{Limbs, SubInfo};
use super::packed::{byte_line, nibble_line, plane_line, Packed, ScaleKind, LANES};

const HALF: usize = 8;

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

/// The i32 word of four limb bytes at `p` in every lane.
#[inline(always)]
unsafe fn word(p: *const i8) -> __m256i {
    // SAFETY: the caller's four bytes are readable.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}

/// The exact limb sums of one sub-block on 8 lanes, bias folded in.
struct Sums {
    a: __m256i,
    b: __m256i,
    c: __m256i,
}

impl Sums {
    #[inline(always)]
    unsafe fn start(bias: i32, info: &SubInfo) -> Sums {
        // SAFETY: plain register ops.
        unsafe {
            Sums {
                a: _mm256_setzero_si256(),
                b: _mm256_set1_epi32(-bias * info.t),
                c: _mm256_set1_epi32(-bias * info.c),
            }
        }
    }

    /// Σ of four products a lane of unsigned `u` and signed `w`, exactly:
    /// `u` ≤ 127 unless `WIDE`, where it is split as `lo7 + 128·top`.
    #[inline(always)]
    unsafe fn dot<const WIDE: bool>(u: __m256i, w: __m256i) -> __m256i {
        // SAFETY: AVX2, enabled by every caller.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            if WIDE {
                let lo = _mm256_and_si256(u, _mm256_set1_epi8(0x7F));
                let top = _mm256_and_si256(_mm256_srli_epi16(u, 7), _mm256_set1_epi8(1));
                let l = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, w), ones);
                let t = _mm256_madd_epi16(_mm256_maddubs_epi16(top, w), ones);
                _mm256_add_epi32(l, _mm256_slli_epi32(t, 7))
            } else {
                _mm256_madd_epi16(_mm256_maddubs_epi16(u, w), ones)
            }
        }
    }

    #[inline(always)]
    unsafe fn add<const WIDE: bool>(&mut self, u: __m256i, a: __m256i, b: __m256i, c: __m256i) {
        // SAFETY: AVX2, enabled by every caller.
        unsafe {
            self.a = _mm256_add_epi32(self.a, Self::dot::<WIDE>(u, a));
            self.b = _mm256_add_epi32(self.b, Self::dot::<WIDE>(u, b));
            self.c = _mm256_add_epi32(self.c, Self::dot::<WIDE>(u, c));
        }
    }

    /// As the AVX-512 `Sums::finish`, on 8 lanes.
    #[inline(always)]
    unsafe fn finish(&self, acc: __m256, sc: __m256, info: &SubInfo, of: Option<__m256>) -> __m256 {
        // SAFETY: AVX2 and FMA, enabled by every caller.
        unsafe {
            let big = _mm256_add_epi32(_mm256_slli_epi32(self.a, 8), self.b);
            let sum = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(big),
                _mm256_set1_ps(256.0),
                _mm256_cvtepi32_ps(self.c),
            );
            let w = _mm256_mul_ps(sc, _mm256_set1_ps(info.scale));
            let acc = _mm256_fmadd_ps(w, sum, acc);
            match of {
                Some(of) => _mm256_fmadd_ps(of, _mm256_set1_ps(info.sum), acc),
                None => acc,
            }
        }
    }
}

/// Half `h` of a nibble line as operand bytes (low and high nibbles,
/// through the table if any).
#[inline(always)]
unsafe fn nibbles(line: *const u8, h: usize, lut: Option<__m256i>) -> (__m256i, __m256i) {
    // SAFETY: the line's 64 bytes are readable; AVX2.
    unsafe {
        let v = _mm256_loadu_si256(line.add(h * HALF * 4) as *const __m256i);
        let m = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(v, m);
        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
        match lut {
            Some(t) => (_mm256_shuffle_epi8(t, lo), _mm256_shuffle_epi8(t, hi)),
            None => (lo, hi),
        }
    }
}

/// Half `h` of a sub-block's high-bit plane line (quad `q`'s bits at
/// `high · q` in each byte).
#[inline(always)]
unsafe fn plane(line: *const u8, h: usize) -> __m256i {
    // SAFETY: the line's 64 bytes are readable; AVX2.
    unsafe { _mm256_loadu_si256(line.add(h * HALF * 4) as *const __m256i) }
}

/// `lo | (hs & mask) << 4` for one quad, and `hs` moved to the next quad.
#[inline(always)]
unsafe fn with_high(lo: __m256i, hs: &mut __m256i, high: u32) -> __m256i {
    // SAFETY: plain register ops (AVX2).
    unsafe {
        let mask = _mm256_set1_epi8(((1u32 << high) - 1) as i8);
        let u = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(*hs, mask), 4));
        *hs = _mm256_srl_epi32(*hs, _mm_cvtsi32_si128(high as i32));
        u
    }
}

#[inline(always)]
unsafe fn lut(p: &Packed) -> Option<__m256i> {
    // SAFETY: the table has 16 bytes.
    p.scheme.lut.map(|t| unsafe {
        _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr() as *const __m128i))
    })
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

/// Group `g` times one row of `x` (its limbs `xl`, its sub-blocks'
/// `info`), into `out`.
///
/// # Safety
/// AVX2, FMA, F16C; as [`super::packed_avx512`]'s decode product.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<const NIB: bool, const WIDE: bool>(
    p: &Packed,
    g: usize,
    xl: *const i8,
    info: *const SubInfo,
    out: *mut f32,
) {
    // SAFETY: as the function's contract.
    unsafe {
        let codes = p.codes.as_ptr().add(g * p.group_code_bytes());
        let s = p.scheme.sub;
        let bias = p.scheme.bias;
        let table = lut(p);
        for h in 0..2 {
            let mut acc = _mm256_setzero_ps();
            for j in 0..p.subs {
                let inf = &*info.add(j);
                let xb = xl.add(j * 3 * s);
                let limb = |q: usize| {
                    (
                        word(xb.add(4 * q)),
                        word(xb.add(s + 4 * q)),
                        word(xb.add(2 * s + 4 * q)),
                    )
                };
                let mut sums = Sums::start(bias, inf);
                if NIB {
                    let high = p.scheme.high;
                    let mut hs = if high > 0 {
                        plane(codes.add(plane_line(p.cols, high, j * s)), h)
                    } else {
                        _mm256_setzero_si256()
                    };
                    for m in 0..s / 8 {
                        let (mut lo, mut hi) =
                            nibbles(codes.add(nibble_line(j * s + 8 * m)), h, table);
                        if high > 0 {
                            lo = with_high(lo, &mut hs, high);
                            hi = with_high(hi, &mut hs, high);
                        }
                        let (a, b, c) = limb(2 * m);
                        sums.add::<WIDE>(lo, a, b, c);
                        let (a, b, c) = limb(2 * m + 1);
                        sums.add::<WIDE>(hi, a, b, c);
                    }
                } else {
                    for q in 0..s / 4 {
                        let at = codes.add(byte_line(j * s + 4 * q) + h * HALF * 4);
                        let (a, b, c) = limb(q);
                        sums.add::<WIDE>(_mm256_loadu_si256(at as *const __m256i), a, b, c);
                    }
                }
                let sc = factor(p, &p.scale_d, &p.scale_m, g, j, h);
                let of = p
                    .scheme
                    .offsets
                    .then(|| factor(p, &p.offs_d, &p.offs_m, g, j, h));
                acc = sums.finish(acc, sc, inf, of);
            }
            _mm256_maskstore_ps(out.add(h * HALF), half_mask(p, g, h), acc);
        }
    }
}

/// Groups `groups` times row `t` of `x`, into `out`.
///
/// # Safety
/// AVX2, FMA, F16C; as [`super::packed_avx512::gemv_groups`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv_groups(
    p: &Packed,
    groups: std::ops::Range<usize>,
    x: &Limbs,
    t: usize,
    out: *mut f32,
) {
    // SAFETY: passed through.
    unsafe {
        let (xl, info) = (x.row(t), x.infos(t));
        for g in groups.clone() {
            let o = out.add((g - groups.start) * LANES);
            match (p.scheme.nibble, p.scheme.wide()) {
                (true, true) => gemv::<true, true>(p, g, xl, info, o),
                (true, false) => gemv::<true, false>(p, g, xl, info, o),
                (false, true) => gemv::<false, true>(p, g, xl, info, o),
                (false, false) => gemv::<false, false>(p, g, xl, info, o),
            }
        }
    }
}

/// Groups `groups` times rows `rows` of `x`, into `out` (`out_stride`
/// apart, column 0 = the first row of `groups.start`): each group's
/// codes unpacked once into operand bytes, then `T` = 4 rows of `x` at a
/// time over them.
///
/// # Safety
/// AVX2, FMA, F16C; as [`super::packed_avx512::gemm_block`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemm_block(
    p: &Packed,
    groups: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    x: &Limbs,
    out: *mut f32,
    out_stride: usize,
) {
    let args = (p, groups, rows, x, out, out_stride);
    // SAFETY: as the function's contract.
    unsafe {
        if p.scheme.wide() {
            gemm::<true>(args)
        } else {
            gemm::<false>(args)
        }
    }
}

type GemmArgs<'a> = (
    &'a Packed,
    std::ops::Range<usize>,
    std::ops::Range<usize>,
    &'a Limbs,
    *mut f32,
    usize,
);

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm<const WIDE: bool>((p, groups, rows, x, out, out_stride): GemmArgs) {
    const T: usize = 4;
    let k = p.cols;
    let s = p.scheme.sub;
    let mut panel = vec![0u8; k * LANES];
    // SAFETY: as the function's contract; the panel holds the group's
    // operand bytes for all of k.
    unsafe {
        let table = lut(p);
        let bias = p.scheme.bias;
        for g in groups.clone() {
            let codes = p.codes.as_ptr().add(g * p.group_code_bytes());
            if p.scheme.nibble {
                let high = p.scheme.high;
                for kk in (0..k).step_by(8) {
                    for h in 0..2 {
                        let (mut lo, mut hi) = nibbles(codes.add(nibble_line(kk)), h, table);
                        if high > 0 {
                            let run = kk % (32 / high as usize) / 8;
                            let hs = plane(codes.add(plane_line(k, high, kk)), h);
                            let mut hs = _mm256_srl_epi32(
                                hs,
                                _mm_cvtsi32_si128((2 * run) as i32 * high as i32),
                            );
                            lo = with_high(lo, &mut hs, high);
                            hi = with_high(hi, &mut hs, high);
                        }
                        let d = panel.as_mut_ptr().add(kk * LANES + h * HALF * 4);
                        _mm256_storeu_si256(d as *mut __m256i, lo);
                        _mm256_storeu_si256(d.add(4 * LANES) as *mut __m256i, hi);
                    }
                }
            } else {
                panel.copy_from_slice(std::slice::from_raw_parts(codes, k * LANES));
            }
            let col = (g - groups.start) * LANES;
            for h in 0..2 {
                let mask = half_mask(p, g, h);
                for t0 in rows.clone().step_by(T) {
                    let nt = (rows.end - t0).min(T);
                    let mut acc = [_mm256_setzero_ps(); T];
                    for j in 0..p.subs {
                        let infos: [SubInfo; T] =
                            std::array::from_fn(|t| x.info(t0 + t.min(nt - 1), j));
                        let mut sums: [Sums; T] =
                            std::array::from_fn(|t| Sums::start(bias, &infos[t]));
                        for q in 0..s / 4 {
                            let at = panel.as_ptr().add((j * s + 4 * q) * LANES + h * HALF * 4);
                            let u = _mm256_loadu_si256(at as *const __m256i);
                            for (t, sums) in sums.iter_mut().enumerate().take(nt) {
                                let xb = x.row(t0 + t).add(j * 3 * s + 4 * q);
                                sums.add::<WIDE>(u, word(xb), word(xb.add(s)), word(xb.add(2 * s)));
                            }
                        }
                        let sc = factor(p, &p.scale_d, &p.scale_m, g, j, h);
                        let of = p
                            .scheme
                            .offsets
                            .then(|| factor(p, &p.offs_d, &p.offs_m, g, j, h));
                        for t in 0..nt {
                            acc[t] = sums[t].finish(acc[t], sc, &infos[t], of);
                        }
                    }
                    for (t, a) in acc.iter().enumerate().take(nt) {
                        let o = out.add((t0 + t) * out_stride + col + h * HALF);
                        _mm256_maskstore_ps(o, mask, *a);
                    }
                }
            }
        }
    }
}
