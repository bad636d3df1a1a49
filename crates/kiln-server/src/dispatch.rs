//! One server, several models: every request reaches the router of the
//! model it names, through the [`ModelPool`].
//!
//! Each loaded model has its own router over its own [`AppState`] (the
//! routes are the single-model server's, unchanged). The dispatcher reads
//! the model a request names — the body's `model` (Ollama's `/api/show`
//! also `name`), or `?model=` on a GET such as `/stats` and `/metrics`;
//! none names the default model, the first configured — takes a lease on
//! it from the pool (loading it first, and waiting for it up to the pool's
//! wait), and passes the request on. The lease lives in the response body,
//! so a model is never unloaded under a stream. A name that is no model but
//! one of a loaded model's LoRA adapters goes to that model.
//!
//! The pool's own routes answer here: `GET /v1/models`, `/api/tags` and
//! `/api/ps` list every model with its state; `POST /models/load` and
//! `/models/unload` (`{"model": NAME}`) load and unload one; `/health`
//! answers for the default model; `/` is the chat page.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::FutureExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use kiln_engine::{Engine, EngineHandle};
use serde_json::{json, Value};
use tokio::sync::watch;
use tower::ServiceExt;

use crate::access_log::AccessLog;
use crate::errors::{ApiError, ErrorShape};
use crate::metrics::Metrics;
use crate::pool::{Catalog, Lease, ModelPool, ModelSource, PoolError};
use crate::server::ServerConfig;
use crate::state::AppState;

/// What every model's router shares: the server's configuration, metrics,
/// shutdown signal and access log.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) config: ServerConfig,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) cancel: watch::Receiver<bool>,
    pub(crate) started_at: u64,
    pub(crate) access: AccessLog,
}

/// A loaded model as the server serves it: its state and router, and the
/// engine when the pool started it (stopped when this is dropped).
pub struct ServedModel {
    pub(crate) state: AppState,
    router: Router,
    _engine: Option<Engine>,
}

impl ServedModel {
    pub(crate) fn new(
        shared: &Shared,
        name: &str,
        handle: EngineHandle,
        engine: Option<Engine>,
    ) -> Self {
        let config = &shared.config;
        let state = AppState {
            model_name: name.into(),
            api_key: config.api_key.as_deref().map(Arc::from),
            max_body_bytes: config.max_body_bytes,
            metrics: shared.metrics.clone(),
            cancel: shared.cancel.clone(),
            started_at: shared.started_at,
            sse_keepalive: config.sse_keepalive,
            output: config.output,
            sampling_defaults: Arc::new(config.sampling_defaults(handle.model())),
            strict_params: config.strict_params,
            matryoshka_dimensions: config.matryoshka_dimensions.clone().map(Arc::from),
            lora_runtime: config.enable_lora_runtime,
            engine: handle,
        };
        let router = crate::server::router(state.clone(), shared.access.for_model(name));
        ServedModel {
            state,
            router,
            _engine: engine,
        }
    }

    /// The engine's handle.
    pub fn engine(&self) -> &EngineHandle {
        &self.state.engine
    }
}

/// The pool the server serves from.
pub type Pool = ModelPool<ServedModel>;

/// A source of engines as a source of served models.
pub(crate) fn served_source(
    shared: &Shared,
    source: ModelSource<Engine>,
) -> ModelSource<ServedModel> {
    let (shared, load, name) = (shared.clone(), source.load.clone(), source.name.clone());
    ModelSource {
        load: Arc::new(move || {
            let engine = load()?;
            Ok(ServedModel::new(
                &shared,
                &name,
                engine.handle(),
                Some(engine),
            ))
        }),
        name: source.name,
        device: source.device,
        memory_bytes: source.memory_bytes,
        pinned: source.pinned,
        path: source.path,
    }
}

/// A catalog of engines as one of served models.
pub(crate) struct ServedCatalog {
    pub(crate) shared: Shared,
    pub(crate) inner: Box<dyn Catalog<Engine>>,
}

impl Catalog<ServedModel> for ServedCatalog {
    fn find(&self, name: &str) -> Option<Result<ModelSource<ServedModel>, String>> {
        self.inner
            .find(name)
            .map(|r| r.map(|s| served_source(&self.shared, s)))
    }

    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
}

/// The server's router over `pool`.
pub(crate) fn router(pool: Arc<Pool>, shared: &Shared) -> Router {
    let own = Router::new()
        .route("/v1/models", get(models))
        .route("/api/tags", get(tags))
        .route("/api/ps", get(ps))
        .route("/models/load", post(load))
        .route("/models/unload", post(unload))
        .route_layer(axum::middleware::from_fn_with_state(
            shared.config.api_key.as_deref().map(Arc::<str>::from),
            crate::server::require_key,
        ))
        .route("/health", get(health))
        .route("/", get(page))
        .layer(axum::middleware::from_fn_with_state(
            shared.metrics.clone(),
            crate::server::count_requests,
        ))
        .layer(axum::middleware::from_fn_with_state(
            shared.access.clone(),
            crate::access_log::record,
        ))
        .with_state(pool.clone());
    let limit = shared.config.max_body_bytes;
    let metrics = shared.metrics.clone();
    Router::new().fallback_service(tower::service_fn(move |req: Request| {
        let (pool, own, metrics) = (pool.clone(), own.clone(), metrics.clone());
        async move {
            let response = dispatch(pool, own, limit, req).await;
            Ok::<_, std::convert::Infallible>(response)
        }
        .inspect(move |r: &Result<Response, _>| {
            // The model's router counts what reaches it; what the
            // dispatcher refuses itself (no such model, no room) counts
            // here, under no route (its paths are the client's).
            if let Ok(r) = r {
                if r.extensions().get::<Refused>().is_some() {
                    metrics.record_request("unmatched", r.status().as_u16());
                }
            }
        })
    }))
}

/// Marks a response the dispatcher made itself.
#[derive(Clone, Copy)]
struct Refused;

/// Whether the pool answers `path` itself.
fn pool_route(method: &Method, path: &str) -> bool {
    match *method {
        Method::GET => matches!(
            path,
            "/" | "/v1/models" | "/api/tags" | "/api/ps" | "/health"
        ),
        Method::POST => matches!(path, "/models/load" | "/models/unload"),
        _ => false,
    }
}

async fn dispatch(pool: Arc<Pool>, own: Router, limit: usize, req: Request) -> Response {
    if pool_route(req.method(), req.uri().path()) {
        return own.oneshot(req).await.unwrap_or_else(|e| match e {});
    }
    let shape = ErrorShape::for_path(req.uri().path());
    let (parts, body) = req.into_parts();
    // The body is read here to find the model, then handed on whole.
    let (bytes, named) = if parts.method == Method::POST {
        match axum::body::to_bytes(body, limit).await {
            Ok(bytes) => {
                let named = named_in_body(&bytes);
                (bytes, named)
            }
            Err(_) => return refused(ApiError::BodyTooLarge { limit }.response_in(shape)),
        }
    } else {
        (Bytes::new(), named_in_query(parts.uri.query()))
    };
    let name = match named {
        Some(n) => owner_of(&pool, &n).unwrap_or(n),
        None => pool.default_name(),
    };
    let ollama = ollama_request(&parts.method, parts.uri.path(), &bytes);
    if let Some(o) = &ollama {
        if let Some(r) = ollama_load_or_unload(&pool, &name, o).await {
            return r;
        }
    }
    let lease = match pool.acquire(&name).await {
        Ok(lease) => lease,
        Err(e) => return refused(pool_error(e).response_in(shape)),
    };
    // Ollama's `keep_alive`: how long the model stays loaded after this.
    if let Some(Some(Ok(keep))) = ollama.map(|o| o.keep_alive) {
        let _ = pool.keep_alive(lease.name(), keep);
    }
    let router = lease.value().router.clone();
    let response = router
        .oneshot(Request::from_parts(parts, Body::from(bytes)))
        .await
        .unwrap_or_else(|e| match e {});
    response.map(|body| {
        Body::new(Leased {
            body,
            _lease: lease,
        })
    })
}

fn refused(mut response: Response) -> Response {
    response.extensions_mut().insert(Refused);
    response
}

/// What the pool reads of an Ollama request.
struct OllamaRequest {
    /// `keep_alive`, when given (`Ok(None)`: forever).
    keep_alive: Option<Result<Option<Duration>, String>>,
    /// A generate or chat request with nothing to answer: Ollama's way to
    /// load a model (or, with `keep_alive: 0`, unload it).
    empty: bool,
    chat: bool,
}

fn ollama_request(method: &Method, path: &str, bytes: &Bytes) -> Option<OllamaRequest> {
    if method != Method::POST || !matches!(path, "/api/generate" | "/api/chat" | "/api/embed") {
        return None;
    }
    let body: serde_json::Map<String, Value> = serde_json::from_slice(bytes).ok()?;
    let blank = |k: &str| match body.get(k) {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    };
    Some(OllamaRequest {
        keep_alive: body
            .get("keep_alive")
            .filter(|v| !v.is_null())
            .map(keep_alive),
        empty: match path {
            "/api/generate" => blank("prompt") && blank("images"),
            "/api/chat" => blank("messages"),
            _ => false,
        },
        chat: path == "/api/chat",
    })
}

/// Ollama's `keep_alive`: seconds as a number, or a duration such as
/// `"5m"`, `"1h30m"`, `"90s"`; negative keeps the model loaded.
fn keep_alive(v: &Value) -> Result<Option<Duration>, String> {
    let seconds = match v {
        Value::Number(n) => n.as_f64().ok_or("keep_alive is not a number")?,
        Value::String(s) => {
            let s = s.trim();
            if let Ok(n) = s.parse::<f64>() {
                n
            } else {
                let (neg, mut rest) = match s.strip_prefix('-') {
                    Some(r) => (true, r),
                    None => (false, s),
                };
                let mut total = 0.0;
                while !rest.is_empty() {
                    let digits = rest
                        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                        .ok_or(format!("keep_alive {s:?}: a number without a unit"))?;
                    let n: f64 = rest[..digits]
                        .parse()
                        .map_err(|_| format!("keep_alive {s:?} is not a duration"))?;
                    rest = &rest[digits..];
                    let unit_len = rest
                        .find(|c: char| c.is_ascii_digit() || c == '.')
                        .unwrap_or(rest.len());
                    let scale = match &rest[..unit_len] {
                        "h" => 3600.0,
                        "m" => 60.0,
                        "s" => 1.0,
                        "ms" => 1e-3,
                        "us" | "µs" => 1e-6,
                        "ns" => 1e-9,
                        u => return Err(format!("keep_alive {s:?}: unknown unit {u:?}")),
                    };
                    total += n * scale;
                    rest = &rest[unit_len..];
                }
                if neg {
                    -total
                } else {
                    total
                }
            }
        }
        _ => return Err("keep_alive must be a number or a duration string".into()),
    };
    if seconds < 0.0 {
        return Ok(None);
    }
    Ok(Some(Duration::from_secs_f64(seconds.min(1e9))))
}

/// Ollama's empty generate/chat: load the model, or unload it with
/// `keep_alive: 0`, and say so as Ollama does.
async fn ollama_load_or_unload(
    pool: &Arc<Pool>,
    name: &str,
    o: &OllamaRequest,
) -> Option<Response> {
    if !o.empty {
        return None;
    }
    let shape = ErrorShape::Ollama;
    let keep = match &o.keep_alive {
        Some(Err(e)) => {
            return Some(refused(
                ApiError::invalid("keep_alive", e.clone()).response_in(shape),
            ))
        }
        Some(Ok(k)) => Some(*k),
        None => None,
    };
    let reason = if keep == Some(Some(Duration::ZERO)) {
        if pool.list().iter().any(|s| s.name == name && s.pinned) {
            let e = ApiError::invalid(
                "keep_alive",
                format!("the model `{name}` is pinned: it stays loaded (POST /models/unload unloads it)"),
            );
            return Some(refused(e.response_in(shape)));
        }
        if let Err(e) = pool.unload(name).await {
            return Some(refused(pool_error(e).response_in(shape)));
        }
        "unload"
    } else {
        if let Err(e) = pool.load(name).await {
            return Some(refused(pool_error(e).response_in(shape)));
        }
        if let Some(k) = keep {
            let _ = pool.keep_alive(name, k);
        }
        "load"
    };
    let mut body = json!({
        "model": name,
        "created_at": crate::routes::ollama::now_rfc3339(),
        "done": true,
        "done_reason": reason,
    });
    if o.chat {
        body["message"] = json!({"role": "assistant", "content": ""});
    } else {
        body["response"] = json!("");
    }
    Some(Json(body).into_response())
}

/// The body's `model` (or `name`, as Ollama's `/api/show` may send it).
fn named_in_body(bytes: &Bytes) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<Value>,
        name: Option<Value>,
    }
    let named: Named = serde_json::from_slice(bytes).ok()?;
    match named.model.or(named.name)? {
        Value::String(s) if !s.is_empty() => Some(s),
        _ => None,
    }
}

fn named_in_query(query: Option<&str>) -> Option<String> {
    query?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == "model" && !v.is_empty()).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push(h << 4 | l);
                i += 3;
            }
            (b'+', ..) => {
                out.push(b' ');
                i += 1;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The loaded model one of whose LoRA adapters is called `name`, when no
/// model is.
fn owner_of(pool: &Pool, name: &str) -> Option<String> {
    if pool.has_entry(name) {
        return None;
    }
    let owner = pool.loaded().into_iter().find_map(|(model, served)| {
        served
            .engine()
            .adapters()
            .list()
            .iter()
            .any(|a| a.name == name)
            .then_some(model)
    })?;
    // A model the catalog knows by that name still wins (asked only here,
    // not on every request: the catalog may read a database).
    (!pool.names().iter().any(|n| n == name)).then_some(owner)
}

/// A pool error as the APIs answer it.
pub(crate) fn pool_error(e: PoolError) -> ApiError {
    match e {
        PoolError::NotFound { name, available } => ApiError::ModelNotFound { name, available },
        PoolError::Unservable(m) => ApiError::invalid("model", m),
        e @ (PoolError::TooLarge { .. }
        | PoolError::Timeout(_)
        | PoolError::LoadFailed { .. }
        | PoolError::InUse { .. }) => ApiError::Unavailable(e.to_string()),
    }
}

/// A response body that holds its model's lease until it ends.
struct Leased {
    body: Body,
    _lease: Lease<ServedModel>,
}

impl HttpBody for Leased {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The chat page (`web/index.html`, in the binary): model picker,
/// streamed markdown, reasoning and tool calls, stop, per-message speed,
/// conversations in the browser's storage. It calls the OpenAI routes
/// from the same origin and nothing else.
async fn page() -> Response {
    use axum::http::header;
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
                 frame-ancestors 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("web/index.html"),
    )
        .into_response()
}

/// `/health`: the default model's engine, and every model's state.
async fn health(State(pool): State<Arc<Pool>>) -> Response {
    let default = pool.default_name();
    let list = pool.list();
    let states: serde_json::Map<String, Value> = list
        .iter()
        .map(|s| (s.name.clone(), json!(s.state.as_str())))
        .collect();
    let served = list
        .into_iter()
        .find(|s| s.name == default)
        .and_then(|s| s.value);
    let (code, mut body) = match served {
        Some(served) => crate::routes::ops::health_of(&served.state),
        None => (StatusCode::OK, json!({"status": "ok"})),
    };
    if states.len() > 1 {
        body["models"] = Value::Object(states);
    }
    let mut response = (code, Json(body)).into_response();
    if code != StatusCode::OK {
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
    }
    response
}

/// A model's (or adapter's) entry in `/v1/models`: its card, then where
/// it stands in the pool.
#[derive(serde::Serialize)]
struct Listed<'a> {
    #[serde(flatten)]
    card: Card,
    status: &'static str,
    device: &'a str,
    memory_bytes: u64,
    pinned: bool,
    in_flight: usize,
    error: Option<&'a str>,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum Card {
    /// A loaded model's card (its context and sampling defaults known).
    Served(crate::openai_types::ModelCard),
    /// A model not loaded: its name and where its weights are.
    Unloaded {
        id: String,
        object: &'static str,
        created: u64,
        owned_by: &'static str,
        root: String,
    },
}

/// Every model's entries in `/v1/models` (a loaded one's adapters too).
async fn models(State(pool): State<Arc<Pool>>) -> Response {
    let list = pool.list();
    let mut data = Vec::new();
    for s in &list {
        let listed = |card| Listed {
            card,
            status: s.state.as_str(),
            device: &s.device,
            memory_bytes: s.memory_bytes,
            pinned: s.pinned,
            in_flight: s.in_flight,
            error: s.error.as_deref(),
        };
        match &s.value {
            Some(served) => data.extend(
                crate::routes::ops::model_cards(&served.state)
                    .into_iter()
                    .map(|c| listed(Card::Served(c))),
            ),
            None => data.push(listed(Card::Unloaded {
                id: s.name.clone(),
                object: "model",
                created: 0,
                owned_by: "kiln",
                root: s.path.display().to_string(),
            })),
        }
    }
    // Typed all the way, so the cards' f32 fields keep their shortest
    // spelling (0.8, not 0.800000011920929 as through a `Value`).
    #[derive(serde::Serialize)]
    struct List<'a> {
        object: &'static str,
        data: Vec<Listed<'a>>,
    }
    Json(List {
        object: "list",
        data,
    })
    .into_response()
}

/// Ollama's list of models: every model the pool serves.
async fn tags(State(pool): State<Arc<Pool>>) -> Json<Value> {
    let models: Vec<Value> = pool
        .list()
        .iter()
        .map(|s| crate::routes::ollama::pool_entry(s))
        .collect();
    Json(json!({"models": models}))
}

/// Ollama's running models: the loaded ones.
async fn ps(State(pool): State<Arc<Pool>>) -> Json<Value> {
    let mut models = Vec::new();
    for s in pool.list() {
        let Some(served) = &s.value else { continue };
        let mut entry = crate::routes::ollama::pool_entry(&s);
        crate::routes::ollama::running_fields(&mut entry, &served.state, pool.unloads_in(&s.name))
            .await;
        models.push(entry);
    }
    Json(json!({"models": models}))
}

#[derive(serde::Deserialize)]
struct Named {
    model: String,
}

fn named(bytes: &Bytes) -> Result<String, ApiError> {
    serde_json::from_slice::<Named>(bytes)
        .map(|n| n.model)
        .map_err(|e| ApiError::invalid("model", format!("expected {{\"model\": NAME}}: {e}")))
}

/// `POST /models/load {"model": NAME}`: loads it (waiting for it).
async fn load(State(pool): State<Arc<Pool>>, bytes: Bytes) -> Result<Json<Value>, ApiError> {
    let name = named(&bytes)?;
    pool.load(&name).await.map_err(pool_error)?;
    Ok(Json(json!({"model": name, "status": "loaded"})))
}

/// `POST /models/unload {"model": NAME}`: unloads it once its requests in
/// flight have ended.
async fn unload(State(pool): State<Arc<Pool>>, bytes: Bytes) -> Result<Json<Value>, ApiError> {
    let name = named(&bytes)?;
    let was_loaded = pool.unload(&name).await.map_err(pool_error)?;
    Ok(Json(
        json!({"model": name, "status": "unloaded", "was_loaded": was_loaded}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_read_from_the_body_or_the_query() {
        assert_eq!(
            named_in_body(&Bytes::from_static(br#"{"model":"a","x":[1]}"#)),
            Some("a".into())
        );
        assert_eq!(
            named_in_body(&Bytes::from_static(br#"{"name":"b"}"#)),
            Some("b".into())
        );
        assert_eq!(named_in_body(&Bytes::from_static(br#"{"model":""}"#)), None);
        assert_eq!(named_in_body(&Bytes::from_static(br#"{"model":7}"#)), None);
        assert_eq!(named_in_body(&Bytes::from_static(b"not json")), None);
        assert_eq!(
            named_in_query(Some("x=1&model=qwen%3A0.5b")),
            Some("qwen:0.5b".into())
        );
        assert_eq!(named_in_query(Some("model=")), None);
        assert_eq!(named_in_query(None), None);
        assert_eq!(percent_decode("a%2"), "a%2");
    }

    #[test]
    fn keep_alive_reads_as_ollama_writes_it() {
        let k = |v: Value| keep_alive(&v);
        assert_eq!(k(json!(0)), Ok(Some(Duration::ZERO)));
        assert_eq!(k(json!(30)), Ok(Some(Duration::from_secs(30))));
        assert_eq!(k(json!("5m")), Ok(Some(Duration::from_secs(300))));
        assert_eq!(k(json!("1h30m")), Ok(Some(Duration::from_secs(5400))));
        assert_eq!(k(json!("90s")), Ok(Some(Duration::from_secs(90))));
        assert_eq!(k(json!("0")), Ok(Some(Duration::ZERO)));
        assert_eq!(k(json!(-1)), Ok(None));
        assert_eq!(k(json!("-1m")), Ok(None));
        assert!(k(json!("5 minutes")).is_err() && k(json!("5")).is_ok() && k(json!(true)).is_err());
        assert!(k(json!("12")).is_ok() && k(json!("3x")).is_err());
    }
}
