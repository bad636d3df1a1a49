//! Cross-backend op checks: every op of [`CudaBackend`] against the CPU
//! reference backend on the same (bf16-rounded) inputs, at odd sizes, GQA
//! ratios, head dims 64/128/256, prefill, chunked prefill, mixed and
//! split-KV decode batches, sliding windows, recorded (graph) decode
//! steps replayed against fresh metadata, and the device sampler against
//! its host reference (`ops/sample/check.rs`); `qkv_attention` with and
//! without QK-norm. `kiln dev cuda-check` runs it on a
//! GPU machine and writes the report.

use half::bf16;
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::prelude::*;
use kiln_tensor::{
    Activation, AttentionParams, Epilogue, ForwardBatch, KvCache, KvPoolShape, NormPrologue,
    QkNorm, RopeParams, Tensor, Weight,
};

use crate::CudaBackend;

/// One comparison: relative L2 error ‖gpu − cpu‖ / ‖cpu‖ and max abs error.
#[derive(Debug, Clone)]
pub struct Check {
    pub op: String,
    pub rel_err: f64,
    pub max_abs_err: f64,
    pub tolerance: f64,
    pub pass: bool,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }

    /// Values exactly representable in bf16, so both backends see the same.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| bf16::from_f32(self.next() * scale).to_f32())
            .collect()
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next() * 0.5 + 0.5) * n as f32) as usize % n.max(1)
    }
}

struct Pair<'a> {
    gpu: &'a CudaBackend,
    cpu: CpuBackend,
    checks: Vec<Check>,
}

type R<T> = std::result::Result<T, String>;

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

impl Pair<'_> {
    fn up(&self, shape: &[usize], data: &[f32]) -> R<(Tensor, Tensor)> {
        Ok((
            self.gpu.upload(shape, data).map_err(e)?,
            self.cpu.upload(shape, data).map_err(e)?,
        ))
    }

    fn compare(&mut self, op: String, gpu: &Tensor, cpu: &Tensor, tolerance: f64) -> R<()> {
        let g = self.gpu.to_host(gpu).map_err(e)?;
        let c = self.cpu.to_host(cpu).map_err(e)?;
        if g.len() != c.len() || gpu.shape() != cpu.shape() {
            return Err(format!(
                "{op}: shapes {:?} vs {:?}",
                gpu.shape(),
                cpu.shape()
            ));
        }
        self.push(op, &g, &c, tolerance);
        Ok(())
    }

    /// Two GPU results (a fused op against its unfused ops).
    fn compare_gpu(&mut self, op: String, a: &Tensor, b: &Tensor, tolerance: f64) -> R<()> {
        if a.shape() != b.shape() {
            return Err(format!("{op}: shapes {:?} vs {:?}", a.shape(), b.shape()));
        }
        let (g, c) = (
            self.gpu.to_host(a).map_err(e)?,
            self.gpu.to_host(b).map_err(e)?,
        );
        self.push(op, &g, &c, tolerance);
        Ok(())
    }

    fn push(&mut self, op: String, g: &[f32], c: &[f32], tolerance: f64) {
        let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
        let mut finite = true;
        for (a, b) in g.iter().zip(c) {
            finite &= a.is_finite();
            let d = (*a as f64 - *b as f64).abs();
            max_abs = max_abs.max(d);
            num += d * d;
            den += (*b as f64) * (*b as f64);
        }
        let rel = if finite {
            (num / den.max(1e-30)).sqrt()
        } else {
            f64::INFINITY
        };
        self.checks.push(Check {
            op,
            rel_err: rel,
            max_abs_err: max_abs,
            tolerance,
            pass: rel <= tolerance,
        });
    }
}

/// bf16 storage of results: about 3 significant digits.
const TOL: f64 = 1e-2;
const TOL_ATTN: f64 = 2e-2;
/// A fused op against the same GPU's unfused ops: equal by construction up
/// to the compiler's float contractions (a few bf16 ulps at most).
const TOL_SAME: f64 = 1e-3;

/// Run every check; an `Err` means a check could not run at all.
pub fn run(gpu: &CudaBackend) -> R<Vec<Check>> {
    let mut p = Pair {
        gpu,
        cpu: CpuBackend::new(),
        checks: Vec::new(),
    };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    dense_ops(&mut p, &mut rng)?;
    for &(heads, kv_heads, hd) in &[(9, 3, 64), (32, 8, 128), (4, 1, 256), (14, 2, 64)] {
        attention_ops(&mut p, &mut rng, heads, kv_heads, hd, None, (hd / 2, 1.0))?;
    }
    attention_ops(&mut p, &mut rng, 8, 2, 64, Some(48), (32, 1.0))?;
    // Partial rotary (a quarter of the head's dims rotate) with an attention scaling.
    attention_ops(&mut p, &mut rng, 12, 4, 128, None, (32, 0.9))?;
    recorded_steps(&mut p, &mut rng, &Toy::SMALL)?;
    norm_linear_ops(&mut p, &mut Rng(0x2545_F491_4F6C_DD1D))?;
    recorded_steps(&mut p, &mut rng, &Toy::WIDE)?;
    p.checks.extend(crate::ops::sample::check::checks(p.gpu)?);
    Ok(p.checks)
}

fn dense_ops(p: &mut Pair, rng: &mut Rng) -> R<()> {
    for &(k, m) in &[(576usize, 1536usize), (896, 1000), (4096, 512)] {
        let (wg, wc) = p.up(&[m, k], &rng.vec(m * k, 0.05))?;
        let (bg, bc) = p.up(&[m], &rng.vec(m, 0.5))?;
        for &n in &[1usize, 2, 3, 8, 9, 37] {
            let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 1.0))?;
            let (rg, rc) = p.up(&[n, m], &rng.vec(n * m, 1.0))?;
            let g = linear(p.gpu, &xg, &wg, None).map_err(e)?;
            let c = linear(&p.cpu, &xc, &wc, None).map_err(e)?;
            p.compare(format!("linear n={n} k={k} m={m}"), &g, &c, TOL)?;
            let g = linear(p.gpu, &xg, &wg, Some(&bg)).map_err(e)?;
            let c = linear(&p.cpu, &xc, &wc, Some(&bc)).map_err(e)?;
            p.compare(format!("linear+bias n={n} k={k} m={m}"), &g, &c, TOL)?;
            let g = linear_add(p.gpu, &xg, &wg, None, &rg).map_err(e)?;
            let c = linear_add(&p.cpu, &xc, &wc, None, &rc).map_err(e)?;
            p.compare(format!("linear_add n={n} k={k} m={m}"), &g, &c, TOL)?;
            if m % 2 == 0 {
                for act in [Activation::Silu, Activation::GeluTanh] {
                    let g = gated_linear(p.gpu, &xg, &wg, act).map_err(e)?;
                    let c = gated_linear(&p.cpu, &xc, &wc, act).map_err(e)?;
                    p.compare(
                        format!("gated_linear {act:?} n={n} k={k} 2i={m}"),
                        &g,
                        &c,
                        TOL,
                    )?;
                }
            }
        }
    }
    let (n, d) = (37usize, 896usize);
    let (xg, xc) = p.up(&[n, d], &rng.vec(n * d, 2.0))?;
    let (yg, yc) = p.up(&[n, d], &rng.vec(n * d, 2.0))?;
    let (wg, wc) = p.up(&[d], &rng.vec(d, 1.0))?;
    let g = p.gpu.rms_norm(&xg, &wg, 1e-6, 1.0).map_err(e)?;
    let c = p.cpu.rms_norm(&xc, &wc, 1e-6, 1.0).map_err(e)?;
    p.compare("rms_norm".into(), &g, &c, TOL)?;
    let g = p.gpu.rms_norm_add(&xg, &wg, 1e-6, 1.0, &yg).map_err(e)?;
    let c = p.cpu.rms_norm_add(&xc, &wc, 1e-6, 1.0, &yc).map_err(e)?;
    p.compare("rms_norm_add".into(), &g, &c, TOL)?;
    let g = p.gpu.add(&xg, &yg).map_err(e)?;
    let c = p.cpu.add(&xc, &yc).map_err(e)?;
    p.compare("add".into(), &g, &c, TOL)?;
    let g = p.gpu.scale(&xg, 0.37).map_err(e)?;
    let c = p.cpu.scale(&xc, 0.37).map_err(e)?;
    p.compare("scale".into(), &g, &c, TOL)?;
    for act in [Activation::Silu, Activation::GeluTanh] {
        let g = p.gpu.gated_activation(&xg, &yg, act).map_err(e)?;
        let c = p.cpu.gated_activation(&xc, &yc, act).map_err(e)?;
        p.compare(format!("gated_activation {act:?}"), &g, &c, TOL)?;
    }
    let ids: Vec<u32> = (0..n as u32).map(|i| i * 7919 % 1000).collect();
    let (tg, tc) = p.up(&[1000, 64], &rng.vec(64_000, 1.0))?;
    let g = p.gpu.embedding(&tg, &ids).map_err(e)?;
    let c = p.cpu.embedding(&tc, &ids).map_err(e)?;
    p.compare("embedding".into(), &g, &c, 0.0)?;
    let rows = [36u32, 0, 5, 5];
    let g = p.gpu.gather_rows(&xg, &rows).map_err(e)?;
    let c = p.cpu.gather_rows(&xc, &rows).map_err(e)?;
    p.compare("gather_rows".into(), &g, &c, 0.0)?;
    // Rows of an odd width (element by element), and every row in order.
    let (tg, tc) = p.up(&[300, 61], &rng.vec(300 * 61, 1.0))?;
    let ids: Vec<u32> = (0..n as u32).map(|i| i * 31 % 300).collect();
    let g = p.gpu.embedding(&tg, &ids).map_err(e)?;
    let c = p.cpu.embedding(&tc, &ids).map_err(e)?;
    p.compare("embedding (odd width)".into(), &g, &c, 0.0)?;
    let rows = [7u32, 299, 0];
    let g = p.gpu.gather_rows(&tg, &rows).map_err(e)?;
    let c = p.cpu.gather_rows(&tc, &rows).map_err(e)?;
    p.compare("gather_rows (odd width)".into(), &g, &c, 0.0)?;
    // Argmax rows of an odd vocabulary (element by element) with ties (values on a coarse grid:
    // the lowest index wins), and of the 8B shape's vocabulary.
    for (it, (rows, vocab, grid)) in [(3usize, 1001usize, 4.0f32), (2, 49_152, 64.0)]
        .into_iter()
        .enumerate()
    {
        let vals: Vec<f32> = rng
            .vec(rows * vocab, 3.0)
            .iter()
            .map(|v| (v * grid).round() / grid)
            .collect();
        let (lg, _) = p.up(&[rows, vocab], &vals)?;
        argmax_check(p, &lg, 100 + it)?;
    }
    let all: Vec<u32> = (0..xg.shape()[0] as u32).collect();
    let g = p.gpu.gather_rows(&xg, &all).map_err(e)?;
    let c = p.cpu.gather_rows(&xc, &all).map_err(e)?;
    p.compare("gather_rows (all, in order)".into(), &g, &c, 0.0)?;
    let g = p.gpu.split_cols(&xg, &[100, 700, 96]).map_err(e)?;
    let c = p.cpu.split_cols(&xc, &[100, 700, 96]).map_err(e)?;
    for i in 0..3 {
        p.compare(format!("split_cols part {i}"), &g[i], &c[i], 0.0)?;
    }
    let (heads, hd) = (14usize, 64usize);
    let inv_freq: Vec<f32> = (0..24)
        .map(|i| 1e4f32.powf(-(2 * i) as f32 / 48.0))
        .collect();
    let positions: Vec<u32> = (0..n as u32).map(|i| i * 97 % 4099).collect();
    let (qg, qc) = p.up(&[n, heads * hd], &rng.vec(n * heads * hd, 1.0))?;
    let rp = RopeParams {
        num_heads: heads,
        head_dim: hd,
        inv_freq: &inv_freq,
        attention_scaling: 1.0,
    };
    let g = p.gpu.rope(&qg, &positions, &rp).map_err(e)?;
    let c = p.cpu.rope(&qc, &positions, &rp).map_err(e)?;
    p.compare("rope partial rotary".into(), &g, &c, TOL)?;
    Ok(())
}

/// The RMSNorm-fused projections against the CPU (norm then product) and
/// against the GPU's own unfused ops, which they reproduce (same summation
/// order and bf16 rounding; the report's errors show how exactly). Row
/// counts 1–8 take the fused GEMV kernels, 9 the unfused path (norm, then
/// cuBLAS); k = 900 (not a multiple of 8) the unfused path (cuBLAS)
/// at every row count, k = 8192 the unfused path of `rms_norm_linear` from 6
/// rows (shared memory).
fn norm_linear_ops(p: &mut Pair, rng: &mut Rng) -> R<()> {
    for &(k, m) in &[
        (576usize, 1536usize),
        (896, 1001),
        (1000, 1002),
        (4096, 514),
        (900, 300),
        (8192, 66),
    ] {
        let (wg, wc) = p.up(&[m, k], &rng.vec(m * k, 0.05))?;
        let (bg, bc) = p.up(&[m], &rng.vec(m, 0.5))?;
        for &offset in &[0.0f32, 1.0] {
            let (ng, nc) = p.up(&[k], &rng.vec(k, 1.0))?;
            for &n in &[1usize, 2, 3, 7, 8, 9] {
                let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 2.0))?;
                let label = format!("n={n} k={k} offset={offset}");
                let hg = p.gpu.rms_norm(&xg, &ng, 1e-6, offset).map_err(e)?;
                for bias in [None, Some((&bg, &bc))] {
                    let g = rms_norm_linear(p.gpu, &xg, &ng, 1e-6, offset, &wg, bias.map(|b| b.0))
                        .map_err(e)?;
                    let c = rms_norm_linear(&p.cpu, &xc, &nc, 1e-6, offset, &wc, bias.map(|b| b.1))
                        .map_err(e)?;
                    let what = if bias.is_some() { "+bias" } else { "" };
                    p.compare(format!("rms_norm_linear{what} {label} m={m}"), &g, &c, TOL)?;
                    let u = linear(p.gpu, &hg, &wg, bias.map(|b| b.0)).map_err(e)?;
                    p.compare_gpu(
                        format!("rms_norm_linear{what} vs unfused gpu {label} m={m}"),
                        &g,
                        &u,
                        TOL_SAME,
                    )?;
                }
                if m % 2 == 0 {
                    for act in [Activation::Silu, Activation::GeluTanh] {
                        let g = rms_norm_gated_linear(p.gpu, &xg, &ng, 1e-6, offset, &wg, act)
                            .map_err(e)?;
                        let c = rms_norm_gated_linear(&p.cpu, &xc, &nc, 1e-6, offset, &wc, act)
                            .map_err(e)?;
                        let what = format!("rms_norm_gated_linear {act:?} {label} 2i={m}");
                        p.compare(what.clone(), &g, &c, TOL)?;
                        let u = gated_linear(p.gpu, &hg, &wg, act).map_err(e)?;
                        p.compare_gpu(format!("{what} vs unfused gpu"), &g, &u, TOL_SAME)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// A sequence of steps over one shared KV history on both backends.
struct Caches {
    gpu: KvCache,
    cpu: KvCache,
}

/// QK-norm weights (q, k) on the GPU and on the CPU, and the weight offset.
type QkNorms<'a> = ([(&'a Tensor, &'a Tensor); 2], f32);

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
        let (kg, kc) = p.up(&[n, kw], &rng.vec(n * kw, 1.0))?;
        let (vg, vc) = p.up(&[n, kw], &rng.vec(n * kw, 1.0))?;
        (
            p.gpu
                .attention(&qg, &kg, &vg, &mut caches.gpu, 0, batch, ap)
                .map_err(e)?,
            p.cpu
                .attention(&qc, &kc, &vc, &mut caches.cpu, 0, batch, ap)
                .map_err(e)?,
        )
    };
    let kind = match (fused, qk.is_some()) {
        (true, true) => "qkv_attention (QK-norm)",
        (true, false) => "qkv_attention",
        _ => "attention",
    };
    p.compare(
        format!(
            "{kind} {label} heads={}/{} hd={} window={:?}",
            ap.num_heads, ap.num_kv_heads, ap.head_dim, ap.sliding_window
        ),
        &g,
        &c,
        TOL_ATTN,
    )
}

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

fn attention_ops(
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
        num_kv_heads: kv_heads,
        head_dim: hd,
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
    let norms = [(&qng, &kng), (&qnc, &knc)];
    for (fused, vpre, qk) in [
        (false, true, false),
        (true, true, false),
        (true, false, false),
        (true, true, true),
    ] {
        let qk = qk.then_some((norms, offset));
        p.gpu.set_decode_vpre(vpre);
        let mut caches = Caches {
            gpu: p.gpu.alloc_kv_cache(spec).map_err(e)?,
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
        let mut b = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        b.push_seq_groups(&toks(150), 0, ta.clone(), true);
        b.push_seq_groups(&toks(100), 0, tb.clone(), true);
        b.push_seq_groups(&toks(1200), 0, td.clone(), true);
        b.push_seq_groups(&toks(600), 0, te.clone(), true);
        attention_step(p, rng, &mut caches, &b, &ap, rotary, qk, "prefill", fused)?;
        let mut b = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        b.push_seq_groups(&toks(37), 100, tb.clone(), true);
        attention_step(p, rng, &mut caches, &b, &ap, rotary, qk, "chunked", fused)?;
        let mut b = ForwardBatch {
            block_size: bs,
            ..ForwardBatch::default()
        };
        b.push_seq_groups(&toks(1), 150, held(&ta, 150), true);
        b.push_seq_groups(&toks(20), 0, tc.clone(), true);
        attention_step(p, rng, &mut caches, &b, &ap, rotary, qk, "mixed", fused)?;
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
            attention_step(p, rng, &mut caches, &b, &ap, rotary, qk, &label, fused)?;
        }
    }
    p.gpu.set_decode_vpre(true);
    Ok(())
}

/// The device argmax of `logits` against the host's on the same values.
fn argmax_check(p: &mut Pair, logits: &Tensor, it: usize) -> R<()> {
    let (rows, vocab) = logits.dims2("argmax").map_err(e)?;
    let host = p.gpu.to_host(logits).map_err(e)?;
    let Some(picked) = p.gpu.argmax_rows(logits).map_err(e)? else {
        return Err("argmax_rows is not available".into());
    };
    let mut worst = 0f64;
    let mut ok = picked.len() == rows;
    for (r, &(id, lp)) in picked.iter().enumerate().take(rows) {
        let row = &host[r * vocab..(r + 1) * vocab];
        let (best, max) = row
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc },
            );
        let lse = max as f64
            + row
                .iter()
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln();
        ok &= id as usize == best;
        worst = worst.max((lp as f64 - (max as f64 - lse)).abs());
    }
    p.checks.push(Check {
        op: format!("argmax_rows step {it}"),
        rel_err: if ok { 0.0 } else { 1.0 },
        max_abs_err: worst,
        tolerance: 1e-4,
        pass: ok && worst <= 1e-4,
    });
    Ok(())
}

/// The device's masked argmax against the host's (`masked_argmax`) on the
/// same values: every other row masked to a pseudo-random third of the ids
/// (the top id forbidden in some), one row masked to nothing.
fn masked_argmax_check(p: &mut Pair, logits: &Tensor, it: usize) -> R<()> {
    let (rows, vocab) = logits.dims2("argmax").map_err(e)?;
    let host = p.gpu.to_host(logits).map_err(e)?;
    let words = vocab.div_ceil(32);
    let masks: Vec<Option<Vec<u32>>> = (0..rows)
        .map(|r| match r % 3 {
            0 => None,
            1 => Some(
                (0..words)
                    .map(|w| (0x9e37_79b9u32.wrapping_mul((w + r + it) as u32 | 1)) & 0x4924_9249)
                    .collect(),
            ),
            _ if r == 2 => Some(vec![0; words]),
            _ => Some(vec![u32::MAX; words]),
        })
        .collect();
    let refs: Vec<Option<&[u32]>> = masks.iter().map(|m| m.as_deref()).collect();
    let Some(picked) = p.gpu.argmax_rows_masked(logits, &refs).map_err(e)? else {
        return Err("argmax_rows_masked is not available".into());
    };
    let mut ok = picked.len() == rows;
    let mut worst = 0f64;
    for (r, &(id, lp)) in picked.iter().enumerate().take(rows) {
        let want = kiln_tensor::backend::masked_argmax(&host[r * vocab..(r + 1) * vocab], refs[r]);
        ok &= id == want.0;
        worst = worst.max((lp as f64 - want.1 as f64).abs());
    }
    p.checks.push(Check {
        op: format!("argmax_rows_masked step {it}"),
        rel_err: if ok { 0.0 } else { 1.0 },
        max_abs_err: worst,
        tolerance: 1e-4,
        pass: ok && worst <= 1e-4,
    });
    Ok(())
}

/// The toy model of [`recorded_steps`]: width, heads, sequences decoded,
/// then sequences left.
struct Toy {
    d: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    seqs: usize,
    after: usize,
}

impl Toy {
    const SMALL: Toy = Toy {
        d: 256,
        heads: 4,
        kv_heads: 2,
        hd: 64,
        seqs: 3,
        after: 2,
    };
    const WIDE: Toy = Toy {
        d: 1024,
        heads: 8,
        kv_heads: 4,
        hd: 128,
        seqs: 40,
        after: 20,
    };
}

/// A toy model step (embedding → norm and packed qkv → attention → output
/// projection into the residual → norm and gated MLP into the residual →
/// norm and logits, each norm fused into its projection) run through
/// `run_step`, so decode steps are recorded and replayed, against the CPU
/// step by step. `Toy::WIDE` decodes 40 then 20 sequences (buckets 48
/// and 24): recorded steps whose products run on cuBLAS.
fn recorded_steps(p: &mut Pair, rng: &mut Rng, toy: &Toy) -> R<()> {
    let (vocab, d, heads, kv_heads, hd) = (512usize, toy.d, toy.heads, toy.kv_heads, toy.hd);
    let qkv_w = (heads + 2 * kv_heads) * hd;
    let (emb_g, emb_c) = p.up(&[vocab, d], &rng.vec(vocab * d, 1.0))?;
    let (wqkv_g, wqkv_c) = p.up(&[qkv_w, d], &rng.vec(qkv_w * d, 0.06))?;
    let (wo_g, wo_c) = p.up(&[d, heads * hd], &rng.vec(d * heads * hd, 0.06))?;
    let (head_g, head_c) = p.up(&[vocab, d], &rng.vec(vocab * d, 0.06))?;
    let (norm_g, norm_c) = p.up(&[d], &rng.vec(d, 1.0))?;
    let (gu_g, gu_c) = p.up(&[2 * d, d], &rng.vec(2 * d * d, 0.06))?;
    let (down_g, down_c) = p.up(&[d, d], &rng.vec(d * d, 0.06))?;
    let spec = KvPoolShape {
        num_layers: 1,
        num_groups: 1,
        num_blocks: 64.max(4 * toy.seqs),
        block_size: 16,
        num_kv_heads: kv_heads,
        head_dim: hd,
    };
    let ap = AttentionParams {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        scale: 0.125,
        sliding_window: None,
        softcap: None,
        kv_group: 0,
        causal: true,
    };
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| 1e4f32.powf(-((2 * i) as f32) / hd as f32))
        .collect();
    let rope = RopeParams {
        num_heads: heads,
        head_dim: hd,
        inv_freq: &inv_freq,
        attention_scaling: 1.0,
    };
    fn step(
        b: &dyn Backend,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        w: [&Tensor; 7],
        ap: &AttentionParams,
        rope: &RopeParams,
    ) -> kiln_tensor::Result<Tensor> {
        let [emb, wqkv, wo, head, norm, gu, down] = w;
        let x = b.embedding(emb, &batch.token_ids)?;
        let qkv = rms_norm_linear(b, &x, norm, 1e-6, 0.0, wqkv, None)?;
        let a = b.qkv_attention(&qkv, cache, 0, batch, ap, rope, None)?;
        let x = linear_add(b, &a, wo, None, &x)?;
        let h = rms_norm_gated_linear(b, &x, norm, 1e-6, 1.0, gu, Activation::Silu)?;
        let x = linear_add(b, &h, down, None, &x)?;
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        rms_norm_linear(b, &x, norm, 1e-6, 0.0, head, None)
    }
    let mut gc = p.gpu.alloc_kv_cache(spec).map_err(e)?;
    let mut cc = p.cpu.alloc_kv_cache(spec).map_err(e)?;
    let per = (spec.num_blocks / toy.seqs) as u32;
    let tables: Vec<Vec<u32>> = (0..toy.seqs as u32)
        .map(|s| (s * per..s * per + per).collect())
        .collect();
    let mut lens: Vec<usize> = (0..toy.seqs).map(|s| [5, 9, 30][s % 3] + s % 5).collect();
    // Prompts, eagerly (not graphable).
    let mut b = ForwardBatch {
        block_size: 16,
        ..ForwardBatch::default()
    };
    for (s, &l) in lens.iter().enumerate() {
        let toks: Vec<u32> = (0..l).map(|_| rng.below(vocab) as u32).collect();
        b.push_seq(&toks, 0, tables[s].clone(), true);
    }
    let wg = [&emb_g, &wqkv_g, &wo_g, &head_g, &norm_g, &gu_g, &down_g];
    let wc = [&emb_c, &wqkv_c, &wo_c, &head_c, &norm_c, &gu_c, &down_c];
    let g = p
        .gpu
        .run_step(&b, &mut gc, &mut |bt, c| step(p.gpu, bt, c, wg, &ap, &rope))
        .map_err(e)?;
    let c = p
        .cpu
        .run_step(&b, &mut cc, &mut |bt, c| {
            step(&p.cpu, bt, c, wc, &ap, &rope)
        })
        .map_err(e)?;
    p.compare("run_step prefill".into(), &g, &c, TOL_ATTN)?;
    // Decode steps: all sequences (3: bucket 4), the first records, the
    // rest replay; then fewer (2: bucket 2) after some finish.
    let pos = &mut lens;
    for it in 0..6 {
        let live = if it < 4 { toy.seqs } else { toy.after };
        let mut b = ForwardBatch {
            block_size: 16,
            ..ForwardBatch::default()
        };
        for s in 0..live {
            b.push_seq(&[rng.below(vocab) as u32], pos[s], tables[s].clone(), true);
            pos[s] += 1;
        }
        let g = p
            .gpu
            .run_step(&b, &mut gc, &mut |bt, c| step(p.gpu, bt, c, wg, &ap, &rope))
            .map_err(e)?;
        let c = p
            .cpu
            .run_step(&b, &mut cc, &mut |bt, c| {
                step(&p.cpu, bt, c, wc, &ap, &rope)
            })
            .map_err(e)?;
        p.compare(
            format!("run_step decode {it} ({live} seqs, d={d})"),
            &g,
            &c,
            TOL_ATTN,
        )?;
        argmax_check(p, &g, it)?;
        masked_argmax_check(p, &g, it)?;
    }
    let recorded = p.gpu.num_recordings();
    p.checks.push(Check {
        op: format!("decode steps recorded as graphs ({recorded})"),
        rel_err: 0.0,
        max_abs_err: 0.0,
        tolerance: 0.0,
        pass: !p.gpu.graphs_enabled() || recorded >= 2,
    });
    Ok(())
}

/// The products the checks compare, each one form of [`Ops::matmul`] on
/// a dense weight.
type R2 = kiln_tensor::Result<Tensor>;

fn dense(w: &Tensor) -> Weight {
    Weight::Dense(w.clone())
}

fn linear(b: &dyn Backend, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> R2 {
    b.matmul(x, &dense(w), None, Epilogue::bias(bias))
}

fn linear_add(b: &dyn Backend, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, r: &Tensor) -> R2 {
    b.matmul(x, &dense(w), None, Epilogue::bias(bias).with_residual(r))
}

fn gated_linear(b: &dyn Backend, x: &Tensor, w: &Tensor, act: Activation) -> R2 {
    b.matmul(x, &dense(w), None, Epilogue::gated(act))
}

fn prologue(weight: &Tensor, eps: f32, offset: f32) -> Option<NormPrologue<'_>> {
    Some(NormPrologue {
        weight,
        eps,
        offset,
    })
}

#[allow(clippy::too_many_arguments)]
fn rms_norm_linear(
    b: &dyn Backend,
    x: &Tensor,
    n: &Tensor,
    eps: f32,
    offset: f32,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> R2 {
    b.matmul(x, &dense(w), prologue(n, eps, offset), Epilogue::bias(bias))
}

fn rms_norm_gated_linear(
    b: &dyn Backend,
    x: &Tensor,
    n: &Tensor,
    eps: f32,
    offset: f32,
    w: &Tensor,
    act: Activation,
) -> R2 {
    b.matmul(x, &dense(w), prologue(n, eps, offset), Epilogue::gated(act))
}
