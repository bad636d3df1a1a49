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

pub fn run(a: GenerateArgs) -> Result<()> {
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
