//! Attention checks: every path of `attention` and `qkv_attention` (prefill,
//! chunked, mixed, split-KV decode; two KV groups, a window's freed entries;
//! a pool wider than the layer, a value norm and `attention_shared`, as
//! Gemma 4 runs them; an FP8 cache, the CPU's keys and values rounded as
//! the GPU stores them) against the CPU.

use super::*;
use kiln_quant::{dequant::e4m3_to_f32, quantize::f32_to_e4m3};

struct Caches {
    gpu: KvCache,
    cpu: KvCache,
}

/// QK-norm weights (q, k, and v if normed) on the GPU and on the CPU, and
/// the weight offset.
type QkNorms<'a> = ([(&'a Tensor, &'a Tensor, Option<&'a Tensor>); 2], f32);

#[allow(clippy::too_many_arguments)]
fn attention_step(
    p: &mut Pair,
    rng: &mut Rng,
    caches: &mut Caches,
    batch: &ForwardBatch,
    ap: &AttentionParams,
    rotary: (&[f32], f32),
    qk: Option<QkNorms>,
    label: &str,
    fused: bool,
    fp8: bool,
) -> R<()> {
    let n = batch.num_tokens();
    let (qw, kw) = (ap.num_heads * ap.head_dim, ap.num_kv_heads * ap.head_dim);
    let rope = RopeParams {
        num_heads: ap.num_heads,
        head_dim: ap.head_dim,
        inv_freq: rotary.0,
        attention_scaling: rotary.1,
    };
    let norm = |side: usize| {
        qk.map(|(w, weight_offset)| QkNorm {
            v_weight: w[side].2,
            q_weight: w[side].0,
            k_weight: w[side].1,
            eps: 1e-6,
            weight_offset,
        })
    };
    let (g, c) = if fused {
        let (xg, xc) = p.up(&[n, qw + 2 * kw], &rng.vec(n * (qw + 2 * kw), 1.0))?;
        (
            p.gpu
                .qkv_attention(&xg, &mut caches.gpu, 0, batch, ap, &rope, norm(0))
                .map_err(e)?,
            p.cpu
                .qkv_attention(&xc, &mut caches.cpu, 0, batch, ap, &rope, norm(1))
                .map_err(e)?,
        )
    } else {
        let (qg, qc) = p.up(&[n, qw], &rng.vec(n * qw, 1.0))?;
        // An FP8 cache: the CPU's keys and values rounded to E4M3 as the
        // GPU stores them (round to nearest, saturating), so only the
        // attention's arithmetic differs.
        let up_kv = |p: &Pair, v: Vec<f32>| -> R<(Tensor, Tensor)> {
            let rounded: Vec<f32> = if fp8 {
                v.iter().map(|&x| e4m3_to_f32(f32_to_e4m3(x))).collect()
            } else {
                v.clone()
            };
            Ok((
                p.gpu.upload(&[n, kw], &v).map_err(e)?,
                p.cpu.upload(&[n, kw], &rounded).map_err(e)?,
            ))
        };
        let (kg, kc) = up_kv(p, rng.vec(n * kw, 1.0))?;
        let (vg, vc) = up_kv(p, rng.vec(n * kw, 1.0))?;
        (
            p.gpu
                .attention(&qg, &kg, &vg, &mut caches.gpu, 0, batch, ap)
                .map_err(e)?,
            p.cpu
                .attention(&qc, &kc, &vc, &mut caches.cpu, 0, batch, ap)
                .map_err(e)?,
        )
    };
    let kind = match (fused, qk) {
        (true, Some(([(_, _, Some(_)), _], _))) => "qkv_attention (QKV-norm)",
        (true, Some(_)) => "qkv_attention (QK-norm)",
        (true, None) => "qkv_attention",
        _ => "attention",
    };
    // Fused over an FP8 cache, the keys the kernel rotates are rounded to
    // E4M3 on the GPU only: the rounding's error (a few percent a value),
    // not a layout's (order one), is what the tolerance allows.
    let (kind, tol) = match (fp8, fused) {
        (false, _) => (kind.to_string(), TOL_ATTN),
        (true, false) => (format!("{kind} (fp8 cache)"), TOL_ATTN),
        (true, true) => (
            format!("{kind} (fp8 cache, unrounded reference)"),
            TOL_FP8_KV,
        ),
    };
    p.compare(
        format!(
            "{kind} {label} heads={}/{} hd={} window={:?} pool row {}",
            ap.num_heads, ap.num_kv_heads, ap.head_dim, ap.sliding_window, caches.gpu.spec.kv_row
        ),
        &g,
        &c,
        tol,
    )
}

/// [`attention_step`]'s tolerance for a fused step over an FP8 cache
/// against the CPU's unrounded keys and values.
const TOL_FP8_KV: f64 = 0.08;

/// Blocks for sequences, handed out in a shuffled order.
struct Blocks(Vec<u32>);

impl Blocks {
    fn new(rng: &mut Rng, n: usize) -> Self {
        let mut v: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            v.swap(i, rng.below(i + 1));
        }
        Blocks(v)
    }

    fn take(&mut self, n: usize) -> Vec<u32> {
        let at = self.0.len() - n;
        self.0.split_off(at)
    }
}

pub(super) fn attention_ops(
    p: &mut Pair,
    rng: &mut Rng,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    window: Option<usize>,
    (half, scaling): (usize, f32),
) -> R<()> {
    let bs = 16;
    // Two KV groups (as Gemma's global and sliding layers): a windowed
    // layer reads group 1's tables and slots, the others group 0's.
    let spec = KvPoolShape {
        num_layers: 1,
        num_groups: 2,
        num_blocks: 400,
        block_size: bs,
        kv_row: kv_heads * hd,
    };
    let group = usize::from(window.is_some());
    let ap = AttentionParams {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        scale: (hd as f32).powf(-0.5),
        sliding_window: window,
        softcap: None,
        kv_group: group,
        causal: true,
    };
    // A decode step's tables as the engine passes them: a windowed group's
    // entries before the window (freed) name its first held block.
    let held = |t: &Vec<Vec<u32>>, pos: usize| -> Vec<Vec<u32>> {
        let mut t = t.clone();
        if let Some(w) = window {
            let first = (pos + 1).saturating_sub(w) / bs;
            let keep = t[1][first];
            t[1][..first].fill(keep);
        }
        t
    };
    // `half` rotated pairs (hd / 2: the whole head).
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1e4f32.powf(-((2 * i) as f32) / (2 * half) as f32))
        .collect();
    let rotary = (inv_freq.as_slice(), scaling);
    // Unfused ops and qkv_attention; split decode steps with values loaded
    // with keys (the default) and apart.
    // QK-norm (Qwen3, Gemma 3: weight offset 1 at head dim 256) through the
    // fused path too.
    let offset = if hd == 256 { 1.0 } else { 0.0 };
    let (qn, kn) = (rng.vec(hd, 0.5), rng.vec(hd, 0.5));
    let (qng, qnc) = p.up(&[hd], &qn)?;
    let (kng, knc) = p.up(&[hd], &kn)?;
    let (vng, vnc) = p.up(&[hd], &rng.vec(hd, 0.5))?;
    let norms = [(&qng, &kng, None), (&qnc, &knc, None)];
    let qkv_norms = [(&qng, &kng, Some(&vng)), (&qnc, &knc, Some(&vnc))];
    // The last pass is Gemma 4's: a value norm, a pool twice the layer's
    // width (a wider layer elsewhere in the model), and a layer that
    // attends over this one's cache.
    for (fused, vpre, qk, gemma4, fp8) in [
        (false, true, false, false, false),
        (true, true, false, false, false),
        (true, false, false, false, false),
        (true, true, true, false, false),
        (true, true, true, true, false),
        (false, true, false, false, true),
        (false, false, false, false, true),
        (true, true, true, false, true),
    ] {
        let qk = qk.then_some((if gemma4 { qkv_norms } else { norms }, offset));
        let spec = KvPoolShape {
            kv_row: if gemma4 { 2 } else { 1 } * spec.kv_row,
            ..spec
        };
        p.gpu.set_decode_vpre(vpre);
        let mut caches = Caches {
            gpu: crate::ops::attention::cache::alloc_kv_cache_as(p.gpu, spec, fp8).map_err(e)?,
            cpu: p.cpu.alloc_kv_cache(spec).map_err(e)?,
        };
        let mut blocks = Blocks::new(rng, spec.num_blocks);
        // A: 150-token prompt from scratch; B: 100 tokens, then 37 more
        // (chunked prefill); then a mixed step (A decodes, C prefills 20);
        // then decode steps of A, B, C and two long sequences (split KV).
        let mut two = |n: usize| vec![blocks.take(n), blocks.take(n)];
        let ta = two(12);
        let tb = two(10);
        let tc = two(4);
        let td = two(80);
        let te = two(40);
        let toks = |n: usize| vec![0u32; n];
        // One step of this pass, against the CPU.
        let run =
            |p: &mut Pair, rng: &mut Rng, caches: &mut Caches, b: &ForwardBatch, label: &str| {
                attention_step(p, rng, caches, b, &ap, rotary, qk, label, fused, fp8)
            };
        let mut b = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        b.push_seq_groups(&toks(150), 0, ta.clone(), true);
        b.push_seq_groups(&toks(100), 0, tb.clone(), true);
        b.push_seq_groups(&toks(1200), 0, td.clone(), true);
        b.push_seq_groups(&toks(600), 0, te.clone(), true);
        run(p, rng, &mut caches, &b, "prefill")?;
        let mut b = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        b.push_seq_groups(&toks(37), 100, tb.clone(), true);
        run(p, rng, &mut caches, &b, "chunked")?;
        let mut b = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        b.push_seq_groups(&toks(1), 150, held(&ta, 150), true);
        b.push_seq_groups(&toks(20), 0, tc.clone(), true);
        run(p, rng, &mut caches, &b, "mixed")?;
        let apart = if vpre { "" } else { " (values apart)" };
        for (step, label) in [(0, "decode"), (1, "decode 2")] {
            let mut b = ForwardBatch {
                block_size: bs,
                ..ForwardBatch::default()
            };
            for (at, t) in [(151, &ta), (137, &tb), (20, &tc), (1200, &td), (600, &te)] {
                b.push_seq_groups(&toks(1), at + step, held(t, at + step), true);
            }
            let label = format!("{label}{apart}");
            run(p, rng, &mut caches, &b, &label)?;
        }
        // A layer sharing the cache: new queries over what is there, one
        // a sequence (decode) and two (prefill).
        for per in [1, 2].into_iter().filter(|_| gemma4) {
            let mut b = ForwardBatch {
                block_size: bs,
                ..ForwardBatch::default()
            };
            for (at, t) in [(150, &ta), (136, &tb), (1200, &td)] {
                b.push_seq_groups(&toks(per), at, held(t, at + per - 1), true);
            }
            let (qw, n) = (heads * hd, 3 * per);
            let (qg, qc) = p.up(&[n, qw], &rng.vec(n * qw, 1.0))?;
            let g = p
                .gpu
                .attention_shared(&qg, &mut caches.gpu, 0, &b, &ap)
                .map_err(e)?;
            let c = p
                .cpu
                .attention_shared(&qc, &mut caches.cpu, 0, &b, &ap)
                .map_err(e)?;
            let label = format!(
                "attention_shared {per} a row heads={heads}/{kv_heads} hd={hd} window={window:?} pool row {}",
                spec.kv_row
            );
            p.compare(label, &g, &c, TOL_ATTN)?;
        }
    }
    p.gpu.set_decode_vpre(true);
    Ok(())
}

/// Bidirectional attention (encoders: EmbeddingGemma), with and without a
/// window: a prompt step of three sequences, one of them a single token
/// (a decode-shaped step), by `attention` and `qkv_attention`.
pub(super) fn bidirectional_ops(
    p: &mut Pair,
    rng: &mut Rng,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    window: Option<usize>,
) -> R<()> {
    let bs = 16;
    let spec = KvPoolShape {
        num_layers: 1,
        num_groups: 1,
        num_blocks: 64,
        block_size: bs,
        kv_row: kv_heads * hd,
    };
    let ap = AttentionParams {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        scale: (hd as f32).powf(-0.5),
        sliding_window: window,
        softcap: None,
        kv_group: 0,
        causal: false,
    };
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 1e4f32.powf(-((2 * i) as f32) / hd as f32))
        .collect();
    for fused in [false, true] {
        let mut caches = Caches {
            gpu: p.gpu.alloc_kv_cache(spec).map_err(e)?,
            cpu: p.cpu.alloc_kv_cache(spec).map_err(e)?,
        };
        let mut blocks = Blocks::new(rng, spec.num_blocks);
        for (label, lens) in [
            ("prompts", vec![300usize, 37, 1]),
            ("single tokens", vec![1, 1]),
        ] {
            let mut b = ForwardBatch {
                block_size: bs,
                ..ForwardBatch::default()
            };
            for &len in &lens {
                b.push_seq_groups(
                    &vec![0u32; len],
                    0,
                    vec![blocks.take(len.div_ceil(bs))],
                    true,
                );
            }
            let label = format!("bidirectional {label}");
            attention_step(
                p,
                rng,
                &mut caches,
                &b,
                &ap,
                (&inv_freq, 1.0),
                None,
                &label,
                fused,
                false,
            )?;
        }
    }
    Ok(())
}

/// Attention with a sink logit a head (gpt-oss), full and with a window:
/// a prefill step of three sequences (the flash kernel), then two decode
/// steps (the split-KV kernel; the longest sequence split).
pub(super) fn sinks_ops(p: &mut Pair, rng: &mut Rng, window: Option<usize>) -> R<()> {
    let (heads, kv_heads, hd, bs) = (8, 2, 64, 16);
    let spec = KvPoolShape {
        num_layers: 1,
        num_groups: 1,
        num_blocks: 128,
        block_size: bs,
        kv_row: kv_heads * hd,
    };
    let ap = AttentionParams {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        scale: (hd as f32).powf(-0.5),
        sliding_window: window,
        softcap: None,
        kv_group: 0,
        causal: true,
    };
    let mut caches = Caches {
        gpu: p.gpu.alloc_kv_cache(spec).map_err(e)?,
        cpu: p.cpu.alloc_kv_cache(spec).map_err(e)?,
    };
    // Sinks around the rows' logits, so that they take a real share.
    let (sg, sc) = p.up(&[heads], &rng.vec(heads, 3.0))?;
    let mut blocks = Blocks::new(rng, spec.num_blocks);
    let (ta, tb, tc) = (
        vec![blocks.take(12)],
        vec![blocks.take(4)],
        vec![blocks.take(60)],
    );
    let (qw, kw) = (heads * hd, kv_heads * hd);
    for (step, label) in [
        (None, "prefill"),
        (Some(0), "decode"),
        (Some(1), "decode 2"),
    ] {
        let mut b = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        match step {
            None => {
                b.push_seq_groups(&[0; 150], 0, ta.clone(), true);
                b.push_seq_groups(&[0; 40], 0, tb.clone(), true);
                b.push_seq_groups(&[0; 900], 0, tc.clone(), true);
            }
            Some(s) => {
                b.push_seq_groups(&[0], 150 + s, ta.clone(), true);
                b.push_seq_groups(&[0], 40 + s, tb.clone(), true);
                b.push_seq_groups(&[0], 900 + s, tc.clone(), true);
            }
        }
        let n = b.num_tokens();
        let (qg, qc) = p.up(&[n, qw], &rng.vec(n * qw, 1.0))?;
        let (kg, kc) = p.up(&[n, kw], &rng.vec(n * kw, 1.0))?;
        let (vg, vc) = p.up(&[n, kw], &rng.vec(n * kw, 1.0))?;
        let g = p
            .gpu
            .attention_sinks(&qg, &kg, &vg, &mut caches.gpu, 0, &b, &ap, &sg)
            .map_err(e)?;
        let c = p
            .cpu
            .attention_sinks(&qc, &kc, &vc, &mut caches.cpu, 0, &b, &ap, &sc)
            .map_err(e)?;
        p.compare(
            format!("attention_sinks {label} heads={heads}/{kv_heads} hd={hd} window={window:?}"),
            &g,
            &c,
            TOL_ATTN,
        )?;
    }
    Ok(())
}
