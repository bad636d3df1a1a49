//! Cross-backend op checks: every op of [`CudaBackend`] against the CPU
//! reference backend on the same (bf16-rounded) inputs, at odd sizes, GQA
//! ratios, head dims 64/128/256, prefill, chunked prefill, mixed and
//! split-KV decode batches, sliding windows, recorded (graph) decode
//! steps replayed against fresh metadata, and the device sampler against
//! its host reference (`ops/sample/check.rs`); `qkv_attention` with and
//! without QK-norm (`attention.rs`; recorded steps and the sampler in
//! `steps.rs`), the recurrent mixers (`recurrent.rs`) and Mixture-of-Experts
//! layers (`moe.rs`). `kiln dev cuda-check` runs it on a GPU machine and writes
//! the report.

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
    // Bidirectional (EmbeddingGemma: one KV head of 256, a window of 257 each way).
    bidirectional_ops(&mut p, &mut rng, 8, 2, 64, None)?;
    bidirectional_ops(&mut p, &mut rng, 4, 1, 256, Some(257))?;
    bidirectional_ops(&mut p, &mut rng, 8, 2, 64, Some(48))?;
    sinks_ops(&mut p, &mut rng, None)?;
    sinks_ops(&mut p, &mut rng, Some(128))?;
    recorded_steps(&mut p, &mut rng, &Toy::SMALL)?;
    norm_linear_ops(&mut p, &mut Rng(0x2545_F491_4F6C_DD1D))?;
    lora_ops(&mut p, &mut rng)?;
    blocks::block_ops(&mut p, &mut rng)?;
    recurrent::recurrent_ops(&mut p, &mut rng)?;
    recurrent::recorded_recurrent_steps(&mut p, &mut rng)?;
    moe::moe_ops(&mut p, &mut rng)?;
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
    let cap = kiln_tensor::SoftCap { cap: 1.3 };
    let g = p.gpu.extension(&cap, &xg).map_err(e)?;
    let c = p.cpu.extension(&cap, &xc).map_err(e)?;
    p.compare("extension softcap".into(), &g, &c, TOL)?;
    let ln = kiln_tensor::LayerNorm {
        weight: rng.vec(d, 1.0),
        bias: rng.vec(d, 0.5),
        eps: 1e-12,
    };
    let g = p.gpu.extension(&ln, &xg).map_err(e)?;
    let c = p.cpu.extension(&ln, &xc).map_err(e)?;
    p.compare("extension layer_norm".into(), &g, &c, TOL)?;
    let g = p.gpu.extension(&kiln_tensor::GeluErf, &xg).map_err(e)?;
    let c = p.cpu.extension(&kiln_tensor::GeluErf, &xc).map_err(e)?;
    p.compare("extension gelu_erf".into(), &g, &c, TOL)?;
    mla_ops(p, rng)?;
    for act in [Activation::Silu, Activation::GeluTanh] {
        let g = p.gpu.gated_activation(&xg, &yg, act).map_err(e)?;
        let c = p.cpu.gated_activation(&xc, &yc, act).map_err(e)?;
        p.compare(format!("gated_activation {act:?}"), &g, &c, TOL)?;
    }
    let ids: Vec<u32> = (0..n as u32).map(|i| i * 7919 % 1000).collect();
    let (tg, tc) = p.up(&[1000, 64], &rng.vec(64_000, 1.0))?;
    let g = p
        .gpu
        .embedding(&Weight::Dense(tg.clone()), &ids)
        .map_err(e)?;
    let c = p
        .cpu
        .embedding(&Weight::Dense(tc.clone()), &ids)
        .map_err(e)?;
    p.compare("embedding".into(), &g, &c, 0.0)?;
    let rows = [36u32, 0, 5, 5];
    let g = p.gpu.gather_rows(&xg, &rows).map_err(e)?;
    let c = p.cpu.gather_rows(&xc, &rows).map_err(e)?;
    p.compare("gather_rows".into(), &g, &c, 0.0)?;
    // Rows of an odd width (element by element), and every row in order.
    let (tg, tc) = p.up(&[300, 61], &rng.vec(300 * 61, 1.0))?;
    let ids: Vec<u32> = (0..n as u32).map(|i| i * 31 % 300).collect();
    let g = p
        .gpu
        .embedding(&Weight::Dense(tg.clone()), &ids)
        .map_err(e)?;
    let c = p
        .cpu
        .embedding(&Weight::Dense(tc.clone()), &ids)
        .map_err(e)?;
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
mod attention;
mod blocks;
mod moe;
mod recurrent;
mod steps;

use attention::{attention_ops, bidirectional_ops, sinks_ops};
use steps::{argmax_check, recorded_steps, Toy};

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

/// `lora_add` and `lora_apply` against the CPU: a packed q/k/v output
/// (parts 576/192/192, and 100/103/97: widths and starts off the expands'
/// 8-column pieces) with two adapters of ranks 4 and 16 over uneven row runs (tiles of 8 and
/// 8 rows, chunks of k), the rows of no adapter left alone; the product
/// taken in place and on a copy; more segments than one launch holds. Steps
/// of 37 and 40 rows run the CUDA-core kernels; steps of 400 and 160 rows
/// (k not a multiple of 32) the tensor-core ones, whatever
/// `CudaOptions::lora_mma_rows` says; every case with both CUDA-core
/// expands, whatever `CudaOptions::lora_expand8` says.
fn lora_ops(p: &mut Pair, rng: &mut Rng) -> R<()> {
    let small = [0usize..5, 10..12, 5..10, 20..37];
    let large = [0usize..5, 10..12, 5..10, 20..250, 300..333, 340..400];
    let qkv = [0usize..576, 576..768, 768..960];
    // Parts of widths and starts off the 8-column pieces (the expands' odd-edge paths).
    let odd = [0usize..100, 100..203, 203..300];
    // Every case with the one-column and the 8-column CUDA-core expands.
    for wide in [false, true] {
        lora_case(p, rng, 576, 37, &small[..2], &small[2..], 40, &qkv, wide)?;
        lora_case(p, rng, 584, 400, &large[..3], &large[3..], 160, &qkv, wide)?;
        lora_case(p, rng, 200, 37, &small[..2], &small[2..], 9, &odd, wide)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn lora_case(
    p: &mut Pair,
    rng: &mut Rng,
    k: usize,
    n: usize,
    rows1: &[std::ops::Range<usize>],
    rows2: &[std::ops::Range<usize>],
    one_row_runs: usize,
    parts: &[std::ops::Range<usize>; 3],
    wide: bool,
) -> R<()> {
    let v = if wide { ", 8-column expand" } else { "" };
    use kiln_tensor::{LoraDelta, LoraProj};
    let width = parts[2].end;
    let proj =
        |p: &Pair, rng: &mut Rng, r: usize, out: usize, scale: f32| -> R<(LoraProj, LoraProj)> {
            let (ag, ac) = p.up(&[r, k], &rng.vec(r * k, 0.1))?;
            let (bg, bc) = p.up(&[out, r], &rng.vec(out * r, 0.1))?;
            Ok((
                LoraProj {
                    a: ag,
                    b: bg,
                    scale,
                },
                LoraProj {
                    a: ac,
                    b: bc,
                    scale,
                },
            ))
        };
    // Adapter 1 (r 4) adapts q and v; adapter 2 (r 16) q, k and v.
    let (wq, wk, wv) = (parts[0].len(), parts[1].len(), parts[2].len());
    let q1 = proj(p, rng, 4, wq, 2.0)?;
    let v1 = proj(p, rng, 4, wv, 2.0)?;
    let q2 = proj(p, rng, 16, wq, 0.5)?;
    let k2 = proj(p, rng, 16, wk, 0.5)?;
    let v2 = proj(p, rng, 16, wv, 0.5)?;
    let spec: [(&[std::ops::Range<usize>], &(LoraProj, LoraProj), usize); 5] = [
        (rows1, &q1, 0),
        (rows1, &v1, 2),
        (rows2, &q2, 0),
        (rows2, &k2, 1),
        (rows2, &v2, 2),
    ];
    let deltas = |gpu: bool| -> Vec<LoraDelta<'_>> {
        spec.iter()
            .map(|(rows, pr, part)| LoraDelta {
                rows,
                proj: if gpu { &pr.0 } else { &pr.1 },
                cols: parts[*part].clone(),
            })
            .collect()
    };
    let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 1.0))?;
    let (yg, yc) = p.up(&[n, width], &rng.vec(n * width, 1.0))?;
    let c = p.cpu.lora_add(&yc, &xc, &deltas(false)).map_err(e)?;
    let kept = yg.clone();
    let before = p.gpu.to_host(&yg).map_err(e)?;
    let gpu_add = |y: &Tensor, x: &Tensor, d: &[kiln_tensor::LoraDelta<'_>]| {
        crate::ops::lora::lora_add_rows(p.gpu, y, x, d, 128, wide).map_err(e)
    };
    let g = gpu_add(&yg, &xg, &deltas(true))?;
    p.compare(
        format!("lora_add on a copy (2 adapters, packed q/k/v; {n} rows, k {k}, width {width}{v})"),
        &g,
        &c,
        TOL,
    )?;
    let after = p.gpu.to_host(&kept).map_err(e)?;
    p.push(
        format!("lora_add on a copy leaves its input ({n} rows, width {width}{v})"),
        &after,
        &before,
        0.0,
    );
    drop(kept);
    let g = gpu_add(&yg, &xg, &deltas(true))?;
    p.compare(
        format!("lora_add in place (2 adapters, packed q/k/v; {n} rows, k {k}, width {width}{v})"),
        &g,
        &c,
        TOL,
    )?;
    // The deltas with the gated activation of packed [gate | up] columns
    // and with a residual sum (lora_expand_epi_bf16 when the step takes the
    // CUDA-core kernels; the unfused ops otherwise): against the CPU's
    // unfused ops, and the fused pass against the GPU's unfused ops, bit
    // for bit.
    // (A fresh y, held twice: the unfused deltas take a copy, not y.)
    let (yg, yc) = p.up(&[n, width], &rng.vec(n * width, 1.0))?;
    let _held = yg.clone();
    let (rg, rc) = p.up(&[n, width], &rng.vec(n * width, 1.0))?;
    let (rhg, rhc) = p.up(&[n, width / 2], &rng.vec(n * width / 2, 1.0))?;
    for (what, act, residual) in [
        ("SiLU-gated", Some(Activation::Silu), None),
        ("GELU-gated", Some(Activation::GeluTanh), None),
        ("residual", None, Some((&rg, &rc))),
    ] {
        let after = |gpu: bool| Epilogue {
            bias: None,
            gated: act,
            residual: residual.map(|r| if gpu { r.0 } else { r.1 }),
        };
        let c = kiln_tensor::lora_apply_unfused(&p.cpu, &yc, &xc, &deltas(false), after(false))
            .map_err(e)?;
        for mma_rows in [usize::MAX, 128] {
            let g = crate::ops::lora::lora_apply(
                p.gpu,
                &yg,
                &xg,
                &deltas(true),
                after(true),
                mma_rows,
                wide,
            )
            .map_err(e)?;
            let path = if n >= mma_rows {
                "tensor-core, unfused"
            } else {
                "fused"
            };
            p.compare(
                format!("lora_apply {what} ({path}; {n} rows, k {k}, width {width}{v})"),
                &g,
                &c,
                TOL,
            )?;
            if n < mma_rows {
                let u =
                    kiln_tensor::lora_apply_unfused(p.gpu, &yg, &xg, &deltas(true), after(true))
                        .map_err(e)?;
                p.compare_gpu(
                    format!(
                        "lora_apply {what} fused = the GPU's unfused ops ({n} rows, width {width}{v})"
                    ),
                    &g,
                    &u,
                    0.0,
                )?;
            }
        }
    }
    // The gated activation of rows of no adapter only.
    let c = p.cpu.gated_packed(&yc, Activation::Silu).map_err(e)?;
    let c = p.cpu.add(&rhc, &c).map_err(e)?;
    let none: Vec<LoraDelta<'_>> = Vec::new();
    let g = crate::ops::lora::lora_apply(
        p.gpu,
        &yg,
        &xg,
        &none,
        Epilogue {
            bias: None,
            gated: Some(Activation::Silu),
            residual: None,
        },
        usize::MAX,
        wide,
    )
    .map_err(e)?;
    let g = p.gpu.add(&rhg, &g).map_err(e)?;
    p.compare(
        format!("lora_apply gated, no adapter rows ({n} rows, width {width}{v})"),
        &g,
        &c,
        TOL,
    )?;
    // One row a run: more segments than one launch takes.
    let n = one_row_runs;
    let rows: Vec<_> = (0..n).map(|i| i..i + 1).collect();
    let (xg, xc) = p.up(&[n, k], &rng.vec(n * k, 1.0))?;
    let (yg, yc) = p.up(&[n, width], &rng.vec(n * width, 1.0))?;
    let d = |proj| LoraDelta {
        rows: &rows,
        proj,
        cols: parts[0].clone(),
    };
    let c = p.cpu.lora_add(&yc, &xc, &[d(&q2.1)]).map_err(e)?;
    let g = gpu_add(&yg, &xg, &[d(&q2.0)])?;
    p.compare(
        format!("lora_add over {n} one-row runs (width {width}{v})"),
        &g,
        &c,
        TOL,
    )?;
    Ok(())
}

/// Latent attention's extension ops (`kiln_tensor::mla`) at DeepSeek-V3's
/// head sizes and at a tiny checkpoint's, against the CPU.
fn mla_ops(p: &mut Pair, rng: &mut Rng) -> R<()> {
    for (h, dn, dr, c, dv) in [(4usize, 128, 64, 512, 128), (3, 8, 8, 16, 12)] {
        let n = 19;
        let (wk_g, wk_c) = p.up(&[h, dn, c], &rng.vec(h * dn * c, 0.1))?;
        let (wv_g, wv_c) = p.up(&[h, dv, c], &rng.vec(h * dv * c, 0.1))?;
        let (nw_g, nw_c) = p.up(&[c], &rng.vec(c, 1.0))?;
        let query = |w_uk| kiln_tensor::MlaQuery {
            heads: h,
            nope: dn,
            rope: dr,
            latent: c,
            w_uk,
        };
        let kv = |weight| kiln_tensor::MlaKv {
            rope: dr,
            latent: c,
            weight,
            eps: 1e-6,
        };
        let output = |w_uv| kiln_tensor::MlaOutput {
            heads: h,
            rope: dr,
            latent: c,
            value: dv,
            w_uv,
        };
        let name = format!("heads={h} nope={dn} rope={dr} latent={c} value={dv}");
        let (xg, xc) = p.up(&[n, h * (dn + dr)], &rng.vec(n * h * (dn + dr), 1.0))?;
        let g = p.gpu.extension(&query(wk_g), &xg).map_err(e)?;
        let cpu = p.cpu.extension(&query(wk_c), &xc).map_err(e)?;
        p.compare(format!("extension mla_query {name}"), &g, &cpu, TOL)?;
        let (xg, xc) = p.up(&[n, c + dr], &rng.vec(n * (c + dr), 2.0))?;
        let g = p.gpu.extension(&kv(nw_g), &xg).map_err(e)?;
        let cpu = p.cpu.extension(&kv(nw_c), &xc).map_err(e)?;
        p.compare(format!("extension mla_kv {name}"), &g, &cpu, TOL)?;
        let (xg, xc) = p.up(&[n, h * (dr + c)], &rng.vec(n * h * (dr + c), 1.0))?;
        let g = p.gpu.extension(&output(wv_g), &xg).map_err(e)?;
        let cpu = p.cpu.extension(&output(wv_c), &xc).map_err(e)?;
        p.compare(format!("extension mla_output {name}"), &g, &cpu, TOL)?;
    }
    Ok(())
}
