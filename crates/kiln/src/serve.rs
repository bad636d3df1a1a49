//! `kiln serve`: bind at once, load the model and start the engine in the
//! background (the server answers 503 until then; a failed load ends the
//! process with the error), and serve the APIs over HTTP until SIGINT or
//! SIGTERM. The first signal stops accepting and waits up to the grace for
//! the requests in flight; a second one cancels them and stops at once
//! (the exit status is 0 either way).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use kiln_engine::{Engine, EngineConfig};
use kiln_server::ServerConfig;

use crate::cli::ModelArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A GGUF file, a Hugging Face model directory, or a registered
    /// model's name (`kiln ls`). Default: the SmolLM2 model in
    /// $KILN_MODELS_DIR (or ./models).
    pub model: Option<String>,
    /// Tokens one sequence must be able to reach (default: the model's
    /// context length); serve refuses to start when that cannot fit.
    #[arg(long)]
    pub context: Option<usize>,
    /// Check the fit against this many free bytes instead of measuring
    /// them (for planning, and for tests).
    #[arg(long)]
    pub memory_bytes: Option<u64>,
    /// Where to run: cpu, cuda, cuda:N, or auto (a usable GPU, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Address to listen on; loopback by default.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the API routes.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Allow browser calls from this origin (repeatable; `*` for any).
    #[arg(long = "cors-origin")]
    pub cors_origins: Vec<String>,
    /// KV cache memory in MiB (default: on a GPU, what is free after the
    /// weights and an activation reserve; on the CPU, 1024).
    #[arg(long)]
    pub kv_mib: Option<usize>,
    /// The name clients use in `model` (default: the model file's stem).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Request bodies larger than this many MiB get 413.
    #[arg(long, default_value_t = 8)]
    pub max_body_mib: usize,
    /// Seconds in-flight requests may run after a shutdown signal.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// Tool-call syntax to read: hermes (also qwen), llama3, mistral or
    /// gemma (default: the one the chat template teaches).
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Split `<think>` reasoning from answers: think, or none (default:
    /// when the chat template mentions it).
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// How log lines (one per request, throughput, shutdown) are written
    /// to stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: crate::logging::LogFormat,
    /// Seconds between throughput lines while requests run (0: none).
    #[arg(long, default_value_t = 10)]
    pub throughput_log_secs: u64,
}

/// The output syntax the flags choose.
fn output_overrides(a: &ServeArgs) -> Result<kiln_server::OutputOverrides> {
    let tool_syntax = match a.tool_call_parser.as_deref() {
        None => None,
        Some(name) => Some(kiln_server::ToolSyntax::from_name(name).ok_or_else(|| {
            anyhow::anyhow!(
                "--tool-call-parser `{name}`: expected hermes, qwen, llama3, mistral or gemma"
            )
        })?),
    };
    let reasoning = match a.reasoning_parser.as_deref() {
        None => None,
        Some("think" | "deepseek_r1" | "qwen3") => Some(true),
        Some("none") => Some(false),
        Some(other) => anyhow::bail!("--reasoning-parser `{other}`: expected think or none"),
    };
    Ok(kiln_server::OutputOverrides {
        tool_syntax,
        reasoning,
    })
}

pub fn run(a: ServeArgs) -> Result<()> {
    crate::logging::init(a.log_format);
    let output = output_overrides(&a)?;
    let model_args = ModelArgs {
        model: a.model.clone(),
        device: a.device.clone(),
    };
    let mut model_args = model_args;
    let path = model_args.path()?;
    // Resolved once: the loader takes the path.
    model_args.model = Some(path.to_string_lossy().into_owned());
    // The memory equation before anything loads: one sequence of the
    // context must fit.
    let backend = model_args.backend()?;
    let (target, avail) = crate::fit::target_for(&a.device, Some(&backend), a.memory_bytes)?;
    let fit = crate::fit::check(&path, target, avail, a.context, 1)?;
    if !fit.fits {
        anyhow::bail!(
            "{} does not fit one sequence of {} tokens:\n{fit}use --context, a smaller model or quantization, or another device",
            path.display(),
            fit.context
        );
    }
    let model_name = a.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kiln".into())
    });
    let config = ServerConfig {
        host: a.host,
        port: a.port,
        api_key: a.api_key,
        cors_origins: a.cors_origins,
        max_body_bytes: a.max_body_mib << 20,
        model_name: model_name.clone(),
        shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
        output,
        throughput_log_interval: Duration::from_secs(a.throughput_log_secs),
        ..ServerConfig::default()
    };
    let (kv_mib, context) = (a.kv_mib, fit.context);
    let load_path = path.clone();
    let load = move || {
        load_engine(&model_args, &load_path, backend, kv_mib, context).map_err(|e| format!("{e:#}"))
    };
    kiln_server::run(config, load, |addr| {
        eprintln!(
            "kiln serve: `{model_name}` on http://{addr} (Ctrl-C to stop); loading {}",
            path.display()
        );
    })?;
    eprintln!("kiln serve: stopped");
    Ok(())
}

/// Loads the model and starts its engine (on a background thread while the
/// server already answers).
fn load_engine(
    model_args: &ModelArgs,
    path: &std::path::Path,
    backend: Arc<dyn kiln_tensor::Backend>,
    kv_mib: Option<usize>,
    context: usize,
) -> Result<Engine> {
    let model = model_args.load_on(backend)?;
    let plan = EngineConfig::plan(&model, kv_mib, context)?;
    let engine_config = plan.config;
    let load_seconds = model.load_seconds;
    let engine = Engine::start(model, engine_config).context("starting the engine")?;
    eprintln!(
        "kiln serve: {} loaded in {load_seconds:.1}s; {plan}; ready",
        path.display(),
    );
    Ok(engine)
}
