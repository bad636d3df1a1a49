//! An engine in a process of its own: the weights, the scheduler and the
//! KV pool live in a child process (the same binary, re-executed in its
//! engine mode), so a crash there — a segfault in a kernel, an abort, the
//! out-of-memory killer, a `kill -9` — fails only the requests it held.
//!
//! The server's side is an ordinary [`EngineHandle`]: its commands go to a
//! proxy thread ([`parent`]) instead of an engine loop. The proxy speaks
//! [`wire`]'s messages over a Unix socket that is the child's standard
//! input, passes each request's events back to its stream, cancels in the
//! child what callers drop, and supervises the child: when it ends, every
//! request it held gets [`Event::Failed`](crate::Event::Failed), the
//! handle's status is [`EngineStatus::Restarting`] (new requests are
//! refused with a retry hint), and a fresh child is started after a pause
//! that doubles with each failure in a row (up to 30 s). Its prefix cache
//! is lost with it; nothing else is.
//!
//! The server keeps what requests need before they reach the engine — the
//! tokenizer, chat template, configuration, output-format compiler — in a
//! [`LoadedModel`] without weights ([`LoadedModel::load_front`]); the child
//! loads the model itself and answers [`worker::serve`]'s loop.
//!
//! LoRA adapters and the fault-injection hook stay with in-process engines.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use kiln_models::{CausalLm, ModelConfig};
use kiln_tensor::{Backend, ForwardBatch, KvCache, Tensor};

use super::{supervise, Engine, EngineHandle};
use crate::error::{EngineError, Result};
use crate::load::LoadedModel;

mod parent;
mod wire;
pub(crate) mod worker;

pub use worker::{report_load_failure, serve as serve_worker};

/// How to start the engine process: a program and its arguments (the
/// binary's engine mode, which loads the model and calls
/// [`serve_worker`]).
#[derive(Debug, Clone)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// A child that holds requests and says nothing (no token, no
    /// progress, no answer to a ping) this long is taken for hung and
    /// killed, failing its requests like a crash (`None`: never).
    pub watchdog: Option<std::time::Duration>,
}

impl Engine {
    /// Starts `worker` and waits until its model is loaded, then serves it
    /// through the returned engine: `path` is the model the worker loads,
    /// read here too for its tokenizer, template and configuration.
    /// Dropping the engine ends the process.
    pub fn start_process(path: &Path, worker: WorkerCommand) -> Result<Engine> {
        let (proxy, ready) = parent::Proxy::start(worker)?;
        let model = Arc::new(LoadedModel::load_front(path, ready.generates)?);
        let (tx, rx) = std::sync::mpsc::channel();
        let status = Arc::new(supervise::StatusCell::default());
        status.set(supervise::StatusCell::RUNNING);
        let loop_status = status.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-engine-proxy".into())
            .spawn(move || proxy.run(rx, &loop_status))
            .map_err(|e| EngineError::Config(format!("cannot start the engine proxy: {e}")))?;
        Ok(Engine {
            handle: EngineHandle {
                commands: tx,
                model: model.clone(),
                embedding_head: Arc::new(OnceLock::new()),
                adapters: Arc::new(crate::Adapters::new(model, 0)),
                context: ready.context,
                status,
            },
            thread: Some(thread),
        })
    }
}

/// A model's configuration without its weights: what the server's side of
/// an engine process needs. It runs no forward pass.
struct FrontModel {
    config: ModelConfig,
    backend: Arc<dyn Backend>,
    generates: bool,
}

impl CausalLm for FrontModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    fn forward(&self, _: &ForwardBatch, _: &mut KvCache) -> kiln_models::Result<Tensor> {
        Err(kiln_models::ModelError::Config {
            key: "weights".into(),
            what: "this model's weights are in its engine process".into(),
        })
    }

    fn generates(&self) -> bool {
        self.generates
    }
}

impl LoadedModel {
    /// `path`'s tokenizer, chat template, configuration and sampling
    /// defaults, without its weights (their engine runs in another
    /// process; it reports its device in [`super::EngineStats`]).
    pub fn load_front(path: &Path, generates: bool) -> Result<Self> {
        let mut front = LoadedModel::load_parts(path, |config| {
            Ok(Box::new(FrontModel {
                config,
                backend: Arc::new(kiln_tensor::cpu::CpuBackend::new()),
                generates,
            }) as Box<dyn CausalLm>)
        })?;
        front.load_seconds = 0.0;
        Ok(front)
    }
}
