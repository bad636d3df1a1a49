//! Elementwise and row-wise ops of the CPU backend, on plain slices.

use rayon::prelude::*;

use crate::backend::{Activation, RopeParams};

/// Rows at or above this many elements in total are processed in parallel.
const PAR_MIN: usize = 1 << 14;

pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, weight_offset: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = vec![0f32; x.len()];
    let row = |(o, xr): (&mut [f32], &[f32])| {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(w) {
            *o = xv * inv * (weight_offset + wv);
        }
    };
    if x.len() >= PAR_MIN {
        out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(row);
    } else {
        out.chunks_mut(d).zip(x.chunks(d)).for_each(row);
    }
    out
}

/// [`gated`] of rows `gate | up` of `2 * i` columns, each row's halves
/// read in place (the same products, so the same bits).
pub fn gated_packed(y: &[f32], i: usize, act: Activation) -> Vec<f32> {
    let n = if i == 0 { 0 } else { y.len() / (2 * i) };
    let mut out = vec![0f32; n * i];
    if i == 0 {
        return out;
    }
    let body = |(o, row): (&mut [f32], &[f32])| {
        let (g, u) = row.split_at(i);
        gated_into(o, g, u, act);
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(i)
            .zip(y.par_chunks(2 * i))
            .for_each(body);
    } else {
        out.chunks_mut(i).zip(y.chunks(2 * i)).for_each(body);
    }
    out
}

pub fn gated(gate: &[f32], up: &[f32], act: Activation) -> Vec<f32> {
    let mut out = vec![0f32; gate.len()];
    const CH: usize = 4096;
    out.par_chunks_mut(CH)
        .zip(gate.par_chunks(CH).zip(up.par_chunks(CH)))
        .for_each(|(o, (g, u))| gated_into(o, g, u, act));
    out
}

/// `o = act(g) · u`: 16 lanes at a time with AVX-512 (the vector `exp`,
/// every element through the same formula, the tail masked), else the
/// scalar functions below.
fn gated_into(o: &mut [f32], g: &[f32], u: &[f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    if act != Activation::Sigmoid && crate::cpu::matmul::runs_avx512() {
        // SAFETY: AVX-512F was detected.
        unsafe { gated_avx512(o, g, u, act) };
        return;
    }
    let f = match act {
        Activation::Silu => silu,
        Activation::GeluTanh => gelu_tanh,
        Activation::Sigmoid => sigmoid,
    };
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = f(g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gated_avx512(o: &mut [f32], g: &[f32], u: &[f32], act: Activation) {
    use super::vmath::avx512::{gelu_tanh16, silu16};
    use std::arch::x86_64::*;
    let n = o.len().min(g.len()).min(u.len());
    for c in (0..n).step_by(16) {
        let mask: __mmask16 = if n - c >= 16 {
            !0
        } else {
            (1u16 << (n - c)) - 1
        };
        // SAFETY: the mask covers only elements below n.
        unsafe {
            let gv = _mm512_maskz_loadu_ps(mask, g.as_ptr().add(c));
            let uv = _mm512_maskz_loadu_ps(mask, u.as_ptr().add(c));
            let a = match act {
                Activation::Silu => silu16(gv),
                Activation::GeluTanh => gelu_tanh16(gv),
                // (Not reached: sigmoid gates take the scalar loop.)
                Activation::Sigmoid => gv,
            };
            _mm512_mask_storeu_ps(o.as_mut_ptr().add(c), mask, _mm512_mul_ps(a, uv));
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

/// Rotate-half RoPE in place over `x [n, heads * head_dim]`.
pub fn rope(x: &mut [f32], positions: &[u32], p: &RopeParams<'_>) {
    let hd = p.head_dim;
    let half = p.inv_freq.len();
    let row_len = p.num_heads * hd;
    let body = |(row, &pos): (&mut [f32], &u32)| {
        for i in 0..half {
            // Same order of operations as Hugging Face: angle = inv_freq * position in f32.
            let angle = p.inv_freq[i] * pos as f32;
            let (s, c) = angle.sin_cos();
            let (s, c) = (s * p.attention_scaling, c * p.attention_scaling);
            for h in 0..p.num_heads {
                let base = h * hd;
                let a = row[base + i];
                let b = row[base + i + half];
                row[base + i] = a * c - b * s;
                row[base + i + half] = b * c + a * s;
            }
        }
    };
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(row_len)
            .zip(positions.par_iter())
            .for_each(body);
    } else {
        x.chunks_mut(row_len).zip(positions.iter()).for_each(body);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let out = rms_norm(&x, &w, 1e-6, 0.0);
        let rms = ((1.0 + 4.0 + 9.0 + 0.25) / 4.0f32 + 1e-6).sqrt();
        for i in 0..4 {
            assert!((out[i] - x[i] / rms * w[i]).abs() < 1e-6);
        }
        let out1 = rms_norm(&x, &w, 1e-6, 1.0);
        assert!((out1[1] - x[1] / rms * 1.5).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let inv_freq = [1.0f32, 0.1];
        let p = RopeParams {
            num_heads: 1,
            head_dim: 4,
            inv_freq: &inv_freq,
            attention_scaling: 1.0,
        };
        let mut x = vec![1.0f32, 2.0, 3.0, 4.0];
        rope(&mut x, &[2], &p);
        let (s0, c0) = 2.0f32.sin_cos();
        assert!((x[0] - (1.0 * c0 - 3.0 * s0)).abs() < 1e-6);
        assert!((x[2] - (3.0 * c0 + 1.0 * s0)).abs() < 1e-6);
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 30.0).abs() < 1e-4);
        // Position 0 is the identity.
        let mut y = vec![1.0f32, 2.0, 3.0, 4.0];
        rope(&mut y, &[0], &p);
        assert_eq!(y, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn activations() {
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        let g = gated(&[1.0, 0.0], &[2.0, 5.0], Activation::Silu);
        assert!((g[0] - 2.0 * 0.731_058_6).abs() < 1e-6 && g[1] == 0.0);
    }

    #[test]
    fn gated_activations_are_the_functions_to_float_rounding() {
        // Whatever path runs here (AVX-512's vector exp or the scalar
        // functions), each element is act(g)·u within a few ulps of the
        // f64 definition, across the range and at the extremes.
        let mut g: Vec<f32> = (0..4001).map(|k| (k as f32 - 2000.0) / 40.0).collect();
        g.extend([-200.0, -88.0, 88.0, 200.0, 1e-30, -1e-30, 0.0]);
        let u: Vec<f32> = (0..g.len()).map(|k| 1.0 + (k % 7) as f32 / 8.0).collect();
        for act in [Activation::Silu, Activation::GeluTanh, Activation::Sigmoid] {
            let got = gated(&g, &u, act);
            for ((&x, &uu), &o) in g.iter().zip(&u).zip(&got) {
                let x64 = x as f64;
                let a = match act {
                    Activation::Silu => x64 / (1.0 + (-x64).exp()),
                    Activation::Sigmoid => 1.0 / (1.0 + (-x64).exp()),
                    Activation::GeluTanh => {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * x64 * (1.0 + (c * (x64 + 0.044715 * x64.powi(3))).tanh())
                    }
                };
                let want = a * uu as f64;
                let tol = 4e-7 * want.abs() + 1e-7 * (x64.abs() * uu as f64).min(1.0) + 1e-38;
                assert!(
                    (o as f64 - want).abs() <= tol,
                    "{act:?}({x}) * {uu}: {o} vs {want}"
                );
            }
            let nan = gated(&[f32::NAN], &[1.0], act);
            assert!(nan[0].is_nan(), "{act:?}(NaN)");
        }
    }

    #[test]
    fn gated_packed_is_gated_of_the_halves() {
        // Enough rows to take the parallel path.
        let (n, i) = (40, 600);
        let y: Vec<f32> = (0..n * 2 * i)
            .map(|k| ((k * 7919 % 1000) as f32 - 500.0) / 97.0)
            .collect();
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for row in y.chunks(2 * i) {
            gate.extend_from_slice(&row[..i]);
            up.extend_from_slice(&row[i..]);
        }
        for act in [Activation::Silu, Activation::GeluTanh] {
            let want = gated(&gate, &up, act);
            let got = gated_packed(&y, i, act);
            assert_eq!(got.len(), n * i);
            assert!(want
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
