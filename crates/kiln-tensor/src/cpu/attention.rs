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
                let head = HeadCache {
                    k: k_cache,
                    v: v_cache,
                    block_table: seq.block_tables[p.kv_group].as_slice(),
                    block_size: batch.block_size,
                    kv_row,
                    kvh,
                    hd,
                };
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
                let head = HeadCache {
                    k: k_cache,
                    v: v_cache,
                    block_table: seq.block_tables[p.kv_group].as_slice(),
                    block_size: batch.block_size,
                    kv_row,
                    kvh,
                    hd,
                };
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

/// The softmax weights of a run of keys for each head of a group: head
/// `h`'s weight of the run's key `t` is `w[h·nk + j + t] · inv[h]`.
#[derive(Clone, Copy)]
pub(crate) struct Weights<'a> {
    w: &'a [f32],
    nk: usize,
    j: usize,
    inv: &'a [f32],
}

/// The inner loops of one (row, head), chosen once per CPU, element and
/// head size.
pub(crate) struct Kernels<E> {
    /// `s[t] = (q · k[t]) * scale` for the rows `k[t]` of `k`.
    scores: fn(&[f32], &[E], f32, &mut [f32]),
    /// `s[t] = exp(s[t] - max)`, returning their sum.
    exp_sum: fn(&mut [f32], f32) -> f32,
    /// For each head `h` of a group (`o` holds them, `head_dim` each):
    /// `o_h += (w_h[t] · inv_h) · v[t]` in ascending `t` (the run's rows
    /// `v[t]`), each head's sums as if it were alone.
    weighted_sum: fn(Weights, &[E], &mut [f32]),
}

mod portable {
    use super::{Kernels, KvElem, Weights};

    pub fn kernels<E: KvElem>() -> Kernels<E> {
        Kernels {
            scores: scores::<E>,
            exp_sum,
            weighted_sum: weighted_sum::<E>,
        }
    }

    /// By the dense product's dot (f16 keys widened into a row first).
    pub fn scores<E: KvElem>(q: &[f32], k: &[E], scale: f32, s: &mut [f32]) {
        let dot = super::super::matmul::dot_fn();
        if std::any::TypeId::of::<E>() == std::any::TypeId::of::<f32>() {
            // SAFETY: E is f32, so the slice is one of f32s.
            let k = unsafe { std::slice::from_raw_parts(k.as_ptr() as *const f32, k.len()) };
            for (s, kr) in s.iter_mut().zip(k.chunks_exact(q.len())) {
                *s = dot(q, kr) * scale;
            }
            return;
        }
        let mut row = vec![0f32; q.len()];
        for (s, kr) in s.iter_mut().zip(k.chunks_exact(q.len())) {
            for (r, &x) in row.iter_mut().zip(kr) {
                *r = x.to_f32();
            }
            *s = dot(q, &row) * scale;
        }
    }

    pub fn exp_sum(s: &mut [f32], max: f32) -> f32 {
        let mut sum = 0f32;
        for s in s.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        sum
    }

    /// Head by head, element by element, no fused multiply-add.
    pub fn weighted_sum<E: KvElem>(ws: Weights, v: &[E], o: &mut [f32]) {
        let hd = o.len() / ws.inv.len();
        let n = v.len() / hd;
        for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
            let w = &ws.w[h * ws.nk + ws.j..h * ws.nk + ws.j + n];
            for (&w, vr) in w.iter().zip(v.chunks_exact(hd)) {
                let a = w * ws.inv[h];
                for (o, &x) in oh.iter_mut().zip(vr) {
                    *o += a * x.to_f32();
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Kernels, KvElem, Weights};
    use crate::cpu::vmath::avx512::exp16;

    pub fn detected() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Only handed out after [`detected`], for head sizes that are
    /// multiples of 16.
    pub const fn kernels<E: KvElem>() -> Kernels<E> {
        Kernels {
            scores: scores::<E>,
            exp_sum,
            weighted_sum: weighted_sum::<E>,
        }
    }

    /// Sixteen keys or values of `p` as f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16<E: KvElem>(p: *const E) -> __m512 {
        // SAFETY: the caller's 16 elements are readable.
        unsafe {
            if E::F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
            } else {
                _mm512_loadu_ps(p as *const f32)
            }
        }
    }

    fn scores<E: KvElem>(q: &[f32], k: &[E], scale: f32, s: &mut [f32]) {
        // SAFETY: selected only after detecting avx512f; hd % 16 == 0.
        unsafe { scores_inner(q, k, scale, s) }
    }

    /// Sixteen keys at a time (independent accumulators, rows past the
    /// run clamped to its last and their scores dropped), each dot in 16
    /// lanes over ascending `d`, then the 16 accumulators reduced together
    /// by [`reduce16`] (every key's lanes summed by the same tree).
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_inner<E: KvElem>(q: &[f32], k: &[E], scale: f32, s: &mut [f32]) {
        let hd = q.len();
        let n = s.len();
        assert!(k.len() >= n * hd && hd % 16 == 0);
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        for t0 in (0..n).step_by(16) {
            let m = (n - t0).min(16);
            let rows: [*const E; 16] = std::array::from_fn(|r| {
                // SAFETY: row t0 + min(r, m − 1) < n is inside k.
                unsafe { kp.add((t0 + r.min(m - 1)) * hd) }
            });
            let mut acc = [_mm512_setzero_ps(); 16];
            let mut d = 0;
            while d < hd {
                // SAFETY: d + 16 <= hd, inside q and every row.
                unsafe {
                    let qv = _mm512_loadu_ps(qp.add(d));
                    for (a, row) in acc.iter_mut().zip(rows) {
                        *a = _mm512_fmadd_ps(qv, load16(row.add(d)), *a);
                    }
                }
                d += 16;
            }
            let v = _mm512_mul_ps(reduce16(&acc), _mm512_set1_ps(scale));
            // SAFETY: the mask covers the m scores of this chunk.
            unsafe {
                _mm512_mask_storeu_ps(s.as_mut_ptr().add(t0), ((1u32 << m) - 1) as __mmask16, v)
            };
        }
    }

    /// Lane `i` of the result is the sum of the lanes of `v[i]`, each by
    /// the same tree: `(((0+8)+(4+12))+((2+10)+(6+14)))+(((1+9)+(5+13))+((3+11)+(7+15)))`
    /// (a 16 × 16 transpose folded into the additions: 45 instructions for
    /// 16 dots instead of a reduction each).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce16(v: &[__m512; 16]) -> __m512 {
        let x: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        let y: [__m512; 4] = std::array::from_fn(|i| {
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        });
        let z: [__m512; 2] = std::array::from_fn(|i| {
            let (a, b) = (y[2 * i], y[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        let r = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(z[0], z[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(z[0], z[1]),
        );
        // Lane l holds key (l % 4)·4 + l / 4: a 4 × 4 transpose back.
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(idx, r)
    }

    fn exp_sum(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: selected only after detecting avx512f.
        unsafe { exp_sum_inner(s, max) }
    }

    /// Lane `l` sums the exponentials at `t ≡ l (mod 16)` in ascending `t`
    /// (the tail masked in), then the lanes by the fixed shuffle order.
    #[target_feature(enable = "avx512f")]
    unsafe fn exp_sum_inner(s: &mut [f32], max: f32) -> f32 {
        let m = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        for c in s.chunks_mut(16) {
            let mask: __mmask16 = if c.len() == 16 {
                !0
            } else {
                (1u16 << c.len()) - 1
            };
            // SAFETY: the mask covers only the chunk's elements.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, c.as_ptr());
                let e = exp16(_mm512_sub_ps(x, m));
                let e = _mm512_maskz_mov_ps(mask, e);
                _mm512_mask_storeu_ps(c.as_mut_ptr(), mask, e);
                acc = _mm512_add_ps(acc, e);
            }
        }
        _mm512_reduce_add_ps(acc)
    }

    fn weighted_sum<E: KvElem>(ws: Weights, v: &[E], o: &mut [f32]) {
        // SAFETY: selected only after detecting avx512f; hd % 16 == 0.
        unsafe { weighted_sum_inner(ws, v, o) }
    }

    /// Up to six heads and 64 dims at a time: each run row `v[t]` is
    /// loaded once for them, each head's columns accumulate
    /// `fma(w_h[t] · inv_h, v[t], o_h)` in ascending `t` (its own sums,
    /// as alone).
    #[target_feature(enable = "avx512f")]
    unsafe fn weighted_sum_inner<E: KvElem>(ws: Weights, v: &[E], o: &mut [f32]) {
        let heads = ws.inv.len();
        let hd = o.len() / heads.max(1);
        let n = v.len() / hd.max(1);
        assert!(hd % 16 == 0 && o.len() == heads * hd);
        assert!(heads == 0 || ws.w.len() >= (heads - 1) * ws.nk + ws.j + n);
        let mut h = 0;
        while h < heads {
            let nh = (heads - h).min(6);
            let mut d = 0;
            while d < hd {
                // SAFETY: heads h..h + nh and columns d.. are inside o, the
                // weights inside w.
                d += unsafe {
                    let c = (hd - d) / 16;
                    match nh {
                        6 => columns_dyn::<E, 6>(ws, v, o, h, d, c),
                        5 => columns_dyn::<E, 5>(ws, v, o, h, d, c),
                        4 => columns_dyn::<E, 4>(ws, v, o, h, d, c),
                        3 => columns_dyn::<E, 3>(ws, v, o, h, d, c),
                        2 => columns_dyn::<E, 2>(ws, v, o, h, d, c),
                        _ => columns_dyn::<E, 1>(ws, v, o, h, d, c),
                    }
                };
            }
            h += nh;
        }
    }

    /// [`columns`] for the columns left (four at most).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn columns_dyn<E: KvElem, const H: usize>(
        ws: Weights,
        v: &[E],
        o: &mut [f32],
        h: usize,
        d: usize,
        c: usize,
    ) -> usize {
        // SAFETY: as the caller's.
        unsafe {
            match c {
                4.. => columns::<E, H, 4>(ws, v, o, h, d),
                3 => columns::<E, H, 3>(ws, v, o, h, d),
                2 => columns::<E, H, 2>(ws, v, o, h, d),
                _ => columns::<E, H, 1>(ws, v, o, h, d),
            }
        }
    }

    /// Heads `h..h + H`, columns `d..d + 16·C`; returns `16·C`.
    ///
    /// # Safety
    /// AVX-512F; the heads and columns are inside `o`, their weights
    /// inside `ws.w`, and `v` holds the run's rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn columns<E: KvElem, const H: usize, const C: usize>(
        ws: Weights,
        v: &[E],
        o: &mut [f32],
        h: usize,
        d: usize,
    ) -> usize {
        let heads = ws.inv.len();
        let hd = o.len() / heads;
        let n = v.len() / hd;
        let (vp, op, wp) = (v.as_ptr(), o.as_mut_ptr(), ws.w.as_ptr());
        // SAFETY: as the function's contract.
        unsafe {
            let at = |hh: usize, c: usize| op.add((h + hh) * hd + d + 16 * c);
            let mut acc: [[__m512; C]; H] =
                std::array::from_fn(|hh| std::array::from_fn(|c| _mm512_loadu_ps(at(hh, c))));
            let inv: [f32; H] = std::array::from_fn(|hh| ws.inv[h + hh]);
            let wrow: [*const f32; H] = std::array::from_fn(|hh| wp.add((h + hh) * ws.nk + ws.j));
            for t in 0..n {
                let row = vp.add(t * hd + d);
                let x: [__m512; C] = std::array::from_fn(|c| load16(row.add(16 * c)));
                for hh in 0..H {
                    let a = _mm512_set1_ps(*wrow[hh].add(t) * inv[hh]);
                    for c in 0..C {
                        acc[hh][c] = _mm512_fmadd_ps(a, x[c], acc[hh][c]);
                    }
                }
            }
            for (hh, acc) in acc.iter().enumerate() {
                for (c, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(at(hh, c), *a);
                }
            }
        }
        16 * C
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
        let round =
            |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| E::from_f32(x).to_f32()).collect() };
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
                    let at =
                        |m: &Vec<f32>, t: usize| m[t * kv_heads * hd + kvh * hd..][..hd].to_vec();
                    let s: Vec<f64> = (0..=row)
                        .map(|t| {
                            let k = at(&kd, t);
                            (0..hd).map(|d| qv[d] as f64 * k[d] as f64).sum::<f64>()
                                * p.scale as f64
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
}
