//! Device memory: every buffer the CUDA backend hands out is a [`DevBuf`]
//! (a raw device pointer kernels take as an argument). Activations come
//! from a caching [`Pool`] with size classes, so a step allocates nothing
//! from the driver once warm — which is also what lets a step be recorded
//! into a CUDA graph. Buffers handed out while a graph is being recorded
//! come from (and go back to) a separate free list that only recordings
//! use, so a recorded step never shares memory with anything live outside
//! it. Weights and KV caches are exact-size allocations.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

/// Bytes held by the backend, for the memory snapshot API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// Bytes in live buffers (weights, KV caches, activations in use).
    pub active_bytes: u64,
    /// Highest `active_bytes` since start or the last peak reset.
    pub peak_active_bytes: u64,
    /// Bytes obtained from the driver: active plus cached free buffers.
    pub reserved_bytes: u64,
}

/// A device buffer. Pooled buffers go back to their pool's free list when
/// dropped; exact ones go back to the driver.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    slice: Option<CudaSlice<u8>>,
    pool: Arc<Pool>,
    kind: Kind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Exact,
    General,
    Graph,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            self.pool.put(s, self.kind);
        }
    }
}

#[derive(Default)]
struct State {
    general: HashMap<usize, Vec<CudaSlice<u8>>>,
    graph: HashMap<usize, Vec<CudaSlice<u8>>>,
    recording: bool,
    capturing: bool,
    active: u64,
    peak: u64,
    cached: u64,
}

/// The caching allocator of one backend (one stream).
pub struct Pool {
    stream: Arc<CudaStream>,
    state: Mutex<State>,
}

/// Size class of a request: at least 512 bytes, rounded up to a quarter of
/// its power of two (at most ~25 % slack).
pub fn size_class(bytes: usize) -> usize {
    let b = bytes.max(512);
    let top = usize::BITS - 1 - b.leading_zeros();
    let quarter = 1usize << (top - 2);
    b.div_ceil(quarter) * quarter
}

impl Pool {
    pub fn new(stream: Arc<CudaStream>) -> Arc<Pool> {
        Arc::new(Pool {
            stream,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// While `recording`, pooled buffers come from the recording free
    /// list; while `capturing` too, a buffer that list lacks is refused
    /// (a driver allocation would become part of the graph) — a warm-up
    /// run in recording mode fills the list first.
    pub fn set_recording(&self, recording: bool, capturing: bool) {
        let mut st = self.lock();
        st.recording = recording;
        st.capturing = recording && capturing;
    }

    fn raw_alloc(&self, bytes: usize) -> Option<CudaSlice<u8>> {
        // SAFETY: the contents are uninitialized; every user writes before reading.
        unsafe { self.stream.alloc::<u8>(bytes) }.ok()
    }

    fn wrap(self: &Arc<Self>, slice: CudaSlice<u8>, bytes: usize, kind: Kind) -> DevBuf {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(&self.stream);
            ptr
        };
        DevBuf {
            ptr,
            bytes,
            slice: Some(slice),
            pool: self.clone(),
            kind,
        }
    }

    /// A pooled buffer of at least `bytes`; `None` when the device is out
    /// of memory even after the free lists are returned to the driver, or
    /// when a recording would need a fresh allocation.
    pub fn get(self: &Arc<Self>, bytes: usize) -> Option<DevBuf> {
        let class = size_class(bytes);
        let (kind, reused, capturing) = {
            let mut st = self.lock();
            let (recording, capturing) = (st.recording, st.capturing);
            let kind = if recording {
                Kind::Graph
            } else {
                Kind::General
            };
            let list = if recording {
                &mut st.graph
            } else {
                &mut st.general
            };
            let reused = list.get_mut(&class).and_then(|v| v.pop());
            if reused.is_some() {
                st.cached -= class as u64;
                st.active += class as u64;
                st.peak = st.peak.max(st.active);
            }
            (kind, reused, capturing)
        };
        if let Some(s) = reused {
            return Some(self.wrap(s, bytes, kind));
        }
        if capturing {
            return None;
        }
        let slice = self.raw_alloc(class).or_else(|| {
            self.trim();
            self.raw_alloc(class)
        })?;
        let mut st = self.lock();
        st.active += class as u64;
        st.peak = st.peak.max(st.active);
        drop(st);
        Some(self.wrap(slice, bytes, kind))
    }

    /// An exact-size buffer (weights, KV caches), freed to the driver on drop.
    pub fn get_exact(self: &Arc<Self>, bytes: usize) -> Option<DevBuf> {
        let slice = self.raw_alloc(bytes.max(1)).or_else(|| {
            self.trim();
            self.raw_alloc(bytes.max(1))
        })?;
        let mut st = self.lock();
        st.active += slice.len() as u64;
        st.peak = st.peak.max(st.active);
        drop(st);
        Some(self.wrap(slice, bytes, Kind::Exact))
    }

    fn put(&self, s: CudaSlice<u8>, kind: Kind) {
        let mut st = self.lock();
        let len = s.len();
        st.active -= len as u64;
        match kind {
            Kind::Exact => drop(s),
            Kind::General => {
                st.cached += len as u64;
                st.general.entry(len).or_default().push(s);
            }
            Kind::Graph => {
                st.cached += len as u64;
                st.graph.entry(len).or_default().push(s);
            }
        }
    }

    /// Return the general free list to the driver (the recording list is
    /// kept: recorded steps still use those addresses).
    pub fn trim(&self) {
        let mut st = self.lock();
        let freed: u64 = st
            .general
            .values()
            .flat_map(|v| v.iter().map(|s| s.len() as u64))
            .sum();
        st.general.clear();
        st.cached -= freed;
    }

    pub fn snapshot(&self) -> MemorySnapshot {
        let st = self.lock();
        MemorySnapshot {
            active_bytes: st.active,
            peak_active_bytes: st.peak,
            reserved_bytes: st.active + st.cached,
        }
    }

    pub fn reset_peak(&self) {
        let mut st = self.lock();
        st.peak = st.active;
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_cover_the_request_with_bounded_slack() {
        for bytes in [
            1usize,
            511,
            512,
            513,
            4095,
            4096,
            5000,
            1 << 20,
            (1 << 20) + 1,
            3 << 29,
        ] {
            let c = size_class(bytes);
            assert!(c >= bytes && c >= 512, "{bytes} -> {c}");
            assert!(
                c <= (bytes.max(512) as f64 * 1.25) as usize + 1,
                "{bytes} -> {c}"
            );
            assert_eq!(size_class(c), c, "classes are fixed points");
        }
    }
}
