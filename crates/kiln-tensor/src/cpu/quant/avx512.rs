//! AVX-512 products of up to four rows of `x` with block weights that
//! dequantize in registers: no f32 copy of the weights, not even of a panel.
//!
//! Each dot is the dense AVX-512 tile's dot bit for bit
//! ([`super::super::matmul`]): one 16-lane accumulator per output, fed by
//! fused multiply-adds in ascending `k`, 16 values at a time, summed at the
//! end by the same in-register reduction. The 16 weight values of each step
//! are the reference values of [`kiln_quant::dequant`] bit for bit: the
//! 4- and 5-bit formats look them up in a per-block (per-sub-block for
//! K-quants) table of all 16 or 32 values a block can hold, each entry
//! computed with the reference's f32 operations (`vpermps` /
//! `vpermt2ps` then only select entries); Q6_K and Q8_0 convert and scale
//! as the reference does. So a decode row computed here equals the same
//! row computed from a dequantized panel, alone or batched.

use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

use kiln_quant::dequant::{scale_min_k4, IQ4_NL_VALUES};
use kiln_quant::{QuantFormat, QuantMatrix};

/// `out[i * out_stride + j] = x[i] · w[j]` for the `n ≤ 4` rows of `x` and
/// the weight rows `j` in `rows`.
pub(crate) type FusedFn = unsafe fn(&[f32], usize, &QuantMatrix, Range<usize>, *mut f32, usize);

/// The most rows of `x` a fused product takes.
pub(crate) const MAX_ROWS: usize = 4;

pub(crate) fn detected() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("f16c")
    })
}

/// The fused product for `format`, where this CPU has AVX-512 and the
/// format has one.
pub(crate) fn fused_fn(format: QuantFormat) -> Option<FusedFn> {
    use QuantFormat::*;
    if !detected() {
        return None;
    }
    Some(match format {
        Q4_0 => product::<Q40>,
        Q4_1 => product::<Q41>,
        IQ4NL => product::<Iq4Nl>,
        Q5_0 => product::<Q50>,
        Q5_1 => product::<Q51>,
        Q8_0 => product::<Q80>,
        Q4K => product::<Q4k>,
        Q5K => product::<Q5k>,
        Q6K => product::<Q6k>,
        _ => return None,
    })
}

/// A block format's register dequantizer.
trait Blocks {
    /// Values a block holds.
    const VALUES: usize;
    /// Bytes a block takes.
    const BYTES: usize;
    /// A per-call constant (the quantized levels as f32, for tables).
    unsafe fn levels() -> [__m512; 2];
    /// Adds the block at `b` times `x[i][0..VALUES]` into `acc[i]`, 16
    /// values a step in ascending order.
    unsafe fn block<const RI: usize>(
        levels: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    );
}

/// `acc[i] += x[i][off..off + 16] * w`, fused, for every row.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn step<const RI: usize>(
    x: &[*const f32; RI],
    off: usize,
    w: __m512,
    acc: &mut [__m512; RI],
) {
    for i in 0..RI {
        // SAFETY: the caller's rows hold off..off + 16.
        acc[i] = _mm512_fmadd_ps(unsafe { _mm512_loadu_ps(x[i].add(off)) }, w, acc[i]);
    }
}

/// The f16 at byte `i` of a block (the conversion is exact, so the
/// hardware's equals the reference's).
#[target_feature(enable = "avx512f,f16c")]
#[inline]
unsafe fn f16_at(b: *const u8, i: usize) -> f32 {
    // SAFETY: the caller's block holds bytes i and i + 1.
    let h = unsafe { (b.add(i) as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Sixteen bytes at `p`, zero-extended to sixteen i32 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn u8x16(p: *const u8) -> __m512i {
    // SAFETY: the caller's block holds p..p + 16.
    unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)) }
}

#[target_feature(enable = "avx512f")]
#[inline]
fn ramp(start: f32) -> __m512 {
    let s = start;
    _mm512_setr_ps(
        s,
        s + 1.0,
        s + 2.0,
        s + 3.0,
        s + 4.0,
        s + 5.0,
        s + 6.0,
        s + 7.0,
        s + 8.0,
        s + 9.0,
        s + 10.0,
        s + 11.0,
        s + 12.0,
        s + 13.0,
        s + 14.0,
        s + 15.0,
    )
}

/// Low nibbles of 16 bytes looked up in `t` (only index bits 0..3 count).
#[target_feature(enable = "avx512f")]
#[inline]
fn lut16(q: __m512i, t: __m512) -> __m512 {
    _mm512_permutexvar_ps(q, t)
}

/// Every pointer of `xs` moved `by` values on.
#[inline(always)]
fn offset<const RI: usize>(xs: &[*const f32; RI], by: usize) -> [*const f32; RI] {
    let mut v = *xs;
    for p in v.iter_mut() {
        *p = p.wrapping_add(by);
    }
    v
}

/// The product over rows `rows` of `w`, four weight rows at a time.
///
/// # Safety
/// AVX-512 (F, BW, VL) detected; `x` holds `n * w.cols()` values, `n ≤ 4`;
/// `out` valid for writes at `i * out_stride + j` for `i < n`, `j` in
/// `rows`, and written by no one else meanwhile.
unsafe fn product<F: Blocks>(
    x: &[f32],
    n: usize,
    w: &QuantMatrix,
    rows: Range<usize>,
    out: *mut f32,
    out_stride: usize,
) {
    // SAFETY: passed through.
    unsafe {
        match n {
            1 => product_n::<F, 1>(x, w, rows, out, out_stride),
            2 => product_n::<F, 2>(x, w, rows, out, out_stride),
            3 => product_n::<F, 3>(x, w, rows, out, out_stride),
            4 => product_n::<F, 4>(x, w, rows, out, out_stride),
            _ => unreachable!("fused product of {n} rows; this is a bug"),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn product_n<F: Blocks, const RI: usize>(
    x: &[f32],
    w: &QuantMatrix,
    rows: Range<usize>,
    out: *mut f32,
    out_stride: usize,
) {
    let k = w.cols();
    let nb = k / F::VALUES;
    let row_bytes = nb * F::BYTES;
    let bytes = w.rows_bytes(rows.clone());
    let levels = unsafe { F::levels() };
    let mut xs = [x.as_ptr(); RI];
    for (i, p) in xs.iter_mut().enumerate() {
        *p = x[i * k..].as_ptr();
    }
    let mut j = rows.start;
    // SAFETY (all below): row r of the range starts at (r - rows.start) *
    // row_bytes of `bytes` and holds nb blocks; x rows hold k values; out
    // is the caller's.
    while j + 4 <= rows.end {
        let b0 = unsafe { bytes.as_ptr().add((j - rows.start) * row_bytes) };
        // Four named accumulator sets (not an array of them indexed in a
        // loop), so they stay in registers.
        let (mut a0, mut a1, mut a2, mut a3) = (
            [_mm512_setzero_ps(); RI],
            [_mm512_setzero_ps(); RI],
            [_mm512_setzero_ps(); RI],
            [_mm512_setzero_ps(); RI],
        );
        for blk in 0..nb {
            let xb = offset(&xs, blk * F::VALUES);
            let p = unsafe { b0.add(blk * F::BYTES) };
            unsafe {
                F::block(&levels, p, &xb, &mut a0);
                F::block(&levels, p.add(row_bytes), &xb, &mut a1);
                F::block(&levels, p.add(2 * row_bytes), &xb, &mut a2);
                F::block(&levels, p.add(3 * row_bytes), &xb, &mut a3);
            }
        }
        for (r, acc) in [a0, a1, a2, a3].iter().enumerate() {
            for (i, a) in acc.iter().enumerate() {
                unsafe { *out.add(i * out_stride + j + r) = _mm512_reduce_add_ps(*a) };
            }
        }
        j += 4;
    }
    while j < rows.end {
        let b0 = unsafe { bytes.as_ptr().add((j - rows.start) * row_bytes) };
        let mut acc = [_mm512_setzero_ps(); RI];
        for blk in 0..nb {
            let xb = offset(&xs, blk * F::VALUES);
            unsafe { F::block(&levels, b0.add(blk * F::BYTES), &xb, &mut acc) };
        }
        for (i, a) in acc.iter().enumerate() {
            unsafe { *out.add(i * out_stride + j) = _mm512_reduce_add_ps(*a) };
        }
        j += 1;
    }
}

// The formats. SAFETY (each `block`): `b` holds one whole block, every row
// of `x` its VALUES values; called only from `product_n`, whose features
// they share.

struct Q40;
impl Blocks for Q40 {
    const VALUES: usize = 32;
    const BYTES: usize = 18;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [ramp(-8.0), ramp(0.0)]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        l: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            // (q - 8) as f32 * d for q in 0..16.
            let t = _mm512_mul_ps(l[0], _mm512_set1_ps(f16_at(b, 0)));
            let q = u8x16(b.add(2));
            step(x, 0, lut16(q, t), acc);
            step(x, 16, lut16(_mm512_srli_epi32::<4>(q), t), acc);
        }
    }
}

struct Q41;
impl Blocks for Q41 {
    const VALUES: usize = 32;
    const BYTES: usize = 20;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [ramp(0.0), ramp(16.0)]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        l: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            // q as f32 * d + m, two roundings.
            let d = _mm512_set1_ps(f16_at(b, 0));
            let m = _mm512_set1_ps(f16_at(b, 2));
            let t = _mm512_add_ps(_mm512_mul_ps(l[0], d), m);
            let q = u8x16(b.add(4));
            step(x, 0, lut16(q, t), acc);
            step(x, 16, lut16(_mm512_srli_epi32::<4>(q), t), acc);
        }
    }
}

struct Iq4Nl;
impl Blocks for Iq4Nl {
    const VALUES: usize = 32;
    const BYTES: usize = 18;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        // SAFETY: the table has 16 entries.
        let v = unsafe { _mm_loadu_si128(IQ4_NL_VALUES.as_ptr() as *const __m128i) };
        [_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), ramp(0.0)]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        l: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            let t = _mm512_mul_ps(l[0], _mm512_set1_ps(f16_at(b, 0)));
            let q = u8x16(b.add(2));
            step(x, 0, lut16(q, t), acc);
            step(x, 16, lut16(_mm512_srli_epi32::<4>(q), t), acc);
        }
    }
}

/// 5-bit indices: the nibbles of `q` (low, or high when `high`) plus 16
/// where the matching bit of `qh` is set.
#[target_feature(enable = "avx512f")]
#[inline]
fn five_bit(q: __m512i, qh: u16, high: bool) -> __m512i {
    let nib = if high {
        _mm512_srli_epi32::<4>(q)
    } else {
        _mm512_and_si512(q, _mm512_set1_epi32(0xF))
    };
    _mm512_mask_or_epi32(nib, qh, nib, _mm512_set1_epi32(16))
}

/// A Q5_K sub-block's 16 values: 5-bit indices from the nibbles of `q`
/// and the bits of `qh` under `m`, looked up in the 32-entry table `t`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[inline]
fn five_lut(q: __m512i, qh: __m128i, m: __m128i, high: bool, t: [__m512; 2]) -> __m512 {
    _mm512_permutex2var_ps(t[0], five_bit(q, _mm_test_epi8_mask(qh, m), high), t[1])
}

struct Q50;
impl Blocks for Q50 {
    const VALUES: usize = 32;
    const BYTES: usize = 22;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [ramp(-16.0), ramp(0.0)]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        l: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            // (q - 16) as f32 * d for q in 0..32.
            let d = _mm512_set1_ps(f16_at(b, 0));
            let (t0, t1) = (_mm512_mul_ps(l[0], d), _mm512_mul_ps(l[1], d));
            let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
            let q = u8x16(b.add(6));
            let lo = five_bit(q, qh as u16, false);
            let hi = five_bit(q, (qh >> 16) as u16, true);
            step(x, 0, _mm512_permutex2var_ps(t0, lo, t1), acc);
            step(x, 16, _mm512_permutex2var_ps(t0, hi, t1), acc);
        }
    }
}

struct Q51;
impl Blocks for Q51 {
    const VALUES: usize = 32;
    const BYTES: usize = 24;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [ramp(0.0), ramp(16.0)]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        l: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            let d = _mm512_set1_ps(f16_at(b, 0));
            let m = _mm512_set1_ps(f16_at(b, 2));
            let t0 = _mm512_add_ps(_mm512_mul_ps(l[0], d), m);
            let t1 = _mm512_add_ps(_mm512_mul_ps(l[1], d), m);
            let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
            let q = u8x16(b.add(8));
            let lo = five_bit(q, qh as u16, false);
            let hi = five_bit(q, (qh >> 16) as u16, true);
            step(x, 0, _mm512_permutex2var_ps(t0, lo, t1), acc);
            step(x, 16, _mm512_permutex2var_ps(t0, hi, t1), acc);
        }
    }
}

struct Q80;
impl Blocks for Q80 {
    const VALUES: usize = 32;
    const BYTES: usize = 34;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [_mm512_setzero_ps(); 2]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        _: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            let d = _mm512_set1_ps(f16_at(b, 0));
            for h in 0..2 {
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(2 + 16 * h) as *const __m128i));
                step(x, 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d), acc);
            }
        }
    }
}

/// The tables of sub-blocks `2c` and `2c + 1` of a Q4_K/Q5_K block:
/// `(d · scale) · level - dmin · min` for the levels in `l` (two roundings
/// after the scalar products, as the reference).
#[target_feature(enable = "avx512f,f16c")]
#[inline]
unsafe fn k_tables(b: *const u8, c: usize, l: &[__m512; 2]) -> [[__m512; 2]; 2] {
    // SAFETY: the caller's block holds the header and its 12 scale bytes.
    let (d, dmin, scales) = unsafe {
        (
            f16_at(b, 0),
            f16_at(b, 2),
            std::slice::from_raw_parts(b.add(4), 12),
        )
    };
    let mut t = [[_mm512_setzero_ps(); 2]; 2];
    for (s, t) in t.iter_mut().enumerate() {
        let (sc, m) = scale_min_k4(2 * c + s, scales);
        let dl = _mm512_set1_ps(d * sc as f32);
        let ml = _mm512_set1_ps(dmin * m as f32);
        *t = [
            _mm512_sub_ps(_mm512_mul_ps(dl, l[0]), ml),
            _mm512_sub_ps(_mm512_mul_ps(dl, l[1]), ml),
        ];
    }
    t
}

struct Q4k;
impl Blocks for Q4k {
    const VALUES: usize = 256;
    const BYTES: usize = 144;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [ramp(0.0), ramp(16.0)]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        l: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            for c in 0..4 {
                let [t1, t2] = k_tables(b, c, l);
                let q0 = u8x16(b.add(16 + 32 * c));
                let q1 = u8x16(b.add(32 + 32 * c));
                step(x, 64 * c, lut16(q0, t1[0]), acc);
                step(x, 64 * c + 16, lut16(q1, t1[0]), acc);
                step(
                    x,
                    64 * c + 32,
                    lut16(_mm512_srli_epi32::<4>(q0), t2[0]),
                    acc,
                );
                step(
                    x,
                    64 * c + 48,
                    lut16(_mm512_srli_epi32::<4>(q1), t2[0]),
                    acc,
                );
            }
        }
    }
}

struct Q5k;
impl Blocks for Q5k {
    const VALUES: usize = 256;
    const BYTES: usize = 176;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [ramp(0.0), ramp(16.0)]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        l: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            let qh0 = _mm_loadu_si128(b.add(16) as *const __m128i);
            let qh1 = _mm_loadu_si128(b.add(32) as *const __m128i);
            for c in 0..4 {
                let [t1, t2] = k_tables(b, c, l);
                let q0 = u8x16(b.add(48 + 32 * c));
                let q1 = u8x16(b.add(64 + 32 * c));
                let (m1, m2) = (_mm_set1_epi8(1 << (2 * c)), _mm_set1_epi8(2 << (2 * c)));
                step(x, 64 * c, five_lut(q0, qh0, m1, false, t1), acc);
                step(x, 64 * c + 16, five_lut(q1, qh1, m1, false, t1), acc);
                step(x, 64 * c + 32, five_lut(q0, qh0, m2, true, t2), acc);
                step(x, 64 * c + 48, five_lut(q1, qh1, m2, true, t2), acc);
            }
        }
    }
}

struct Q6k;
impl Blocks for Q6k {
    const VALUES: usize = 256;
    const BYTES: usize = 210;
    #[target_feature(enable = "avx512f")]
    unsafe fn levels() -> [__m512; 2] {
        [_mm512_setzero_ps(); 2]
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn block<const RI: usize>(
        _: &[__m512; 2],
        b: *const u8,
        x: &[*const f32; RI],
        acc: &mut [__m512; RI],
    ) {
        unsafe {
            let d = f16_at(b, 208);
            let low = _mm512_set1_epi32(0xF);
            let two = _mm512_set1_epi32(3);
            let bias = _mm512_set1_epi32(32);
            for half in 0..2 {
                let ql = b.add(64 * half);
                let qh = b.add(128 + 32 * half);
                let sc = b.add(192 + 8 * half);
                // parts[t][is]: the 16 values at 128·half + 32·t + 16·is.
                let mut parts = [[_mm512_setzero_ps(); 2]; 4];
                for is in 0..2 {
                    let a = u8x16(ql.add(16 * is));
                    let c = u8x16(ql.add(32 + 16 * is));
                    let h = u8x16(qh.add(16 * is));
                    let q = [
                        _mm512_or_si512(
                            _mm512_and_si512(a, low),
                            _mm512_slli_epi32::<4>(_mm512_and_si512(h, two)),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(c, low),
                            _mm512_slli_epi32::<4>(_mm512_and_si512(
                                _mm512_srli_epi32::<2>(h),
                                two,
                            )),
                        ),
                        _mm512_or_si512(
                            _mm512_srli_epi32::<4>(a),
                            _mm512_slli_epi32::<4>(_mm512_and_si512(
                                _mm512_srli_epi32::<4>(h),
                                two,
                            )),
                        ),
                        _mm512_or_si512(
                            _mm512_srli_epi32::<4>(c),
                            _mm512_slli_epi32::<4>(_mm512_srli_epi32::<6>(h)),
                        ),
                    ];
                    for (t, q) in q.into_iter().enumerate() {
                        // (d · scale) · (q - 32), as the reference associates it.
                        let ds = _mm512_set1_ps(d * (*sc.add(is + 2 * t) as i8) as f32);
                        parts[t][is] =
                            _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, bias)));
                    }
                }
                for (t, p) in parts.iter().enumerate() {
                    step(x, 128 * half + 32 * t, p[0], acc);
                    step(x, 128 * half + 32 * t + 16, p[1], acc);
                }
            }
        }
    }
}
