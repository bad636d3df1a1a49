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

/// The vectorized converter of `format` (F16, BF16), where this CPU has AVX2.
pub(super) fn row_fn(format: QuantFormat) -> Option<RowFn> {
    use QuantFormat::*;
    if !detected() {
        return None;
    }
    Some(match format {
        F16 => row_f16,
        BF16 => row_bf16,
        _ => return None,
    })
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
