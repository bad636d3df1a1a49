//! What every handler shares: the engine, the served model's name, the
//! metrics, and the signal that cancels in-flight requests at shutdown.

use std::sync::Arc;
use std::time::Duration;

use kiln_engine::EngineHandle;
use kiln_sampling::SamplingDefaults;
use tokio::sync::watch;

use crate::errors::ApiError;
use crate::metrics::Metrics;

/// Shared state of the server; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    /// The name the model is served under (`model` in requests and responses).
    pub model_name: Arc<str>,
    pub api_key: Option<Arc<str>>,
    pub max_body_bytes: usize,
    pub metrics: Arc<Metrics>,
    /// Becomes `true` when the shutdown grace period is over: every request
    /// still running ends, which drops its stream and cancels it.
    pub cancel: watch::Receiver<bool>,
    /// Unix time the server started (the model's `created`).
    pub started_at: u64,
    /// Silence after which a stream sends a keep-alive frame.
    pub sse_keepalive: Duration,
    /// Tool-call syntax and reasoning split, where the template should not decide.
    pub output: crate::parse::OutputOverrides,
    /// What a request gets for the sampling fields it leaves out.
    pub sampling_defaults: Arc<SamplingDefaults>,
    /// Refuse unknown request fields instead of ignoring them.
    pub strict_params: bool,
}

impl AppState {
    /// The model's vocabulary size, for validating token ids and logit biases.
    pub fn vocab_size(&self) -> usize {
        self.engine.model().model.config().vocab_size
    }

    /// The served context length in tokens (`kiln serve --context`, at
    /// most the model's trained length).
    pub fn context_length(&self) -> usize {
        self.engine.context_length()
    }

    /// Refuses a request that names a model other than the one served.
    pub fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            Some(m) if m != &*self.model_name => Err(ApiError::ModelNotFound(m.to_string())),
            _ => Ok(()),
        }
    }
}
