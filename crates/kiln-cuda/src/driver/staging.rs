//! Weight uploads through pinned memory: two pinned buffers in turn, the
//! host filling one (bf16 bits copied, or f32 converted, on rayon threads)
//! while the copy engine moves the other to the GPU. A pageable copy would
//! be staged by the driver one piece at a time on the calling thread.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use cudarc::driver::{result as drv, sys, DriverError};
use rayon::prelude::*;

use super::device::{dev_err, Device};

/// Elements (bf16) per pinned buffer: 64 MiB.
const CHUNK: usize = 32 << 20;
/// Elements one rayon task fills.
const PIECE: usize = 1 << 20;
/// Uploads smaller than this go the pageable way (the copy costs less than
/// a round through the buffers).
pub(crate) const MIN_STAGED: usize = 1 << 20;

/// The two pinned buffers and the events that say when each was last
/// emptied by the copy engine.
pub(crate) struct Staging {
    bufs: [*mut u16; 2],
    emptied: [sys::CUevent; 2],
    next: usize,
}

// SAFETY: the buffers and events are owned by this value and used by one
// thread at a time (the backend keeps it behind a mutex).
unsafe impl Send for Staging {}

impl Staging {
    /// Two pinned buffers, or `None` where the driver will not pin them (the
    /// caller then copies from pageable memory).
    pub(crate) fn new() -> Option<Staging> {
        let mut bufs = [std::ptr::null_mut::<u16>(); 2];
        let mut emptied = [std::ptr::null_mut(); 2];
        let mut ok = true;
        for i in 0..2 {
            // SAFETY: a plain allocation, released in Drop (or below).
            match unsafe { drv::malloc_host(CHUNK * 2, 0) } {
                Ok(p) => bufs[i] = p as *mut u16,
                Err(_) => ok = false,
            }
            match drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
                Ok(e) => emptied[i] = e,
                Err(_) => ok = false,
            }
        }
        let staging = Staging {
            bufs,
            emptied,
            next: 0,
        };
        // Drop releases whatever was made.
        ok.then_some(staging)
    }

    /// Copies `n` bf16 elements to the device at `dst` on `stream`; `fill(first,
    /// out)` writes elements `first .. first + out.len()` into `out`. Returns
    /// once every element is in pinned memory and its copy is queued: the
    /// caller's source may go; the stream orders later work after the copies.
    ///
    /// # Safety
    /// `dst` must hold `n` bf16 elements, and `stream` must be the stream the
    /// data is used on.
    pub(crate) unsafe fn upload(
        &mut self,
        stream: sys::CUstream,
        dst: u64,
        n: usize,
        fill: &(dyn Fn(usize, &mut [u16]) + Sync),
    ) -> Result<(), DriverError> {
        let mut done = 0;
        while done < n {
            let len = CHUNK.min(n - done);
            let b = self.next;
            self.next ^= 1;
            // The buffer's previous copy has left it (an event never
            // recorded is complete).
            drv::event::synchronize(self.emptied[b])?;
            // SAFETY: bufs[b] holds CHUNK elements, and no copy reads it now.
            let buf = std::slice::from_raw_parts_mut(self.bufs[b], len);
            buf.par_chunks_mut(PIECE)
                .enumerate()
                .for_each(|(i, piece)| fill(done + i * PIECE, piece));
            drv::memcpy_htod_async(dst + 2 * done as u64, &*buf, stream)?;
            drv::event::record(self.emptied[b], stream)?;
            done += len;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for i in 0..2 {
            // SAFETY: the events and buffers were made by `new`; a buffer is
            // freed only after its last copy has completed.
            unsafe {
                if !self.emptied[i].is_null() {
                    let _ = drv::event::synchronize(self.emptied[i]);
                    let _ = drv::event::destroy(self.emptied[i]);
                }
                if !self.bufs[i].is_null() {
                    let _ = drv::free_host(self.bufs[i] as *mut c_void);
                }
            }
        }
    }
}

/// Weight uploads through the pinned buffers, made on first use (unless
/// off: [`crate::CudaOptions::pinned_staging`]; on an H200 the 8B checkpoint
/// loaded in 9.2 s with them, 11.4 s without, same logits).
pub(crate) struct Uploader {
    staging: Mutex<Option<Staging>>,
    tried: AtomicBool,
    enabled: bool,
}

impl Uploader {
    pub(crate) fn new(enabled: bool) -> Self {
        Uploader {
            staging: Mutex::new(None),
            tried: AtomicBool::new(false),
            enabled,
        }
    }

    /// Uploads `n` bf16 elements to `dst` on `dev`'s stream; `fill(first,
    /// out)` writes elements `first .. first + out.len()` into `out`.
    /// `Ok(false)`: off, too small or no pinned memory; the caller copies the
    /// pageable way.
    pub(crate) fn upload(
        &self,
        dev: &Device,
        dst: u64,
        n: usize,
        fill: &(dyn Fn(usize, &mut [u16]) + Sync),
    ) -> kiln_tensor::Result<bool> {
        if n < MIN_STAGED {
            return Ok(false);
        }
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        dev.ctx.bind_to_thread().map_err(dev_err)?;
        if staging.is_none() && !self.tried.swap(true, Ordering::Relaxed) {
            *staging = self.enabled.then(Staging::new).flatten();
        }
        let Some(s) = staging.as_mut() else {
            return Ok(false);
        };
        // SAFETY: the caller allocated `dst` for `n` elements; weights are
        // used on the device's one stream.
        unsafe { s.upload(dev.stream.cu_stream(), dst, n, fill) }.map_err(dev_err)?;
        Ok(true)
    }
}
