//! `kiln bench`: prefill and decode speed over several runs, as JSON.

use std::ops::ControlFlow;
use std::sync::Arc;

use rayon::prelude::*;

use anyhow::Result;
use clap::Args;
use kiln_engine::{GenerationRequest, LoadedModel};
use kiln_sampling::SamplingParams;
use kiln_tensor::profile::{OpTime, ProfilingBackend};
use kiln_tensor::{QuantFormat, WeightKind};
use serde_json::json;

use crate::cli::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens to generate (greedy, end-of-sequence ignored).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Measured runs after one warm-up run.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Also time every backend op, for prefill and for decode separately.
    #[arg(long)]
    pub profile: bool,
    #[command(flatten)]
    pub speculative: crate::cli::SpeculativeArgs,
}

/// `kiln bench --speculative ...`: the same prompt through the engine,
/// which speculates; decode speed and acceptance of each run.
fn run_speculative(a: BenchArgs) -> Result<()> {
    let backend = a.model.backend()?;
    let model = a.model.load_on(backend.clone())?;
    let draft = a.speculative.load_draft(backend)?;
    let prompt = bench_prompt(&model, a.prompt_tokens)?;
    let path = model.path.display().to_string();
    let engine = crate::generate::speculative_engine(
        model,
        draft,
        &a.speculative,
        a.prompt_tokens + a.gen_tokens,
    )?;
    let h = engine.handle();
    let (mut decode, mut rates) = (Vec::new(), Vec::new());
    for run in 0..=a.runs {
        let mut req = GenerationRequest::new(
            prompt.clone(),
            SamplingParams {
                max_tokens: Some(a.gen_tokens),
                ignore_eos: true,
                ..SamplingParams::greedy()
            },
        );
        // Each run computes its prompt: no prefix hits across runs.
        req.cache_salt = Some(format!("run{run}"));
        let r = crate::generate::run_on_engine(&h, req, &mut |_| {})?;
        let tps = r.ids.len().saturating_sub(1) as f64 / r.timings.decode_seconds.max(1e-9);
        let rate = r.usage.accepted_draft_tokens as f64 / r.usage.draft_tokens.max(1) as f64;
        eprintln!(
            "{} {run}: decode {tps:.1} tok/s, {} of {} drafts accepted",
            if run == 0 { "warm-up" } else { "run" },
            r.usage.accepted_draft_tokens,
            r.usage.draft_tokens
        );
        if run > 0 {
            decode.push(tps);
            rates.push(rate);
        }
    }
    println!(
        "{}",
        json!({
            "engine": "kiln",
            "model": path,
            "speculative": format!("{:?}", a.speculative.speculative).to_lowercase(),
            "speculative_tokens": a.speculative.speculative_tokens,
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "decode_tokens_per_second": stats(decode),
            "acceptance_rate": stats(rates),
        })
    );
    Ok(())
}

/// The CPU's model name from /proc/cpuinfo (empty where there is none).
pub(crate) fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default()
}

/// A prompt of exactly `n` tokens: ordinary English text, repeated.
fn bench_prompt(model: &LoadedModel, n: usize) -> Result<Vec<u32>> {
    const TEXT: &str = "The history of the printing press begins in the fifteenth century, when \
        movable type made books cheaper to produce. Knowledge spread quickly across Europe, and \
        literacy rose in cities and villages alike. Scholars exchanged letters, merchants kept \
        better records, and new ideas about science and government reached readers everywhere. ";
    let ids = model.tokenizer.encode(TEXT, false)?;
    anyhow::ensure!(!ids.is_empty(), "the tokenizer produced no tokens");
    let mut out = Vec::with_capacity(n);
    if let Some(bos) = model
        .model
        .config()
        .bos_token_id
        .filter(|_| model.tokenizer.add_bos())
    {
        out.push(bos);
    }
    while out.len() < n {
        out.extend_from_slice(&ids[..(n - out.len()).min(ids.len())]);
    }
    Ok(out)
}

/// Host memory read bandwidth in GB/s: the median of several parallel dot
/// products over a buffer far larger than the caches (the same access
/// pattern as a decode step's weight reads).
fn read_bandwidth_gbs() -> f64 {
    const N: usize = 128 << 20; // 512 MiB of f32
    let buf: Vec<f32> = (0..N).map(|i| (i % 7) as f32).collect();
    let dot = kiln_tensor::cpu::matmul::dot_fn();
    let mut runs = Vec::new();
    for _ in 0..5 {
        let start = std::time::Instant::now();
        let s: f32 = buf.par_chunks(1 << 16).map(|c| dot(c, c)).sum();
        let dt = start.elapsed().as_secs_f64();
        std::hint::black_box(s);
        runs.push((N * 4) as f64 / dt / 1e9);
    }
    runs.sort_by(|a, b| a.total_cmp(b));
    runs[runs.len() / 2]
}

/// Bytes of weights one decode step reads: every weight as the backend
/// holds it (blocks as stored where it keeps them), less the embedding
/// table (rows are looked up) unless the output shares it.
fn weight_bytes_per_token(model: &LoadedModel) -> Result<f64> {
    let cfg = model.model.config();
    let backend = model.model.backend();
    let target = kiln_engine::memory::MemoryTarget {
        weight_bytes_per_element: backend.weight_bytes_per_element(),
        keeps_blocks: backend.supports_weight(WeightKind::Blocks(QuantFormat::Q8_0)),
        on_device: backend.device_memory().is_some(),
        ..kiln_engine::memory::MemoryTarget::cpu()
    };
    let blocks = crate::fit::block_bytes(&model.path, cfg, model.quantized, target.on_device)?;
    let held = kiln_engine::memory::held_weights(cfg, &target, &blocks)?;
    // The embedding's looked-up rows, and a sparse model's idle experts,
    // are not read (kiln_models::decode_share).
    Ok(held
        .iter()
        .map(|w| w.1 as f64 * kiln_models::decode_share(cfg, &w.0))
        .sum())
}

fn stats(mut v: Vec<f64>) -> serde_json::Value {
    v.sort_by(|a, b| a.total_cmp(b));
    let median = if v.is_empty() { 0.0 } else { v[v.len() / 2] };
    json!({"median": median, "min": v.first(), "max": v.last(), "runs": v})
}

/// Per-op seconds of one prefill and of the decode steps after it.
fn profile_ops(
    model: &LoadedModel,
    prof: &ProfilingBackend,
    req: &GenerationRequest,
) -> Result<serde_json::Value> {
    let prefill_only = GenerationRequest {
        params: SamplingParams {
            max_tokens: Some(1),
            ..req.params.clone()
        },
        ..req.clone()
    };
    prof.reset();
    let g1 = model.generate(&prefill_only, &mut |_| ControlFlow::Continue(()))?;
    let prefill = prof.snapshot();
    prof.reset();
    let g = model.generate(req, &mut |_| ControlFlow::Continue(()))?;
    let full = prof.snapshot();
    let table = |m: &std::collections::BTreeMap<&'static str, OpTime>,
                 base: Option<&std::collections::BTreeMap<&'static str, OpTime>>,
                 wall: f64| {
        let mut rows: Vec<(String, f64, u64)> = m
            .iter()
            .map(|(k, v)| {
                let b = base.and_then(|b| b.get(k)).copied().unwrap_or_default();
                (k.to_string(), v.seconds - b.seconds, v.calls - b.calls)
            })
            .collect();
        rows.sort_by(|x, y| y.1.total_cmp(&x.1));
        let ops: Vec<_> = rows
            .iter()
            .map(|(k, s, c)| json!({"op": k, "seconds": s, "calls": c, "share_of_wall": s / wall.max(1e-9)}))
            .collect();
        json!({"wall_seconds": wall, "ops": ops})
    };
    let decode_wall =
        g.timings.prefill_seconds + g.timings.decode_seconds - g1.timings.prefill_seconds;
    Ok(json!({
        "prefill": table(&prefill, None, g1.timings.prefill_seconds),
        "decode": table(&full, Some(&prefill), decode_wall),
    }))
}

pub fn run(a: BenchArgs) -> Result<()> {
    // Load-time lines (kernel compile and load times) on stderr; the report is stdout's.
    crate::logging::init(crate::logging::LogFormat::Text);
    if a.speculative.on() {
        return run_speculative(a);
    }
    let (model, prof) = if a.profile {
        let p = Arc::new(ProfilingBackend::new(a.model.backend()?));
        (a.model.load_on(p.clone())?, Some(p))
    } else {
        (a.model.load()?, None)
    };
    let prompt = bench_prompt(&model, a.prompt_tokens)?;
    let req = GenerationRequest {
        prompt,
        params: SamplingParams {
            max_tokens: Some(a.gen_tokens),
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        skip_special_tokens: true,
        ..Default::default()
    };
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    let mut first_token_after_start = None;
    for run in 0..=a.runs {
        let g = model.generate(&req, &mut |_| {
            first_token_after_start.get_or_insert_with(|| {
                crate::PROCESS_START
                    .get()
                    .map(|s| s.elapsed().as_secs_f64())
            });
            ControlFlow::Continue(())
        })?;
        let t = g.timings;
        eprintln!(
            "{} {}: prefill {:.1} tok/s ({} tokens), decode {:.1} tok/s ({} tokens)",
            if run == 0 { "warm-up" } else { "run" },
            run,
            t.prefill_tokens_per_second(),
            t.prompt_tokens,
            t.decode_tokens_per_second(),
            t.generated_tokens
        );
        if run > 0 {
            prefill.push(t.prefill_tokens_per_second());
            decode.push(t.decode_tokens_per_second());
        }
    }
    let cpu = cpu_model();
    let profile = match &prof {
        Some(p) => Some(profile_ops(&model, p, &req)?),
        None => None,
    };
    let backend = model.model.backend();
    let device_bandwidth = backend.measure_copy_bandwidth_gbs();
    let bandwidth = device_bandwidth.unwrap_or_else(read_bandwidth_gbs);
    let bytes = weight_bytes_per_token(&model)?;
    // A hybrid model's recurrent state: read and written once a token.
    let state_bytes = 2.0 * model.model.state_bytes_per_seq() as f64;
    let decode_median = {
        let mut d = decode.clone();
        d.sort_by(|a, b| a.total_cmp(b));
        d.get(d.len() / 2).copied().unwrap_or(0.0)
    };
    let achieved = (bytes + state_bytes) * decode_median / 1e9;
    let report = json!({
        "engine": "kiln",
        "model": model.path.display().to_string(),
        "backend": model.model.backend().name(),
        "threads": rayon::current_num_threads(),
        "cpu_matmul": format!("{:?}", crate::cli::CPU_MATMUL.get().copied().unwrap_or_default()).to_lowercase(),
        "cpu_matmul_fast_kernel": kiln_tensor::cpu::quant::CpuMatmul::fast_kernel_name(),
        "kv_cache_dtype": crate::cli::KV_CACHE_DTYPE
            .get()
            .copied()
            .unwrap_or_default()
            .name(),
        "cpu": cpu,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "load_seconds": model.load_seconds,
        "process_start_to_first_token_seconds": first_token_after_start.flatten(),
        "prefill_tokens_per_second": stats(prefill),
        "decode_tokens_per_second": stats(decode),
        "decode_weight_bytes_per_token": bytes,
        "decode_state_bytes_per_token": state_bytes,
        "decode_achieved_gbs": achieved,
        "bandwidth_gbs": bandwidth,
        "bandwidth_kind": if device_bandwidth.is_some() { "device copy, read + write counted" } else { "host read" },
        "decode_fraction_of_bandwidth": achieved / bandwidth,
        "profile": profile,
    });
    println!("{report}");
    Ok(())
}
