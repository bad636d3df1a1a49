//! AVX2 row converters for the formats the CPU keeps as stored (F16 with
//! F16C, BF16): exact widenings, so every value is the reference value.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use half::{bf16, f16};
use kiln_quant::{QuantFormat, QuantMatrix};

use super::RowFn;

fn detected() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
}

/// The vectorized converter of `format` (F16, BF16, FP8), where this CPU has AVX2.
pub(super) fn row_fn(format: QuantFormat) -> Option<RowFn> {
    use QuantFormat::*;
    if !detected() {
        return None;
    }
    Some(match format {
        F16 => row_f16,
        BF16 => row_bf16,
        FP8 => row_fp8,
        _ => return None,
    })
}

/// FP8 blocks (an f32 scale, 128 E4M3 bytes): 8 codes at a time to f32 by
/// their bits (normals `(code & 0x7F) << 20` with the exponent rebased by
/// 120, subnormals `code · 2^-9`, 0x7F NaN, the sign bit above), times the
/// scale: the reference's one product, bit for bit.
fn row_fp8(m: &QuantMatrix, r: usize, out: &mut [f32]) {
    #[target_feature(enable = "avx2")]
    unsafe fn rows(bytes: &[u8], out: &mut [f32]) {
        let low7 = _mm256_set1_epi32(0x7F);
        let rebase = _mm256_set1_epi32(120 << 23);
        let eight = _mm256_set1_epi32(8);
        let step = _mm256_set1_ps(1.0 / 512.0);
        let nan = _mm256_set1_epi32(0x7FC0_0000);
        for (blk, o) in bytes.chunks_exact(132).zip(out.chunks_exact_mut(128)) {
            let s = _mm256_set1_ps(f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]));
            for j in (0..128).step_by(8) {
                // SAFETY: bytes 4 + j .. 4 + j + 8 of the block and elements j .. j + 8 of
                // its output are inside both.
                unsafe {
                    let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        blk.as_ptr().add(4 + j) as *const __m128i
                    ));
                    let r = _mm256_and_si256(b, low7);
                    let sign = _mm256_slli_epi32(_mm256_andnot_si256(low7, b), 24);
                    let normal = _mm256_add_epi32(_mm256_slli_epi32(r, 20), rebase);
                    let sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(r), step));
                    let v = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(eight, r));
                    let v = _mm256_blendv_epi8(v, nan, _mm256_cmpeq_epi32(r, low7));
                    let v = _mm256_castsi256_ps(_mm256_or_si256(v, sign));
                    _mm256_storeu_ps(o.as_mut_ptr().add(j), _mm256_mul_ps(v, s));
                }
            }
        }
    }
    // SAFETY: only selected where AVX2 was detected.
    unsafe { rows(m.rows_bytes(r..r + 1), out) }
}

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
