//! `kiln bench-engine`: the engine loop under load on CPU — aggregate
//! throughput at several concurrency levels, and time to first token with
//! and without a cached shared prefix. Prints one JSON object.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kiln_engine::{Engine, EngineConfig, EngineHandle, Event, GenerationRequest, RequestStream};
use kiln_sampling::SamplingParams;
use serde_json::json;

use crate::cli::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Concurrency levels to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16])]
    pub concurrency: Vec<usize>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Generated tokens per request (end-of-sequence ignored).
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Shared prefix length for the time-to-first-token test.
    #[arg(long, default_value_t = 1000)]
    pub prefix_tokens: usize,
    /// KV cache memory in MiB (default: on a GPU, what is free after the
    /// weights and an activation reserve; on the CPU, 1024).
    #[arg(long)]
    pub kv_mib: Option<usize>,
    /// Fraction of each level's requests constrained to a JSON schema
    /// (structured output under load; masks are counted per step).
    #[arg(long, default_value_t = 0.0)]
    pub json_fraction: f64,
    /// Sampling temperature of the measured requests (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass of the measured requests.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k of the measured requests (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// LoRA adapters (PEFT directories): request i of each level runs
    /// with adapter i mod N (all of them resident).
    #[arg(long)]
    pub lora: Vec<std::path::PathBuf>,
}

/// The schema of constrained requests: open strings keep a random model
/// writing until its token budget.
fn bench_schema() -> kiln_structured::Format {
    kiln_structured::Format::JsonSchema(json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "bio": {"type": "string"}
        },
        "required": ["name", "age", "tags", "bio"]
    }))
}

const TEXT: &str = "The history of the printing press begins in the fifteenth century, when movable type made \
    books cheaper to produce. Knowledge spread quickly across Europe, and literacy rose in cities and villages \
    alike. Scholars exchanged letters, merchants kept better records, and new ideas reached readers everywhere. ";

fn tokens(h: &EngineHandle, lead: &str, n: usize) -> Result<Vec<u32>> {
    let tok = &h.model().tokenizer;
    let mut out = tok.encode(lead, false)?;
    let body = tok.encode(TEXT, false)?;
    while out.len() < n {
        out.extend_from_slice(&body[..(n - out.len()).min(body.len())]);
    }
    out.truncate(n);
    Ok(out)
}

fn request(prompt: Vec<u32>, gen: usize, salt: Option<String>) -> GenerationRequest {
    let mut r = GenerationRequest::new(
        prompt,
        SamplingParams {
            max_tokens: Some(gen),
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
    );
    r.cache_salt = salt;
    r
}

/// Time to first token as the engine measured it (queue + prefill), seconds
/// from `start` to the end as read here, and tokens generated.
fn drain(stream: RequestStream, start: Instant) -> Result<(f64, f64, usize)> {
    let mut n = 0;
    for ev in stream {
        match ev {
            Event::Token { token_id, .. } if token_id != u32::MAX => n += 1,
            Event::Finished { timings, .. } => {
                return Ok((
                    timings.queue_seconds + timings.prefill_seconds,
                    start.elapsed().as_secs_f64(),
                    n,
                ))
            }
            Event::Failed { message, .. } => anyhow::bail!("request failed: {message}"),
            _ => {}
        }
    }
    anyhow::bail!("the stream ended without finishing")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn run(a: BenchEngineArgs) -> Result<()> {
    let model = a.model.load()?;
    let backend_name = model.model.backend().name();
    let path = model.path.display().to_string();
    let plan = EngineConfig::plan(
        &model,
        a.kv_mib.map(|m| m << 20),
        model.context_length().min(256),
    )?;
    eprintln!("kiln bench-engine: {plan}");
    let cfg = plan.config;
    let engine = Engine::start(model, cfg)?;
    let h = engine.handle();
    h.adapters().set_max_loaded(a.lora.len().max(1));
    let adapters = a
        .lora
        .iter()
        .enumerate()
        .map(|(i, dir)| {
            let name = format!("lora{i}");
            h.adapters()
                .add(&name, dir)
                .with_context(|| format!("loading {}", dir.display()))?;
            h.adapters()
                .get(&name)?
                .ok_or_else(|| anyhow::anyhow!("adapter {name} not resident"))
        })
        .collect::<Result<Vec<_>>>()?;
    // Warm-up.
    drain(
        h.submit(request(
            tokens(&h, "Warm-up. ", 32)?,
            4,
            Some("warm".into()),
        ))?,
        Instant::now(),
    )?;
    if a.json_fraction > 0.0 {
        // The schema compiled once, as on a server that has seen it: the
        // levels measure steady-state throughput, not the first compile.
        let mut r = request(tokens(&h, "Warm-up. ", 32)?, 4, Some("warm".into()));
        r.format = Some(bench_schema());
        drain(h.submit(r)?, Instant::now())?;
    }
    let mut levels = Vec::new();
    for (round, &c) in a.concurrency.iter().enumerate() {
        let before = h.stats()?;
        let requests = (0..c)
            .map(|i| {
                // A distinct salt per request: no prefix sharing inflates the numbers.
                let p = tokens(
                    &h,
                    &format!("Request {i} of round {round}. "),
                    a.prompt_tokens,
                )?;
                let mut r = request(p, a.gen_tokens, Some(format!("r{round}-{i}")));
                r.params.temperature = a.temperature;
                r.params.top_p = a.top_p;
                r.params.top_k = a.top_k;
                r.params.seed = Some(i as u64);
                if !adapters.is_empty() {
                    r.adapter = Some(adapters[i % adapters.len()].clone());
                }
                // Spread the constrained requests evenly over the batch.
                let f = a.json_fraction.clamp(0.0, 1.0);
                if ((i + 1) as f64 * f).floor() > (i as f64 * f).floor() {
                    r.format = Some(bench_schema());
                    r.params.ignore_eos = false;
                }
                Ok(r)
            })
            .collect::<Result<Vec<_>>>()?;
        let start = Instant::now();
        // Submitted from a thread each, as a server's clients would: the
        // engine admits what arrived during a step all at once (one thread
        // waiting for each admission would add one request per step).
        let streams = std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .into_iter()
                .map(|r| scope.spawn(|| h.submit(r)))
                .collect();
            handles
                .into_iter()
                .map(|t| {
                    t.join()
                        .map_err(|_| anyhow::anyhow!("a submitting thread panicked"))?
                        .map_err(anyhow::Error::from)
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let mut ttft = Vec::new();
        let mut generated = 0;
        for s in streams {
            let (f, _, n) = drain(s, start)?;
            ttft.push(f);
            generated += n;
        }
        let wall = start.elapsed().as_secs_f64();
        let after = h.stats()?;
        // Steps in which every running request decoded one token (after the
        // prompts are in): the decode throughput, as batched-decode
        // benchmarks report it.
        let d_steps = after.decode_steps - before.decode_steps;
        let d_tokens = after.decode_step_tokens - before.decode_step_tokens;
        let d_secs = after.decode_step_seconds_total - before.decode_step_seconds_total;
        let decode_tps = d_tokens as f64 / d_secs.max(1e-9);
        eprintln!(
            "concurrency {c}: {:.1} generated tok/s overall, {decode_tps:.1} tok/s in {d_steps} decode steps, median TTFT {:.3}s",
            generated as f64 / wall,
            median(ttft.clone())
        );
        levels.push(json!({
            "concurrency": c,
            "wall_seconds": wall,
            "generated_tokens": generated,
            "generated_tokens_per_second": generated as f64 / wall,
            "total_tokens_per_second": (generated + c * a.prompt_tokens) as f64 / wall,
            "ttft_median_seconds": median(ttft),
            "decode_steps": d_steps,
            "decode_step_tokens": d_tokens,
            "decode_tokens_per_second": decode_tps,
            "forward_seconds": after.step_seconds_total - before.step_seconds_total,
            "json_fraction": a.json_fraction,
            "temperature": a.temperature,
            "top_p": a.top_p,
            "top_k": a.top_k,
            "lora_adapters": adapters.len(),
            "mask_steps": after.mask_steps - before.mask_steps,
            "masks": after.masks - before.masks,
            "mask_seconds": after.mask_seconds_total - before.mask_seconds_total,
            "mask_wait_seconds": after.mask_wait_seconds_total - before.mask_wait_seconds_total,
        }));
    }
    // Time to first token with and without a cached prefix (salts keep them apart).
    let prefix = tokens(&h, "Shared document. ", a.prefix_tokens)?;
    let ask = |q: &str| -> Result<Vec<u32>> {
        let mut p = prefix.clone();
        p.extend(h.model().tokenizer.encode(q, false)?);
        Ok(p)
    };
    let t = Instant::now();
    let (cold, _, _) = drain(
        h.submit(request(ask(" Question one?")?, 1, Some("prefix".into())))?,
        t,
    )?;
    let t = Instant::now();
    let (warm, _, _) = drain(
        h.submit(request(
            ask(" Question two, different?")?,
            1,
            Some("prefix".into()),
        ))?,
        t,
    )?;
    let stats = h.stats()?;
    let device_memory = h.model().model.backend().device_memory().map(|m| {
        json!({
            "total_bytes": m.total_bytes,
            "free_bytes": m.free_bytes,
            "active_bytes": m.active_bytes,
            "peak_active_bytes": m.peak_active_bytes,
            "reserved_bytes": m.reserved_bytes,
        })
    });
    eprintln!(
        "TTFT with a {}-token prefix: cold {cold:.3}s, cached {warm:.3}s",
        a.prefix_tokens
    );
    let report = json!({
        "engine": format!("kiln (engine loop, {backend_name} backend)"),
        "model": path,
        "threads": rayon::current_num_threads(),
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "kv_blocks": cfg.num_blocks,
        "levels": levels,
        "prefix_tokens": a.prefix_tokens,
        "ttft_uncached_seconds": cold,
        "ttft_cached_seconds": warm,
        "ttft_speedup": cold / warm.max(1e-9),
        "prefix_cache_hit_tokens": stats.prefix_cache.num_hit_tokens,
        "num_preemptions": stats.num_preemptions,
        "kv_bytes": plan.kv_bytes,
        "device_memory": device_memory,
        "peak_rss_bytes": crate::generate::peak_rss_bytes(),
    });
    println!("{report}");
    Ok(())
}
