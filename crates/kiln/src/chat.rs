//! `kiln chat`: an interactive multi-turn conversation streamed to the terminal.

use std::io::{BufRead, Write};
use std::ops::ControlFlow;

use anyhow::Result;
use clap::Args;
use kiln_engine::GenerationRequest;
use serde_json::json;

use crate::cli::{ModelArgs, SamplingArgs};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message that opens the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Print timings after each answer.
    #[arg(long)]
    pub verbose: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(a: ChatArgs) -> Result<()> {
    let model = a.model.load()?;
    if model.chat_template.is_none() {
        anyhow::bail!(
            "{} has no chat template; use `kiln generate` with a raw prompt",
            model.path.display()
        );
    }
    eprintln!(
        "kiln chat: {} (loaded in {:.1}s). Empty line or Ctrl-D to quit; /reset to start over.",
        model.path.display(),
        model.load_seconds
    );
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        let Some(line) = lines.next() else { break };
        let line = line?;
        let line = line.trim();
        if line.is_empty() {
            break;
        }
        if line == "/reset" {
            messages.truncate(usize::from(a.system.is_some()));
            continue;
        }
        messages.push(json!({"role": "user", "content": line}));
        let rendered = model.render_chat(&serde_json::Value::Array(messages.clone()), true)?;
        let prompt = model.tokenizer.encode(&rendered, false)?;
        let req = GenerationRequest {
            prompt,
            params: a.sampling.params(),
            skip_special_tokens: true,
            ..Default::default()
        };
        let mut stdout = std::io::stdout().lock();
        let g = model.generate(&req, &mut |ev| {
            let _ = stdout.write_all(ev.text.as_bytes());
            let _ = stdout.flush();
            ControlFlow::Continue(())
        })?;
        writeln!(stdout)?;
        if a.verbose {
            let t = &g.timings;
            eprintln!(
                "[{} prompt tokens, prefill {:.1} tok/s; {} generated, decode {:.1} tok/s]",
                t.prompt_tokens,
                t.prefill_tokens_per_second(),
                t.generated_tokens,
                t.decode_tokens_per_second()
            );
        }
        messages.push(json!({"role": "assistant", "content": g.text}));
    }
    Ok(())
}
