//! Causal attention over a contiguous per-sequence KV cache (the reference
//! implementation; the paged version replaces the cache layout later).

use rayon::prelude::*;

use crate::backend::AttentionParams;

/// Host KV storage: per layer, `[capacity, num_kv_heads * head_dim]` for K and V.
pub struct CpuKv {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// Query rows per block in the prefill path; bounds the score matrix to
/// `QUERY_BLOCK × context` floats per head.
const QUERY_BLOCK: usize = 128;

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
    let q_row = p.num_heads * hd;
    // Each head is computed on its own (in parallel), then interleaved back.
    let per_head: Vec<Vec<f32>> = (0..p.num_heads)
        .into_par_iter()
        .map(|h| head_attention(q, n, start_pos, k, v, p, h))
        .collect();
    let mut out = vec![0f32; n * q_row];
    for (h, o) in per_head.iter().enumerate() {
        for i in 0..n {
            out[i * q_row + h * hd..i * q_row + (h + 1) * hd]
                .copy_from_slice(&o[i * hd..(i + 1) * hd]);
        }
    }
    out
}

/// First key position query position `pos` may attend to.
fn first_key(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) if pos + 1 > w => pos + 1 - w,
        _ => 0,
    }
}

/// One head's output `[n, head_dim]`: scores by a GEMM over blocks of query
/// rows, masked, soft-maxed, and multiplied by V with a second GEMM.
fn head_attention(
    q: &[f32],
    n: usize,
    start_pos: usize,
    k: &[f32],
    v: &[f32],
    p: &AttentionParams,
    h: usize,
) -> Vec<f32> {
    let hd = p.head_dim;
    let q_row = p.num_heads * hd;
    let kv_row = p.num_kv_heads * hd;
    let kvh = h / (p.num_heads / p.num_kv_heads);
    let mut out = vec![0f32; n * hd];
    let mut scores = Vec::new();
    for r0 in (0..n).step_by(QUERY_BLOCK) {
        let rows = QUERY_BLOCK.min(n - r0);
        // Keys this block can see: [lo, hi).
        let lo = first_key(start_pos + r0, p.sliding_window);
        let hi = start_pos + r0 + rows;
        let ctx = hi - lo;
        scores.clear();
        scores.resize(rows * ctx, 0.0);
        // SAFETY: strides address q rows r0.. of head h, K rows lo..hi of kv head
        // kvh transposed, and `scores` [rows, ctx]; every index stays in bounds.
        unsafe {
            gemm::gemm(
                rows,
                ctx,
                hd,
                scores.as_mut_ptr(),
                1,
                ctx as isize,
                false,
                q.as_ptr().add(r0 * q_row + h * hd),
                1,
                q_row as isize,
                k.as_ptr().add(lo * kv_row + kvh * hd),
                kv_row as isize,
                1,
                0.0,
                p.scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        for i in 0..rows {
            let pos = start_pos + r0 + i;
            let first = first_key(pos, p.sliding_window);
            let row = &mut scores[i * ctx..(i + 1) * ctx];
            if let Some(c) = p.softcap {
                row.iter_mut().for_each(|s| *s = (*s / c).tanh() * c);
            }
            // Visible keys are lo + j for j in [first - lo, pos - lo].
            let (a, b) = (first - lo, pos - lo + 1);
            let max = row[a..b].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for s in &mut row[a..b] {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            row[..a].iter_mut().for_each(|s| *s = 0.0);
            row[a..b].iter_mut().for_each(|s| *s *= inv);
            row[b..].iter_mut().for_each(|s| *s = 0.0);
        }
        // SAFETY: `scores` [rows, ctx] times V rows lo..hi of kv head kvh
        // ([ctx, hd] with row stride kv_row) into `out` rows r0.. [rows, hd].
        unsafe {
            gemm::gemm(
                rows,
                hd,
                ctx,
                out.as_mut_ptr().add(r0 * hd),
                1,
                hd as isize,
                false,
                scores.as_ptr(),
                1,
                ctx as isize,
                v.as_ptr().add(lo * kv_row + kvh * hd),
                1,
                kv_row as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
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
