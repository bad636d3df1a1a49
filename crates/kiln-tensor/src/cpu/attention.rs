//! Attention over the paged KV cache (causal or bidirectional), one query
//! row at a time.
//!
//! Each (query row, head) is computed on its own in a fixed order — scores
//! by the backend's dot product, softmax summed in ascending key order, the
//! value sum in ascending key order — so its result does not depend on
//! which other rows or sequences share the step, nor on how the prompt was
//! split into chunks. That is what makes batched, chunked and prefix-cached
//! outputs bit-identical to a request run alone on CPU.

use rayon::prelude::*;

use crate::backend::{AttentionParams, ForwardBatch};

/// Host KV storage: per layer, `[num_blocks * block_size, kv_row]` for K and
/// for V; slot `s` is row `s` (a layer narrower than the pool's `kv_row` uses
/// the front of each row).
pub struct CpuKv {
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// The keys query position `pos` of a sequence whose cache holds `seq_len`
/// tokens attends to, `first..=last`: causal up to itself, bidirectional up
/// to the sequence's end; a sliding window keeps keys less than `window`
/// away (behind only, when causal).
pub(crate) fn key_range(pos: usize, seq_len: usize, p: &AttentionParams) -> (usize, usize) {
    let back = p
        .sliding_window
        .map_or(pos, |w| pos.min(w.saturating_sub(1)));
    let last = if p.causal {
        pos
    } else {
        let ahead = p.sliding_window.map_or(usize::MAX, |w| w.saturating_sub(1));
        seq_len.saturating_sub(1).min(pos.saturating_add(ahead))
    };
    (pos - back, last.max(pos))
}

/// Attention output `[num_tokens, num_heads * head_dim]` for every new token
/// of every sequence in `batch`, over keys/values already written to
/// `k_cache`/`v_cache` (including this step's), rows `kv_row` apart.
pub fn attend(
    q: &[f32],
    batch: &ForwardBatch,
    k_cache: &[f32],
    v_cache: &[f32],
    kv_row: usize,
    p: &AttentionParams,
) -> Vec<f32> {
    let hd = p.head_dim;
    let q_row = p.num_heads * hd;
    let n = batch.token_ids.len();
    // Which sequence each token row belongs to.
    let mut seq_of = vec![0usize; n];
    for (s, seq) in batch.seqs.iter().enumerate() {
        seq_of[seq.token_start..seq.token_start + seq.num_tokens].fill(s);
    }
    let mut out = vec![0f32; n * q_row];
    let dot = super::matmul::dot_fn();
    out.par_chunks_mut(hd).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (idx, o)| {
            let (row, h) = (idx / p.num_heads, idx % p.num_heads);
            let seq = &batch.seqs[seq_of[row]];
            let pos = seq.num_computed + (row - seq.token_start);
            let qv = &q[row * q_row + h * hd..row * q_row + (h + 1) * hd];
            let keys = key_range(pos, seq.num_computed + seq.num_tokens, p);
            row_head(
                qv,
                seq.block_tables[p.kv_group].as_slice(),
                batch.block_size,
                keys,
                h,
                (k_cache, v_cache, kv_row),
                p,
                dot,
                scores,
                o,
            );
        },
    );
    out
}

#[allow(clippy::too_many_arguments)]
#[inline]
fn row_head(
    qv: &[f32],
    block_table: &[u32],
    block_size: usize,
    (first, last): (usize, usize),
    h: usize,
    (k_cache, v_cache, kv_row): (&[f32], &[f32], usize),
    p: &AttentionParams,
    dot: fn(&[f32], &[f32]) -> f32,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    let hd = p.head_dim;
    let kvh = h / (p.num_heads / p.num_kv_heads);
    let slot = |t: usize| block_table[t / block_size] as usize * block_size + t % block_size;
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for t in first..=last {
        let base = slot(t) * kv_row + kvh * hd;
        let mut s = dot(qv, &k_cache[base..base + hd]) * p.scale;
        if let Some(c) = p.softcap {
            s = (s / c).tanh() * c;
        }
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    o.fill(0.0);
    for (j, t) in (first..=last).enumerate() {
        let wgt = scores[j] * inv;
        let base = slot(t) * kv_row + kvh * hd;
        axpy(wgt, &v_cache[base..base + hd], o);
    }
}

/// `o += a * x`, element by element (no fused multiply-add, so every CPU
/// path gives the same bits).
#[inline]
fn axpy(a: f32, x: &[f32], o: &mut [f32]) {
    for (o, &x) in o.iter_mut().zip(x) {
        *o += a * x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqSlice;

    fn params(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> AttentionParams {
        AttentionParams {
            num_heads,
            num_kv_heads,
            head_dim,
            scale: 1.0,
            sliding_window: None,
            softcap: None,
            kv_group: 0,
            causal: true,
        }
    }

    fn one_seq(
        n: usize,
        num_computed: usize,
        block_table: Vec<u32>,
        block_size: usize,
    ) -> ForwardBatch {
        ForwardBatch {
            token_ids: vec![0; n],
            positions: (num_computed..num_computed + n).map(|p| p as u32).collect(),
            seqs: vec![SeqSlice {
                token_start: 0,
                num_tokens: n,
                num_computed,
                block_tables: vec![block_table],
            }],
            slot_mapping: vec![Vec::new()],
            block_size,
            logits_rows: Vec::new(),
        }
    }

    #[test]
    fn single_key_returns_its_value_and_gqa_maps_heads() {
        let p = params(2, 1, 2);
        let q = [1.0, 0.0, 0.0, 1.0];
        let (k, v) = ([0.3, 0.7], [5.0, -1.0]);
        let out = attend(
            &q,
            &one_seq(1, 0, vec![0], 1),
            &k,
            &v,
            p.num_kv_heads * p.head_dim,
            &p,
        );
        assert_eq!(out, vec![5.0, -1.0, 5.0, -1.0]);
    }

    #[test]
    fn causal_softmax_weights_window_and_block_table() {
        let p = params(1, 1, 1);
        let q = [1.0, 1.0];
        // Block size 1, the two tokens live in slots 3 and 1.
        let mut k = vec![0.0; 4];
        let mut v = vec![0.0; 4];
        (k[3], v[3]) = (0.0, 0.0);
        (k[1], v[1]) = (1.0, 1.0);
        let batch = one_seq(2, 0, vec![3, 1], 1);
        let out = attend(&q, &batch, &k, &v, p.num_kv_heads * p.head_dim, &p);
        assert_eq!(out[0], 0.0);
        let e = 1f32.exp();
        assert!((out[1] - e / (1.0 + e)).abs() < 1e-6);
        let pw = AttentionParams {
            sliding_window: Some(1),
            ..p
        };
        let outw = attend(&q, &batch, &k, &v, pw.num_kv_heads * pw.head_dim, &pw);
        assert!((outw[1] - 1.0).abs() < 1e-6);
        // Bidirectional: the first token sees the second too.
        let pb = AttentionParams { causal: false, ..p };
        let outb = attend(&q, &batch, &k, &v, pb.num_kv_heads * pb.head_dim, &pb);
        assert!((outb[0] - e / (1.0 + e)).abs() < 1e-6);
        assert!((outb[1] - e / (1.0 + e)).abs() < 1e-6);
    }

    #[test]
    fn key_ranges_of_causal_and_bidirectional_windows() {
        let p = params(1, 1, 1);
        let at = |pos, len, window, causal| {
            key_range(
                pos,
                len,
                &AttentionParams {
                    sliding_window: window,
                    causal,
                    ..p
                },
            )
        };
        assert_eq!(at(5, 10, None, true), (0, 5));
        assert_eq!(at(5, 10, Some(3), true), (3, 5));
        assert_eq!(at(1, 10, Some(3), true), (0, 1));
        assert_eq!(at(5, 10, None, false), (0, 9));
        // |5 - key| < 3: keys 3..=7.
        assert_eq!(at(5, 10, Some(3), false), (3, 7));
        assert_eq!(at(8, 10, Some(3), false), (6, 9));
        assert_eq!(at(0, 1, Some(1), false), (0, 0));
    }
}
