//! Dequantization of GGML block formats to f32 (the reference formulas of the
//! GGML block layouts; checked against the `gguf` Python package's numpy
//! dequantizers in the tests).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::dtype::GgmlType;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantize `n` elements of type `ty` from `bytes`. The caller guarantees
/// `bytes` has exactly the size `ty` needs for `n` elements; the error string
/// names an unsupported type.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let mut out = vec![0f32; n];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Dequantize into `out`, whose length gives the element count.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), String> {
    let bs = ty.block_size() as usize;
    let ts = ty.type_size() as usize;
    if !out.len().is_multiple_of(bs) || bytes.len() != out.len() / bs * ts {
        return Err(format!(
            "{}: {} bytes do not hold {} elements",
            ty.name(),
            bytes.len(),
            out.len()
        ));
    }
    let block_fn: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => block_f32,
        GgmlType::F16 => block_f16,
        GgmlType::BF16 => block_bf16,
        GgmlType::Q4_0 => block_q4_0,
        GgmlType::Q4_1 => block_q4_1,
        GgmlType::Q5_0 => block_q5_0,
        GgmlType::Q5_1 => block_q5_1,
        GgmlType::Q8_0 => block_q8_0,
        GgmlType::Q4K => block_q4_k,
        GgmlType::Q5K => block_q5_k,
        GgmlType::Q6K => block_q6_k,
        other => return Err(other.name().to_string()),
    };
    // Work in chunks of many blocks so rayon's overhead stays small.
    let blocks_per_chunk = (16384 / bs).max(1);
    out.par_chunks_mut(bs * blocks_per_chunk)
        .zip(bytes.par_chunks(ts * blocks_per_chunk))
        .for_each(|(o, b)| {
            for (ob, bb) in o.chunks_exact_mut(bs).zip(b.chunks_exact(ts)) {
                block_fn(bb, ob);
            }
        });
    Ok(())
}

fn block_f32(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn block_f16(b: &[u8], y: &mut [f32]) {
    y[0] = f16_at(b, 0);
}

fn block_bf16(b: &[u8], y: &mut [f32]) {
    y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0xF) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn block_q5_0(b: &[u8], y: &mut [f32]) {
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

fn block_q5_1(b: &[u8], y: &mut [f32]) {
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

fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` in a K-quant's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn block_q4_k(b: &[u8], y: &mut [f32]) {
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

fn block_q5_k(b: &[u8], y: &mut [f32]) {
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

fn block_q6_k(b: &[u8], y: &mut [f32]) {
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
