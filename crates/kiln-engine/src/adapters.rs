//! The LoRA adapters a server offers: every name it knows with its PEFT
//! directory, and a bounded set of them loaded (least recently used out
//! first, never one a running request holds). A known adapter that was
//! let go is loaded again when a request names it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kiln_tensor::LoraAdapter;

use crate::error::{EngineError, Result};
use crate::LoadedModel;

/// Adapters by name over one model.
pub struct Adapters {
    model: Arc<LoadedModel>,
    max_loaded: std::sync::atomic::AtomicUsize,
    /// Bytes the loaded adapters may take together (0: no bound).
    max_bytes: std::sync::atomic::AtomicU64,
    inner: Mutex<Inner>,
}

/// Adapters loaded at once unless [`Adapters::set_max_loaded`] says
/// otherwise.
pub const DEFAULT_MAX_LOADED: usize = 8;

#[derive(Default)]
struct Inner {
    known: BTreeMap<String, PathBuf>,
    /// Loaded adapters and the tick of their last use.
    loaded: HashMap<String, (Arc<LoraAdapter>, u64)>,
    tick: u64,
}

/// An adapter as `/v1/models` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    pub name: String,
    pub path: PathBuf,
    pub loaded: bool,
}

impl Adapters {
    /// No adapters yet; at most `max_loaded` (at least 1) loaded at once.
    pub fn new(model: Arc<LoadedModel>, max_loaded: usize) -> Adapters {
        Adapters {
            model,
            max_loaded: std::sync::atomic::AtomicUsize::new(max_loaded.max(1)),
            max_bytes: std::sync::atomic::AtomicU64::new(0),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// At most `n` (at least 1) adapters loaded at once from now on.
    pub fn set_max_loaded(&self, n: usize) {
        self.max_loaded
            .store(n.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// At most `bytes` of adapters loaded at once (0: no bound), the
    /// memory plan's share for them.
    pub fn set_max_bytes(&self, bytes: u64) {
        self.max_bytes
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    fn max(&self) -> usize {
        self.max_loaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves the maps consistent (each
        // change is one insert or remove).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `name` for the PEFT directory `path`, loading it now (so a
    /// bad adapter is refused here, with the reason).
    pub fn add(&self, name: &str, path: &Path) -> Result<()> {
        if name.is_empty() {
            return Err(EngineError::InvalidRequest(
                "an adapter needs a name".into(),
            ));
        }
        let mut inner = self.lock();
        if inner.known.contains_key(name) {
            return Err(EngineError::InvalidRequest(format!(
                "an adapter named {name:?} is already loaded"
            )));
        }
        let adapter = self.load(name, path)?;
        self.make_room(&mut inner, adapter.num_bytes)?;
        inner.known.insert(name.to_string(), path.to_path_buf());
        inner.tick += 1;
        let tick = inner.tick;
        inner
            .loaded
            .insert(name.to_string(), (Arc::new(adapter), tick));
        Ok(())
    }

    /// Forgets `name`. Requests running with it keep it until they end.
    pub fn remove(&self, name: &str) -> Result<()> {
        let mut inner = self.lock();
        if inner.known.remove(name).is_none() {
            return Err(EngineError::InvalidRequest(format!(
                "no adapter named {name:?} is loaded"
            )));
        }
        inner.loaded.remove(name);
        Ok(())
    }

    /// The adapter `name` (`None`: no such name), loaded again first if it
    /// was let go.
    pub fn get(&self, name: &str) -> Result<Option<Arc<LoraAdapter>>> {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        if let Some((a, used)) = inner.loaded.get_mut(name) {
            *used = tick;
            return Ok(Some(a.clone()));
        }
        let Some(path) = inner.known.get(name).cloned() else {
            return Ok(None);
        };
        let adapter = Arc::new(self.load(name, &path)?);
        self.make_room(&mut inner, adapter.num_bytes)?;
        inner
            .loaded
            .insert(name.to_string(), (adapter.clone(), tick));
        Ok(Some(adapter))
    }

    /// Every known adapter, by name.
    pub fn list(&self) -> Vec<AdapterInfo> {
        let inner = self.lock();
        inner
            .known
            .iter()
            .map(|(name, path)| AdapterInfo {
                name: name.clone(),
                path: path.clone(),
                loaded: inner.loaded.contains_key(name),
            })
            .collect()
    }

    /// Bytes the loaded adapters take.
    pub fn loaded_bytes(&self) -> u64 {
        self.lock().loaded.values().map(|(a, _)| a.num_bytes).sum()
    }

    /// Loads an adapter; what is wrong with it is the caller's to fix (a
    /// path, a file, an adapter for another model).
    fn load(&self, name: &str, path: &Path) -> Result<LoraAdapter> {
        kiln_models::lora::load_peft(path, name, self.model.model.as_ref()).map_err(|e| match e {
            kiln_models::ModelError::Tensor(t) => EngineError::Tensor(t),
            e => EngineError::InvalidRequest(format!("LoRA adapter {name:?}: {e}")),
        })
    }

    /// Lets go of the least recently used adapters no request holds until
    /// one more of `bytes` fits under both bounds.
    fn make_room(&self, inner: &mut Inner, bytes: u64) -> Result<()> {
        let max_bytes = self.max_bytes.load(std::sync::atomic::Ordering::Relaxed);
        if max_bytes > 0 && bytes > max_bytes {
            return Err(EngineError::InvalidRequest(format!(
                "the adapter takes {bytes} bytes, more than the {max_bytes} the memory plan gives adapters"
            )));
        }
        loop {
            let held: u64 = inner.loaded.values().map(|(a, _)| a.num_bytes).sum();
            let over_count = inner.loaded.len() >= self.max();
            let over_bytes = max_bytes > 0 && held + bytes > max_bytes;
            if !over_count && !over_bytes {
                return Ok(());
            }
            let idle = inner
                .loaded
                .iter()
                .filter(|(_, (a, _))| Arc::strong_count(a) == 1)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(n, _)| n.clone());
            match idle {
                Some(n) => {
                    inner.loaded.remove(&n);
                }
                None => {
                    return Err(EngineError::Busy(format!(
                        "the adapters in memory ({} of at most {}, {held} bytes) are all used by running requests; retry shortly",
                        inner.loaded.len(),
                        self.max()
                    )))
                }
            }
        }
    }
}
