//! The server: configuration, the router, authentication and request
//! counting, binding, serving while the model loads, and graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use kiln_engine::{Engine, EngineHandle};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::access_log::{self, AccessLog};
use crate::connections::ConnectionLimits;
use crate::dispatch::{Pool, ServedModel, Shared};
use crate::errors::{ApiError, ErrorShape};
use crate::guard::Guard;
use crate::loading::{gate, Readiness, Ready};
use crate::metrics::Metrics;
use crate::openai_types::unix_now;
use crate::pool::{Catalog, ModelPool, ModelSource, PoolConfig};
use crate::routes::{chat, completions, messages, ops, tokenize};
use crate::state::AppState;

/// How the server listens and what it accepts.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// When set, every API route needs `Authorization: Bearer <key>` or
    /// `x-api-key: <key>` (`/health` and `/metrics` stay open).
    pub api_key: Option<String>,
    /// Origins allowed to call from a browser (`*` for any); none by default.
    pub cors_origins: Vec<String>,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// The name the model is served under.
    pub model_name: String,
    /// After a shutdown signal, how long in-flight requests may run before
    /// they are cancelled.
    pub shutdown_grace: Duration,
    /// A stream silent this long (waiting in the queue, a long prefill)
    /// sends a keep-alive: `: ping` or Anthropic's `ping` event. Zero
    /// turns keep-alives off.
    pub sse_keepalive: Duration,
    /// Tool-call syntax and reasoning split, where the chat template
    /// should not decide.
    pub output: crate::parse::OutputOverrides,
    /// Sampling defaults set by flags; the fields left unset come from the
    /// model's generation config, else llama.cpp's defaults.
    pub sampling: kiln_sampling::PartialSampling,
    /// The repetition guard every request gets (`None`: off).
    pub loop_guard: Option<kiln_sampling::NgramRepeat>,
    /// Refuse unknown request fields (400) instead of ignoring them.
    pub strict_params: bool,
    /// Host names accepted in the `Host` header besides the loopback ones
    /// (`*` for any). With none, a server on a loopback address answers
    /// only for loopback names and one bound elsewhere for any.
    pub allowed_hosts: Vec<String>,
    /// A request head not complete this long after its first byte closes
    /// the connection.
    pub header_read_timeout: Duration,
    /// A request body not complete this long after its head gets 408.
    pub body_read_timeout: Duration,
    /// A connection with no request in progress this long is closed.
    pub idle_timeout: Duration,
    /// Most open connections; past it, new ones get 503 and are closed.
    pub max_connections: usize,
    /// How often the throughput line is logged while the engine has work;
    /// zero turns it off.
    pub throughput_log_interval: Duration,
    /// Mount `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    pub enable_lora_runtime: bool,
    /// The embedding lengths `dimensions` may ask for (Matryoshka), over
    /// what the model's `config.json` declares: `Some(empty)` any length up
    /// to the model's, `None` the model's own declaration.
    pub matryoshka_dimensions: Option<Vec<usize>>,
}

impl ServerConfig {
    /// The sampling defaults requests to `model` get under this config.
    pub fn sampling_defaults(
        &self,
        model: &kiln_engine::LoadedModel,
    ) -> kiln_sampling::SamplingDefaults {
        kiln_sampling::SamplingDefaults::resolve(
            self.sampling,
            model.sampling_defaults,
            self.loop_guard,
        )
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            cors_origins: Vec::new(),
            max_body_bytes: 8 << 20,
            model_name: "kiln".into(),
            shutdown_grace: Duration::from_secs(30),
            sse_keepalive: Duration::from_secs(15),
            output: crate::parse::OutputOverrides::default(),
            sampling: kiln_sampling::PartialSampling::default(),
            loop_guard: Some(kiln_sampling::DEFAULT_LOOP_GUARD),
            strict_params: false,
            allowed_hosts: Vec::new(),
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_connections: 512,
            throughput_log_interval: Duration::from_secs(10),
            matryoshka_dimensions: None,
            enable_lora_runtime: false,
        }
    }
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("invalid CORS origin {0:?}")]
    BadCorsOrigin(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("the model failed to load: {0}")]
    Load(String),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// Binds `config.host:config.port`.
pub async fn bind(config: &ServerConfig) -> Result<TcpListener, ServerError> {
    let addr = format!("{}:{}", config.host, config.port);
    TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })
}

/// Binds and serves until `shutdown` resolves (see [`serve_on`]).
pub async fn serve(
    config: ServerConfig,
    engine: EngineHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let listener = bind(&config).await?;
    serve_on(listener, config, engine, shutdown).await
}

/// Serves `engine` on a bound listener until `shutdown` resolves (see
/// [`serve_loading`]).
pub async fn serve_on(
    listener: TcpListener,
    config: ServerConfig,
    engine: EngineHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let readiness = Readiness::new();
    readiness.ready(engine);
    serve_loading(listener, config, readiness, shutdown).await
}

/// Serves on a bound listener until `shutdown` resolves, answering 503
/// until `readiness` is given the engine; then stops accepting, lets
/// in-flight requests finish for `shutdown_grace`, cancels those still
/// running, and returns.
pub async fn serve_loading(
    listener: TcpListener,
    config: ServerConfig,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let (shared, cancel) = Shared::new(config)?;
    serve_until(
        listener,
        shared,
        cancel,
        readiness,
        shutdown,
        std::future::pending(),
    )
    .await
}

impl Shared {
    /// The parts every model's router shares, and the sender that cancels
    /// the requests still running at shutdown.
    fn new(config: ServerConfig) -> Result<(Shared, watch::Sender<bool>), ServerError> {
        if config
            .api_key
            .as_deref()
            .is_some_and(|k| k.trim().is_empty())
        {
            return Err(ServerError::Config(
                "the API key is empty; give a non-empty key or none".into(),
            ));
        }
        let (cancel_tx, cancel_rx) = watch::channel(false);
        let shared = Shared {
            access: AccessLog::new(&config.model_name),
            config,
            metrics: Arc::new(Metrics::default()),
            cancel: cancel_rx,
            started_at: unix_now(),
        };
        Ok((shared, cancel_tx))
    }
}

/// [`serve_loading`], where `force` resolving during the grace period
/// cancels the requests still running and returns at once.
async fn serve_until(
    listener: TcpListener,
    shared: Shared,
    cancel_tx: watch::Sender<bool>,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
    force: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let config = shared.config.clone();
    let access = shared.access.clone();
    let _throughput = (!config.throughput_log_interval.is_zero()).then(|| {
        AbortOnDrop(tokio::spawn(crate::throughput::report(
            readiness.clone(),
            config.throughput_log_interval,
        )))
    });
    let mut app = gate(readiness, move |ready| {
        let pool = match ready {
            Ready::Pool(pool) => pool,
            Ready::Engine(handle) => single(&shared, handle),
        };
        crate::dispatch::router(pool, &shared)
    })
    .layer(DefaultBodyLimit::max(config.max_body_bytes));
    if !config.cors_origins.is_empty() {
        app = app.layer(cors(&config.cors_origins)?);
    }
    let app = app.layer(middleware::from_fn_with_state(
        Guard::new(&config),
        crate::guard::check,
    ));
    let limits = ConnectionLimits {
        header_read_timeout: config.header_read_timeout,
        idle_timeout: config.idle_timeout,
        max_connections: config.max_connections,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = crate::connections::serve(listener, app, limits, stop_rx);
    tokio::pin!(server);
    tokio::select! {
        () = &mut server => return Ok(()),
        () = shutdown => {}
    }
    let _ = stop_tx.send(true);
    let grace = config.shutdown_grace.as_secs_f64();
    match access.in_flight() {
        0 => tracing::info!(target: "kiln::server", "shutting down: no requests in flight"),
        n => tracing::info!(
            target: "kiln::server",
            in_flight = n,
            grace_s = grace,
            "shutting down: waiting up to {grace}s for {n} request(s) in flight; interrupt again to stop now"
        ),
    }
    tokio::pin!(force);
    tokio::select! {
        r = tokio::time::timeout(config.shutdown_grace, &mut server) => {
            if r.is_ok() {
                return Ok(());
            }
            tracing::info!(
                target: "kiln::server",
                in_flight = access.in_flight(),
                "the {grace}s grace is over: cancelling the requests still running"
            );
        }
        () = &mut force => {
            tracing::info!(
                target: "kiln::server",
                in_flight = access.in_flight(),
                "interrupted again: cancelling the requests still running and stopping now"
            );
            let _ = cancel_tx.send(true);
            // Each handler drops its stream as it sees the cancel; the
            // server is not waited for.
            tokio::task::yield_now().await;
            return Ok(());
        }
    }
    // Grace is over: end every request still running (each drops its
    // stream, which cancels it in the engine) and give them a moment.
    let _ = cancel_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), &mut server).await;
    Ok(())
}

/// The models `kiln serve` serves: the configured ones (the first is the
/// default, loaded before the server reports ready), others found by name
/// in `catalog`, under `config`'s budgets.
pub struct PoolSpec {
    pub sources: Vec<ModelSource<Engine>>,
    pub catalog: Option<Box<dyn Catalog<Engine>>>,
    pub config: PoolConfig,
}

/// Starts a runtime, binds, calls `on_listening` with the bound address,
/// loads the pool's default model on a blocking thread while answering
/// 503, calls `on_ready` with its name and sampling defaults (none for an
/// embedding model) once requests reach it, and serves
/// the pool until SIGINT or SIGTERM. A default model that fails to load
/// ends this with [`ServerError::Load`] (`/health` says `failed` until the
/// process exits). For the `kiln serve` command.
pub fn run(
    config: ServerConfig,
    spec: PoolSpec,
    on_listening: impl FnOnce(SocketAddr),
    on_ready: impl FnOnce(&str, Option<&kiln_sampling::SamplingDefaults>),
) -> Result<(), ServerError> {
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(4);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        // Every admitted request holds a blocking thread while it waits and
        // runs (up to the engine's running cap plus its waiting queue, 1280
        // by default, and one more per extra choice). Past tokio's default
        // of 512, later requests would queue inside tokio unbounded instead
        // of reaching the engine's admission and its 429, and `/stats`
        // would wait behind them. Threads start only when needed.
        .max_blocking_threads(4096)
        .thread_name("kiln-http")
        .enable_all()
        .build()
        .map_err(ServerError::Runtime)?;
    let (result, pool) = runtime.block_on(async move {
        let (shared, cancel) = match Shared::new(config) {
            Ok(s) => s,
            Err(e) => return (Err(e), None),
        };
        let sources = spec
            .sources
            .into_iter()
            .map(|s| crate::dispatch::served_source(&shared, s))
            .collect();
        let catalog = spec.catalog.map(|inner| {
            Box::new(crate::dispatch::ServedCatalog {
                shared: shared.clone(),
                inner,
            }) as Box<dyn Catalog<ServedModel>>
        });
        let pool = match ModelPool::new(sources, catalog, spec.config) {
            Ok(p) => p,
            Err(e) => return (Err(ServerError::Config(e)), None),
        };
        let listener = match bind(&shared.config).await {
            Ok(l) => l,
            Err(e) => return (Err(e), None),
        };
        match listener.local_addr() {
            Ok(addr) => on_listening(addr),
            Err(e) => return (Err(ServerError::Io(e)), None),
        }
        let readiness = Readiness::new();
        let (first, second) = signals();
        let serving = serve_until(listener, shared, cancel, readiness.clone(), first, second);
        tokio::pin!(serving);
        let default = pool.default_name();
        let loading = pool.acquire_within(&default, None);
        let lease = tokio::select! {
            r = &mut serving => return (r, Some(pool)),
            loaded = loading => match loaded {
                Ok(lease) => lease,
                Err(e) => {
                    let message = match e {
                        crate::pool::PoolError::LoadFailed { message, .. } => message,
                        e => e.to_string(),
                    };
                    readiness.failed(message.clone());
                    return (Err(ServerError::Load(message)), Some(pool));
                }
            },
        };
        let _idle = AbortOnDrop(pool.spawn_idle_unloader());
        readiness.ready_pool(pool.clone());
        let state = &lease.value().state;
        let generates = state.engine.model().model.generates();
        on_ready(&default, generates.then_some(&*state.sampling_defaults));
        drop(lease);
        (serving.await, Some(pool))
    });
    // Tasks still blocked on a request end when the engines stop; don't wait.
    runtime.shutdown_background();
    drop(pool);
    result
}

/// A pool of the one engine handed over, loaded and pinned, under the
/// configured model name.
fn single(shared: &Shared, handle: EngineHandle) -> Arc<Pool> {
    let name = shared.config.model_name.clone();
    let source = ModelSource {
        name: name.clone(),
        device: String::new(),
        memory_bytes: 0,
        pinned: true,
        path: handle.model().path.clone(),
        load: Arc::new(
            || Err("this engine was handed over; it cannot be loaded again".to_string()),
        ),
    };
    let pool =
        ModelPool::new(vec![source], None, PoolConfig::default()).expect("one model, named once");
    pool.insert_loaded(&name, ServedModel::new(shared, &name, handle, None));
    pool
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// Resolves on the first and on the second SIGINT or SIGTERM.
fn signals() -> (
    impl Future<Output = ()> + Send + 'static,
    impl Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = watch::channel(0u32);
    tokio::spawn(async move {
        // Listeners kept across signals, so none is missed between two.
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            if let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) {
                loop {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                    tx.send_modify(|n| *n += 1);
                }
            }
        }
        loop {
            shutdown_signal().await;
            tx.send_modify(|n| *n += 1);
        }
    });
    let nth = |n: u32, mut rx: watch::Receiver<u32>| async move {
        if rx.wait_for(|&count| count >= n).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    (nth(1, rx.clone()), nth(2, rx))
}

/// A task that is aborted when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(crate) fn router(state: AppState, access: AccessLog) -> Router {
    let mut api = Router::new();
    if state.lora_runtime {
        api = api
            .route("/v1/load_lora_adapter", post(crate::routes::lora::load))
            .route("/v1/unload_lora_adapter", post(crate::routes::lora::unload));
    }
    let api = api
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/responses", post(crate::routes::responses::handle))
        .route("/v1/embeddings", post(crate::routes::embeddings::handle))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/messages", post(messages::handle))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/stats", get(ops::stats))
        .route("/api/version", get(crate::routes::ollama::version))
        .route("/api/show", post(crate::routes::ollama::show))
        .route("/api/chat", post(crate::routes::ollama::chat))
        .route("/api/generate", post(crate::routes::ollama::generate))
        .route("/api/embed", post(crate::routes::ollama::embed))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    api.route("/metrics", get(ops::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::json_body::track_ignored,
        ))
        .layer(middleware::from_fn_with_state(
            state.metrics.clone(),
            count_requests,
        ))
        .layer(middleware::from_fn_with_state(access, access_log::record))
        .with_state(state)
}

fn cors(origins: &[String]) -> Result<CorsLayer, ServerError> {
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let list = origins
            .iter()
            .map(|o| HeaderValue::from_str(o).map_err(|_| ServerError::BadCorsOrigin(o.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        AllowOrigin::list(list)
    };
    Ok(CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([
            header::AUTHORIZATION,
            header::CONTENT_TYPE,
            header::HeaderName::from_static("x-api-key"),
            header::HeaderName::from_static("anthropic-version"),
        ]))
}

async fn authenticate(State(state): State<AppState>, req: Request, next: Next) -> Response {
    require_key(State(state.api_key.clone()), req, next).await
}

/// 401 in the path's error shape unless the request carries `key` (when
/// one is set).
pub(crate) async fn require_key(
    State(key): State<Option<Arc<str>>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &key {
        if !presents_key(req.headers(), key) {
            let shape = ErrorShape::for_path(req.uri().path());
            return ApiError::Unauthorized.response_in(shape);
        }
    }
    next.run(req).await
}

/// Whether `Authorization: Bearer <key>` (the scheme in any case) or
/// `x-api-key: <key>` carries `key`.
fn presents_key(headers: &header::HeaderMap, key: &str) -> bool {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(token)
        });
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    bearer
        .or(x_api_key)
        .map(str::trim)
        .is_some_and(|given| keys_match(given, key))
}

/// Compares the keys' SHA-256 digests without stopping at the first
/// difference, so neither the time nor its dependence on where the keys
/// differ says anything about the key's length or its bytes.
fn keys_match(given: &str, key: &str) -> bool {
    use sha2::{Digest, Sha256};
    let (a, b) = (
        Sha256::digest(given.as_bytes()),
        Sha256::digest(key.as_bytes()),
    );
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

pub(crate) async fn count_requests(
    State(metrics): State<Arc<Metrics>>,
    req: Request,
    next: Next,
) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let response = next.run(req).await;
    metrics.record_request(&endpoint, response.status().as_u16());
    response
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path();
    ApiError::NotFound(format!("{} {path}", req.method())).response_in(ErrorShape::for_path(path))
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::MethodNotAllowed.response_in(ErrorShape::for_path(req.uri().path()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_comparison() {
        assert!(keys_match("secret", "secret"));
        assert!(!keys_match("secret", "secreT"));
        assert!(!keys_match("secret", "secrets"));
        assert!(!keys_match("", "secret"));
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let with = |name: &str, value: &str| {
            let mut h = header::HeaderMap::new();
            h.insert(
                header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
            h
        };
        for auth in ["Bearer k1", "bearer k1", "BEARER  k1", " Bearer k1 "] {
            assert!(presents_key(&with("authorization", auth), "k1"), "{auth}");
        }
        assert!(presents_key(&with("x-api-key", "k1"), "k1"));
        assert!(!presents_key(&with("authorization", "Basic k1"), "k1"));
        assert!(!presents_key(&with("authorization", "Bearer k2"), "k1"));
        assert!(!presents_key(&header::HeaderMap::new(), "k1"));
    }
}
