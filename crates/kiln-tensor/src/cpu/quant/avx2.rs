//! AVX2 row dequantizers (F16C for F16): [`kiln_quant::dequant`]'s formulas
//! eight lanes at a time, with the same f32 operations in the same order —
//! an exact integer-to-float conversion, one product by the block's (or
//! sub-block's) scale computed as the reference computes it, then at most
//! one addition or subtraction, never fused — so every value is the
//! reference value bit for bit.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use half::{bf16, f16};
use kiln_quant::dequant::{q3_k_scale, scale_min_k4, IQ4_NL_VALUES};
use kiln_quant::{QuantFormat, QuantMatrix};

use super::RowFn;

fn detected() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
}

/// The vectorized dequantizer of `format`, where this CPU has AVX2.
pub(super) fn row_fn(format: QuantFormat) -> Option<RowFn> {
    use QuantFormat::*;
    if !detected() {
        return None;
    }
    Some(match format {
        F16 => row_f16,
        BF16 => row_bf16,
        Q4_0 => row_q4_0,
        Q4_1 => row_q4_1,
        Q5_0 => row_q5_0,
        Q5_1 => row_q5_1,
        Q8_0 => row_q8_0,
        Q2K => row_q2_k,
        Q3K => row_q3_k,
        Q4K => row_q4_k,
        Q5K => row_q5_k,
        Q6K => row_q6_k,
        IQ4NL => row_iq4_nl,
    })
}

/// A row dequantizer from a block one: `$block(b, y)` reads one block at
/// `b` and writes its `$bs` values at `y`.
macro_rules! block_rows {
    ($name:ident, $block:ident, $bs:expr, $ts:expr) => {
        fn $name(m: &QuantMatrix, r: usize, out: &mut [f32]) {
            #[target_feature(enable = "avx2,f16c")]
            unsafe fn rows(bytes: &[u8], out: &mut [f32]) {
                for (b, y) in bytes.chunks_exact($ts).zip(out.chunks_exact_mut($bs)) {
                    // SAFETY: `b` is one whole block and `y` its values.
                    unsafe { $block(b.as_ptr(), y.as_mut_ptr()) }
                }
            }
            // SAFETY: only selected where AVX2 and F16C were detected.
            unsafe { rows(m.rows_bytes(r..r + 1), out) }
        }
    };
}

block_rows!(row_q4_0, q4_0, 32, 18);
block_rows!(row_q4_1, q4_1, 32, 20);
block_rows!(row_q5_0, q5_0, 32, 22);
block_rows!(row_q5_1, q5_1, 32, 24);
block_rows!(row_q8_0, q8_0, 32, 34);
block_rows!(row_iq4_nl, iq4_nl, 32, 18);
block_rows!(row_q2_k, q2_k, 256, 84);
block_rows!(row_q3_k, q3_k, 256, 110);
block_rows!(row_q4_k, q4_k, 256, 144);
block_rows!(row_q5_k, q5_k, 256, 176);
block_rows!(row_q6_k, q6_k, 256, 210);

fn row_f16(m: &QuantMatrix, r: usize, out: &mut [f32]) {
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn rows(bytes: &[u8], out: &mut [f32]) {
        let n8 = out.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            // SAFETY: elements i..i + 8 are inside both.
            unsafe {
                let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i) as *const __m128i);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        for i in n8..out.len() {
            out[i] = f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32();
        }
    }
    // SAFETY: only selected where AVX2 and F16C were detected.
    unsafe { rows(m.rows_bytes(r..r + 1), out) }
}

fn row_bf16(m: &QuantMatrix, r: usize, out: &mut [f32]) {
    #[target_feature(enable = "avx2")]
    unsafe fn rows(bytes: &[u8], out: &mut [f32]) {
        let n8 = out.len() / 8 * 8;
        for i in (0..n8).step_by(8) {
            // SAFETY: elements i..i + 8 are inside both.
            unsafe {
                let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i) as *const __m128i);
                let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
            }
        }
        for i in n8..out.len() {
            out[i] = bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32();
        }
    }
    // SAFETY: only selected where AVX2 was detected.
    unsafe { rows(m.rows_bytes(r..r + 1), out) }
}

/// The f16 at byte `i` of a block.
#[inline(always)]
unsafe fn f16_at(b: *const u8, i: usize) -> f32 {
    // SAFETY: the caller's block holds bytes i and i + 1.
    unsafe { f16::from_le_bytes([*b.add(i), *b.add(i + 1)]).to_f32() }
}

/// Eight bytes at `p`, zero-extended to eight i32 lanes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn u8x8(p: *const u8) -> __m256i {
    // SAFETY: the caller's block holds p..p + 8.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
}

/// `v >> s` in every lane, for a shift known only at run time.
#[target_feature(enable = "avx2")]
#[inline]
fn shr(v: __m256i, s: u32) -> __m256i {
    _mm256_srlv_epi32(v, _mm256_set1_epi32(s as i32))
}

#[target_feature(enable = "avx2")]
#[inline]
fn and(v: __m256i, mask: i32) -> __m256i {
    _mm256_and_si256(v, _mm256_set1_epi32(mask))
}

#[target_feature(enable = "avx2")]
#[inline]
fn sub(v: __m256i, k: i32) -> __m256i {
    _mm256_sub_epi32(v, _mm256_set1_epi32(k))
}

/// `y[0..8] = q as f32 * d`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn put_mul(y: *mut f32, q: __m256i, d: __m256) {
    // SAFETY: the caller's output holds y..y + 8.
    unsafe { _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)) }
}

/// `y[0..8] = q as f32 * d + m` (two roundings, as the reference).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn put_mul_add(y: *mut f32, q: __m256i, d: __m256, m: __m256) {
    let v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m);
    // SAFETY: the caller's output holds y..y + 8.
    unsafe { _mm256_storeu_ps(y, v) }
}

/// `y[0..8] = d * q as f32 - m` (two roundings, as the reference).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn put_mul_sub(y: *mut f32, q: __m256i, d: __m256, m: __m256) {
    let v = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m);
    // SAFETY: the caller's output holds y..y + 8.
    unsafe { _mm256_storeu_ps(y, v) }
}

/// The bits `e0..e0 + 8` of `qh`, one a lane, times 16.
#[target_feature(enable = "avx2")]
#[inline]
fn high_bits(qh: u32, e0: i32) -> __m256i {
    let idx = _mm256_setr_epi32(e0, e0 + 1, e0 + 2, e0 + 3, e0 + 4, e0 + 5, e0 + 6, e0 + 7);
    _mm256_slli_epi32::<4>(and(_mm256_srlv_epi32(_mm256_set1_epi32(qh as i32), idx), 1))
}

// The block dequantizers. SAFETY (each): `b` holds one whole block of the
// format and `y` its values; they are called only by `block_rows!`.

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q4_0(b: *const u8, y: *mut f32) {
    unsafe {
        let d = _mm256_set1_ps(f16_at(b, 0));
        for h in 0..2 {
            let q = u8x8(b.add(2 + 8 * h));
            put_mul(y.add(8 * h), sub(and(q, 0xF), 8), d);
            put_mul(y.add(16 + 8 * h), sub(shr(q, 4), 8), d);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q4_1(b: *const u8, y: *mut f32) {
    unsafe {
        let d = _mm256_set1_ps(f16_at(b, 0));
        let m = _mm256_set1_ps(f16_at(b, 2));
        for h in 0..2 {
            let q = u8x8(b.add(4 + 8 * h));
            put_mul_add(y.add(8 * h), and(q, 0xF), d, m);
            put_mul_add(y.add(16 + 8 * h), shr(q, 4), d, m);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q5_0(b: *const u8, y: *mut f32) {
    unsafe {
        let d = _mm256_set1_ps(f16_at(b, 0));
        let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
        for h in 0..2 {
            let q = u8x8(b.add(6 + 8 * h));
            let e = 8 * h as i32;
            let lo = _mm256_or_si256(and(q, 0xF), high_bits(qh, e));
            let hi = _mm256_or_si256(shr(q, 4), high_bits(qh, e + 16));
            put_mul(y.add(8 * h), sub(lo, 16), d);
            put_mul(y.add(16 + 8 * h), sub(hi, 16), d);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q5_1(b: *const u8, y: *mut f32) {
    unsafe {
        let d = _mm256_set1_ps(f16_at(b, 0));
        let m = _mm256_set1_ps(f16_at(b, 2));
        let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
        for h in 0..2 {
            let q = u8x8(b.add(8 + 8 * h));
            let e = 8 * h as i32;
            let lo = _mm256_or_si256(and(q, 0xF), high_bits(qh, e));
            let hi = _mm256_or_si256(shr(q, 4), high_bits(qh, e + 16));
            put_mul_add(y.add(8 * h), lo, d, m);
            put_mul_add(y.add(16 + 8 * h), hi, d, m);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q8_0(b: *const u8, y: *mut f32) {
    unsafe {
        let d = _mm256_set1_ps(f16_at(b, 0));
        for g in 0..4 {
            let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(2 + 8 * g) as *const __m128i));
            put_mul(y.add(8 * g), q, d);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn iq4_nl(b: *const u8, y: *mut f32) {
    unsafe {
        let d = _mm256_set1_ps(f16_at(b, 0));
        let table = _mm_loadu_si128(IQ4_NL_VALUES.as_ptr() as *const __m128i);
        let q = _mm_loadu_si128(b.add(2) as *const __m128i);
        let low = _mm_set1_epi8(0xF);
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(q), low));
        for (half, v) in [lo, hi].into_iter().enumerate() {
            // d * value, as the reference writes it (a product commutes exactly).
            put_mul(y.add(16 * half), _mm256_cvtepi8_epi32(v), d);
            put_mul(
                y.add(16 * half + 8),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)),
                d,
            );
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q2_k(b: *const u8, y: *mut f32) {
    unsafe {
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        for e0 in (0..256usize).step_by(8) {
            let s = *b.add(e0 / 16);
            let dl = _mm256_set1_ps(d * (s & 0xF) as f32);
            let ml = _mm256_set1_ps(dmin * (s >> 4) as f32);
            let q = u8x8(b.add(16 + (e0 / 128) * 32 + e0 % 32));
            let q = and(shr(q, 2 * ((e0 / 32) % 4) as u32), 3);
            put_mul_sub(y.add(e0), q, dl, ml);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q3_k(b: *const u8, y: *mut f32) {
    unsafe {
        let d = f16_at(b, 108);
        let scales = std::slice::from_raw_parts(b.add(96), 12);
        for e0 in (0..256usize).step_by(8) {
            let dl = _mm256_set1_ps(d * q3_k_scale(scales, e0 / 16) as f32);
            let lo = u8x8(b.add(32 + (e0 / 128) * 32 + e0 % 32));
            let lo = and(shr(lo, 2 * ((e0 / 32) % 4) as u32), 3);
            let h = and(shr(u8x8(b.add(e0 % 32)), (e0 / 32) as u32), 1);
            // lo - 4 where the high bit is clear: lo - 4 + 4·h.
            let q = _mm256_add_epi32(sub(lo, 4), _mm256_slli_epi32::<2>(h));
            put_mul(y.add(e0), q, dl);
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q4_k(b: *const u8, y: *mut f32) {
    unsafe {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = std::slice::from_raw_parts(b.add(4), 12);
        for c in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * c, scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
            let (d1, m1) = (
                _mm256_set1_ps(d * sc1 as f32),
                _mm256_set1_ps(dmin * m1 as f32),
            );
            let (d2, m2) = (
                _mm256_set1_ps(d * sc2 as f32),
                _mm256_set1_ps(dmin * m2 as f32),
            );
            for g in 0..4 {
                let q = u8x8(b.add(16 + 32 * c + 8 * g));
                put_mul_sub(y.add(64 * c + 8 * g), and(q, 0xF), d1, m1);
                put_mul_sub(y.add(64 * c + 32 + 8 * g), shr(q, 4), d2, m2);
            }
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q5_k(b: *const u8, y: *mut f32) {
    unsafe {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = std::slice::from_raw_parts(b.add(4), 12);
        for c in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * c, scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
            let (d1, m1) = (
                _mm256_set1_ps(d * sc1 as f32),
                _mm256_set1_ps(dmin * m1 as f32),
            );
            let (d2, m2) = (
                _mm256_set1_ps(d * sc2 as f32),
                _mm256_set1_ps(dmin * m2 as f32),
            );
            for g in 0..4 {
                let qh = u8x8(b.add(16 + 8 * g));
                let q = u8x8(b.add(48 + 32 * c + 8 * g));
                let h1 = _mm256_slli_epi32::<4>(and(shr(qh, 2 * c as u32), 1));
                let h2 = _mm256_slli_epi32::<4>(and(shr(qh, 2 * c as u32 + 1), 1));
                put_mul_sub(
                    y.add(64 * c + 8 * g),
                    _mm256_add_epi32(and(q, 0xF), h1),
                    d1,
                    m1,
                );
                put_mul_sub(
                    y.add(64 * c + 32 + 8 * g),
                    _mm256_add_epi32(shr(q, 4), h2),
                    d2,
                    m2,
                );
            }
        }
    }
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn q6_k(b: *const u8, y: *mut f32) {
    unsafe {
        let d = f16_at(b, 208);
        for half in 0..2 {
            let ql = b.add(64 * half);
            let qh = b.add(128 + 32 * half);
            let sc = b.add(192 + 8 * half);
            let y = y.add(128 * half);
            for l0 in (0..32usize).step_by(8) {
                let is = l0 / 16;
                let a = u8x8(ql.add(l0));
                let c = u8x8(ql.add(32 + l0));
                let h = u8x8(qh.add(l0));
                let parts = [
                    _mm256_or_si256(and(a, 0xF), _mm256_slli_epi32::<4>(and(h, 3))),
                    _mm256_or_si256(and(c, 0xF), _mm256_slli_epi32::<4>(and(shr(h, 2), 3))),
                    _mm256_or_si256(shr(a, 4), _mm256_slli_epi32::<4>(and(shr(h, 4), 3))),
                    _mm256_or_si256(shr(c, 4), _mm256_slli_epi32::<4>(and(shr(h, 6), 3))),
                ];
                for (t, q) in parts.into_iter().enumerate() {
                    let s = *sc.add(is + 2 * t) as i8;
                    // (d · scale) · q, as the reference associates it.
                    let ds = _mm256_set1_ps(d * s as f32);
                    _mm256_storeu_ps(
                        y.add(32 * t + l0),
                        _mm256_mul_ps(ds, _mm256_cvtepi32_ps(sub(q, 32))),
                    );
                }
            }
        }
    }
}
