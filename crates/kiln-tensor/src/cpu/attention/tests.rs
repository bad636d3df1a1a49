//! Attention against f64 references, and the bits of a row against its
//! placement, its batch and its neighbours.

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
        lora: Default::default(),
        states: Vec::new(),
    }
}

#[test]
fn single_key_returns_its_value_and_gqa_maps_heads() {
    let p = params(2, 1, 2);
    let q = [1.0, 0.0, 0.0, 1.0];
    let (k, v) = ([0.3, 0.7], [5.0, -1.0]);
    let out = attend(&q, &one_seq(1, 0, vec![0], 1), &k, &v, 1, &p);
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
    let out = attend(&q, &batch, &k, &v, 1, &p);
    assert_eq!(out[0], 0.0);
    let e = 1f32.exp();
    assert!((out[1] - e / (1.0 + e)).abs() < 1e-6);
    let pw = AttentionParams {
        sliding_window: Some(1),
        ..p
    };
    let outw = attend(&q, &batch, &k, &v, 1, &pw);
    assert!((outw[1] - 1.0).abs() < 1e-6);
    // Bidirectional: the first token sees the second too.
    let pb = AttentionParams { causal: false, ..p };
    let outb = attend(&q, &batch, &k, &v, 1, &pb);
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

/// Deterministic pseudo-random values in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The head sizes the SIMD kernels take (64, 128, 256) against an f64
/// softmax; and a row's bits do not depend on where its keys sit in the
/// cache nor on what else is in the batch. For an f32, an f16 and an
/// E4M3 cache (against the f64 softmax of the rounded keys and values:
/// the same arithmetic on rounded values).
#[test]
fn wide_heads_match_f64_and_do_not_depend_on_placement_or_batch() {
    wide_heads::<f32>();
    wide_heads::<f16>();
    wide_heads::<E4m3>();
}

/// A sequence's few rows taken together (a speculative decode) give
/// each row the bits it has as a one-row step: causal, windowed,
/// soft-capped, with sinks, bidirectional.
#[test]
fn rows_taken_together_equal_rows_alone() {
    let (hd, heads, kv_heads, bs, len) = (64, 6, 2, 16, 45);
    let kv_row = kv_heads * hd;
    let mut kv = CpuKv::<f32> {
        k: vec![vec![0.0; 4 * bs * kv_row]],
        v: vec![vec![0.0; 4 * bs * kv_row]],
        block_size: bs,
        kv_row,
    };
    let table = vec![2u32, 0, 3];
    let slots: Vec<u32> = (0..len)
        .map(|t| table[t / bs] * bs as u32 + (t % bs) as u32)
        .collect();
    kv.write(
        0,
        &slots,
        &noise(len * kv_row, 7),
        &noise(len * kv_row, 8),
        (kv_heads, hd),
    );
    let q = noise(len * heads * hd, 9);
    let q_row = heads * hd;
    let sinks = noise(heads, 10);
    for (window, softcap, causal, sink) in [
        (None, None, true, false),
        (Some(7), None, true, false),
        (Some(20), Some(5.0), true, true),
        (Some(9), None, false, false),
    ] {
        let p = AttentionParams {
            scale: 0.125,
            sliding_window: window,
            softcap,
            causal,
            ..params(heads, kv_heads, hd)
        };
        // Rows 30..39 of the sequence (computed after 30 tokens) in one
        // step.
        let (start, n) = (30, 9);
        let batch = one_seq(n, start, table.clone(), bs);
        let seq_len = start + n;
        let qs = &q[start * q_row..(start + n) * q_row];
        let sk = sink.then_some(&sinks[..]);
        let together = attend_sinks(qs, &batch, &kv.k[0], &kv.v[0], kv_row, &p, sk);
        // The reference: the same rows as the last of a 20-row chunk
        // ending at the same place, which runs row by row.
        let lead = 20 - n;
        let mut long = one_seq(20, start - lead, table.clone(), bs);
        long.seqs[0].num_computed = start - lead;
        let ql = &q[(start - lead) * q_row..(start + n) * q_row];
        let alone = attend_sinks(ql, &long, &kv.k[0], &kv.v[0], kv_row, &p, sk);
        assert!(key_range(start + n - 1, seq_len, &p).1 < len);
        assert_eq!(
            together,
            alone[lead * q_row..].to_vec(),
            "window {window:?}, causal {causal}"
        );
    }
}

/// An f16 cache moves outputs by about the rounding of its values.
#[test]
fn an_f16_cache_is_the_f32_cache_to_f16_rounding() {
    let (hd, heads, len) = (64, 2, 20);
    let p = AttentionParams {
        scale: 0.125,
        ..params(heads, 1, hd)
    };
    let (kd, vd, q) = (
        noise(len * hd, 1),
        noise(len * hd, 2),
        noise(len * heads * hd, 3),
    );
    let run = |f16: bool| {
        let slots: Vec<u32> = (0..len as u32).collect();
        let batch = one_seq(len, 0, vec![0, 1], 16);
        if f16 {
            let mut kv = CpuKv::<f16> {
                k: vec![vec![f16::ZERO; 32 * hd]],
                v: vec![vec![f16::ZERO; 32 * hd]],
                block_size: 16,
                kv_row: hd,
            };
            kv.write(0, &slots, &kd, &vd, (1, hd));
            attend(&q, &batch, &kv.k[0], &kv.v[0], hd, &p)
        } else {
            let mut kv = CpuKv::<f32> {
                k: vec![vec![0.0; 32 * hd]],
                v: vec![vec![0.0; 32 * hd]],
                block_size: 16,
                kv_row: hd,
            };
            kv.write(0, &slots, &kd, &vd, (1, hd));
            attend(&q, &batch, &kv.k[0], &kv.v[0], hd, &p)
        }
    };
    let (a, b) = (run(false), run(true));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    // Values in [-1, 1): f16 steps of at most 2^-11; scores move by
    // about as much.
    assert!(
        worst > 0.0 && worst < 4e-3,
        "f16 cache moved an output by {worst}"
    );
}

fn wide_heads<E: KvElem>() {
    let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| E::from_f32(x).to_f32()).collect() };
    for hd in [64usize, 128, 256, 80] {
        let (heads, kv_heads, bs, len) = (4, 2, 16, 37);
        let p = AttentionParams {
            scale: 1.0 / (hd as f32).sqrt(),
            ..params(heads, kv_heads, hd)
        };
        // Rows wider than the layer's (another group's layers are wider).
        let kv_row = kv_heads * hd + 32;
        let mut kv = CpuKv::<E> {
            k: vec![vec![E::default(); 8 * bs * kv_row]],
            v: vec![vec![E::default(); 8 * bs * kv_row]],
            block_size: bs,
            kv_row,
        };
        let kd = noise(len * kv_heads * hd, hd as u64);
        let vd = noise(len * kv_heads * hd, hd as u64 + 1);
        let q = noise(len * heads * hd, hd as u64 + 2);
        // The same tokens twice: blocks [5, 0, 3] and blocks [1, 6, 7].
        let place = |table: &[u32]| -> Vec<u32> {
            (0..len)
                .map(|t| table[t / bs] * bs as u32 + (t % bs) as u32)
                .collect()
        };
        let (ta, tb) = (vec![5u32, 0, 3], vec![1u32, 6, 7]);
        kv.write(0, &place(&ta), &kd, &vd, (kv_heads, hd));
        kv.write(0, &place(&tb), &kd, &vd, (kv_heads, hd));
        let alone = attend(
            &q,
            &one_seq(len, 0, ta.clone(), bs),
            &kv.k[0],
            &kv.v[0],
            kv_row,
            &p,
        );
        // Batched: the second placement's last 5 rows after a 3-row
        // sequence on the first placement.
        let q_row = heads * hd;
        let mut qb = q[..3 * q_row].to_vec();
        qb.extend_from_slice(&q[(len - 5) * q_row..]);
        let batch = ForwardBatch {
            token_ids: vec![0; 8],
            positions: Vec::new(),
            seqs: vec![
                SeqSlice {
                    token_start: 0,
                    num_tokens: 3,
                    num_computed: 0,
                    block_tables: vec![ta.clone()],
                },
                SeqSlice {
                    token_start: 3,
                    num_tokens: 5,
                    num_computed: len - 5,
                    block_tables: vec![tb.clone()],
                },
            ],
            slot_mapping: vec![Vec::new()],
            block_size: bs,
            logits_rows: Vec::new(),
            lora: Default::default(),
            states: Vec::new(),
        };
        let batched = attend(&qb, &batch, &kv.k[0], &kv.v[0], kv_row, &p);
        assert_eq!(&batched[..3 * q_row], &alone[..3 * q_row], "hd {hd}");
        assert_eq!(
            &batched[3 * q_row..],
            &alone[(len - 5) * q_row..],
            "hd {hd}"
        );
        // Against f64, on the values as the cache holds them.
        let (kd, vd) = (round(&kd), round(&vd));
        for row in 0..len {
            for h in 0..heads {
                let kvh = h / (heads / kv_heads);
                let qv = &q[row * q_row + h * hd..][..hd];
                let at = |m: &Vec<f32>, t: usize| m[t * kv_heads * hd + kvh * hd..][..hd].to_vec();
                let s: Vec<f64> = (0..=row)
                    .map(|t| {
                        let k = at(&kd, t);
                        (0..hd).map(|d| qv[d] as f64 * k[d] as f64).sum::<f64>() * p.scale as f64
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 = (0..=row).map(|t| e[t] / z * at(&vd, t)[d] as f64).sum();
                    let got = alone[row * q_row + h * hd + d] as f64;
                    assert!(
                        (got - want).abs() < 2e-6,
                        "hd {hd} row {row} head {h} dim {d}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
