//! Reference dequantization: the f32 value of every element of every
//! format, in the formulas of GGML's block layouts. These are the
//! definition the fast kernels are checked against bit for bit (each is
//! written so that a vectorized version can do the same f32 operations in
//! the same order: a product, then at most one subtraction or addition),
//! and they are checked in turn against the `gguf` Python package's numpy
//! dequantizers (kiln-formats' `dequant_oracle` test).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::QuantFormat;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The reference dequantizer of one block of `format`: reads
/// `format.block_bytes()` bytes, writes `format.block_size()` values.
pub type BlockFn = fn(&[u8], &mut [f32]);

/// The reference dequantizer of one block.
pub fn block_fn(format: QuantFormat) -> BlockFn {
    use QuantFormat::*;
    match format {
        F16 => block_f16,
        BF16 => block_bf16,
        Q4_0 => block_q4_0,
        Q4_1 => block_q4_1,
        Q5_0 => block_q5_0,
        Q5_1 => block_q5_1,
        Q8_0 => block_q8_0,
        Q2K => block_q2_k,
        Q3K => block_q3_k,
        Q4K => block_q4_k,
        Q5K => block_q5_k,
        Q6K => block_q6_k,
        IQ4NL => block_iq4_nl,
        MXFP4 => block_mxfp4,
        Q4Z | Q4Z32 => block_q4_z,
        FP8 => block_fp8,
    }
}

/// Dequantize `bytes` (whole blocks of `format`) into `out`, whose length
/// gives the element count; an error names a size that does not fit.
pub fn dequantize_into(format: QuantFormat, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let bs = format.block_size();
    let ts = format.block_bytes();
    if !out.len().is_multiple_of(bs) || bytes.len() != out.len() / bs * ts {
        return Err(format!(
            "{format}: {} bytes do not hold {} elements",
            bytes.len(),
            out.len()
        ));
    }
    let f = block_fn(format);
    // Work in chunks of many blocks so rayon's overhead stays small.
    let blocks_per_chunk = (16384 / bs).max(1);
    out.par_chunks_mut(bs * blocks_per_chunk)
        .zip(bytes.par_chunks(ts * blocks_per_chunk))
        .for_each(|(o, b)| {
            for (ob, bb) in o.chunks_exact_mut(bs).zip(b.chunks_exact(ts)) {
                f(bb, ob);
            }
        });
    Ok(())
}

/// [`dequantize_into`] a new vector of `n` elements.
pub fn dequantize(format: QuantFormat, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let mut out = vec![0f32; n];
    dequantize_into(format, bytes, &mut out)?;
    Ok(out)
}

pub(crate) fn block_f16(b: &[u8], y: &mut [f32]) {
    y[0] = f16_at(b, 0);
}

pub(crate) fn block_bf16(b: &[u8], y: &mut [f32]) {
    y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

pub(crate) fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

pub(crate) fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0xF) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Q4_Z and Q4_Z32 (one run of 32 instead of four): `d · (q − z)`, as `d·q + (−d)·z` (both products exact in f32, so
/// one rounding, none in fact: the sum is exact too; `q = z` gives +0).
pub(crate) fn block_q4_z(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let off = -d * (b[2] & 0x1F) as f32;
    for (qs, y) in b[4..].chunks_exact(16).zip(y.chunks_exact_mut(32)) {
        for j in 0..16 {
            y[j] = (qs[j] & 0xF) as f32 * d + off;
            y[j + 16] = (qs[j] >> 4) as f32 * d + off;
        }
    }
}

/// The value of an FP8 E4M3 byte (`e4m3fn`: sign, 4 exponent bits of bias
/// 7, 3 mantissa bits; exponent 0 subnormal; `0x7F`/`0xFF` NaN; no
/// infinities).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let (e, m) = ((b >> 3) & 0xF, b & 7);
    let v = if b & 0x7F == 0x7F {
        f32::NAN
    } else if e == 0 {
        m as f32 * (1.0 / 512.0)
    } else {
        (8 + m) as f32 * f32::from_bits(((e as u32 + 127 - 10) << 23) as u32)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// Every E4M3 byte's value (the CPU reads FP8 rows through it).
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

pub(crate) fn block_fp8(b: &[u8], y: &mut [f32]) {
    let s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let t = e4m3_table();
    for (y, &q) in y.iter_mut().zip(&b[4..132]) {
        *y = t[q as usize] * s;
    }
}

pub(crate) fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((((qs[j] & 0xF) as u32) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = ((((qs[j] >> 4) as u32) | h1) as i32 - 16) as f32 * d;
    }
}

pub(crate) fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((qs[j] & 0xF) as u32) | h0) as f32 * d + m;
        y[j + 16] = (((qs[j] >> 4) as u32) | h1) as f32 * d + m;
    }
}

pub(crate) fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` in a K-quant's 12 packed bytes.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

pub(crate) fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        let is = chunk * 2;
        let (sc1, m1) = scale_min_k4(is, scales);
        let (sc2, m2) = scale_min_k4(is + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let y = &mut y[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

pub(crate) fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (chunk, ql) in qs.chunks_exact(32).enumerate() {
        let is = chunk * 2;
        let (sc1, m1) = scale_min_k4(is, scales);
        let (sc2, m2) = scale_min_k4(is + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let u1 = 1u8 << (2 * chunk);
        let u2 = 2u8 << (2 * chunk);
        let y = &mut y[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

pub(crate) fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let ql_all = &b[0..128];
    let qh_all = &b[128..192];
    let sc_all = &b[192..208];
    let d = f16_at(b, 208);
    for half_idx in 0..2 {
        let ql = &ql_all[half_idx * 64..];
        let qh = &qh_all[half_idx * 32..];
        let sc = &sc_all[half_idx * 8..];
        let y = &mut y[half_idx * 128..half_idx * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// The 16 values an IQ4_NL nibble selects (GGML's non-linear 4-bit grid).
pub const IQ4_NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

pub(crate) fn block_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * IQ4_NL_VALUES[(qs[j] & 0xF) as usize] as f32;
        y[j + 16] = d * IQ4_NL_VALUES[(qs[j] >> 4) as usize] as f32;
    }
}

/// The e2m1 values of MXFP4's 16 codes, doubled (so they are integers;
/// the scale is halved to match): sign in bit 3.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half an e8m0 scale, `2^(e - 128)`, exactly (subnormal for e < 2), as
/// GGML computes it.
pub fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// MXFP4: the e8m0 scale byte, then 16 bytes of codes (element `j` the low
/// nibble of byte `j`, element `j + 16` its high nibble).
pub(crate) fn block_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = d * MXFP4_VALUES[(qs[j] & 0xF) as usize] as f32;
        y[j + 16] = d * MXFP4_VALUES[(qs[j] >> 4) as usize] as f32;
    }
}

/// Q2_K: 16 sub-blocks of 16, each with a 4-bit scale and a 4-bit min
/// (`scales[16]`), 2-bit values (`qs[64]`: element `e` of each half of 128
/// is bits `2·(e/32 mod 4)` of byte `e mod 32`), then `d` and `dmin`.
pub(crate) fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for (e, out) in y.iter_mut().enumerate().take(256) {
        let sc = scales[e / 16];
        let dl = d * (sc & 0xF) as f32;
        let ml = dmin * (sc >> 4) as f32;
        let q = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 3;
        *out = dl * q as f32 - ml;
    }
}

/// The 6-bit signed scale of Q3_K sub-block `i` (of 16): low 4 bits from
/// `scales[i mod 8]` (its high nibble for `i ≥ 8`), high 2 bits from
/// `scales[8 + i mod 4]` at bit `2·(i/4)`, minus 32.
pub fn q3_k_scale(scales: &[u8], i: usize) -> i8 {
    let lo = if i < 8 {
        scales[i] & 0xF
    } else {
        scales[i - 8] >> 4
    };
    let hi = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    (lo | (hi << 4)) as i8 - 32
}

/// Q3_K: `hmask[32]` (bit `e/32` of byte `e mod 32` clear subtracts 4),
/// 2-bit values `qs[64]` laid out as Q2_K's, 16 packed 6-bit scales
/// (`scales[12]`), then `d`.
pub(crate) fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let scales = &b[96..108];
    let d = f16_at(b, 108);
    for (e, out) in y.iter_mut().enumerate().take(256) {
        let dl = d * q3_k_scale(scales, e / 16) as f32;
        let lo = (qs[(e / 128) * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 3;
        let high = (hmask[e % 32] >> (e / 32)) & 1;
        let q = lo as i32 - if high == 0 { 4 } else { 0 };
        *out = dl * q as f32;
    }
}
