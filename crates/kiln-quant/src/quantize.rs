//! Quantizers: f32 values into blocks of a format, the inverse of
//! [`crate::dequant`] up to each format's rounding.
//!
//! Each block is fitted on its own (so a row's blocks, and a matrix's rows,
//! quantize the same alone or together) by least squares:
//! - `Q8_0`: one scale per 32, the block's largest magnitude at ±127.
//! - `Q6_K`: a signed scale per 16 values (values in −32..=31), chosen among
//!   a few candidates around "the largest magnitude at −32" by the squared
//!   error after rounding; the 16 scales are stored as i8 under one f16.
//! - `Q4_K` / `Q5_K`: a scale and a min per 32 values (`x ≈ s·q − m`, `q` in
//!   0..=15 or 0..=31, `m ≥ 0`), fitted the same way (for each candidate
//!   rounding, the least-squares `s` and `m`); the 8 scales and 8 mins are
//!   stored as 6-bit integers under two f16s.
//!
//! - `FP8`: an f32 scale per 128 values, the block's largest magnitude at
//!   E4M3's 448, each value rounded to the nearest E4M3 (ties to even).
//!
//! After the sub-block scales are rounded to their stored integers, every
//! value is rounded again against the scale it will actually be read with,
//! so the error is each format's rounding of the stored scale, not of the
//! fitted one. Unweighted squared error is what the fits minimise (llama.cpp
//! weights by magnitude and, with an importance matrix, by activations; the
//! formats are the same, the choice of values differs).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::QuantFormat;

/// The formats [`quantize`] writes.
pub const QUANTIZE_FORMATS: [QuantFormat; 8] = [
    QuantFormat::F16,
    QuantFormat::BF16,
    QuantFormat::Q8_0,
    QuantFormat::Q4_0,
    QuantFormat::Q4K,
    QuantFormat::Q5K,
    QuantFormat::Q6K,
    QuantFormat::FP8,
];

/// A format [`quantize`] writes, by its GGML name (any case) or a generic
/// one: `int8` is Q8_0 and `int4` Q4_0 (symmetric, groups of 32 — what a
/// symmetric GPTQ or compressed-tensors int4 checkpoint also loads as).
pub fn parse_quantize_type(s: &str) -> Result<QuantFormat, String> {
    let names = || {
        QUANTIZE_FORMATS.map(|f| f.name().to_lowercase()).join(", ")
            + ", int8 (q8_0), int4 (q4_0), fp8_e4m3 (fp8)"
    };
    let name = match s.to_ascii_lowercase().as_str() {
        "int8" => "q8_0".to_string(),
        "int4" => "q4_0".to_string(),
        "fp8_e4m3" | "f8_e4m3" => "fp8".to_string(),
        other => other.to_string(),
    };
    QuantFormat::from_name(&name)
        .filter(|f| QUANTIZE_FORMATS.contains(f))
        .ok_or_else(|| format!("unknown quantization type {s:?} (one of {})", names()))
}

/// Quantize `values` (a whole number of blocks of `format`) into blocks.
/// Errors name a format [`quantize`] does not write, a length that is not
/// whole blocks, a value that is not finite, or a block whose scale does
/// not fit the format's f16 (magnitudes beyond about 10^6–10^9, which no
/// trained weight has).
pub fn quantize(format: QuantFormat, values: &[f32]) -> Result<Vec<u8>, String> {
    if !QUANTIZE_FORMATS.contains(&format) {
        return Err(format!(
            "quantizing to {format} is not supported (supported: {})",
            QUANTIZE_FORMATS.map(|f| f.name()).join(", ")
        ));
    }
    let bs = format.block_size();
    if !values.len().is_multiple_of(bs) {
        return Err(format!(
            "{} values are not a whole number of {format} blocks of {bs}",
            values.len()
        ));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!("value {} at element {i} is not finite", values[i]));
    }
    let ts = format.block_bytes();
    let mut out = vec![0u8; values.len() / bs * ts];
    let per_chunk = (16384 / bs).max(1);
    out.par_chunks_mut(ts * per_chunk)
        .zip(values.par_chunks(bs * per_chunk))
        .enumerate()
        .try_for_each(|(c, (o, x))| {
            for (b, (ob, xb)) in o.chunks_exact_mut(ts).zip(x.chunks_exact(bs)).enumerate() {
                let ok = match format {
                    QuantFormat::F16 => put_f16(ob, 0, xb[0]),
                    QuantFormat::BF16 => {
                        ob.copy_from_slice(&bf16::from_f32(xb[0]).to_le_bytes());
                        true
                    }
                    QuantFormat::Q8_0 => block_q8_0(xb, ob),
                    QuantFormat::Q4_0 => block_q4_0(xb, ob),
                    QuantFormat::Q4K => block_k_min(xb, ob, 15),
                    QuantFormat::Q5K => block_k_min(xb, ob, 31),
                    QuantFormat::Q6K => block_q6_k(xb, ob),
                    QuantFormat::FP8 => block_fp8(xb, ob),
                    _ => unreachable!("checked above"),
                };
                if !ok {
                    let block = c * per_chunk + b;
                    let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                    return Err(format!(
                        "block {block} (largest magnitude {amax:e}) does not fit {format}'s f16 scale"
                    ));
                }
            }
            Ok(())
        })?;
    Ok(out)
}

/// The E4M3 byte nearest `v` (ties to even), saturating at ±448; `v` finite.
pub fn f32_to_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    // Below the smallest normal (2^-6): multiples of 2^-9 (code = the multiple;
    // 8 rounds up to the smallest normal, whose code is 8 too).
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let e = ((a.to_bits() >> 23) as i32 - 127).min(8);
    // a = m · 2^(e - 3) with m in [8, 16): scaling by a power of two is exact.
    let m = (a * f32::from_bits(((127 + 3 - e) as u32) << 23)).round_ties_even() as u32;
    let (e, m) = if m == 16 { (e + 1, 8) } else { (e, m) };
    if e > 8 || (e == 8 && m > 14) {
        return sign | 0x7E; // 448
    }
    sign | (((e + 7) as u8) << 3) | (m - 8) as u8
}

fn block_fp8(x: &[f32], out: &mut [u8]) -> bool {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let s = amax / 448.0;
    out[..4].copy_from_slice(&s.to_le_bytes());
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    for (q, &v) in out[4..].iter_mut().zip(x) {
        *q = f32_to_e4m3(v * inv);
    }
    s.is_finite()
}

/// Write `v` as f16 at `at`; false when it overflows.
fn put_f16(b: &mut [u8], at: usize, v: f32) -> bool {
    let h = f16::from_f32(v);
    b[at..at + 2].copy_from_slice(&h.to_le_bytes());
    h.is_finite()
}

/// `v` rounded to f16 and back (the value a stored scale is read as).
fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

fn block_q8_0(x: &[f32], b: &mut [u8]) -> bool {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = f16_round(amax / 127.0);
    if !put_f16(b, 0, amax / 127.0) {
        return false;
    }
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in b[2..34].iter_mut().zip(x) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8 as u8;
    }
    true
}

/// Q4_0: symmetric 4-bit, `x ≈ d·(q − 8)`. As GGML does, the element of
/// largest magnitude sets `d = x_max / −8`, so it is exact (code 0) up to
/// the f16 rounding of `d`; the others round to the nearest step, those of
/// the opposite sign beyond 7.5 steps clamp to code 15.
fn block_q4_0(x: &[f32], b: &mut [u8]) -> bool {
    let max = x
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    if !put_f16(b, 0, max / -8.0) {
        return false;
    }
    let d = f16_round(max / -8.0);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let code = |v: f32| ((v * id).round() + 8.0).clamp(0.0, 15.0) as u8;
    for j in 0..16 {
        b[2 + j] = code(x[j]) | (code(x[j + 16]) << 4);
    }
    true
}

/// Relative steps tried around a sub-block's first-guess scale.
const SEARCH: std::ops::RangeInclusive<i32> = -9..=9;

/// The signed scale `s` for `x ≈ s·q`, `q` in `-half..=half-1`, minimising
/// the squared error after rounding.
fn fit_symmetric(x: &[f32], half: i32) -> f32 {
    let (mut xmax, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            xmax = v;
        }
    }
    if amax == 0.0 {
        return 0.0;
    }
    let (lo, hi) = (-half as f32, (half - 1) as f32);
    let mut best = (f32::NEG_INFINITY, 0f32);
    for step in SEARCH {
        // The extreme value lands on −half (the longer side of the range).
        let iscale = -(half as f32 + 0.1 * step as f32) / xmax;
        let (mut xq, mut qq) = (0f64, 0f64);
        for &v in x {
            let q = (iscale * v).round().clamp(lo, hi) as f64;
            xq += v as f64 * q;
            qq += q * q;
        }
        // With the least-squares scale xq/qq the error is Σx² − xq²/qq.
        if qq > 0.0 && xq * xq / qq > best.0 as f64 {
            best = ((xq * xq / qq) as f32, (xq / qq) as f32);
        }
    }
    best.1
}

/// The scale `s ≥ 0` and min `m ≥ 0` for `x ≈ s·q − m`, `q` in `0..=nmax`,
/// minimising the squared error after rounding.
fn fit_min(x: &[f32], nmax: i32) -> (f32, f32) {
    let lo = x.iter().fold(0f32, |a, &v| a.min(v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    if hi <= lo {
        return (0.0, -lo);
    }
    let n = x.len() as f64;
    let (sx, sxx) = x.iter().fold((0f64, 0f64), |(a, b), &v| {
        (a + v as f64, b + v as f64 * v as f64)
    });
    // Σ(s·q + b − x)² from the sums (one pass per candidate).
    let sse = |s: f64, b: f64, sq: f64, sqq: f64, sxq: f64| {
        sxx + s * s * sqq + n * b * b + 2.0 * s * b * sq - 2.0 * s * sxq - 2.0 * b * sx
    };
    let mut best = (f64::INFINITY, (hi - lo) as f64 / nmax as f64, lo as f64);
    // The first pass is the plain min/max rounding, kept as it stands
    // unless a refit beats it.
    for (pass, step) in std::iter::once(0).chain(SEARCH).enumerate() {
        let iscale = (nmax as f64 + 0.1 * step as f64) / (hi - lo) as f64;
        let (sq, sqq, sxq) = candidate_sums(x, lo, iscale as f32, nmax);
        if pass == 0 {
            let (s0, b0) = (1.0 / iscale, lo as f64);
            best = (sse(s0, b0, sq, sqq, sxq), s0, b0);
        }
        // Least squares for x ≈ s·q + b, then b ≤ 0 (the min is subtracted).
        let det = n * sqq - sq * sq;
        if det <= 0.0 {
            continue;
        }
        let mut s = (n * sxq - sq * sx) / det;
        let mut b = (sqq * sx - sq * sxq) / det;
        if b > 0.0 {
            b = 0.0;
            s = sxq / sqq;
        }
        if s <= 0.0 {
            continue;
        }
        let e = sse(s, b, sq, sqq, sxq);
        if e < best.0 {
            best = (e, s, b);
        }
    }
    (best.1 as f32, (-best.2) as f32)
}

/// For `q = round(iscale · (x − lo))` clamped to `0..=nmax`: Σq, Σq², Σx·q.
/// In f32 over eight lanes (the q sums are small integers, exact), with
/// rounding by truncating `y + 0.5` (`y ≥ 0`), so the loop vectorizes.
fn candidate_sums(x: &[f32], lo: f32, iscale: f32, nmax: i32) -> (f64, f64, f64) {
    let q_of = |v: f32| ((iscale * (v - lo) + 0.5) as i32).min(nmax) as f32;
    let mut acc = [[0f32; 8]; 3];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            let q = q_of(c[i]);
            acc[0][i] += q;
            acc[1][i] += q * q;
            acc[2][i] += c[i] * q;
        }
    }
    for &v in rest {
        let q = q_of(v);
        acc[0][0] += q;
        acc[1][0] += q * q;
        acc[2][0] += v * q;
    }
    let sum = |a: &[f32; 8]| a.iter().map(|&v| v as f64).sum::<f64>();
    (sum(&acc[0]), sum(&acc[1]), sum(&acc[2]))
}

/// The 6-bit `(scale, min)` pairs of a K-quant's 8 sub-blocks into its
/// 12 scale bytes (the inverse of [`crate::dequant::scale_min_k4`]).
fn pack_scale_min_k4(sc: &[u8; 8], mn: &[u8; 8], q: &mut [u8]) {
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
}

/// Q4_K (`nmax` 15) or Q5_K (`nmax` 31): 8 sub-blocks of 32.
fn block_k_min(x: &[f32], b: &mut [u8], nmax: i32) -> bool {
    let mut fits = [(0f32, 0f32); 8];
    for (f, sub) in fits.iter_mut().zip(x.chunks_exact(32)) {
        *f = fit_min(sub, nmax);
    }
    let smax = fits.iter().fold(0f32, |a, f| a.max(f.0));
    let mmax = fits.iter().fold(0f32, |a, f| a.max(f.1));
    if !put_f16(b, 0, smax / 63.0) || !put_f16(b, 2, mmax / 63.0) {
        return false;
    }
    let d = f16_round(smax / 63.0);
    let dmin = f16_round(mmax / 63.0);
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        if d > 0.0 {
            sc[j] = (fits[j].0 / d).round().clamp(0.0, 63.0) as u8;
        }
        if dmin > 0.0 {
            mn[j] = (fits[j].1 / dmin).round().clamp(0.0, 63.0) as u8;
        }
    }
    pack_scale_min_k4(&sc, &mn, &mut b[4..16]);
    let mut q = [0u8; 256];
    for j in 0..8 {
        let s = d * sc[j] as f32;
        let m = dmin * mn[j] as f32;
        let is = if s > 0.0 { 1.0 / s } else { 0.0 };
        for (qv, &v) in q[j * 32..j * 32 + 32].iter_mut().zip(&x[j * 32..]) {
            *qv = (((v + m) * is + 0.5) as i32).clamp(0, nmax) as u8;
        }
    }
    // Element c·64 + l in the low nibble of byte c·32 + l, c·64 + 32 + l in
    // its high nibble; Q5_K's fifth bits in qh (bit 2c and 2c + 1 of byte l).
    let qs_at = if nmax == 15 { 16 } else { 48 };
    if nmax == 31 {
        b[16..48].fill(0);
    }
    for c in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (q[c * 64 + l], q[c * 64 + 32 + l]);
            b[qs_at + c * 32 + l] = (lo & 0xF) | ((hi & 0xF) << 4);
            if nmax == 31 {
                b[16 + l] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1));
            }
        }
    }
    true
}

/// Q6_K: 16 sub-blocks of 16, i8 scales under one f16, values −32..=31.
fn block_q6_k(x: &[f32], b: &mut [u8]) -> bool {
    let mut scales = [0f32; 16];
    for (s, sub) in scales.iter_mut().zip(x.chunks_exact(16)) {
        *s = fit_symmetric(sub, 32);
    }
    let amax = scales.iter().fold(0f32, |a, s| a.max(s.abs()));
    if !put_f16(b, 208, amax / 127.0) {
        return false;
    }
    let d = f16_round(amax / 127.0);
    let mut sc = [0i8; 16];
    if d > 0.0 {
        for (o, s) in sc.iter_mut().zip(scales) {
            *o = (s / d).round().clamp(-128.0, 127.0) as i8;
        }
    }
    let mut q = [0u8; 256];
    for (j, &scj) in sc.iter().enumerate() {
        let s = d * scj as f32;
        let is = if s != 0.0 { 1.0 / s } else { 0.0 };
        for (qv, &v) in q[j * 16..j * 16 + 16].iter_mut().zip(&x[j * 16..]) {
            *qv = ((v * is).round().clamp(-32.0, 31.0) + 32.0) as u8;
        }
    }
    let (ql, rest) = b.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    for (o, s) in rest[..16].iter_mut().zip(sc) {
        *o = s as u8;
    }
    // Per half of 128: element l, l+32, l+64, l+96 share ql[l], ql[l+32]
    // (low, low, high, high nibbles) and qh[l] (2 bits each).
    for h in 0..2 {
        let q = &q[h * 128..];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (q[l], q[l + 32], q[l + 64], q[l + 96]);
            ql[h * 64 + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[h * 64 + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[h * 32 + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequant::dequantize;

    /// Reproducible values: a normal-ish bulk with a few outliers, as trained
    /// weights have.
    fn weights(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        (0..n)
            .map(|i| {
                let u: f32 = (0..4).map(|_| next()).sum::<f32>() - 2.0;
                let v = 0.02 * u;
                if i % 97 == 5 {
                    v * 12.0
                } else {
                    v
                }
            })
            .collect()
    }

    fn rel_rmse(x: &[f32], y: &[f32]) -> f64 {
        let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let r: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
        (e / r).sqrt()
    }

    /// Each format's error on trained-weight-like values (a normal bulk, an
    /// outlier 12× the spread in one block of three) stays inside its bound:
    /// measured 2.2e-4 / 1.7e-3 / 0.0102 / 0.0286 / 0.0473 / 0.0955 for F16 /
    /// BF16 / Q8_0 / Q6_K / Q5_K / Q4_K, bounds 1.2–2.3× that (Q4_0: 0.154,
    /// bound 1.1× — plain symmetric rounding, no mins, no search), and within 1 %
    /// for Q5_K / Q4_K, whose least-squares search this pins (a search that
    /// lost its refits measured 0.0482 / 0.0967); FP8 0.0176, bound 1.2×
    /// (three mantissa bits, so about 2^-4/√3 of each value, less where the
    /// scale of a block of 128 is set by an outlier). Q4_K's 0.095 is what 16
    /// levels over a 32-value range give a normal bulk: step/√12 ≈ 0.08σ,
    /// plus the outlier blocks.
    /// Every E4M3 code but the NaNs reads back to itself; values halfway
    /// between two codes go to the even one; beyond 448 saturates.
    #[test]
    fn e4m3_codes_round_trip_and_ties_go_to_even() {
        use crate::dequant::e4m3_to_f32;
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if b & 0x7F == 0x7F {
                assert!(v.is_nan());
                continue;
            }
            assert_eq!(f32_to_e4m3(v), b, "{b:#04x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        // 1 + 1/16 is halfway between 1 (0x38, even) and 1.125 (0x39).
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A); // between 0x39 and 0x3A: even
        assert_eq!(f32_to_e4m3(-1.5 / 512.0), 0x82); // subnormal tie: even
        assert_eq!(f32_to_e4m3(460.0), 0x7E);
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(-1e9), 0xFE);
        assert_eq!(f32_to_e4m3(1e-9), 0x00);
    }

    #[test]
    fn round_trip_error_within_format_bounds() {
        let x = weights(256 * 64, 1);
        for (format, bound) in [
            (QuantFormat::F16, 5e-4),
            (QuantFormat::BF16, 4e-3),
            (QuantFormat::Q8_0, 0.0125),
            (QuantFormat::Q4_0, 0.17),
            (QuantFormat::Q6K, 0.035),
            (QuantFormat::Q5K, 0.0478),
            (QuantFormat::Q4K, 0.0965),
            (QuantFormat::FP8, 0.021),
        ] {
            let q = quantize(format, &x).unwrap();
            assert_eq!(
                q.len(),
                x.len() / format.block_size() * format.block_bytes()
            );
            let y = dequantize(format, &q, x.len()).unwrap();
            let e = rel_rmse(&x, &y);
            assert!(e < bound, "{format}: relative rms error {e:.4} ≥ {bound}");
        }
    }

    /// More bits, less error: the K-quants order as their bits do, and the
    /// least-squares search beats plain min/max rounding.
    #[test]
    fn more_bits_less_error_and_search_helps() {
        let x = weights(256 * 32, 2);
        let err = |f| {
            rel_rmse(
                &x,
                &dequantize(f, &quantize(f, &x).unwrap(), x.len()).unwrap(),
            )
        };
        let (e4, e5, e6, e8) = (
            err(QuantFormat::Q4K),
            err(QuantFormat::Q5K),
            err(QuantFormat::Q6K),
            err(QuantFormat::Q8_0),
        );
        assert!(e8 < e6 && e6 < e5 && e5 < e4, "{e8} {e6} {e5} {e4}");
        // Plain rounding against min/max of each sub-block of 32, 4 bits.
        let mut plain = 0f64;
        for sub in x.chunks_exact(32) {
            let lo = sub.iter().fold(0f32, |a, &v| a.min(v));
            let hi = sub.iter().fold(f32::MIN, |a, &v| a.max(v));
            let s = (hi - lo) / 15.0;
            for &v in sub {
                let y = ((v - lo) / s).round().clamp(0.0, 15.0) * s + lo;
                plain += ((v - y) as f64).powi(2);
            }
        }
        let fitted: f64 = x
            .chunks_exact(32)
            .map(|sub| {
                let (s, m) = fit_min(sub, 15);
                sub.iter()
                    .map(|&v| {
                        let y = ((v + m) / s).round().clamp(0.0, 15.0) * s - m;
                        ((v - y) as f64).powi(2)
                    })
                    .sum::<f64>()
            })
            .sum();
        assert!(fitted < plain, "fitted {fitted} ≥ plain {plain}");
    }

    /// Q8_0 is plain rounding: every element within half a step of its
    /// value, the block's largest magnitude exact up to f16 rounding.
    #[test]
    fn q8_0_elementwise_bound() {
        let x = weights(32 * 50, 3);
        let q = quantize(QuantFormat::Q8_0, &x).unwrap();
        let y = dequantize(QuantFormat::Q8_0, &q, x.len()).unwrap();
        for (b, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let d = f16::from_le_bytes([q[b * 34], q[b * 34 + 1]]).to_f32();
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert!((d - amax / 127.0).abs() <= amax / 127.0 * 1e-3);
            for (a, c) in xs.iter().zip(ys) {
                assert!((a - c).abs() <= 0.5 * d * 1.01 + amax * 2e-3, "{a} {c} {d}");
            }
        }
    }

    /// Q4_0 rounds to the nearest of its 16 steps: every element within
    /// half a step, but those of the opposite sign to the block's extreme
    /// beyond 7.5 steps, which clamp to 7 steps; the extreme itself is
    /// exact up to the f16 rounding of its scale.
    #[test]
    fn q4_0_elementwise_bound() {
        let x = weights(32 * 50, 5);
        let q = quantize(QuantFormat::Q4_0, &x).unwrap();
        let y = dequantize(QuantFormat::Q4_0, &q, x.len()).unwrap();
        for (b, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let d = f16::from_le_bytes([q[b * 18], q[b * 18 + 1]]).to_f32();
            let max = xs
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            assert!(
                (d - max / -8.0).abs() <= (max / 8.0).abs() * 1e-3,
                "block {b}"
            );
            for (a, c) in xs.iter().zip(ys) {
                let clamped = a / d > 7.5;
                let bound = if clamped {
                    (a / d - 7.0).abs() * d.abs()
                } else {
                    0.5 * d.abs()
                };
                assert!(
                    (a - c).abs() <= bound * 1.01 + 1e-6,
                    "block {b}: {a} became {c} (d {d})"
                );
            }
            let i = xs.iter().position(|&v| v == max).unwrap();
            assert!(
                (ys[i] - max).abs() <= max.abs() * 1e-3,
                "block {b}: extreme {max} became {}",
                ys[i]
            );
        }
    }

    /// Zero, constant, one-sided and single-spike blocks quantize to finite
    /// values that keep their shape (zeros stay zero, a constant stays
    /// nearly constant).
    #[test]
    fn degenerate_blocks() {
        for format in QUANTIZE_FORMATS {
            let n = 256;
            for (what, x) in [
                ("zeros", vec![0f32; n]),
                ("constant", vec![0.37f32; n]),
                ("negative constant", vec![-0.37f32; n]),
                (
                    "spike",
                    (0..n).map(|i| if i == 77 { 3.0 } else { 0.0 }).collect(),
                ),
                (
                    "positive ramp",
                    (0..n).map(|i| i as f32 / n as f32).collect(),
                ),
            ] {
                let q = quantize(format, &x).unwrap();
                let y = dequantize(format, &q, n).unwrap();
                assert!(y.iter().all(|v| v.is_finite()), "{format} {what}");
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                    assert!(
                        (a - b).abs() <= 0.1 * amax + 1e-6,
                        "{format} {what}: element {i}: {a} became {b}"
                    );
                }
                if what == "zeros" {
                    assert!(y.iter().all(|&v| v == 0.0), "{format} zeros");
                }
            }
        }
    }

    /// A block quantizes the same alone or inside a longer run.
    #[test]
    fn blocks_are_independent() {
        let x = weights(256 * 8, 4);
        for format in QUANTIZE_FORMATS {
            let all = quantize(format, &x).unwrap();
            let bs = format.block_size().max(256);
            let ts = all.len() / (x.len() / bs);
            for (i, chunk) in x.chunks(bs).enumerate() {
                assert_eq!(
                    quantize(format, chunk).unwrap(),
                    all[i * ts..(i + 1) * ts],
                    "{format} block run {i}"
                );
            }
        }
    }

    #[test]
    fn quantize_types_by_ggml_or_generic_name() {
        assert_eq!(parse_quantize_type("Q4_K"), Ok(QuantFormat::Q4K));
        assert_eq!(parse_quantize_type("q4_0"), Ok(QuantFormat::Q4_0));
        assert_eq!(parse_quantize_type("int4"), Ok(QuantFormat::Q4_0));
        assert_eq!(parse_quantize_type("INT8"), Ok(QuantFormat::Q8_0));
        assert_eq!(parse_quantize_type("fp8"), Ok(QuantFormat::FP8));
        assert_eq!(parse_quantize_type("FP8_E4M3"), Ok(QuantFormat::FP8));
        // A format Kiln reads but does not write is refused by name.
        let e = parse_quantize_type("iq4_nl").unwrap_err();
        assert!(e.contains("\"iq4_nl\"") && e.contains("q4_k"), "{e}");
    }

    #[test]
    fn refusals_name_the_problem() {
        let e = quantize(QuantFormat::IQ4NL, &[0.0; 32]).unwrap_err();
        assert!(e.contains("IQ4_NL") && e.contains("Q4_K"), "{e}");
        let e = quantize(QuantFormat::Q4K, &[0.0; 100]).unwrap_err();
        assert!(e.contains("100") && e.contains("256"), "{e}");
        let mut x = vec![0.0f32; 32];
        x[9] = f32::NAN;
        let e = quantize(QuantFormat::Q8_0, &x).unwrap_err();
        assert!(e.contains("element 9"), "{e}");
        let x = vec![1e12f32; 32];
        let e = quantize(QuantFormat::Q8_0, &x).unwrap_err();
        assert!(e.contains("block 0") && e.contains("f16"), "{e}");
        let e = quantize(QuantFormat::F16, &[1e6]).unwrap_err();
        assert!(e.contains("F16"), "{e}");
    }
}
