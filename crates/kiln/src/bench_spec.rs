//! `kiln bench-spec`: speculative decoding side by side with plain decoding
//! on one workload, in one run — each method on a fresh engine over the
//! same requests (greedy), its decode speed, acceptance and whether its
//! outputs equal the plain ones. Prints one JSON object.
//!
//! Workloads: `edit` (rewrite a given source file with a small change: the
//! code-editing case, where the file itself is the prediction), `complete`
//! (continue the first lines of a source file: the draft model's case) and
//! `repeat` (copy a text given in the prompt: the n-gram case, also on
//! random weights).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kiln_engine::{GenerationRequest, LoadedModel, SpeculativeMethod};
use kiln_sampling::SamplingParams;
use serde_json::{json, Value};

use crate::cli::{ModelArgs, SpeculativeArgs};
use crate::generate::{run_on_engine, speculative_engine, EngineRun};

#[derive(Args, Debug)]
pub struct BenchSpecArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// edit, complete or repeat.
    #[arg(long, default_value = "edit")]
    pub workload: String,
    /// The source file of the edit and complete workloads.
    #[arg(long)]
    pub file: Option<std::path::PathBuf>,
    /// The edit: rename this identifier (`old=new`).
    #[arg(long, default_value = "randomise=randomize")]
    pub rename: String,
    /// Lines of the file the complete workload gives as its prompt.
    #[arg(long, default_value_t = 60)]
    pub prompt_lines: usize,
    /// Tokens to generate (complete and repeat; edit: the file's length and 64).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Prompt tokens of the repeat workload.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Methods to compare: off, ngram, prediction (the workload's expected
    /// output as OpenAI's `prediction`), draft (--draft-model).
    #[arg(long, value_delimiter = ',', default_value = "off,ngram,prediction")]
    pub methods: Vec<String>,
    /// Concurrent requests (each level on every method).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub concurrency: Vec<usize>,
    /// The draft model of the draft method.
    #[arg(long)]
    pub draft_model: Option<String>,
    /// The most draft tokens a step.
    #[arg(long, default_value_t = kiln_engine::speculative::DEFAULT_NUM_TOKENS)]
    pub speculative_tokens: usize,
    /// Speculation stops above this many running requests.
    #[arg(long, default_value_t = kiln_engine::speculative::DEFAULT_MAX_BATCH)]
    pub speculative_max_batch: usize,
    /// Also time every backend op of each method's measured requests.
    #[arg(long)]
    pub profile: bool,
}

/// A workload: the prompt, its expected output (the prediction) and how
/// many tokens to allow.
struct Workload {
    prompt: Vec<u32>,
    prediction: Option<Vec<u32>>,
    max_tokens: usize,
}

const TEXT: &str = "The history of the printing press begins in the fifteenth century, when \
    movable type made books cheaper to produce. Knowledge spread quickly across Europe, and \
    literacy rose in cities and villages alike. Scholars exchanged letters, merchants kept \
    better records, and new ideas about science and government reached readers everywhere. ";

fn workload(a: &BenchSpecArgs, model: &LoadedModel) -> Result<Workload> {
    let tok = &model.tokenizer;
    let source = || -> Result<String> {
        let f = a.file.as_ref().context("this workload needs --file")?;
        std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))
    };
    match a.workload.as_str() {
        "edit" => {
            let file = source()?;
            let (old, new) = a.rename.split_once('=').context("--rename is old=new")?;
            let q = format!(
                "Here is a Python file:\n```python\n{file}```\nRename `{old}` to `{new}` everywhere \
                 in it. Reply with the complete updated file in one ```python block and nothing else."
            );
            let r = model.render_chat(&json!([{"role": "user", "content": q}]), true)?;
            let expected = format!("```python\n{}```", file.replace(old, new));
            let prediction = tok.encode(&format!("```python\n{file}```"), false)?;
            Ok(Workload {
                prompt: tok.encode(&r, false)?,
                max_tokens: tok.encode(&expected, false)?.len() + 64,
                prediction: Some(prediction),
            })
        }
        "complete" => {
            let file = source()?;
            let lines: Vec<&str> = file.lines().collect();
            let n = a.prompt_lines.min(lines.len());
            let head = lines[..n].join("\n") + "\n";
            let rest = lines[n..].join("\n");
            Ok(Workload {
                prompt: tok.encode(&head, true)?,
                prediction: Some(tok.encode(&rest, false)?),
                max_tokens: a.gen_tokens,
            })
        }
        "repeat" => {
            let body = tok.encode(TEXT, false)?;
            let lead = tok.encode("Copy this text exactly:\n", true)?;
            let mut prompt = lead;
            while prompt.len() < a.prompt_tokens {
                let n = (a.prompt_tokens - prompt.len()).min(body.len());
                prompt.extend_from_slice(&body[..n]);
            }
            let prediction = Some(prompt.clone());
            Ok(Workload {
                prompt,
                prediction,
                max_tokens: a.gen_tokens,
            })
        }
        other => anyhow::bail!("unknown workload {other:?} (edit, complete or repeat)"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn run(a: BenchSpecArgs) -> Result<()> {
    crate::logging::init(crate::logging::LogFormat::Text);
    let mut methods = serde_json::Map::new();
    let mut plain: Option<Vec<Vec<u32>>> = None;
    let mut base_tps: Vec<f64> = Vec::new();
    let mut info = json!({});
    for m in &a.methods {
        let method: SpeculativeMethod = match m.as_str() {
            "prediction" => SpeculativeMethod::Off,
            other => other.parse().map_err(anyhow::Error::msg)?,
        };
        let spec = SpeculativeArgs {
            speculative: method,
            draft_model: (method == SpeculativeMethod::Draft)
                .then(|| a.draft_model.clone())
                .flatten(),
            speculative_tokens: a.speculative_tokens,
            speculative_max_batch: a.speculative_max_batch,
        };
        let mut backend = a.model.backend()?;
        let prof = a
            .profile
            .then(|| Arc::new(kiln_tensor::profile::ProfilingBackend::new(backend.clone())));
        if let Some(p) = &prof {
            backend = p.clone();
        }
        let model = a.model.load_on(backend.clone())?;
        let draft = spec.load_draft(backend)?;
        let w = workload(&a, &model)?;
        info = json!({
            "model": model.path.display().to_string(),
            "backend": model.model.backend().name(),
            "draft_model": a.draft_model,
            "prompt_tokens": w.prompt.len(),
            "max_tokens": w.max_tokens,
            "prediction_tokens": w.prediction.as_ref().map(Vec::len),
        });
        let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
        let engine = speculative_engine(model, draft, &spec, w.prompt.len() + w.max_tokens)?;
        let h = engine.handle();
        let request = |salt: String| {
            let mut r = GenerationRequest::new(
                w.prompt.clone(),
                SamplingParams {
                    max_tokens: Some(w.max_tokens),
                    ..SamplingParams::greedy()
                },
            );
            r.cache_salt = Some(salt);
            if m == "prediction" {
                r.prediction = w.prediction.clone();
            }
            r
        };
        // Warm-up: one short request.
        let mut warm = request("warm".into());
        warm.params.max_tokens = Some(4);
        run_on_engine(&h, warm, &mut |_| {})?;
        let mut levels = serde_json::Map::new();
        if let Some(p) = &prof {
            p.reset();
        }
        for (li, &c) in a.concurrency.iter().enumerate() {
            anyhow::ensure!(c <= max_c && c > 0);
            let start = Instant::now();
            let runs: Vec<EngineRun> = std::thread::scope(|scope| {
                let hs: Vec<_> = (0..c)
                    .map(|i| {
                        let h = h.clone();
                        let r = request(format!("{m}-{li}-{i}"));
                        scope.spawn(move || run_on_engine(&h, r, &mut |_| {}))
                    })
                    .collect();
                hs.into_iter()
                    .map(|t| {
                        t.join()
                            .map_err(|_| anyhow::anyhow!("a client thread panicked"))?
                    })
                    .collect::<Result<Vec<_>>>()
            })?;
            let wall = start.elapsed().as_secs_f64();
            let tokens: usize = runs.iter().map(|r| r.ids.len()).sum();
            let decode: Vec<f64> = runs
                .iter()
                .map(|r| r.ids.len().saturating_sub(1) as f64 / r.timings.decode_seconds.max(1e-9))
                .collect();
            let (drafts, accepted): (usize, usize) = runs
                .iter()
                .map(|r| (r.usage.draft_tokens, r.usage.accepted_draft_tokens))
                .fold((0, 0), |s, x| (s.0 + x.0, s.1 + x.1));
            let outputs: Vec<Vec<u32>> = runs.iter().map(|r| r.ids.clone()).collect();
            if li == 0 && plain.is_none() && m == "off" {
                plain = Some(outputs.clone());
            }
            let identical = plain.as_ref().map(|p| outputs.iter().all(|o| *o == p[0]));
            let decode_median = median(decode);
            if m == "off" {
                base_tps.push(tokens as f64 / wall);
            }
            eprintln!(
                "{m} x{c}: decode {decode_median:.1} tok/s a request, {:.1} tok/s in all; {accepted} of {drafts} drafts accepted",
                tokens as f64 / wall
            );
            let mut level = json!({
                "decode_tokens_per_second_median": decode_median,
                "output_tokens_per_second": tokens as f64 / wall,
                "wall_seconds": wall,
                "generated_tokens": tokens,
                "draft_tokens": drafts,
                "accepted_draft_tokens": accepted,
                "acceptance_rate": if drafts == 0 { Value::Null } else { json!(accepted as f64 / drafts as f64) },
                "outputs_equal_plain": identical,
                "finish": runs.iter().map(|r| r.finish.as_openai_str()).collect::<Vec<_>>(),
            });
            if let Some(b) = base_tps.get(li) {
                level["throughput_vs_off"] = json!((tokens as f64 / wall) / b);
            }
            levels.insert(c.to_string(), level);
        }
        if let Some(p) = &prof {
            let mut ops: Vec<(&str, f64, u64)> = p
                .snapshot()
                .iter()
                .map(|(k, v)| (*k, v.seconds, v.calls))
                .collect();
            ops.sort_by(|x, y| y.1.total_cmp(&x.1));
            let table: Vec<Value> = ops
                .iter()
                .map(|(k, s, c)| json!({"op": k, "seconds": s, "calls": c}))
                .collect();
            for (k, s, c) in ops.iter().take(8) {
                eprintln!("  {m}: {k} {s:.2} s in {c} calls");
            }
            levels.insert("profile".into(), json!(table));
        }
        methods.insert(m.clone(), Value::Object(levels));
    }
    // Batch-1 decode speed-ups against off.
    let mut speedup = serde_json::Map::new();
    if let Some(off) = methods.get("off").and_then(|o| o.get("1")) {
        let b = off["decode_tokens_per_second_median"]
            .as_f64()
            .unwrap_or(0.0);
        for (m, v) in &methods {
            if let Some(d) = v
                .get("1")
                .and_then(|l| l["decode_tokens_per_second_median"].as_f64())
            {
                speedup.insert(m.clone(), json!(d / b.max(1e-9)));
            }
        }
    }
    let cpu = crate::bench::cpu_model();
    let report = json!({
        "engine": "kiln",
        "workload": a.workload,
        "file": a.file,
        "speculative_tokens": a.speculative_tokens,
        "threads": rayon::current_num_threads(),
        "cpu": cpu,
        "info": info,
        "methods": methods,
        "batch1_decode_speedup_vs_off": speedup,
    });
    println!("{report}");
    Ok(())
}
