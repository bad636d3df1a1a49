//! `kiln serve`: load a model, start the engine, and serve the OpenAI API
//! over HTTP until SIGINT or SIGTERM.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use kiln_engine::{Engine, EngineConfig};
use kiln_server::ServerConfig;

use crate::cli::ModelArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A GGUF file or a Hugging Face model directory. Default: the SmolLM2
    /// model in $KILN_MODELS_DIR (or ./models).
    pub model: Option<PathBuf>,
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
}

pub fn run(a: ServeArgs) -> Result<()> {
    let model_args = ModelArgs {
        model: a.model.clone(),
        device: a.device.clone(),
    };
    let path = model_args.path();
    let model = model_args.load()?;
    let model_name = a.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kiln".into())
    });
    let plan = EngineConfig::plan(&model, a.kv_mib)?;
    let engine_config = plan.config;
    eprintln!(
        "kiln serve: {} loaded in {:.1}s; {plan}",
        path.display(),
        model.load_seconds,
    );
    let engine = Engine::start(model, engine_config).context("starting the engine")?;
    let config = ServerConfig {
        host: a.host,
        port: a.port,
        api_key: a.api_key,
        cors_origins: a.cors_origins,
        max_body_bytes: a.max_body_mib << 20,
        model_name: model_name.clone(),
        shutdown_grace: Duration::from_secs(a.shutdown_grace_secs),
    };
    kiln_server::run(config, engine.handle(), |addr| {
        eprintln!("kiln serve: `{model_name}` on http://{addr} (Ctrl-C to stop)");
    })?;
    eprintln!("kiln serve: stopped");
    // Dropping the engine ends any request still running.
    drop(engine);
    Ok(())
}
