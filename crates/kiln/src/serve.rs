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
    /// Another model to serve: `[NAME=]MODEL` (repeatable). The first
    /// model given is the default for requests that name none; the others
    /// load when a request first names them.
    #[arg(long = "model", value_parser = crate::serve_pool::parse_model)]
    pub models: Vec<crate::serve_pool::ModelEntry>,
    /// Models to serve from a TOML file (`[[model]]` tables: name, path,
    /// device, context, kv_mib, quantize, pinned; see the README).
    #[arg(long = "models")]
    pub models_file: Option<std::path::PathBuf>,
    /// Memory each device may hold in models, in MiB (default: what it has
    /// free at start); the least recently used idle model is unloaded to
    /// make room for another.
    #[arg(long)]
    pub memory_budget_mib: Option<u64>,
    /// Unload a model (not pinned) after this many seconds without a
    /// request (0: never).
    #[arg(long)]
    pub idle_unload_secs: Option<u64>,
    /// Seconds a request waits for its model to load, or for room, before
    /// a 503.
    #[arg(long, default_value_t = 120)]
    pub load_wait_secs: u64,
    /// Where each model's engine runs: `process` (its own child process,
    /// supervised: a crash fails only that model's requests in flight and
    /// the engine restarts) or `thread` (in the server's process). The
    /// default model runs in a thread when it serves LoRA adapters.
    #[arg(long, value_enum, default_value = "process")]
    pub isolation: Isolation,
    /// An engine process that holds requests and says nothing for this
    /// many seconds (no token, no progress, no answer to a ping) is taken
    /// for hung, killed and restarted (0: never).
    #[arg(long, default_value_t = 300)]
    pub engine_watchdog_secs: u64,
    /// Speculative decoding for the default model.
    #[command(flatten)]
    pub speculative: crate::cli::SpeculativeArgs,
    /// Tokens one sequence may reach, prompt and output (default: the
    /// longest the KV pool holds, at most the model's trained length — the
    /// plan `kiln fit` prints); serve refuses to start when it cannot fit.
    #[arg(long)]
    pub context: Option<usize>,
    /// Check the fit against this many free bytes instead of measuring
    /// them (for planning, and for tests).
    #[arg(long)]
    pub memory_bytes: Option<u64>,
    /// Where to run: cpu, cuda, cuda:N, or auto (a usable GPU, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Quantize the model's float matrices as it loads: q8_0, q4_0, q4_k,
    /// q5_k, q6_k, fp8 (E4M3 in runs of 128 under an f32 scale), or int8 /
    /// int4 (q8_0 / q4_0); matrices already quantized
    /// keep their blocks.
    #[arg(long, value_parser = crate::quantize::parse_quant_type)]
    pub quantize: Option<kiln_quant::QuantFormat>,
    /// Split each model over N ranks (tensor parallel; llama- and
    /// moe-family models): on the CPU, N ranks sharing its threads.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tensor_parallel: u32,
    /// With --tensor-parallel on a Mixture-of-Experts model: each rank
    /// holds a run of whole experts instead of a slice of every expert.
    #[arg(long)]
    pub expert_parallel: bool,
    #[command(flatten)]
    pub nodes: crate::nodes::NodeArgs,
    /// Address to listen on; loopback by default.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the API routes (visible in
    /// `ps`: prefer --api-key-file or $KILN_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Read the API key from this file (surrounding whitespace removed).
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Host names accepted in the `Host` header besides loopback ones
    /// (repeatable or comma-separated; `*` for any). Default: loopback
    /// names when listening on loopback, any host otherwise.
    #[arg(long = "allowed-hosts", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Most open connections; more get 503.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Allow browser calls from this origin (repeatable; `*` for any).
    #[arg(long = "cors-origin")]
    pub cors_origins: Vec<String>,
    /// KV cache memory in MiB (default: on a GPU, 90 % of what is free
    /// after the weights less an activation reserve; on the CPU, up to 90 %
    /// of the free RAM left after the weights, at most 1 GiB or one
    /// sequence of the trained context).
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
    /// Tool-call syntax to read: hermes (also qwen), llama3, mistral,
    /// gemma, glm45, deepseek_v3 (also deepseek_v31) or kimi_k2 (default:
    /// the one the chat template teaches).
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Split `<think>` reasoning from answers: think, or none (default:
    /// when the chat template mentions it).
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    #[command(flatten)]
    pub defaults: DefaultFlags,
    /// Refuse requests with unknown fields (400) instead of ignoring them
    /// (they are listed in the `x-kiln-ignored-params` header and the log).
    #[arg(long)]
    pub strict_params: bool,
    /// How log lines (one per request, throughput, shutdown) are written
    /// to stderr.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: crate::logging::LogFormat,
    /// Seconds between throughput lines while requests run (0: none).
    #[arg(long, default_value_t = 10)]
    pub throughput_log_secs: u64,
    /// A LoRA adapter requests may name by `model`: NAME=PATH of a PEFT
    /// directory (repeatable).
    #[arg(long, value_parser = parse_lora)]
    pub lora: Vec<(String, std::path::PathBuf)>,
    /// Adapters kept in memory at once (least recently used out first).
    #[arg(long, default_value_t = kiln_engine::adapters::DEFAULT_MAX_LOADED)]
    pub max_loras: usize,
    /// Mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
    #[arg(long)]
    pub enable_lora_runtime: bool,
    /// MiB of memory planned for adapters loaded at run time (with
    /// --enable-lora-runtime), beside those of --lora.
    #[arg(long, default_value_t = 128)]
    pub lora_reserve_mib: u64,
    /// Embedding lengths `/v1/embeddings` may cut vectors to (`dimensions`)
    /// for a model trained to allow it (Matryoshka) whose config does not
    /// say so: `any`, or a list such as `512,256,128`.
    #[arg(long, value_parser = parse_matryoshka)]
    pub matryoshka_dimensions: Option<MatryoshkaDims>,
}

fn parse_lora(s: &str) -> Result<(String, std::path::PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), std::path::PathBuf::from(path)))
        }
        _ => Err(format!("{s:?}: give NAME=PATH")),
    }
}

/// `--isolation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Isolation {
    Process,
    Thread,
}

/// `--matryoshka-dimensions`: an empty list means any length.
#[derive(Clone, Debug)]
pub struct MatryoshkaDims(pub Vec<usize>);

fn parse_matryoshka(s: &str) -> Result<MatryoshkaDims, String> {
    if s == "any" {
        return Ok(MatryoshkaDims(Vec::new()));
    }
    s.split(',')
        .map(|d| match d.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{d:?} is not a positive length (or use `any`)")),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(MatryoshkaDims)
}

/// Server-wide defaults for the sampling fields requests leave out (over
/// the model's generation config, else llama.cpp's defaults).
#[derive(Args, Debug, Default)]
pub struct DefaultFlags {
    /// Default temperature (0 = greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Default top-k (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Default top-p (1 = off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Default min-p (0 = off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Default repetition penalty (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Default token limit of requests that set none (default: the context).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// The repetition guard every request gets: `N,K` ends generation when
    /// a loop of up to N tokens fills the last N×K tokens; `off` disables it.
    #[arg(long, default_value = "32,8", value_parser = parse_guard)]
    pub repetition_guard: Guard,
}

/// `--repetition-guard`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Guard(pub Option<kiln_sampling::NgramRepeat>);

fn parse_guard(s: &str) -> Result<Guard, String> {
    if s == "off" {
        return Ok(Guard(None));
    }
    let (n, k) = s
        .split_once(',')
        .ok_or_else(|| format!("expected N,K or off, got `{s}`"))?;
    let n: usize = n.trim().parse().map_err(|_| format!("bad N in `{s}`"))?;
    let k: usize = k.trim().parse().map_err(|_| format!("bad K in `{s}`"))?;
    if n < 1 || k < 2 {
        return Err(format!("`{s}`: N must be at least 1 and K at least 2"));
    }
    Ok(Guard(Some(kiln_sampling::NgramRepeat {
        ngram_len: n,
        num_repeats: k,
    })))
}

impl DefaultFlags {
    fn partial(&self) -> Result<kiln_sampling::PartialSampling> {
        let p = kiln_sampling::PartialSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_tokens: self.max_tokens,
        };
        // The same checks a request's values get.
        let probe = kiln_sampling::SamplingDefaults::resolve(p, p, None).params();
        probe
            .validate(usize::MAX)
            .map_err(|e| anyhow::anyhow!("sampling flags: {e}"))?;
        Ok(p)
    }
}

/// The output syntax the flags choose.
fn output_overrides(a: &ServeArgs) -> Result<kiln_server::OutputOverrides> {
    let tool_syntax = match a.tool_call_parser.as_deref() {
        None => None,
        Some(name) => Some(kiln_server::ToolSyntax::from_name(name).ok_or_else(|| {
            anyhow::anyhow!(
                "--tool-call-parser `{name}`: expected hermes, qwen, llama3, mistral, gemma, \
                 glm45, deepseek_v3, deepseek_v31 or kimi_k2"
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

/// The API key: `--api-key`, else the contents of `--api-key-file`, else
/// `$KILN_API_KEY`; an empty one is refused.
fn api_key(a: &ServeArgs) -> Result<Option<String>> {
    let (key, from) = if let Some(k) = &a.api_key {
        (k.clone(), "--api-key".to_string())
    } else if let Some(path) = &a.api_key_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--api-key-file {}", path.display()))?;
        (text, format!("--api-key-file {}", path.display()))
    } else {
        match std::env::var("KILN_API_KEY") {
            Ok(k) => (k, "$KILN_API_KEY".to_string()),
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(e) => anyhow::bail!("$KILN_API_KEY: {e}"),
        }
    };
    let key = key.trim().to_string();
    if key.is_empty() {
        anyhow::bail!("{from}: the API key is empty");
    }
    Ok(Some(key))
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    crate::logging::init(a.log_format);
    if a.nodes.nnodes > 1 {
        if a.nodes.node_rank > 0 {
            // A following node serves nothing: it runs node 0's steps.
            let model = crate::cli::ModelArgs {
                model: a.model.clone(),
                device: a.device.clone(),
                quantize: a.quantize,
                tensor_parallel: a.tensor_parallel,
                tp_transport: Default::default(),
                expert_parallel: a.expert_parallel,
                nodes: a.nodes.clone(),
            };
            return crate::nodes::follow(&model);
        }
        // Node 0 leads the others from this process, for one model: the
        // nodes meet once, when it loads.
        anyhow::ensure!(
            a.models.is_empty() && a.models_file.is_none(),
            "a model split over nodes (--nnodes) is served alone: drop --model/--models"
        );
        a.isolation = Isolation::Thread;
    }
    let output = output_overrides(&a)?;
    let api_key = api_key(&a)?;
    let sampling = a.defaults.partial()?;
    let loras = Loras {
        startup: a.lora.clone(),
        max_loaded: a.max_loras,
        max_bytes: adapter_budget(&a)?,
    };
    let loader = Arc::new(crate::serve_pool::Loader::new(
        a.speculative.clone(),
        loras,
        a.memory_bytes,
        a.isolation,
        (a.engine_watchdog_secs > 0).then(|| Duration::from_secs(a.engine_watchdog_secs)),
    ));
    // Every model planned (the plan `kiln fit` prints) before the server
    // binds: one sequence of each one's context must fit.
    let (spec, default_name) = crate::serve_pool::spec(&a, loader)?;
    let config = ServerConfig {
        host: a.host,
        port: a.port,
        api_key,
        cors_origins: a.cors_origins,
        allowed_hosts: a.allowed_hosts,
        max_connections: a.max_connections,
        max_body_bytes: a.max_body_mib << 20,
        model_name: default_name.clone(),
        shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
        output,
        sampling,
        loop_guard: a.defaults.repetition_guard.0,
        strict_params: a.strict_params,
        throughput_log_interval: Duration::from_secs(a.throughput_log_secs),
        matryoshka_dimensions: a.matryoshka_dimensions.map(|d| d.0),
        enable_lora_runtime: a.enable_lora_runtime,
        ..ServerConfig::default()
    };
    let models = spec.sources.len();
    kiln_server::run(
        config,
        spec,
        |addr| {
            let others = match models {
                1 => String::new(),
                n => format!(
                    " and {} other model{}",
                    n - 1,
                    if n == 2 { "" } else { "s" }
                ),
            };
            eprintln!(
                "kiln serve: `{default_name}`{others} on http://{addr} (Ctrl-C to stop); loading `{default_name}`"
            );
        },
        |name: &str, defaults: Option<&kiln_sampling::SamplingDefaults>| match defaults {
            Some(d) => eprintln!("kiln serve: `{name}` loaded; sampling defaults: {d}; ready"),
            None => eprintln!("kiln serve: `{name}` loaded; ready"),
        },
    )?;
    eprintln!("kiln serve: stopped");
    Ok(())
}

/// Loads a model and starts its engine (on a blocking thread while the
/// server already answers), with the default model's LoRA adapters and
/// speculation; the engine and what to say of the load.
pub(crate) fn load_engine(
    model_args: &ModelArgs,
    path: &std::path::Path,
    backend: Arc<dyn kiln_tensor::Backend>,
    kv_bytes: Option<usize>,
    context: usize,
    loras: Option<&Loras>,
    speculative: Option<&crate::cli::SpeculativeArgs>,
) -> Result<(Engine, String)> {
    let model = model_args.load_on(backend.clone())?;
    // The draft's weights are on the device before the pool is sized.
    let draft = match speculative {
        Some(s) => s.load_draft(backend)?,
        None => None,
    };
    let plan = EngineConfig::plan(&model, kv_bytes, context)?;
    let engine_config = EngineConfig {
        context_length: Some(context),
        ..plan.config
    };
    let load_seconds = model.load_seconds;
    let weights = model.model.weight_bytes().map(|w| {
        let parts: Vec<String> =
            w.0.iter()
                .map(|(k, b)| format!("{k} {:.2} GB", *b as f64 / 1e9))
                .collect();
        format!(
            "; weights {:.2} GB ({})",
            w.total() as f64 / 1e9,
            parts.join(", ")
        )
    });
    let engine_config = match (&draft, speculative) {
        (Some(d), Some(s)) => engine_config.with_draft(&model, d, s.speculative_max_batch),
        (None, Some(s)) if s.speculative == kiln_engine::SpeculativeMethod::Mtp => {
            engine_config.with_mtp_head(&model, s.speculative_max_batch)
        }
        _ => engine_config,
    };
    let generates = model.model.generates();
    let spec_config = speculative.map(|s| s.config()).unwrap_or_default();
    let engine = Engine::start_with_draft(model, engine_config, spec_config, draft)
        .context("starting the engine")?;
    let handle = engine.handle();
    let mut note = String::new();
    if let Some(loras) = loras {
        let adapters = handle.adapters().clone();
        adapters.set_max_loaded(loras.max_loaded);
        adapters.set_max_bytes(loras.max_bytes);
        for (name, dir) in &loras.startup {
            adapters
                .add(name, dir)
                .with_context(|| format!("loading the LoRA adapter {name} ({})", dir.display()))?;
        }
        note = match loras.startup.len() {
            0 => String::new(),
            n => format!("; {n} LoRA adapter{}", if n == 1 { "" } else { "s" }),
        };
    }
    let kind = if generates {
        format!("context {context} tokens")
    } else if let Ok(head) = handle.embedding_head() {
        format!(
            "an embedding model (POST /v1/embeddings): {:?} pooling, {} values a vector, inputs of up to {} tokens",
            head.pooling, head.dimension, head.max_seq_length
        )
    } else {
        String::new()
    };
    Ok((
        engine,
        format!(
            "{} loaded in {load_seconds:.1}s{}; {plan}{note}; {kind}",
            path.display(),
            weights.unwrap_or_default()
        ),
    ))
}

/// The LoRA adapters `kiln serve` starts with and their bounds.
pub struct Loras {
    pub startup: Vec<(String, std::path::PathBuf)>,
    pub max_loaded: usize,
    pub max_bytes: u64,
}

/// Memory the plan gives adapters: those of --lora, and with
/// --enable-lora-runtime a reserve for those loaded later.
fn adapter_budget(a: &ServeArgs) -> Result<u64> {
    let mut bytes = 0;
    for (name, dir) in &a.lora {
        bytes += kiln_models::lora::peft_bytes(dir)
            .with_context(|| format!("the LoRA adapter {name}"))?;
    }
    if a.enable_lora_runtime {
        bytes += a.lora_reserve_mib << 20;
    }
    Ok(bytes)
}
