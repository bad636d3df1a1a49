//! Rotary position embedding frequencies, including Llama 3 and linear scaling,
//! computed in f32 in the same order as Hugging Face transformers.

use kiln_tensor::{Backend, RopeParams, Tensor};

use crate::config::RopeScaling;
use crate::error::Result;

pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub attention_scaling: f32,
}

impl Rope {
    /// Frequencies `1 / theta^(2i / dim)` for `i < dim / 2`, then scaled.
    pub fn new(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Self {
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut attention_scaling = 1.0;
        match *scaling {
            RopeScaling::None => {}
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings: old_ctx,
                truncate,
                attention_factor,
                mscale,
                mscale_all_dim,
            } => {
                attention_scaling =
                    attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                        (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                            yarn_mscale(factor, m) / yarn_mscale(factor, a)
                        }
                        _ => yarn_mscale(factor, 1.0),
                    });
                // As transformers: the ramp's ends in f64, the blend in f32.
                let dim = head_dim as f64;
                let (base, ctx) = (theta as f64, old_ctx as f64);
                let corr = |rot: f64| {
                    dim * (ctx / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
                };
                let (mut low, mut high) = (corr(beta_fast as f64), corr(beta_slow as f64));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let ramp =
                        ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let interpolation = *f / factor;
                    *f = interpolation * (1.0 - extrapolation) + *f * extrapolation;
                }
            }
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_ctx,
            } => {
                let low_wavelen = old_ctx / low_freq_factor;
                let high_wavelen = old_ctx / high_freq_factor;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old_ctx / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Rope {
            inv_freq,
            attention_scaling,
        }
    }

    /// Rotate `x [n, num_heads * head_dim]` at `positions`.
    /// The backend's view of this RoPE for `num_heads` heads.
    pub fn params(&self, num_heads: usize, head_dim: usize) -> RopeParams<'_> {
        RopeParams {
            num_heads,
            head_dim,
            inv_freq: &self.inv_freq,
            attention_scaling: self.attention_scaling,
        }
    }

    pub fn apply(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        positions: &[u32],
        num_heads: usize,
        head_dim: usize,
    ) -> Result<Tensor> {
        Ok(b.rope(
            x,
            positions,
            &RopeParams {
                num_heads,
                head_dim,
                inv_freq: &self.inv_freq,
                attention_scaling: self.attention_scaling,
            },
        )?)
    }
}

/// YaRN's `mscale`: `0.1 · m · ln(scale) + 1`, 1 without scaling.
fn yarn_mscale(scale: f32, m: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = Rope::new(128, 500000.0, &RopeScaling::None);
        let scaled = Rope::new(
            128,
            500000.0,
            &RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
        );
        assert_eq!(plain.inv_freq[0], scaled.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 8.0).abs() < 1e-12);
        assert!(scaled
            .inv_freq
            .iter()
            .zip(&plain.inv_freq)
            .all(|(s, p)| s <= p));
    }
}
