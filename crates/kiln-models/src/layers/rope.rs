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
        match *scaling {
            RopeScaling::None => {}
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
            attention_scaling: 1.0,
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
