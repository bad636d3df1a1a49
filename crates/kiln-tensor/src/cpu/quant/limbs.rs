//! Activations as the packed products read them: each sub-block of a row
//! of `x` as exact integers split into three signed bytes.
//!
//! For a sub-block of `S` elements (the weight format's sub-block, 16 or
//! 32) with largest magnitude `amax`:
//!
//! ```text
//! e   = max(E − 22, −126), E = amax's binary exponent (⌊log₂ amax⌋);
//!       e + 1 instead where round(amax · 2^−e) would pass 8355711
//! X_i = round_half_even(x_i · 2^−e)                |X_i| ≤ 8355711 < 2²³
//! X_i = 65536·a_i + 256·b_i + c_i                  a, b, c ∈ [−128, 127]
//! ```
//!
//! (`c` is the balanced remainder of `X` by 256, `b` that of the
//! quotient, `a` what is left.) So the largest element keeps 23
//! significant bits and every element is within `2^(e−1)` of `x_i`; a
//! sub-block holding a NaN or an infinity gets a NaN scale, so the
//! outputs it reaches are NaN as an f32 product's would be. Every step is
//! exact integer or power-of-two arithmetic, so any implementation gives
//! the same limbs.
//!
//! Per sub-block the products also need `2^e`, the sum of the
//! represented values `f32(Σ X_i) · 2^e` (for the formats' mins), and the
//! limbs' sums `T = 256·Σa + Σb` and `C = Σc` (for the formats whose codes
//! carry a bias: `Σ (u − bias)·X = Σ u·X − bias·ΣX`).

use rayon::prelude::*;

/// The largest |X| three signed bytes hold: 127·(65536 + 256 + 1).
const X_MAX: f32 = 8_355_711.0;

/// Per sub-block of a row: what the products need besides the limbs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct SubInfo {
    /// `2^e`, or NaN where the sub-block is not finite.
    pub scale: f32,
    /// `f32(Σ X_i) · 2^e`.
    pub sum: f32,
    /// `256·Σ a_i + Σ b_i`.
    pub t: i32,
    /// `Σ c_i`.
    pub c: i32,
}

impl SubInfo {
    /// A finite sub-block's info from its exponent and the sums of its
    /// `a`, `b`, `c` and `X`.
    fn of(e: i32, [sa, sb, sc, sx]: [i32; 4]) -> SubInfo {
        let scale = pow2(e);
        SubInfo {
            scale,
            sum: sx as f32 * scale,
            t: 256 * sa + sb,
            c: sc,
        }
    }
}

/// Rows of `x` split into limbs for one sub-block size: per row, per
/// sub-block, the `S` bytes of `a`, then of `b`, then of `c`.
pub(crate) struct Limbs {
    pub sub: usize,
    pub subs: usize,
    bytes: Vec<i8>,
    info: Vec<SubInfo>,
}

impl Limbs {
    /// The `n` rows of `x` (`k` wide, a whole number of `sub`-element
    /// sub-blocks); in parallel only for batches (a decode step's few rows
    /// are split in place).
    pub fn new(x: &[f32], n: usize, k: usize, sub: usize) -> Limbs {
        let subs = k / sub;
        let mut l = Limbs {
            sub,
            subs,
            bytes: vec![0; n * 3 * k],
            info: vec![SubInfo::default(); n * subs],
        };
        let split = split_fn();
        let one = |x: &[f32], bytes: &mut [i8], info: &mut [SubInfo]| {
            for ((xs, bs), inf) in x
                .chunks_exact(sub)
                .zip(bytes.chunks_exact_mut(3 * sub))
                .zip(info.iter_mut())
            {
                *inf = split(xs, bs);
            }
        };
        if n <= 2 {
            for ((xr, br), ir) in x
                .chunks_exact(k)
                .zip(l.bytes.chunks_exact_mut(3 * k))
                .zip(l.info.chunks_exact_mut(subs))
            {
                one(xr, br, ir);
            }
        } else {
            let rows_per = (16384 / k).max(1);
            x[..n * k]
                .par_chunks(k * rows_per)
                .zip(l.bytes.par_chunks_mut(3 * k * rows_per))
                .zip(l.info.par_chunks_mut(subs * rows_per))
                .for_each(|((xr, br), ir)| {
                    for ((xr, br), ir) in xr
                        .chunks_exact(k)
                        .zip(br.chunks_exact_mut(3 * k))
                        .zip(ir.chunks_exact_mut(subs))
                    {
                        one(xr, br, ir);
                    }
                });
        }
        l
    }

    /// Sub-block `j` of row `t`.
    #[inline]
    pub fn info(&self, t: usize, j: usize) -> SubInfo {
        self.info[t * self.subs + j]
    }

    /// Row `t`'s sub-block infos.
    #[inline]
    pub fn infos(&self, t: usize) -> *const SubInfo {
        self.info.as_ptr().wrapping_add(t * self.subs)
    }

    /// Row `t`'s limb bytes (`3 · subs · sub` of them).
    #[inline]
    pub fn row(&self, t: usize) -> *const i8 {
        self.bytes
            .as_ptr()
            .wrapping_add(t * 3 * self.subs * self.sub)
    }

    /// The `a`, `b` and `c` bytes of sub-block `j` of row `t`.
    pub fn limbs(&self, t: usize, j: usize) -> (&[i8], &[i8], &[i8]) {
        let s = self.sub;
        let at = (t * self.subs + j) * 3 * s;
        let v = &self.bytes[at..at + 3 * s];
        (&v[..s], &v[s..2 * s], &v[2 * s..])
    }
}

/// The fastest splitter this CPU runs (each gives the same limbs).
fn split_fn() -> fn(&[f32], &mut [i8]) -> SubInfo {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the features were detected.
        return |x, out| unsafe { split_avx512(x, out) };
    }
    split
}

/// `2^e` as an f32 (`e` in −126..=127).
#[inline]
pub(crate) fn pow2(e: i32) -> f32 {
    f32::from_bits(((127 + e) as u32) << 23)
}

/// The exponent of the module docs for a sub-block whose largest
/// magnitude has the bits `amax_bits` (finite).
#[inline]
pub(crate) fn exponent(amax_bits: u32) -> i32 {
    let biased = (amax_bits >> 23) as i32;
    let e = (biased - 127 - 22).max(-126);
    let top = (f32::from_bits(amax_bits) * pow2(-e)).round_ties_even();
    if top > X_MAX {
        e + 1
    } else {
        e
    }
}

/// One sub-block `x` split into `out` (`a` bytes, `b` bytes, `c` bytes).
pub(crate) fn split(x: &[f32], out: &mut [i8]) -> SubInfo {
    let s = x.len();
    let amax_bits = x
        .iter()
        .map(|v| v.to_bits() & 0x7FFF_FFFF)
        .max()
        .unwrap_or(0);
    if amax_bits >= 0x7F80_0000 {
        out.fill(0);
        return SubInfo {
            scale: f32::NAN,
            sum: f32::NAN,
            t: 0,
            c: 0,
        };
    }
    let e = exponent(amax_bits);
    let inv = pow2(-e);
    let (mut sa, mut sb, mut sc, mut sx) = (0i32, 0i32, 0i32, 0i32);
    for (i, &v) in x.iter().enumerate() {
        let big = (v * inv).round_ties_even() as i32;
        let c = ((big + 128) & 255) - 128;
        let r = (big - c) >> 8;
        let b = ((r + 128) & 255) - 128;
        let a = (r - b) >> 8;
        out[i] = a as i8;
        out[s + i] = b as i8;
        out[2 * s + i] = c as i8;
        sa += a;
        sb += b;
        sc += c;
        sx += big;
    }
    SubInfo::of(e, [sa, sb, sc, sx])
}

/// [`split`] with AVX-512, for sub-blocks of 16 or 32.
///
/// # Safety
/// AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split_avx512(x: &[f32], out: &mut [i8]) -> SubInfo {
    use std::arch::x86_64::*;
    let s = x.len();
    if s != 16 && s != 32 {
        return split(x, out);
    }
    // SAFETY: x holds s = 16 or 32 floats and out 3·s bytes.
    unsafe {
        let p = x.as_ptr();
        let v = [
            _mm512_loadu_ps(p),
            if s == 32 {
                _mm512_loadu_ps(p.add(16))
            } else {
                _mm512_setzero_ps()
            },
        ];
        let abs = _mm512_set1_epi32(0x7FFF_FFFF);
        let bits = |v: __m512| _mm512_and_si512(_mm512_castps_si512(v), abs);
        let amax_bits = _mm512_reduce_max_epu32(_mm512_max_epu32(bits(v[0]), bits(v[1]))) as u32;
        if amax_bits >= 0x7F80_0000 {
            return split(x, out);
        }
        let e = exponent(amax_bits);
        let inv = _mm512_set1_ps(pow2(-e));
        let (c128, c255) = (_mm512_set1_epi32(128), _mm512_set1_epi32(255));
        let low =
            |v: __m512i| _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);
        let mut sums = [_mm512_setzero_si512(); 4];
        let o = out.as_mut_ptr();
        for (h, &v) in v.iter().enumerate().take(s / 16) {
            let big = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
            let c = low(big);
            let r = _mm512_srai_epi32(_mm512_sub_epi32(big, c), 8);
            let b = low(r);
            let a = _mm512_srai_epi32(_mm512_sub_epi32(r, b), 8);
            for (l, limb) in [a, b, c].into_iter().enumerate() {
                _mm_storeu_si128(
                    o.add(l * s + h * 16) as *mut __m128i,
                    _mm512_cvtepi32_epi8(limb),
                );
                sums[l] = _mm512_add_epi32(sums[l], limb);
            }
            sums[3] = _mm512_add_epi32(sums[3], big);
        }
        SubInfo::of(e, sums.map(|v| _mm512_reduce_add_epi32(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(a: &[i8], b: &[i8], c: &[i8], i: usize) -> i64 {
        65536 * a[i] as i64 + 256 * b[i] as i64 + c[i] as i64
    }

    #[test]
    fn limbs_represent_each_element_within_half_a_step() {
        let cases: Vec<Vec<f32>> = vec![
            (0..32).map(|i| (i as f32 - 15.5) * 0.37).collect(),
            (0..32)
                .map(|i| if i == 7 { 1e4 } else { 1e-3 * i as f32 })
                .collect(),
            // The largest element just under a power of two: the bump.
            (0..16)
                .map(|i| if i == 3 { -1.999_999_9 } else { 0.25 })
                .collect(),
            (0..16).map(|i| 1e-40 * i as f32).collect(),
            vec![0.0; 32],
            (0..16).map(|i| 3e38 - i as f32).collect(),
        ];
        for x in cases {
            let s = x.len();
            let mut out = vec![0i8; 3 * s];
            let info = split(&x, &mut out);
            let (a, b, c) = (&out[..s], &out[s..2 * s], &out[2 * s..]);
            let step = info.scale as f64;
            let mut sum = 0i64;
            for (i, &v) in x.iter().enumerate() {
                let big = join(a, b, c, i);
                assert!(big.abs() <= X_MAX as i64, "{x:?}: X = {big}");
                let err = (big as f64 * step - v as f64).abs();
                assert!(
                    err <= step / 2.0,
                    "{x:?}[{i}]: error {err} > {}",
                    step / 2.0
                );
                sum += big;
            }
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            if amax >= 2f32.powi(-100) {
                // 23 bits for the largest element: a step of at most 2^-21 of it.
                assert!(step <= amax as f64 * 2f64.powi(-21), "{x:?}: step {step}");
            }
            let (sa, sb, sc) = (0..s).fold((0i32, 0i32, 0i32), |(p, q, r), i| {
                (p + a[i] as i32, q + b[i] as i32, r + c[i] as i32)
            });
            assert_eq!((info.t, info.c), (256 * sa + sb, sc));
            assert_eq!(info.sum, (sum as f32) * info.scale);
        }
    }

    #[test]
    fn every_splitter_gives_the_same_limbs() {
        let mut seed = 7u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for s in [16, 32] {
            for case in 0..200 {
                let x: Vec<f32> = (0..s)
                    .map(|i| {
                        let r = next();
                        let v = (r % 20001) as f32 / 1e4 - 1.0;
                        match case % 4 {
                            0 => v,
                            1 => v * 1e-20,
                            2 if i == 3 => -1.999_999_9,
                            3 if i == 0 => 8_355_711.0 / 4_194_304.0,
                            _ => v * 3.0,
                        }
                    })
                    .collect();
                let (mut a, mut b) = (vec![0i8; 3 * s], vec![0i8; 3 * s]);
                let (ia, ib) = (split(&x, &mut a), split_fn()(&x, &mut b));
                assert_eq!((ia, &a), (ib, &b), "{x:?}");
            }
        }
    }

    #[test]
    fn a_sub_block_that_is_not_finite_has_a_nan_scale() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![1.0f32; 16];
            x[5] = bad;
            for f in [split, split_fn()] {
                let mut out = vec![1i8; 48];
                let info = f(&x, &mut out);
                assert!(info.scale.is_nan() && info.sum.is_nan());
                assert!(out.iter().all(|&v| v == 0));
            }
        }
    }

    #[test]
    fn rows_split_alone_or_in_a_batch_alike() {
        let (n, k) = (5, 96);
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        for sub in [16, 32] {
            let all = Limbs::new(&x, n, k, sub);
            for t in 0..n {
                let one = Limbs::new(&x[t * k..(t + 1) * k], 1, k, sub);
                for j in 0..k / sub {
                    assert_eq!(one.info(0, j), all.info(t, j));
                    assert_eq!(one.limbs(0, j), all.limbs(t, j));
                }
            }
        }
    }
}
