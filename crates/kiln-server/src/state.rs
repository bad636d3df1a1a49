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
    /// `kiln serve --matryoshka-dimensions`, over the model's declaration.
    pub matryoshka_dimensions: Option<Arc<[usize]>>,
    /// Adapters may be loaded and unloaded at run time.
    pub lora_runtime: bool,
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

    /// Refuses generation from a model that only embeds (an encoder).
    pub fn check_generates(&self) -> Result<(), ApiError> {
        if self.engine.model().model.generates() {
            return Ok(());
        }
        Err(ApiError::InvalidRequest {
            message: format!(
                "the model `{}` is an embedding model: it does not generate text; use POST /v1/embeddings",
                self.model_name
            ),
            param: Some("model".into()),
        })
    }

    /// `dimensions` checked against the lengths the model (or
    /// `--matryoshka-dimensions`) allows.
    pub fn check_dimensions(
        &self,
        head: &kiln_engine::EmbeddingHead,
        d: usize,
    ) -> Result<usize, ApiError> {
        let allowed: Option<Vec<usize>> = match &self.matryoshka_dimensions {
            Some(dims) => Some(dims.to_vec()),
            None => head.matryoshka.clone(),
        };
        let full = head.dimension;
        let Some(allowed) = allowed else {
            if d == full {
                return Ok(d);
            }
            return Err(ApiError::invalid(
                "dimensions",
                format!(
                    "this model gives {full}-long embeddings and does not declare shorter ones \
                     (Matryoshka); `kiln serve --matryoshka-dimensions` allows them"
                ),
            ));
        };
        if d == 0 || d > full || !(allowed.is_empty() || allowed.contains(&d) || d == full) {
            let which = if allowed.is_empty() {
                format!("1 to {full}")
            } else {
                allowed
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(ApiError::invalid(
                "dimensions",
                format!("`dimensions` is {d}; this model gives {which}"),
            ));
        }
        Ok(d)
    }

    /// The 404 for `name`, listing this model and its adapters.
    fn not_found(&self, name: &str) -> ApiError {
        let mut available = vec![self.model_name.to_string()];
        available.extend(self.engine.adapters().list().into_iter().map(|a| a.name));
        ApiError::ModelNotFound {
            name: name.to_string(),
            available,
        }
    }

    /// Refuses a request that names a model other than the one served or
    /// one of its LoRA adapters.
    pub fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            Some(m)
                if m != &*self.model_name
                    && !self.engine.adapters().list().iter().any(|a| a.name == m) =>
            {
                Err(self.not_found(m))
            }
            _ => Ok(()),
        }
    }

    /// The LoRA adapter a request's `model` names (`None`: the base model),
    /// loaded again first if it was let go; a name that is neither is 404.
    pub async fn resolve_adapter(
        &self,
        requested: Option<&str>,
    ) -> Result<Option<Arc<kiln_engine::LoraAdapter>>, ApiError> {
        let Some(name) = requested.filter(|m| *m != &*self.model_name) else {
            return Ok(None);
        };
        let adapters = self.engine.adapters().clone();
        let owned = name.to_string();
        let found = tokio::task::spawn_blocking(move || adapters.get(&owned))
            .await
            .map_err(|e| ApiError::Internal(format!("adapter task: {e}")))??;
        found.map(Some).ok_or_else(|| self.not_found(name))
    }
}
