//! Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form, as
//! three extension ops around the ordinary attention op.
//!
//! A layer compresses each token to a latent `c` (`latent` wide, RMS-normed)
//! and a key part `k_rope` (`rope` wide, rotated, shared by every head);
//! head `h`'s key is `[W_UK[h] · c ‖ k_rope]` and its value `W_UV[h] · c`.
//! Since `q_nope · (W_UK[h] · c) = (W_UK[h]ᵀ · q_nope) · c`, attention runs
//! over one KV head of width `rope + latent` holding `[k_rope ‖ c]` (its
//! values the same row): each head's query becomes `[q_rope ‖ W_UK[h]ᵀ ·
//! q_nope]` ([`MlaQuery`]), the keys `[k_rope ‖ norm(c)]` ([`MlaKv`]), and
//! each head's output — the attention-weighted `[k_rope ‖ c]` — gives its
//! value as `W_UV[h]` times its latent part ([`MlaOutput`]). RoPE then
//! rotates the first `rope` dims of every head, as partial rotary.
//!
//! The projections are per head (block-diagonal). Their weights are
//! tensors of the backend that runs the ops, uploaded with the model; the
//! CPU reference ([`ExtensionOp::cpu`]) reads them where they are host
//! tensors.

use std::any::Any;

use rayon::prelude::*;

use crate::error::{Result, TensorError};
use crate::extension::ExtensionOp;
use crate::tensor::Tensor;

fn shape_err(op: &'static str, detail: String) -> TensorError {
    TensorError::Shape { op, detail }
}

/// `t`'s values, where it is a host (CPU backend) tensor of `len` elements.
fn host<'a>(t: &'a Tensor, len: usize, op: &'static str) -> Result<&'a [f32]> {
    match crate::cpu::host_data(t, op)? {
        v if v.len() == len => Ok(v),
        v => Err(shape_err(
            op,
            format!("{} weights, {len} expected", v.len()),
        )),
    }
}

/// `[n, heads · (nope + rope)]` queries (each head's no-position part, then
/// its rotary part) to `[n, heads · (rope + latent)]`: each head's rotary
/// part, then `W_UK[h]ᵀ · q_nope`.
#[derive(Debug, Clone)]
pub struct MlaQuery {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub latent: usize,
    /// `[heads, nope, latent]`: `W_UK[h]` (`kv_b_proj`'s key rows of head `h`).
    pub w_uk: Tensor,
}

impl MlaQuery {
    pub const NAME: &'static str = "mla_query";
}

impl ExtensionOp for MlaQuery {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        let (h, dn, dr, c) = (self.heads, self.nope, self.rope, self.latent);
        let width = h * (dn + dr);
        let w_uk = host(&self.w_uk, h * dn * c, Self::NAME)?;
        if shape.len() != 2 || shape[1] != width {
            return Err(shape_err(
                Self::NAME,
                format!("{shape:?} for {h} heads of {dn} + {dr}"),
            ));
        }
        let n = shape[0];
        let out_w = h * (dr + c);
        let mut out = vec![0f32; n * out_w];
        // Rows in parallel; each row's sums in a fixed order.
        let row = |(xr, or): (&[f32], &mut [f32])| {
            for head in 0..h {
                let q = &xr[head * (dn + dr)..(head + 1) * (dn + dr)];
                let o = &mut or[head * (dr + c)..(head + 1) * (dr + c)];
                o[..dr].copy_from_slice(&q[dn..]);
                let w = &w_uk[head * dn * c..(head + 1) * dn * c];
                let lat = &mut o[dr..];
                for (d, &qd) in q[..dn].iter().enumerate() {
                    for (l, &wv) in lat.iter_mut().zip(&w[d * c..(d + 1) * c]) {
                        *l += qd * wv;
                    }
                }
            }
        };
        x.par_chunks_exact(width)
            .zip(out.par_chunks_exact_mut(out_w))
            .for_each(row);
        Ok((vec![n, out_w], out))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `[n, latent + rope]` (`kv_a_proj_with_mqa`'s output) to the one KV head
/// `[n, rope + latent]`: the rotary part first, then the latent RMS-normed
/// with `weight` (`kv_a_layernorm`).
#[derive(Debug, Clone)]
pub struct MlaKv {
    pub rope: usize,
    pub latent: usize,
    /// `[latent]`.
    pub weight: Tensor,
    pub eps: f32,
}

impl MlaKv {
    pub const NAME: &'static str = "mla_kv";
}

impl ExtensionOp for MlaKv {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        let (dr, c) = (self.rope, self.latent);
        let weight = host(&self.weight, c, Self::NAME)?;
        if shape.len() != 2 || shape[1] != dr + c {
            return Err(shape_err(
                Self::NAME,
                format!("{shape:?} for a latent of {c} and {dr} rotary dims"),
            ));
        }
        let latent: Vec<f32> = x
            .chunks_exact(dr + c)
            .flat_map(|r| r[..c].iter().copied())
            .collect();
        let normed = crate::cpu::ops::rms_norm(&latent, weight, self.eps, 0.0);
        let mut out = Vec::with_capacity(x.len());
        for (r, l) in x.chunks_exact(dr + c).zip(normed.chunks_exact(c)) {
            out.extend_from_slice(&r[c..]);
            out.extend_from_slice(l);
        }
        Ok((shape.to_vec(), out))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `[n, heads · (rope + latent)]` attention outputs to `[n, heads · value]`:
/// each head's value `W_UV[h] · o[h][rope..]`.
#[derive(Debug, Clone)]
pub struct MlaOutput {
    pub heads: usize,
    pub rope: usize,
    pub latent: usize,
    pub value: usize,
    /// `[heads, value, latent]`: `W_UV[h]` (`kv_b_proj`'s value rows).
    pub w_uv: Tensor,
}

impl MlaOutput {
    pub const NAME: &'static str = "mla_output";
}

impl ExtensionOp for MlaOutput {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        let (h, dr, c, dv) = (self.heads, self.rope, self.latent, self.value);
        let width = h * (dr + c);
        let w_uv = host(&self.w_uv, h * dv * c, Self::NAME)?;
        if shape.len() != 2 || shape[1] != width {
            return Err(shape_err(
                Self::NAME,
                format!("{shape:?} for {h} heads of {dr} + {c}"),
            ));
        }
        let n = shape[0];
        let mut out = vec![0f32; n * h * dv];
        let row = |(xr, or): (&[f32], &mut [f32])| {
            for head in 0..h {
                let lat = &xr[head * (dr + c) + dr..(head + 1) * (dr + c)];
                let w = &w_uv[head * dv * c..(head + 1) * dv * c];
                for (j, o) in or[head * dv..(head + 1) * dv].iter_mut().enumerate() {
                    *o = w[j * c..(j + 1) * c]
                        .iter()
                        .zip(lat)
                        .map(|(a, b)| a * b)
                        .sum();
                }
            }
        };
        x.par_chunks_exact(width)
            .zip(out.par_chunks_exact_mut(h * dv))
            .for_each(row);
        Ok((vec![n, h * dv], out))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Memory;
    use crate::cpu::CpuBackend;

    /// The absorbed form scores and mixes as the expanded one: per head,
    /// `[q_rope ‖ W_UKᵀ q_nope] · [k_rope ‖ c] = q_nope · (W_UK c) + q_rope ·
    /// k_rope`, and `W_UV` of the weighted latent is the weighted values.
    #[test]
    fn absorbed_scores_and_values_equal_the_expanded_ones() {
        let (h, dn, dr, c, dv) = (2, 3, 2, 4, 3);
        let val = |i: usize| ((i * 37 % 11) as f32 - 5.0) / 7.0;
        let w_uk: Vec<f32> = (0..h * dn * c).map(val).collect();
        let w_uv: Vec<f32> = (0..h * dv * c).map(|i| val(i + 5)).collect();
        let q: Vec<f32> = (0..h * (dn + dr)).map(|i| val(i + 9)).collect();
        let kv: Vec<f32> = (0..c + dr).map(|i| val(i + 3)).collect();
        let weight: Vec<f32> = (0..c).map(|i| 1.0 + val(i) / 3.0).collect();
        let eps = 1e-6;
        let cpu = CpuBackend::new();
        let up = |v: &[f32]| cpu.upload(&[v.len()], v).unwrap();
        let mq = MlaQuery {
            heads: h,
            nope: dn,
            rope: dr,
            latent: c,
            w_uk: up(&w_uk),
        };
        let (_, qa) = mq.cpu(&q, &[1, h * (dn + dr)]).unwrap();
        let mk = MlaKv {
            rope: dr,
            latent: c,
            weight: up(&weight),
            eps,
        };
        let (_, k) = mk.cpu(&kv, &[1, c + dr]).unwrap();
        // The latent, normed by hand.
        let ms = kv[..c].iter().map(|v| v * v).sum::<f32>() / c as f32;
        let cn: Vec<f32> = (0..c)
            .map(|i| kv[i] / (ms + eps).sqrt() * weight[i])
            .collect();
        assert_eq!(&k[..dr], &kv[c..]);
        for (a, b) in k[dr..].iter().zip(&cn) {
            assert!((a - b).abs() < 1e-6);
        }
        for head in 0..h {
            let qh = &q[head * (dn + dr)..(head + 1) * (dn + dr)];
            let w = &w_uk[head * dn * c..(head + 1) * dn * c];
            let k_nope: Vec<f32> = (0..dn)
                .map(|d| (0..c).map(|i| w[d * c + i] * cn[i]).sum())
                .collect();
            let expanded: f32 = (0..dn).map(|d| qh[d] * k_nope[d]).sum::<f32>()
                + (0..dr).map(|d| qh[dn + d] * kv[c + d]).sum::<f32>();
            let qa_h = &qa[head * (dr + c)..(head + 1) * (dr + c)];
            let absorbed: f32 = qa_h.iter().zip(&k).map(|(a, b)| a * b).sum();
            assert!((expanded - absorbed).abs() < 1e-5, "{expanded} {absorbed}");
        }
        // One key attended with weight 1: every head's output is the row.
        let o: Vec<f32> = (0..h).flat_map(|_| k.iter().copied()).collect();
        let mo = MlaOutput {
            heads: h,
            rope: dr,
            latent: c,
            value: dv,
            w_uv: up(&w_uv),
        };
        let (shape, v) = mo.cpu(&o, &[1, h * (dr + c)]).unwrap();
        assert_eq!(shape, [1, h * dv]);
        for head in 0..h {
            for j in 0..dv {
                let want: f32 = (0..c)
                    .map(|i| w_uv[head * dv * c + j * c + i] * cn[i])
                    .sum();
                assert!((v[head * dv + j] - want).abs() < 1e-5);
            }
        }
        // A wrong width is an error, not a panic.
        assert!(mq.cpu(&q, &[1, 3]).is_err());
    }
}
