//! `kiln generate`: one prompt, streamed to stdout or returned as JSON.

use std::io::Write;
use std::ops::ControlFlow;

use anyhow::Result;
use clap::Args;
use kiln_engine::{Generation, GenerationRequest, LoadedModel};
use serde_json::json;

use crate::cli::{ModelArgs, SamplingArgs};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Apply the model's chat template to the prompt as a user message.
    #[arg(long)]
    pub chat: bool,
    /// A system message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object (ids, text, finish reason, timings) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub speculative: crate::cli::SpeculativeArgs,
    /// Predicted output text (OpenAI's Predicted Outputs), verified as
    /// draft tokens: a close prediction decodes faster, the output is the same.
    #[arg(long)]
    pub prediction: Option<String>,
    /// Print the process's peak resident memory (VmHWM) to stderr at exit,
    /// as `kiln: peak RSS N bytes` (to check `kiln fit`).
    #[arg(long, hide = true)]
    pub report_peak_rss: bool,
}

/// VmHWM from /proc/self/status, in bytes.
pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}

/// Token ids of `prompt`, raw or through the chat template.
pub fn prompt_ids(
    model: &LoadedModel,
    prompt: &str,
    chat: bool,
    system: Option<&str>,
) -> Result<Vec<u32>> {
    if !chat {
        return Ok(model.tokenizer.encode(prompt, true)?);
    }
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(json!({"role": "system", "content": s}));
    }
    messages.push(json!({"role": "user", "content": prompt}));
    let rendered = model.render_chat(&serde_json::Value::Array(messages), true)?;
    Ok(model.tokenizer.encode(&rendered, false)?)
}

pub fn generation_json(model: &LoadedModel, g: &Generation) -> serde_json::Value {
    let t = &g.timings;
    let logprobs: Vec<_> = g
        .logprobs
        .iter()
        .map(|s| {
            json!({
                "token_id": s.token.0,
                "logprob": s.logprob,
                "top": s.top.iter().map(|(id, lp)| json!({"token_id": id.0, "logprob": lp})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "model": model.path.display().to_string(),
        "token_ids": g.token_ids,
        "text": g.text,
        "finish_reason": g.finish_reason.as_openai_str(),
        "logprobs": if g.logprobs.is_empty() { serde_json::Value::Null } else { logprobs.into() },
        "timings": {
            "load_seconds": model.load_seconds,
            "prompt_tokens": t.prompt_tokens,
            "generated_tokens": t.generated_tokens,
            "prefill_seconds": t.prefill_seconds,
            "decode_seconds": t.decode_seconds,
            "prefill_tokens_per_second": t.prefill_tokens_per_second(),
            "decode_tokens_per_second": t.decode_tokens_per_second(),
        },
    })
}

/// A request through the engine loop (speculative decoding lives there):
/// its tokens, text, finish, usage and timings, the text streamed to
/// `on_text` as it comes.
pub struct EngineRun {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: kiln_sampling::FinishReason,
    pub usage: kiln_engine::Usage,
    pub timings: kiln_engine::RequestTimings,
}

pub fn run_on_engine(
    h: &kiln_engine::EngineHandle,
    req: GenerationRequest,
    on_text: &mut dyn FnMut(&str),
) -> Result<EngineRun> {
    let (mut ids, mut text) = (Vec::new(), String::new());
    for ev in h.submit(req)? {
        match ev {
            kiln_engine::Event::Token {
                token_id, text: t, ..
            } => {
                if token_id != u32::MAX {
                    ids.push(token_id);
                }
                on_text(&t);
                text.push_str(&t);
            }
            kiln_engine::Event::Finished {
                finish_reason,
                usage,
                timings,
            } => {
                return Ok(EngineRun {
                    ids,
                    text,
                    finish: finish_reason,
                    usage,
                    timings,
                })
            }
            kiln_engine::Event::Failed { message, .. } => {
                anyhow::bail!("generation failed: {message}")
            }
            kiln_engine::Event::Progress => {}
        }
    }
    anyhow::bail!("the stream ended without finishing")
}

/// An engine for one request of `tokens` tokens, speculating as `spec` says.
pub fn speculative_engine(
    model: LoadedModel,
    draft: Option<LoadedModel>,
    spec: &crate::cli::SpeculativeArgs,
    tokens: usize,
) -> Result<kiln_engine::Engine> {
    let context = tokens.min(model.context_length());
    let plan = kiln_engine::EngineConfig::plan(&model, None, context)?;
    let mut config = kiln_engine::EngineConfig {
        context_length: Some(context),
        ..plan.config
    };
    if let Some(d) = &draft {
        config = config.with_draft(&model, d, spec.speculative_max_batch);
    } else if spec.speculative == kiln_engine::SpeculativeMethod::Mtp {
        config = config.with_mtp_head(&model, spec.speculative_max_batch);
    }
    Ok(kiln_engine::Engine::start_with_draft(
        model,
        config,
        spec.config(),
        draft,
    )?)
}

/// `kiln generate` through the engine, for speculation and predictions.
fn run_speculative(a: GenerateArgs) -> Result<()> {
    let backend = a.model.backend()?;
    let model = a.model.load_on(backend.clone())?;
    let draft = a.speculative.load_draft(backend)?;
    let prompt = prompt_ids(&model, &a.prompt, a.chat, a.system.as_deref())?;
    let prediction = match &a.prediction {
        Some(p) => Some(model.tokenizer.encode(p, false)?),
        None => None,
    };
    let params = a.sampling.params();
    let max = params.max_tokens.unwrap_or(256);
    let path = model.path.display().to_string();
    let load_seconds = model.load_seconds;
    let engine = speculative_engine(model, draft, &a.speculative, prompt.len() + max)?;
    let h = engine.handle();
    let req = GenerationRequest {
        prompt,
        params,
        skip_special_tokens: true,
        prediction,
        ..Default::default()
    };
    let mut stdout = std::io::stdout().lock();
    let stream = !a.json;
    let r = run_on_engine(&h, req, &mut |t| {
        if stream {
            let _ = stdout.write_all(t.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    let decode_tps = r.ids.len().saturating_sub(1) as f64 / r.timings.decode_seconds.max(1e-9);
    if a.json {
        let u = &r.usage;
        let report = json!({
            "model": path,
            "token_ids": r.ids,
            "text": r.text,
            "finish_reason": r.finish.as_openai_str(),
            "speculative": {
                "method": format!("{:?}", a.speculative.speculative).to_lowercase(),
                "draft_tokens": u.draft_tokens,
                "accepted_draft_tokens": u.accepted_draft_tokens,
            },
            "timings": {
                "load_seconds": load_seconds,
                "prompt_tokens": u.prompt_tokens,
                "generated_tokens": r.ids.len(),
                "prefill_seconds": r.timings.prefill_seconds,
                "decode_seconds": r.timings.decode_seconds,
                "decode_tokens_per_second": decode_tps,
            },
        });
        writeln!(stdout, "{report}")?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "[{} prompt tokens; {} generated, decode {:.1} tok/s; {} of {} drafts accepted; finish: {}]",
            r.usage.prompt_tokens,
            r.ids.len(),
            decode_tps,
            r.usage.accepted_draft_tokens,
            r.usage.draft_tokens,
            r.finish.as_openai_str()
        );
    }
    Ok(())
}

pub fn run(a: GenerateArgs) -> Result<()> {
    if a.speculative.on() || a.prediction.is_some() {
        return run_speculative(a);
    }
    let model = a.model.load()?;
    let prompt = prompt_ids(&model, &a.prompt, a.chat, a.system.as_deref())?;
    let req = GenerationRequest {
        prompt,
        params: a.sampling.params(),
        skip_special_tokens: true,
        ..Default::default()
    };
    let mut stdout = std::io::stdout().lock();
    let stream = !a.json;
    let g = model.generate(&req, &mut |ev| {
        if stream {
            let _ = stdout.write_all(ev.text.as_bytes());
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    if a.json {
        writeln!(stdout, "{}", generation_json(&model, &g))?;
    } else {
        writeln!(stdout)?;
        let t = &g.timings;
        eprintln!(
            "[{} prompt tokens, prefill {:.1} tok/s; {} generated, decode {:.1} tok/s; finish: {}]",
            t.prompt_tokens,
            t.prefill_tokens_per_second(),
            t.generated_tokens,
            t.decode_tokens_per_second(),
            g.finish_reason.as_openai_str()
        );
    }
    if a.report_peak_rss {
        match peak_rss_bytes() {
            Some(b) => eprintln!("kiln: peak RSS {b} bytes"),
            None => eprintln!("kiln: peak RSS unknown (no /proc/self/status)"),
        }
    }
    Ok(())
}
