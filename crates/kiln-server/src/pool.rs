//! The model pool: several models served by one process, each loaded when
//! a request first names it, unloaded when it has been idle too long or
//! when another needs its memory, least recently used first.
//!
//! Every model has a [`ModelSource`]: its name, the device whose budget it
//! counts against, its resident bytes (the terms `kiln fit` plans with:
//! weights, KV pool, activations, fixed overheads) and how to load it.
//! Sources are configured up front or found on first request through a
//! [`Catalog`] (the model registry). A load starts only once the model's
//! bytes fit its device's budget beside the models kept there, after
//! unloading idle unpinned ones (least recently used first); when the
//! budget is held by models with requests in flight, the load waits for
//! them, up to the pool's wait. A request for a model that is loading
//! waits for it the same way. A model alone larger than its budget is
//! refused at once.
//!
//! A [`Lease`] is what a request holds while it uses a loaded model: a
//! model with leases is never unloaded (the server keeps one until a
//! response body, stream included, has ended).
//!
//! The pool is generic over what a load gives (`T`: the server's engine
//! and its router), so its policy is tested without models.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// What loading a model takes, and what it costs.
pub struct ModelSource<T> {
    /// The name requests use (`model`).
    pub name: String,
    /// The device whose budget the model counts against (`cpu`, `cuda:0`).
    pub device: String,
    /// Bytes the model holds while loaded (weights, KV pool, activations).
    pub memory_bytes: u64,
    /// Never unloaded for room or idleness (only on request).
    pub pinned: bool,
    /// Where its weights are (shown in listings).
    pub path: PathBuf,
    /// Loads it (on a blocking thread).
    pub load: Arc<dyn Fn() -> Result<T, String> + Send + Sync>,
}

impl<T> Clone for ModelSource<T> {
    fn clone(&self) -> Self {
        ModelSource {
            name: self.name.clone(),
            device: self.device.clone(),
            memory_bytes: self.memory_bytes,
            pinned: self.pinned,
            path: self.path.clone(),
            load: self.load.clone(),
        }
    }
}

/// Models loadable by name beyond the configured ones.
pub trait Catalog<T>: Send + Sync {
    /// The source of the model called `name`, if the catalog knows it
    /// (`Err`: it does, but it cannot be served here, and why).
    fn find(&self, name: &str) -> Option<Result<ModelSource<T>, String>>;
    /// Every name it knows.
    fn names(&self) -> Vec<String>;
}

/// The pool's limits.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Bytes each device may hold in models (a device not named: no limit).
    pub budgets: BTreeMap<String, u64>,
    /// Unloaded after this long without a request (unpinned models).
    pub idle_unload: Option<Duration>,
    /// How long a request waits for its model to load, or for room.
    pub wait: Duration,
    /// A failed load is tried again by requests only after this long.
    pub retry_after_failure: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            budgets: BTreeMap::new(),
            idle_unload: None,
            wait: Duration::from_secs(120),
            retry_after_failure: Duration::from_secs(10),
        }
    }
}

/// Why a model could not be had.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PoolError {
    #[error("the model `{name}` does not exist")]
    NotFound {
        name: String,
        available: Vec<String>,
    },
    /// It can never fit its device's budget.
    #[error(
        "the model `{name}` needs {need_mib} MiB on {device}, more than the {budget_mib} MiB budget"
    )]
    TooLarge {
        name: String,
        device: String,
        need_mib: u64,
        budget_mib: u64,
    },
    /// Its load (or the room for it) did not come within the wait.
    #[error("{0}")]
    Timeout(String),
    /// Its load failed (tried again after a pause).
    #[error("the model `{name}` failed to load: {message}")]
    LoadFailed { name: String, message: String },
    /// An unload asked of a model with requests in flight past the wait.
    #[error("the model `{name}` still has {in_flight} request(s) in flight")]
    InUse { name: String, in_flight: usize },
    /// The catalog knows the name but cannot serve it.
    #[error("{0}")]
    Unservable(String),
}

/// Where a model stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelState {
    Unloaded,
    Loading,
    Loaded,
    Failed,
}

impl ModelState {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelState::Unloaded => "unloaded",
            ModelState::Loading => "loading",
            ModelState::Loaded => "loaded",
            ModelState::Failed => "failed",
        }
    }
}

/// One model as listed.
#[derive(Debug, Clone)]
pub struct ModelStatus<T> {
    pub name: String,
    pub device: String,
    pub path: PathBuf,
    pub memory_bytes: u64,
    pub pinned: bool,
    pub state: ModelState,
    /// Requests holding it now.
    pub in_flight: usize,
    /// Since its last request (loaded models).
    pub idle: Option<Duration>,
    /// Its last load's error (failed models).
    pub error: Option<String>,
    /// What its load gave (loaded models).
    pub value: Option<Arc<T>>,
}

enum Slot<T> {
    Unloaded,
    Loading,
    Loaded(Arc<T>),
    Failed { message: String, at: Instant },
}

struct Entry<T> {
    source: ModelSource<T>,
    slot: Slot<T>,
    last_used: Instant,
    /// How long it stays loaded when idle, as its last request asked
    /// (Ollama's `keep_alive`; `Some(None)`: until asked otherwise), over
    /// the pool's idle time.
    keep_alive: Option<Option<Duration>>,
    /// One clone a lease: the strong count less one is the leases held.
    leases: Arc<()>,
}

impl<T> Entry<T> {
    fn in_flight(&self) -> usize {
        Arc::strong_count(&self.leases) - 1
    }

    fn holds_memory(&self) -> bool {
        matches!(self.slot, Slot::Loading | Slot::Loaded(_))
    }

    fn state(&self) -> ModelState {
        match self.slot {
            Slot::Unloaded => ModelState::Unloaded,
            Slot::Loading => ModelState::Loading,
            Slot::Loaded(_) => ModelState::Loaded,
            Slot::Failed { .. } => ModelState::Failed,
        }
    }
}

struct Inner<T> {
    /// In the order configured, then found.
    entries: Vec<Entry<T>>,
}

/// The pool. Cheap to share (`Arc`).
pub struct ModelPool<T> {
    inner: Mutex<Inner<T>>,
    catalog: Option<Box<dyn Catalog<T>>>,
    config: PoolConfig,
    /// Bumped whenever a slot changes or a lease ends: what waiters wait on.
    changed: watch::Sender<u64>,
}

/// A request's hold on a loaded model: the model stays loaded while any
/// lease on it lives.
pub struct Lease<T> {
    value: Arc<T>,
    name: Arc<str>,
    lease: Option<Arc<()>>,
    changed: watch::Sender<u64>,
}

impl<T> Lease<T> {
    pub fn value(&self) -> &Arc<T> {
        &self.value
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<T> Drop for Lease<T> {
    fn drop(&mut self) {
        // The count falls before waiters are woken to re-check it.
        drop(self.lease.take());
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }
}

/// What a locked step decided.
enum Step<T> {
    Ready(Lease<T>),
    /// Load it (this caller won the slot); values to drop first.
    Load(ModelSource<T>, Vec<Arc<T>>),
    /// Wait for a change (a load to end, a lease to go).
    Wait(String),
}

impl<T: Send + Sync + 'static> ModelPool<T> {
    /// A pool of `sources` (names must be distinct), finding others in
    /// `catalog`.
    pub fn new(
        sources: Vec<ModelSource<T>>,
        catalog: Option<Box<dyn Catalog<T>>>,
        config: PoolConfig,
    ) -> Result<Arc<Self>, String> {
        let mut entries: Vec<Entry<T>> = Vec::new();
        for source in sources {
            if entries.iter().any(|e| e.source.name == source.name) {
                return Err(format!("two models are named `{}`", source.name));
            }
            entries.push(Entry {
                source,
                slot: Slot::Unloaded,
                last_used: Instant::now(),
                keep_alive: None,
                leases: Arc::new(()),
            });
        }
        if entries.is_empty() {
            return Err("the pool has no model".into());
        }
        Ok(Arc::new(ModelPool {
            inner: Mutex::new(Inner { entries }),
            catalog,
            config,
            changed: watch::channel(0).0,
        }))
    }

    /// The model requests that name none get: the first configured.
    pub fn default_name(&self) -> String {
        self.lock().entries[0].source.name.clone()
    }

    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<T>> {
        // A panic while holding the lock leaves plain data behind.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Whether `name` is a configured model (or one the catalog gave).
    pub fn has_entry(&self, name: &str) -> bool {
        self.lock().entries.iter().any(|e| e.source.name == name)
    }

    /// Every name the pool serves or can load.
    pub fn names(&self) -> Vec<String> {
        let inner = self.lock();
        self.names_in(&inner)
    }

    fn names_in(&self, inner: &Inner<T>) -> Vec<String> {
        let mut names: Vec<String> = inner
            .entries
            .iter()
            .map(|e| e.source.name.clone())
            .collect();
        if let Some(c) = &self.catalog {
            for n in c.names() {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
        names
    }

    /// Every model, configured, found or known to the catalog.
    pub fn list(&self) -> Vec<ModelStatus<T>> {
        let inner = self.lock();
        let now = Instant::now();
        let mut out: Vec<ModelStatus<T>> = inner
            .entries
            .iter()
            .map(|e| ModelStatus {
                name: e.source.name.clone(),
                device: e.source.device.clone(),
                path: e.source.path.clone(),
                memory_bytes: e.source.memory_bytes,
                pinned: e.source.pinned,
                state: e.state(),
                in_flight: e.in_flight(),
                idle: matches!(e.slot, Slot::Loaded(_)).then(|| now - e.last_used),
                error: match &e.slot {
                    Slot::Failed { message, .. } => Some(message.clone()),
                    _ => None,
                },
                value: match &e.slot {
                    Slot::Loaded(v) => Some(v.clone()),
                    _ => None,
                },
            })
            .collect();
        drop(inner);
        if let Some(c) = &self.catalog {
            for name in c.names() {
                if out.iter().any(|s| s.name == name) {
                    continue;
                }
                if let Some(Ok(s)) = c.find(&name) {
                    out.push(ModelStatus {
                        name,
                        device: s.device,
                        path: s.path,
                        memory_bytes: s.memory_bytes,
                        pinned: false,
                        state: ModelState::Unloaded,
                        in_flight: 0,
                        idle: None,
                        error: None,
                        value: None,
                    });
                }
            }
        }
        out
    }

    /// The loaded models' values (for routing by adapter name).
    pub fn loaded(&self) -> Vec<(String, Arc<T>)> {
        self.lock()
            .entries
            .iter()
            .filter_map(|e| match &e.slot {
                Slot::Loaded(v) => Some((e.source.name.clone(), v.clone())),
                _ => None,
            })
            .collect()
    }

    /// The entry called `name` (or `name` less Ollama's `:latest`),
    /// added from the catalog when only it knows the name.
    fn index_of(&self, inner: &mut Inner<T>, name: &str) -> Result<usize, PoolError> {
        let bare = name.strip_suffix(":latest").unwrap_or(name);
        for n in [name, bare] {
            if let Some(i) = inner.entries.iter().position(|e| e.source.name == n) {
                return Ok(i);
            }
        }
        if let Some(c) = &self.catalog {
            for n in [name, bare] {
                match c.find(n) {
                    Some(Ok(mut source)) => {
                        source.name = n.to_string();
                        inner.entries.push(Entry {
                            source,
                            slot: Slot::Unloaded,
                            last_used: Instant::now(),
                            keep_alive: None,
                            leases: Arc::new(()),
                        });
                        return Ok(inner.entries.len() - 1);
                    }
                    Some(Err(message)) => return Err(PoolError::Unservable(message)),
                    None => {}
                }
            }
        }
        Err(PoolError::NotFound {
            name: name.to_string(),
            available: self.names_in(inner),
        })
    }

    /// A lease on `name`, loading it first if needed (waiting up to the
    /// pool's wait for its load, or for room).
    pub async fn acquire(self: &Arc<Self>, name: &str) -> Result<Lease<T>, PoolError> {
        self.acquire_within(name, Some(self.config.wait)).await
    }

    /// [`ModelPool::acquire`] waiting up to `wait` (`None`: as long as it
    /// takes — the server's start-up load).
    pub async fn acquire_within(
        self: &Arc<Self>,
        name: &str,
        wait: Option<Duration>,
    ) -> Result<Lease<T>, PoolError> {
        // Far enough to mean never.
        let wait = wait.unwrap_or(Duration::from_secs(1 << 30));
        let deadline = tokio::time::Instant::now() + wait;
        let mut rx = self.changed.subscribe();
        loop {
            rx.mark_unchanged();
            let step = self.step(name)?;
            match step {
                Step::Ready(lease) => return Ok(lease),
                Step::Load(source, evicted) => {
                    self.start_load(source, evicted);
                }
                Step::Wait(why) => match tokio::time::timeout_at(deadline, rx.changed()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return Err(PoolError::Timeout(why)),
                    Err(_) => {
                        return Err(PoolError::Timeout(format!(
                            "{why} after waiting {:.0} s",
                            wait.as_secs_f64()
                        )))
                    }
                },
            }
        }
    }

    /// One look under the lock: ready, claim the load, or wait.
    fn step(&self, name: &str) -> Result<Step<T>, PoolError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let i = self.index_of(inner, name)?;
        let entry = &mut inner.entries[i];
        match &entry.slot {
            Slot::Loaded(v) => {
                entry.last_used = Instant::now();
                return Ok(Step::Ready(Lease {
                    value: v.clone(),
                    name: entry.source.name.as_str().into(),
                    lease: Some(entry.leases.clone()),
                    changed: self.changed.clone(),
                }));
            }
            Slot::Loading => {
                return Ok(Step::Wait(format!(
                    "the model `{}` is still loading",
                    entry.source.name
                )))
            }
            Slot::Failed { message, at } if at.elapsed() < self.config.retry_after_failure => {
                return Err(PoolError::LoadFailed {
                    name: entry.source.name.clone(),
                    message: message.clone(),
                });
            }
            Slot::Failed { .. } | Slot::Unloaded => {}
        }
        // Room for it on its device, unloading idle models if need be.
        let (device, need) = (entry.source.device.clone(), entry.source.memory_bytes);
        let mut evicted = Vec::new();
        if let Some(&budget) = self.config.budgets.get(&device) {
            if need > budget {
                return Err(PoolError::TooLarge {
                    name: name.to_string(),
                    device,
                    need_mib: need.div_ceil(1 << 20),
                    budget_mib: budget >> 20,
                });
            }
            while inner.used_bytes(&device) + need > budget {
                // The least recently used idle, unpinned, loaded model.
                let victim = inner
                    .entries
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| {
                        e.source.device == device
                            && !e.source.pinned
                            && e.in_flight() == 0
                            && matches!(e.slot, Slot::Loaded(_))
                    })
                    .min_by_key(|(_, e)| e.last_used)
                    .map(|(j, _)| j);
                let Some(j) = victim else {
                    let busy: Vec<String> = inner
                        .entries
                        .iter()
                        .filter(|e| e.source.device == device && e.holds_memory())
                        .map(|e| format!("{} ({} in flight)", e.source.name, e.in_flight()))
                        .collect();
                    return Ok(Step::Wait(format!(
                        "no room on {device} for `{name}` ({} MiB of a {} MiB budget): {} hold it",
                        need.div_ceil(1 << 20),
                        budget >> 20,
                        busy.join(", ")
                    )));
                };
                if let Slot::Loaded(v) =
                    std::mem::replace(&mut inner.entries[j].slot, Slot::Unloaded)
                {
                    tracing::info!(
                        target: "kiln::pool",
                        model = %inner.entries[j].source.name,
                        "unloading `{}` to make room for `{name}`",
                        inner.entries[j].source.name
                    );
                    evicted.push(v);
                }
            }
        }
        let entry = &mut inner.entries[i];
        entry.slot = Slot::Loading;
        Ok(Step::Load(entry.source.clone(), evicted))
    }

    /// Drops what was unloaded and loads `source` on a blocking thread;
    /// the slot becomes loaded or failed and waiters are woken.
    fn start_load(self: &Arc<Self>, source: ModelSource<T>, evicted: Vec<Arc<T>>) {
        self.bump();
        let pool = self.clone();
        tokio::task::spawn_blocking(move || {
            // The evicted engines stop (and free their memory) before the
            // new one takes it.
            drop(evicted);
            let started = Instant::now();
            tracing::info!(target: "kiln::pool", model = %source.name, "loading `{}`", source.name);
            let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (source.load)()))
                .unwrap_or_else(|_| Err("the load panicked".to_string()));
            let mut inner = pool.lock();
            if let Some(e) = inner
                .entries
                .iter_mut()
                .find(|e| e.source.name == source.name)
            {
                e.last_used = Instant::now();
                e.slot = match loaded {
                    Ok(v) => {
                        tracing::info!(
                            target: "kiln::pool",
                            model = %source.name,
                            seconds = started.elapsed().as_secs_f64(),
                            "loaded `{}`", source.name
                        );
                        Slot::Loaded(Arc::new(v))
                    }
                    Err(message) => {
                        tracing::warn!(target: "kiln::pool", model = %source.name, "loading `{}` failed: {message}", source.name);
                        Slot::Failed {
                            message,
                            at: Instant::now(),
                        }
                    }
                };
            }
            drop(inner);
            pool.bump();
        });
    }

    /// Makes `value` the loaded model `name` (a configured one), as if
    /// its load had given it; `false` if there is no such model.
    pub fn insert_loaded(&self, name: &str, value: T) -> bool {
        let mut inner = self.lock();
        let Some(e) = inner.entries.iter_mut().find(|e| e.source.name == name) else {
            return false;
        };
        e.slot = Slot::Loaded(Arc::new(value));
        e.last_used = Instant::now();
        drop(inner);
        self.bump();
        true
    }

    /// Loads `name` (if it is not loaded) and waits until it is.
    pub async fn load(self: &Arc<Self>, name: &str) -> Result<(), PoolError> {
        self.acquire(name).await.map(drop)
    }

    /// Unloads `name` once its requests in flight have ended (waiting up
    /// to the pool's wait); `Ok(false)` if it was not loaded.
    pub async fn unload(self: &Arc<Self>, name: &str) -> Result<bool, PoolError> {
        let deadline = tokio::time::Instant::now() + self.config.wait;
        let mut rx = self.changed.subscribe();
        loop {
            rx.mark_unchanged();
            let taken = {
                let mut guard = self.lock();
                let inner = &mut *guard;
                let i = self.index_of(inner, name)?;
                let e = &mut inner.entries[i];
                match &e.slot {
                    Slot::Loaded(_) if e.in_flight() == 0 => {
                        match std::mem::replace(&mut e.slot, Slot::Unloaded) {
                            Slot::Loaded(v) => Some(Ok(v)),
                            _ => unreachable!("matched as loaded"),
                        }
                    }
                    Slot::Loaded(_) | Slot::Loading => Some(Err(e.in_flight())),
                    Slot::Unloaded | Slot::Failed { .. } => None,
                }
            };
            match taken {
                None => return Ok(false),
                Some(Ok(v)) => {
                    self.bump();
                    tracing::info!(target: "kiln::pool", model = %name, "unloading `{name}` (asked)");
                    let _ = tokio::task::spawn_blocking(move || drop(v)).await;
                    return Ok(true);
                }
                Some(Err(in_flight)) => {
                    if tokio::time::timeout_at(deadline, rx.changed())
                        .await
                        .is_err()
                    {
                        return Err(PoolError::InUse {
                            name: name.to_string(),
                            in_flight,
                        });
                    }
                }
            }
        }
    }

    /// How long `name` stays loaded once idle, from now on (`None`: until
    /// asked otherwise; zero: unloaded as soon as its requests end) —
    /// Ollama's `keep_alive`. Pinned models stay regardless.
    pub fn keep_alive(&self, name: &str, keep: Option<Duration>) -> Result<(), PoolError> {
        let mut guard = self.lock();
        let i = self.index_of(&mut guard, name)?;
        guard.entries[i].keep_alive = Some(keep);
        Ok(())
    }

    /// When `e` is unloaded once idle (`None`: never).
    fn idle_limit(&self, e: &Entry<T>) -> Option<Duration> {
        match e.keep_alive {
            _ if e.source.pinned => None,
            Some(keep) => keep,
            None => self.config.idle_unload,
        }
    }

    /// Unloads every unpinned model idle longer than its keep-alive (its
    /// last request's, else the pool's idle time); how many.
    pub fn unload_idle(&self) -> usize {
        let now = Instant::now();
        let mut dropped = Vec::new();
        {
            let mut inner = self.lock();
            for i in 0..inner.entries.len() {
                let limit = self.idle_limit(&inner.entries[i]);
                let e = &mut inner.entries[i];
                let Some(idle) = limit else { continue };
                if e.in_flight() == 0
                    && matches!(e.slot, Slot::Loaded(_))
                    && now - e.last_used >= idle
                {
                    tracing::info!(
                        target: "kiln::pool",
                        model = %e.source.name,
                        "unloading `{}`: idle for {:.0} s",
                        e.source.name,
                        (now - e.last_used).as_secs_f64()
                    );
                    if let Slot::Loaded(v) = std::mem::replace(&mut e.slot, Slot::Unloaded) {
                        dropped.push(v);
                    }
                }
            }
        }
        let n = dropped.len();
        if n > 0 {
            self.bump();
            // Engines stop on a blocking thread.
            std::thread::spawn(move || drop(dropped));
        }
        n
    }

    /// A task that unloads idle models (keep-alives can ask for it even
    /// when the pool has no idle time).
    pub fn spawn_idle_unloader(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let period = match self.config.idle_unload {
            Some(idle) => (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)),
            None => Duration::from_secs(1),
        };
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(pool) = pool.upgrade() else { return };
                pool.unload_idle();
            }
        })
    }

    /// When `name`, loaded and idle, will be unloaded (`None`: not loaded,
    /// or never).
    pub fn unloads_in(&self, name: &str) -> Option<Duration> {
        let inner = self.lock();
        let e = inner.entries.iter().find(|e| e.source.name == name)?;
        if !matches!(e.slot, Slot::Loaded(_)) {
            return None;
        }
        let limit = self.idle_limit(e)?;
        Some(limit.saturating_sub(e.last_used.elapsed()))
    }

    /// Bytes the loaded and loading models hold on `device`.
    pub fn used_bytes(&self, device: &str) -> u64 {
        self.lock().used_bytes(device)
    }
}

impl<T> Inner<T> {
    /// Bytes the loaded and loading models hold on `device`.
    fn used_bytes(&self, device: &str) -> u64 {
        self.entries
            .iter()
            .filter(|e| e.source.device == device && e.holds_memory())
            .map(|e| e.source.memory_bytes)
            .sum()
    }
}

#[cfg(test)]
mod tests;
