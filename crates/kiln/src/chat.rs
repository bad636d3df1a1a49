//! `kiln chat`: an interactive multi-turn conversation streamed to the
//! terminal. Input is read by [`crate::chat_input`] (line editing, history,
//! paste-safe multi-line messages); answers stream to stdout. Ctrl-C during
//! an answer stops it and the session goes on; Ctrl-C twice at the prompt,
//! Ctrl-D or `/bye` quits. Commands: see [`HELP`].
//!
//! The conversation runs on the engine loop with its prefix cache, sized by
//! the same plan as `kiln serve`: each turn resubmits the rendered
//! conversation, and only what the cache does not already hold (the new
//! turn, from the first block that differs) is prefilled.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use kiln_engine::{Engine, EngineConfig, EngineHandle, Event, GenerationRequest, LoadedModel};
use kiln_sampling::FinishReason;
use serde_json::{json, Value};

use crate::chat_input::{Input, Lines};
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
    /// Keep no input history in ~/.cache/kiln/chat_history.
    #[arg(long)]
    pub no_history: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

const HELP: &str = "\
Type a message and press Enter. A paste is sent as one message; end a line
with \\ to continue it on the next, or put a message between two \"\"\" lines.
  /help           this text
  /system TEXT    set the system message (without TEXT: remove it)
  /reset          start the conversation over (the system message stays)
  /save FILE      write the conversation to FILE as JSON
  /bye            quit (also Ctrl-D, or Ctrl-C twice)
Ctrl-C during an answer stops it.";

/// Plans memory as `kiln serve` does (the context the budget allows, at
/// most the trained length), loads the model and starts its engine.
fn start_engine(a: &ChatArgs) -> Result<Engine> {
    let path = a.model.path()?;
    let backend = a.model.backend()?;
    let (target, available_bytes) = crate::fit::target_for(&a.model.device, Some(&backend), None)?;
    let query = crate::fit::FitQuery {
        target,
        available_bytes,
        context: None,
        batch: 1,
        kv_pool_bytes: None,
        quantize: a.model.quantize,
        adapter_bytes: 0,
        tensor_parallel: a.model.tensor_parallel as usize,
    };
    let fit = crate::fit::check(&path, &query)?;
    if !fit.fits {
        anyhow::bail!(
            "{} does not fit one sequence of {} tokens:\n{fit}use a smaller model or quantization, or another device",
            path.display(),
            fit.context
        );
    }
    let model = a.model.load_on(backend)?;
    if model.chat_template.is_none() {
        anyhow::bail!(
            "{} has no chat template; use `kiln generate` with a raw prompt",
            model.path.display()
        );
    }
    let kv_bytes = (!target.on_device).then_some(fit.kv_pool_bytes as usize);
    let plan = EngineConfig::plan(&model, kv_bytes, fit.context)?;
    let config = EngineConfig {
        context_length: Some(fit.context),
        ..plan.config
    };
    Engine::start(model, config).context("starting the engine")
}

pub fn run(a: ChatArgs) -> Result<()> {
    let engine = start_engine(&a)?;
    let handle = engine.handle();
    let model = handle.model().clone();
    let interrupt = Interrupt::install()?;
    eprintln!(
        "kiln chat: {} (loaded in {:.1}s, context {} tokens). /help for commands; Ctrl-D or /bye to quit.",
        model.path.display(),
        model.load_seconds,
        handle.context_length()
    );
    let history = (!a.no_history)
        .then(|| std::env::var_os("HOME"))
        .flatten()
        .map(|h| PathBuf::from(h).join(".cache/kiln/chat_history"));
    let mut lines = Lines::open(history)?;
    let mut conversation = Conversation {
        system: a.system.clone(),
        turns: Vec::new(),
    };
    let mut interrupted = false;
    loop {
        let text = match lines.message()? {
            Input::End => break,
            Input::Interrupted if interrupted => break,
            Input::Interrupted => {
                interrupted = true;
                eprintln!("(Ctrl-C again, Ctrl-D or /bye to quit)");
                continue;
            }
            Input::Message(text) => text,
        };
        interrupted = false;
        if let Some(command) = ChatCommand::parse(&text) {
            match command {
                ChatCommand::Bye => break,
                command => conversation.apply(command, &model),
            }
            continue;
        }
        conversation
            .turns
            .push(json!({"role": "user", "content": text}));
        match answer(&handle, &a, &conversation.messages(), &interrupt) {
            Ok(reply) => conversation
                .turns
                .push(json!({"role": "assistant", "content": reply})),
            Err(e) => {
                eprintln!("error: {e:#}");
                conversation.turns.pop();
            }
        }
    }
    Ok(())
}

/// The conversation: the system message and the turns since the last reset.
struct Conversation {
    system: Option<String>,
    turns: Vec<Value>,
}

impl Conversation {
    /// The messages as the chat template takes them.
    fn messages(&self) -> Vec<Value> {
        let system = self
            .system
            .as_ref()
            .map(|s| json!({"role": "system", "content": s}));
        system
            .into_iter()
            .chain(self.turns.iter().cloned())
            .collect()
    }

    fn apply(&mut self, command: ChatCommand, model: &LoadedModel) {
        match command {
            ChatCommand::Help => eprintln!("{HELP}"),
            ChatCommand::Reset => {
                self.turns.clear();
                eprintln!("(the conversation starts over)");
            }
            ChatCommand::System(text) => {
                self.system = text;
                match &self.system {
                    Some(_) => eprintln!("(system message set)"),
                    None => eprintln!("(no system message)"),
                }
            }
            ChatCommand::Save(path) => match self.save(&path, model) {
                Ok(()) => eprintln!("(saved to {})", path.display()),
                Err(e) => eprintln!("error: {e:#}"),
            },
            ChatCommand::Unknown(name) => eprintln!("unknown command /{name}; /help lists them"),
            ChatCommand::Bye => {}
        }
    }

    /// Writes `{"model": PATH, "messages": [...]}` to `path`.
    fn save(&self, path: &std::path::Path, model: &LoadedModel) -> Result<()> {
        let doc = json!({
            "model": model.path.display().to_string(),
            "messages": self.messages(),
        });
        let text = serde_json::to_string_pretty(&doc)? + "\n";
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }
}

/// A line starting with `/`.
#[derive(Debug, PartialEq)]
enum ChatCommand {
    Help,
    Bye,
    Reset,
    System(Option<String>),
    Save(PathBuf),
    Unknown(String),
}

impl ChatCommand {
    /// The command `text` is, if it is one line starting with `/`.
    fn parse(text: &str) -> Option<Self> {
        let rest = text.strip_prefix('/')?;
        if text.contains('\n') {
            return None;
        }
        let (name, arg) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        let arg = arg.trim();
        Some(match name {
            "help" | "?" => ChatCommand::Help,
            "bye" | "exit" | "quit" => ChatCommand::Bye,
            "reset" | "clear" => ChatCommand::Reset,
            "system" => ChatCommand::System((!arg.is_empty()).then(|| arg.to_string())),
            "save" if !arg.is_empty() => ChatCommand::Save(PathBuf::from(arg)),
            "save" => ChatCommand::Unknown("save without a FILE".into()),
            other => ChatCommand::Unknown(other.to_string()),
        })
    }
}

/// Ctrl-C while an answer streams: the flag the token callback checks. A
/// second Ctrl-C before the flag is cleared ends the process (status 130).
struct Interrupt {
    flag: Arc<AtomicBool>,
}

impl Interrupt {
    fn install() -> Result<Self> {
        use signal_hook::consts::SIGINT;
        let flag = Arc::new(AtomicBool::new(false));
        // Registered first, so it sees the flag before this Ctrl-C sets it.
        signal_hook::flag::register_conditional_shutdown(SIGINT, 130, flag.clone())
            .context("installing the Ctrl-C handler")?;
        signal_hook::flag::register(SIGINT, flag.clone())
            .context("installing the Ctrl-C handler")?;
        Ok(Interrupt { flag })
    }

    fn clear(&self) {
        self.flag.store(false, Ordering::SeqCst);
    }

    fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }
}

/// Streams the model's answer to `messages` to stdout and returns it (as
/// far as it got when Ctrl-C stopped it).
fn answer(
    engine: &EngineHandle,
    a: &ChatArgs,
    messages: &[Value],
    interrupt: &Interrupt,
) -> Result<String> {
    let model = engine.model();
    let rendered = model.render_chat(&Value::Array(messages.to_vec()), true)?;
    let prompt = model.tokenizer.encode(&rendered, false)?;
    // As in a single generation, an answer runs at most to the end of the
    // context (the engine refuses a request that asks for more).
    let mut params = a.sampling.params();
    let room = engine.context_length().saturating_sub(prompt.len()).max(1);
    params.max_tokens = Some(params.max_tokens.map_or(room, |m| m.min(room)));
    let req = GenerationRequest {
        prompt,
        params,
        skip_special_tokens: true,
        ..Default::default()
    };
    let mut stdout = std::io::stdout().lock();
    interrupt.clear();
    let stream = engine.submit(req)?;
    let mut text = String::new();
    let finished = loop {
        if interrupt.is_set() {
            // Dropping the stream cancels the request on the engine loop.
            break None;
        }
        match stream.next_event_timeout(std::time::Duration::from_millis(50)) {
            Ok(Some(Event::Token { text: t, .. })) => {
                let _ = stdout.write_all(t.as_bytes());
                let _ = stdout.flush();
                text.push_str(&t);
            }
            Ok(Some(Event::Progress)) | Err(()) => {}
            Ok(Some(Event::Finished {
                finish_reason,
                usage,
                timings,
            })) => break Some((finish_reason, usage, timings)),
            Ok(Some(Event::Failed { message, .. })) => anyhow::bail!("{message}"),
            Ok(None) => anyhow::bail!("the engine stopped"),
        }
    };
    drop(stream);
    interrupt.clear();
    writeln!(stdout)?;
    stdout.flush()?;
    let Some((finish, usage, timings)) = finished else {
        eprintln!("[interrupted]");
        return Ok(text);
    };
    if finish == FinishReason::Cancelled {
        eprintln!("[interrupted]");
    }
    if a.verbose {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        let computed = usage.prompt_tokens - usage.cached_tokens;
        eprintln!(
            "[{} prompt tokens ({} from the cache), prefill {:.1} tok/s; {} generated, decode {:.1} tok/s]",
            usage.prompt_tokens,
            usage.cached_tokens,
            rate(computed, timings.prefill_seconds),
            usage.completion_tokens,
            rate(usage.completion_tokens.saturating_sub(1), timings.decode_seconds)
        );
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse() {
        assert_eq!(ChatCommand::parse("/help"), Some(ChatCommand::Help));
        assert_eq!(ChatCommand::parse("/bye"), Some(ChatCommand::Bye));
        assert_eq!(ChatCommand::parse("/reset"), Some(ChatCommand::Reset));
        assert_eq!(
            ChatCommand::parse("/system  Be brief. "),
            Some(ChatCommand::System(Some("Be brief.".into())))
        );
        assert_eq!(
            ChatCommand::parse("/system"),
            Some(ChatCommand::System(None))
        );
        assert_eq!(
            ChatCommand::parse("/save out.json"),
            Some(ChatCommand::Save("out.json".into()))
        );
        assert!(matches!(
            ChatCommand::parse("/save"),
            Some(ChatCommand::Unknown(_))
        ));
        assert_eq!(
            ChatCommand::parse("/nope"),
            Some(ChatCommand::Unknown("nope".into()))
        );
    }

    #[test]
    fn messages_are_not_commands() {
        assert_eq!(ChatCommand::parse("hello /help"), None);
        // A pasted text that starts with a slash is a message.
        assert_eq!(ChatCommand::parse("/usr/bin\nis a directory"), None);
    }

    #[test]
    fn the_system_message_leads_and_survives_a_reset() {
        let mut c = Conversation {
            system: Some("S".into()),
            turns: vec![json!({"role": "user", "content": "u"})],
        };
        assert_eq!(c.messages().len(), 2);
        assert_eq!(c.messages()[0]["role"], "system");
        c.turns.clear();
        assert_eq!(c.messages(), [json!({"role": "system", "content": "S"})]);
        c.system = None;
        assert!(c.messages().is_empty());
    }
}
