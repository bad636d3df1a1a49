//! Causal attention over a contiguous per-sequence KV cache (the reference
//! implementation; the paged version replaces the cache layout later).

use rayon::prelude::*;

use crate::backend::AttentionParams;

/// Host KV storage: per layer, `[capacity, num_kv_heads * head_dim]` for K and V.
pub struct CpuKv {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// Attention output `[n, num_heads * head_dim]` of queries `q` at positions
/// `start_pos..start_pos + n` over keys/values `0..start_pos + n` of one layer.
pub fn attend(
    q: &[f32],
    n: usize,
    start_pos: usize,
    k: &[f32],
    v: &[f32],
    p: &AttentionParams,
) -> Vec<f32> {
    let hd = p.head_dim;
    let kv_row = p.num_kv_heads * hd;
    let q_row = p.num_heads * hd;
    let group = p.num_heads / p.num_kv_heads;
    let dot = super::matmul::dot_fn();
    let mut out = vec![0f32; n * q_row];
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (i, h) = (idx / p.num_heads, idx % p.num_heads);
        let kvh = h / group;
        let pos = start_pos + i;
        let first = match p.sliding_window {
            Some(w) if pos + 1 > w => pos + 1 - w,
            _ => 0,
        };
        let qv = &q[i * q_row + h * hd..i * q_row + (h + 1) * hd];
        let mut scores: Vec<f32> = (first..=pos)
            .map(|t| {
                let s = dot(qv, &k[t * kv_row + kvh * hd..t * kv_row + (kvh + 1) * hd]) * p.scale;
                match p.softcap {
                    Some(c) => (s / c).tanh() * c,
                    None => s,
                }
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in &mut scores {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        for (j, t) in (first..=pos).enumerate() {
            let wgt = scores[j] * inv;
            let vv = &v[t * kv_row + kvh * hd..t * kv_row + (kvh + 1) * hd];
            for (o, &x) in o.iter_mut().zip(vv) {
                *o = wgt.mul_add(x, *o);
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_gqa_maps_heads() {
        // 2 query heads share 1 kv head; one token attends only to itself.
        let p = AttentionParams {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
            sliding_window: None,
            softcap: None,
        };
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [0.3, 0.7];
        let v = [5.0, -1.0];
        let out = attend(&q, 1, 0, &k, &v, &p);
        assert_eq!(out, vec![5.0, -1.0, 5.0, -1.0]);
    }

    #[test]
    fn causal_softmax_weights() {
        let p = AttentionParams {
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: 1,
            scale: 1.0,
            sliding_window: None,
            softcap: None,
        };
        // Two tokens; the second attends to both with scores q*k = 1*0 and 1*1.
        let q = [1.0, 1.0];
        let k = [0.0, 1.0];
        let v = [0.0, 1.0];
        let out = attend(&q, 2, 0, &k, &v, &p);
        assert_eq!(out[0], 0.0);
        let e = 1f32.exp();
        assert!((out[1] - e / (1.0 + e)).abs() < 1e-6);
        // A window of 1 sees only the last key.
        let pw = AttentionParams {
            sliding_window: Some(1),
            ..p
        };
        let outw = attend(&q, 2, 0, &k, &v, &pw);
        assert!((outw[1] - 1.0).abs() < 1e-6);
    }
}
