//! The server before its model is ready. `kiln serve` binds and answers at
//! once while the model loads in the background: until [`Readiness::ready`]
//! hands over the engine, `/health` answers 503 `{"status": "loading"}` and
//! every other route 503 in its API's error shape with `Retry-After`; after
//! [`Readiness::failed`], 503 `{"status": "failed", "error": ...}`. Once
//! ready (an engine handed over, or the model pool with its default model
//! loaded), every request goes to the full router, built on the first one.

use std::convert::Infallible;
use std::sync::{Arc, OnceLock};

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use kiln_engine::EngineHandle;
use serde_json::json;
use tokio::sync::watch;
use tower::ServiceExt;

use crate::dispatch::Pool;
use crate::errors::{ApiError, ErrorShape};

/// Seconds a client is asked to wait while the model loads.
const RETRY_AFTER_SECONDS: &str = "1";

/// Where the served model stands, set by whoever loads it; cheap to clone.
#[derive(Clone)]
pub struct Readiness {
    phase: Arc<watch::Sender<Phase>>,
}

#[derive(Clone)]
enum Phase {
    Loading,
    Ready(Ready),
    Failed(Arc<str>),
}

/// What a ready server serves: one engine handed over, or a pool.
#[derive(Clone)]
pub(crate) enum Ready {
    Engine(EngineHandle),
    Pool(Arc<Pool>),
}

impl Ready {
    /// The engines running now, by model name.
    pub(crate) fn engines(&self) -> Vec<(String, EngineHandle)> {
        match self {
            Ready::Engine(e) => vec![(String::new(), e.clone())],
            Ready::Pool(pool) => pool
                .loaded()
                .into_iter()
                .map(|(name, served)| (name, served.engine().clone()))
                .collect(),
        }
    }
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness::new()
    }
}

impl Readiness {
    /// A model that is still loading.
    pub fn new() -> Self {
        let (tx, _) = watch::channel(Phase::Loading);
        Readiness {
            phase: Arc::new(tx),
        }
    }

    /// The model is loaded and its engine runs: serve it.
    pub fn ready(&self, engine: EngineHandle) {
        self.phase.send_replace(Phase::Ready(Ready::Engine(engine)));
    }

    /// The pool's default model is loaded: serve the pool.
    pub(crate) fn ready_pool(&self, pool: Arc<Pool>) {
        self.phase.send_replace(Phase::Ready(Ready::Pool(pool)));
    }

    /// The model could not be loaded: say so until the process ends.
    pub fn failed(&self, message: impl Into<String>) {
        self.phase
            .send_replace(Phase::Failed(message.into().into()));
    }

    /// What is served once it is ready; `None` if the load failed.
    pub(crate) async fn served(&self) -> Option<Ready> {
        let mut rx = self.phase.subscribe();
        let phase = rx
            .wait_for(|p| !matches!(p, Phase::Loading))
            .await
            .ok()?
            .clone();
        match phase {
            Phase::Ready(ready) => Some(ready),
            _ => None,
        }
    }

    fn phase(&self) -> Phase {
        self.phase.borrow().clone()
    }
}

/// A router that answers "not ready" until `readiness` is ready, then
/// passes every request to the router `build` makes of what is served.
pub(crate) fn gate<B>(readiness: Readiness, build: B) -> Router
where
    B: Fn(Ready) -> Router + Clone + Send + Sync + 'static,
{
    let app: Arc<OnceLock<Router>> = Arc::default();
    let service = tower::service_fn(move |req: Request| {
        let phase = readiness.phase();
        let (app, build) = (app.clone(), build.clone());
        async move {
            match phase {
                Phase::Ready(ready) => {
                    let router = app.get_or_init(|| build(ready)).clone();
                    router.oneshot(req).await
                }
                Phase::Loading => Ok::<_, Infallible>(not_ready(&req, None)),
                Phase::Failed(message) => Ok(not_ready(&req, Some(&message))),
            }
        }
    });
    Router::new().fallback_service(service)
}

/// The answer to `req` while the model is loading (`failed` is `None`) or
/// after it failed to load.
fn not_ready(req: &Request, failed: Option<&str>) -> Response {
    let path = req.uri().path();
    let mut response = if path == "/health" {
        let body = match failed {
            None => json!({"status": "loading"}),
            Some(m) => json!({"status": "failed", "error": m}),
        };
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    } else {
        let shape = if path.starts_with("/v1/messages") {
            ErrorShape::Anthropic
        } else {
            ErrorShape::OpenAi
        };
        let message = match failed {
            None => "the model is still loading; retry shortly".to_string(),
            Some(m) => format!("the model failed to load: {m}"),
        };
        ApiError::Unavailable(message).response_in(shape)
    };
    if failed.is_none() {
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from_static(RETRY_AFTER_SECONDS),
        );
    }
    response
}
