//! Random well-formed blocks, for tests and benchmarks of the kernels that
//! read them: random bytes, with every f16 scale set to a modest finite
//! value (a random f16 would often be huge, infinite or NaN, which real
//! files never hold).

use half::{bf16, f16};

use crate::QuantFormat;

/// Byte offsets of the f16 scales in a block of `format`.
fn f16_fields(format: QuantFormat) -> &'static [usize] {
    use QuantFormat::*;
    match format {
        F16 | BF16 | MXFP4 | FP8 => &[],
        Q4_0 | Q5_0 | Q8_0 | IQ4NL | Q4Z | Q4Z32 => &[0],
        Q4_1 | Q5_1 | Q4K | Q5K => &[0, 2],
        Q2K => &[80, 82],
        Q3K => &[108],
        Q6K => &[208],
    }
}

/// A small xorshift generator (the tests need reproducible bytes, not
/// quality randomness).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// `n_blocks` random blocks of `format`, the same for the same `seed`.
/// Scales are in ±[1e-4, 0.05) (one in eight negative, as some files
/// have); F16 / BF16 elements are normal(ish) values in ±4.
pub fn random_blocks(format: QuantFormat, n_blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let ts = format.block_bytes();
    let mut out = vec![0u8; n_blocks * ts];
    for block in out.chunks_exact_mut(ts) {
        match format {
            QuantFormat::F16 => {
                block.copy_from_slice(&f16::from_f32(rng.uniform(-4.0, 4.0)).to_le_bytes())
            }
            QuantFormat::BF16 => {
                block.copy_from_slice(&bf16::from_f32(rng.uniform(-4.0, 4.0)).to_le_bytes())
            }
            _ => {
                for b in block.iter_mut() {
                    *b = rng.next() as u8;
                }
                if matches!(format, QuantFormat::Q4Z | QuantFormat::Q4Z32) {
                    // A zero point of 0..31 and the byte after it zero.
                    block[2] &= 0x1F;
                    block[3] = 0;
                }
                if format == QuantFormat::FP8 {
                    // An f32 scale in ±[1e-4, 0.05) / 448 (a real block's
                    // largest weight over E4M3's), no NaN codes.
                    let mut v = rng.uniform(1e-4, 0.05) / 448.0;
                    if rng.next() % 8 == 0 {
                        v = -v;
                    }
                    block[..4].copy_from_slice(&v.to_le_bytes());
                    for q in &mut block[4..] {
                        if *q & 0x7F == 0x7F {
                            *q &= 0xFE;
                        }
                    }
                }
                if format == QuantFormat::MXFP4 {
                    // An e8m0 scale of 2^-11 .. 2^-3 (real weights' range).
                    block[0] = 116 + (rng.next() % 9) as u8;
                }
                for &off in f16_fields(format) {
                    let mut v = rng.uniform(1e-4, 0.05);
                    if rng.next() % 8 == 0 {
                        v = -v;
                    }
                    block[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
    out
}
