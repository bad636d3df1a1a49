//! Attention over the paged KV cache (causal or bidirectional), one query
//! row at a time.
//!
//! Each (query row, head) is computed in a fixed order — scores
//! one dot product per key, the softmax's exponentials summed over the
//! key range in a fixed lane order, the value sum in ascending key order —
//! so its result depends only on the query, the keys and the values, not on
//! which other rows or sequences share the step, where the cache keeps the
//! keys, nor on how the prompt was split into chunks. That is what makes
//! batched, chunked and prefix-cached outputs bit-identical to a request
//! run alone on CPU.
//!
//! The cache is head-major within each block: per layer and block,
//! `[kv_head][slot in block][head_dim]`, so the keys of one head within a
//! block are contiguous and each (row, head) streams them in order; blocks
//! stay `block_size * kv_row` apart whatever a layer's head shape, so the
//! groups of a model whose layers differ share a layer's storage safely. The inner loops run on AVX-512 where the CPU has
//! it and the head dimension is a multiple of 16, else on portable code.
//!
//! The cache holds f32 (the default: keys and values as computed), f16
//! (`--kv-cache-dtype f16`: half the bytes, each key and value rounded to
//! the nearest f16 when written, widened to f32 when read; the arithmetic
//! and its order are the f32 cache's, so the results are those of the
//! rounded keys and values, and still batch-invariant) or E4M3
//! (`--kv-cache-dtype fp8`: a quarter of the bytes, rounded as the CUDA FP8
//! cache rounds them, through the portable loops; also batch-invariant).

use std::sync::OnceLock;

use rayon::prelude::*;

use half::f16;

use crate::backend::{AttentionParams, ForwardBatch};

mod kernels;
#[cfg(test)]
mod tests;

#[cfg(target_arch = "x86_64")]
use kernels::avx512;
use kernels::{portable, Kernels, Weights};

/// An E4M3 code in the CPU KV cache (`--kv-cache-dtype fp8`): a quarter of
/// f32's bytes, at unit scale as the CUDA cache keeps it (round to nearest
/// even, saturating at ±448); widened exactly when read.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct E4m3(u8);

impl KvElem for E4m3 {
    const F16: bool = false;
    fn from_f32(v: f32) -> E4m3 {
        E4m3(kiln_quant::quantize::f32_to_e4m3(v))
    }
    fn to_f32(self) -> f32 {
        kiln_quant::dequant::e4m3_to_f32(self.0)
    }
    /// The portable loops: the AVX-512 ones read f32 or f16 rows only.
    fn kernels(_hd: usize) -> &'static Kernels<E4m3> {
        static PORTABLE: OnceLock<Kernels<E4m3>> = OnceLock::new();
        PORTABLE.get_or_init(portable::kernels)
    }
}

/// An element of the CPU KV cache: f32, f16 or E4M3.
pub(crate) trait KvElem: Copy + Default + Send + Sync + 'static {
    /// Whether it is f16 (for the SIMD loads).
    const F16: bool;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    /// The inner loops for this element and head size (chosen once).
    fn kernels(hd: usize) -> &'static Kernels<Self>;
}

impl KvElem for f32 {
    const F16: bool = false;
    fn from_f32(v: f32) -> f32 {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn kernels(hd: usize) -> &'static Kernels<f32> {
        static PORTABLE: OnceLock<Kernels<f32>> = OnceLock::new();
        #[cfg(target_arch = "x86_64")]
        static AVX512: Kernels<f32> = avx512::kernels();
        choose(
            hd,
            &PORTABLE,
            #[cfg(target_arch = "x86_64")]
            &AVX512,
        )
    }
}

impl KvElem for f16 {
    const F16: bool = true;
    fn from_f32(v: f32) -> f16 {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn kernels(hd: usize) -> &'static Kernels<f16> {
        static PORTABLE: OnceLock<Kernels<f16>> = OnceLock::new();
        #[cfg(target_arch = "x86_64")]
        static AVX512: Kernels<f16> = avx512::kernels();
        choose(
            hd,
            &PORTABLE,
            #[cfg(target_arch = "x86_64")]
            &AVX512,
        )
    }
}

/// The AVX-512 kernels where they run (head sizes that are multiples of
/// 16), else the portable ones.
fn choose<E: KvElem>(
    hd: usize,
    fallback: &'static OnceLock<Kernels<E>>,
    #[cfg(target_arch = "x86_64")] avx512: &'static Kernels<E>,
) -> &'static Kernels<E> {
    #[cfg(target_arch = "x86_64")]
    if hd % 16 == 0 && avx512::detected() {
        return avx512;
    }
    let _ = hd;
    fallback.get_or_init(portable::kernels)
}

/// Host KV storage: per layer, keys and values laid out as
/// `[block][kv_head][slot in block][head_dim]`, each block `block_size *
/// kv_row` elements (a layer narrower than the pool's row uses the front).
pub struct CpuKv<E = f32> {
    pub k: Vec<Vec<E>>,
    pub v: Vec<Vec<E>>,
    pub block_size: usize,
    pub kv_row: usize,
}

impl<E: KvElem> CpuKv<E> {
    /// Where head `h`'s `head_dim` values of slot `s` start in a layer.
    fn at(&self, s: usize, h: usize, hd: usize) -> usize {
        head_base(s / self.block_size, h, (self.block_size, self.kv_row), hd)
            + s % self.block_size * hd
    }
}

/// Where head `h` of block `b` starts in a layer (blocks of `block_size`
/// slots, `kv_row` wide).
fn head_base(b: usize, h: usize, (block_size, kv_row): (usize, usize), hd: usize) -> usize {
    b * block_size * kv_row + h * block_size * hd
}

impl<E: KvElem> CpuKv<E> {
    /// Write this step's keys and values (`[n, num_kv_heads * head_dim]`,
    /// row `i` to slot `slots[i]`) into `layer`.
    pub fn write(
        &mut self,
        layer: usize,
        slots: &[u32],
        kd: &[f32],
        vd: &[f32],
        (num_kv_heads, hd): (usize, usize),
    ) {
        let row = num_kv_heads * hd;
        for (i, &s) in slots.iter().enumerate() {
            for h in 0..num_kv_heads {
                let dst = self.at(s as usize, h, hd);
                let (kc, vc) = (&mut self.k[layer], &mut self.v[layer]);
                let src = i * row + h * hd;
                for (d, &x) in kc[dst..dst + hd].iter_mut().zip(&kd[src..src + hd]) {
                    *d = E::from_f32(x);
                }
                for (d, &x) in vc[dst..dst + hd].iter_mut().zip(&vd[src..src + hd]) {
                    *d = E::from_f32(x);
                }
            }
        }
    }
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
/// `k_cache`/`v_cache` (including this step's), laid out as [`CpuKv`] with
/// rows `kv_row` wide.
#[cfg(test)]
pub(crate) fn attend<E: KvElem>(
    q: &[f32],
    batch: &ForwardBatch,
    k_cache: &[E],
    v_cache: &[E],
    kv_row: usize,
    p: &AttentionParams,
) -> Vec<f32> {
    attend_sinks(q, batch, k_cache, v_cache, kv_row, p, None)
}

/// [`attend`] with, when `sinks` is given, one more logit a query head
/// (`sinks[h]`) in every softmax whose weight is dropped: gpt-oss's
/// attention sinks, `exp(s_j) / (Σ exp(s_i) + exp(sink))`.
pub(crate) fn attend_sinks<E: KvElem>(
    q: &[f32],
    batch: &ForwardBatch,
    k_cache: &[E],
    v_cache: &[E],
    kv_row: usize,
    p: &AttentionParams,
    sinks: Option<&[f32]>,
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
    let kern = E::kernels(hd);
    // One task per (row, KV head): the query heads sharing a KV head are
    // adjacent in `q` and `out`, and each run of keys and values is read
    // once for all of them (while it is in L1) instead of once per head.
    // With fewer such tasks than threads (decode: a few rows times a few
    // KV heads), one task per (row, query head) instead; each head's
    // arithmetic is the same either way, so the choice changes no bits.
    // (Measured on Qwen2.5-1.5B's decode shape, 12 heads over 2 KV heads,
    // 2 threads: grouped 40–60 µs a layer, per head 63–116.)
    let group = p.num_heads / p.num_kv_heads.max(1);
    // A step of few rows a sequence (decodes, speculative decodes): a
    // sequence's rows in one task per KV head, so each run of keys and
    // values is read once for all of them — in chunks small enough to give
    // every thread a task. Each (row, head) computes exactly what it does
    // alone (`rows_group`), so this changes no bits.
    // Where sequence `si`'s keys and values of KV head `kvh` are.
    let head_of = |si: usize, kvh: usize| HeadCache {
        k: k_cache,
        v: v_cache,
        block_table: batch.seqs[si].block_tables[p.kv_group].as_slice(),
        block_size: batch.block_size,
        kv_row,
        kvh,
        hd,
    };
    let threads = rayon::current_num_threads().max(1);
    if n > batch.seqs.len() && batch.seqs.iter().all(|s| s.num_tokens <= ROWS_TOGETHER) {
        let chunk = (n * p.num_kv_heads)
            .div_ceil(threads)
            .clamp(1, ROWS_TOGETHER);
        let mut tasks = Vec::new();
        for (si, seq) in batch.seqs.iter().enumerate() {
            let rows = seq.token_start..seq.token_start + seq.num_tokens;
            for r0 in rows.clone().step_by(chunk) {
                for kvh in 0..p.num_kv_heads {
                    tasks.push((si, r0..(r0 + chunk).min(rows.end), kvh));
                }
            }
        }
        let out_addr = out.as_mut_ptr() as usize;
        tasks.into_par_iter().for_each_init(
            || (Vec::new(), Vec::new(), Vec::new()),
            |(scores, inv, local): &mut (Vec<f32>, Vec<f32>, Vec<f32>), (si, rows, kvh)| {
                let seq = &batch.seqs[si];
                let first_head = kvh * group;
                let qs: Vec<&[f32]> = rows
                    .clone()
                    .map(|r| &q[r * q_row + first_head * hd..r * q_row + (first_head + group) * hd])
                    .collect();
                let ranges: Vec<(usize, usize)> = rows
                    .clone()
                    .map(|r| {
                        let pos = seq.num_computed + (r - seq.token_start);
                        key_range(pos, seq.num_computed + seq.num_tokens, p)
                    })
                    .collect();
                let head = head_of(si, kvh);
                local.clear();
                local.resize(rows.len() * group * hd, 0.0);
                let sinks = sinks.map(|s| &s[first_head..first_head + group]);
                rows_group(&qs, &head, &ranges, p, kern, (scores, inv), sinks, local);
                for (i, r) in rows.enumerate() {
                    let dst = r * q_row + first_head * hd;
                    // SAFETY: each task alone writes its rows' columns of
                    // its KV head's query heads, inside `out`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            local[i * group * hd..].as_ptr(),
                            (out_addr as *mut f32).add(dst),
                            group * hd,
                        );
                    }
                }
            },
        );
        return out;
    }
    let per_head = n * p.num_kv_heads < threads && group > 1;
    let (task_heads, tasks_per_row) = if per_head {
        (1, p.num_heads)
    } else {
        (group, p.num_kv_heads)
    };
    out.par_chunks_mut(task_heads * hd)
        .enumerate()
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(scores, inv): &mut (Vec<f32>, Vec<f32>), (idx, o)| {
                let (row, t) = (idx / tasks_per_row, idx % tasks_per_row);
                let (kvh, first_head) = if per_head {
                    (t / group, t)
                } else {
                    (t, t * group)
                };
                let seq = &batch.seqs[seq_of[row]];
                let pos = seq.num_computed + (row - seq.token_start);
                let q0 = row * q_row + first_head * hd;
                let qg = &q[q0..q0 + task_heads * hd];
                let keys = key_range(pos, seq.num_computed + seq.num_tokens, p);
                let head = head_of(seq_of[row], kvh);
                let sinks = sinks.map(|s| &s[first_head..first_head + task_heads]);
                row_group(qg, &head, keys, p, kern, (scores, inv), sinks, o);
            },
        );
    out
}

/// A layer's keys and values, the KV head read, and where a sequence keeps
/// its tokens.
struct HeadCache<'a, E> {
    k: &'a [E],
    v: &'a [E],
    block_table: &'a [u32],
    block_size: usize,
    kv_row: usize,
    kvh: usize,
    hd: usize,
}

impl<E> HeadCache<'_, E> {
    /// Visit keys `first..=last` as runs contiguous in the cache: `f(j,
    /// keys, values)` with `j` the run's first index in the range.
    fn runs(&self, (first, last): (usize, usize), mut f: impl FnMut(usize, &[E], &[E])) {
        let (bs, hd) = (self.block_size, self.hd);
        let mut t = first;
        while t <= last {
            let off = t % bs;
            let run = (bs - off).min(last + 1 - t);
            let b = self.block_table[t / bs] as usize;
            let s0 = head_base(b, self.kvh, (bs, self.kv_row), hd) + off * hd;
            let span = s0..s0 + run * hd;
            f(t - first, &self.k[span.clone()], &self.v[span]);
            t += run;
        }
    }
}

/// The query heads `qg` (each `head_dim` wide) that share `head`'s KV head,
/// for one row, into `o` (as wide). Each head's operations and their order
/// are those of a head computed alone; only the loops over heads move
/// inside the loops over runs of keys.
fn row_group<E>(
    qg: &[f32],
    head: &HeadCache<E>,
    keys: (usize, usize),
    p: &AttentionParams,
    kern: &Kernels<E>,
    (scores, inv): (&mut Vec<f32>, &mut Vec<f32>),
    sinks: Option<&[f32]>,
    o: &mut [f32],
) {
    let hd = p.head_dim;
    let nk = keys.1 + 1 - keys.0;
    scores.clear();
    scores.resize(nk * (qg.len() / hd), 0.0);
    head.runs(keys, |j, k, _| {
        for (qv, sh) in qg.chunks_exact(hd).zip(scores.chunks_exact_mut(nk)) {
            (kern.scores)(qv, k, p.scale, &mut sh[j..j + k.len() / hd]);
        }
    });
    inv.clear();
    for (h, sh) in scores.chunks_exact_mut(nk).enumerate() {
        inv.push(softmax(sh, p, kern, sinks.map(|s| s[h])));
    }
    o.fill(0.0);
    head.runs(keys, |j, _, v| {
        (kern.weighted_sum)(
            Weights {
                w: scores,
                nk,
                j,
                inv,
            },
            v,
            o,
        );
    });
}

/// One head's scores `sh` made softmax numerators in place (soft-capped
/// first where the layer asks, `exp(s - max)`), returning `1 / sum` — with
/// a sink, one more logit in the sum whose weight is dropped.
fn softmax<E>(sh: &mut [f32], p: &AttentionParams, kern: &Kernels<E>, sink: Option<f32>) -> f32 {
    if let Some(c) = p.softcap {
        for s in sh.iter_mut() {
            *s = (*s / c).tanh() * c;
        }
    }
    let max = sh
        .iter()
        .fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &s| m.max(s));
    let mut sum = (kern.exp_sum)(sh, max);
    if let Some(s) = sink {
        sum += (s - max).exp();
    }
    1.0 / sum
}

/// Rows of one sequence taken together: at most this many a task.
const ROWS_TOGETHER: usize = 32;

/// [`row_group`] for several rows of one sequence (`qs[r]`: row `r`'s
/// query heads sharing `head`'s KV head; `ranges[r]` its keys), into
/// `outs` (row after row, as wide as `qs[r]`): each run of keys and values
/// is read once for every row, and each row's runs and their arithmetic are
/// those it has alone (runs are cut at the same block boundaries).
#[allow(clippy::too_many_arguments)]
fn rows_group<E>(
    qs: &[&[f32]],
    head: &HeadCache<E>,
    ranges: &[(usize, usize)],
    p: &AttentionParams,
    kern: &Kernels<E>,
    (scores, inv): (&mut Vec<f32>, &mut Vec<f32>),
    sinks: Option<&[f32]>,
    outs: &mut [f32],
) {
    let hd = p.head_dim;
    let heads = qs.first().map_or(0, |q| q.len() / hd);
    let mut base = Vec::with_capacity(ranges.len());
    let mut total = 0;
    for &(f, l) in ranges {
        base.push(total);
        total += heads * (l + 1 - f);
    }
    scores.clear();
    scores.resize(total, 0.0);
    let union = (
        ranges.iter().map(|r| r.0).min().unwrap_or(0),
        ranges.iter().map(|r| r.1).max().unwrap_or(0),
    );
    // The part of a run (its first key `a`, `n` keys) in a row's keys.
    let part = |a: usize, n: usize, (f, l): (usize, usize)| {
        let (s, e) = (a.max(f), (a + n - 1).min(l));
        (s <= e).then_some((s, e))
    };
    head.runs(union, |j, k, _| {
        let (a, n) = (union.0 + j, k.len() / hd);
        for (r, &range) in ranges.iter().enumerate() {
            let Some((s, e)) = part(a, n, range) else {
                continue;
            };
            let nk = range.1 + 1 - range.0;
            let ks = &k[(s - a) * hd..(e + 1 - a) * hd];
            for (h, qv) in qs[r].chunks_exact(hd).enumerate() {
                let sh = &mut scores[base[r] + h * nk..base[r] + (h + 1) * nk];
                (kern.scores)(qv, ks, p.scale, &mut sh[s - range.0..e + 1 - range.0]);
            }
        }
    });
    inv.clear();
    for (r, &(f, l)) in ranges.iter().enumerate() {
        let nk = l + 1 - f;
        for h in 0..heads {
            let sh = &mut scores[base[r] + h * nk..base[r] + (h + 1) * nk];
            inv.push(softmax(sh, p, kern, sinks.map(|s| s[h])));
        }
    }
    outs.fill(0.0);
    head.runs(union, |j, _, v| {
        let (a, n) = (union.0 + j, v.len() / hd);
        for (r, &range) in ranges.iter().enumerate() {
            let Some((s, e)) = part(a, n, range) else {
                continue;
            };
            let nk = range.1 + 1 - range.0;
            (kern.weighted_sum)(
                Weights {
                    w: &scores[base[r]..base[r] + heads * nk],
                    nk,
                    j: s - range.0,
                    inv: &inv[r * heads..(r + 1) * heads],
                },
                &v[(s - a) * hd..(e + 1 - a) * hd],
                &mut outs[r * heads * hd..(r + 1) * heads * hd],
            );
        }
    });
}
