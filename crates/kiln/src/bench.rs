//! `kiln bench`: prefill and decode speed over several runs, as JSON.

use std::ops::ControlFlow;

use anyhow::Result;
use clap::Args;
use kiln_engine::{GenerationRequest, LoadedModel};
use kiln_sampling::SamplingParams;
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

fn stats(mut v: Vec<f64>) -> serde_json::Value {
    v.sort_by(|a, b| a.total_cmp(b));
    let median = if v.is_empty() { 0.0 } else { v[v.len() / 2] };
    json!({"median": median, "min": v.first(), "max": v.last(), "runs": v})
}

pub fn run(a: BenchArgs) -> Result<()> {
    let model = a.model.load()?;
    let prompt = bench_prompt(&model, a.prompt_tokens)?;
    let req = GenerationRequest {
        prompt,
        params: SamplingParams {
            max_tokens: Some(a.gen_tokens),
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        skip_special_tokens: true,
    };
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for run in 0..=a.runs {
        let g = model.generate(&req, &mut |_| ControlFlow::Continue(()))?;
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
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    let report = json!({
        "engine": "kiln",
        "model": model.path.display().to_string(),
        "backend": model.model.backend().name(),
        "threads": rayon::current_num_threads(),
        "cpu": cpu,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "load_seconds": model.load_seconds,
        "prefill_tokens_per_second": stats(prefill),
        "decode_tokens_per_second": stats(decode),
    });
    println!("{report}");
    Ok(())
}
