//! Step recording: a step's metadata uploaded once as one `u32` array
//! (`meta.rs`), the running step it is found in by the ops, and decode steps
//! recorded as CUDA graphs per batch bucket and replayed (`graphs.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kiln_tensor::{ForwardBatch, Result};

use crate::backend::CudaBackend;
use crate::driver::device::dev_err;
use crate::driver::pool::DevBuf;

pub(crate) mod graphs;
pub mod meta;

use meta::{table_width, StepMeta};

/// A `u32` array on the device: part of the step's metadata or uploaded
/// for this call.
pub(crate) struct DevU32 {
    pub(crate) ptr: u64,
    _hold: Option<DevBuf>,
}

/// A step's metadata on the device.
pub(crate) struct ActiveStep {
    pub batch: ForwardBatch,
    pub meta: StepMeta,
    pub base: u64,
    /// The cache slot of a recorded batch's padding rows (`u32::MAX`: none).
    pub pad_slot: u32,
    pub _hold: Option<DevBuf>,
}

impl CudaBackend {
    pub(crate) fn active(&self) -> Option<Arc<ActiveStep>> {
        self.step.lock().ok().and_then(|s| s.clone())
    }

    pub(crate) fn no_upload_while_recording(&self, what: &str) -> Result<()> {
        if self.capturing.load(Ordering::Relaxed) {
            return Err(dev_err(format!(
                "{what} is not part of the recorded step's metadata"
            )));
        }
        Ok(())
    }

    /// `host` on the device: found in the running step's metadata at
    /// `offset(meta)` when it is that array, else uploaded now.
    pub(crate) fn dev_u32(&self, host: &[u32], offset: fn(&StepMeta) -> usize) -> Result<DevU32> {
        if let Some(step) = self.active() {
            let off = offset(&step.meta);
            if step.meta.words.get(off..off + host.len()) == Some(host) {
                return Ok(DevU32 {
                    ptr: step.base + 4 * off as u64,
                    _hold: None,
                });
            }
        }
        self.no_upload_while_recording("an index array")?;
        let b = self.dev.alloc(host.len(), 4, "indices")?;
        self.dev.htod(b.ptr, host)?;
        Ok(DevU32 {
            ptr: b.ptr,
            _hold: Some(b),
        })
    }

    /// The metadata of `batch`: the running step's, or built and uploaded now.
    pub(crate) fn step_meta(&self, batch: &ForwardBatch) -> Result<Arc<ActiveStep>> {
        if let Some(step) = self.active() {
            if step.batch == *batch {
                return Ok(step);
            }
        }
        self.no_upload_while_recording("a batch")?;
        self.upload_step(batch.clone(), table_width(batch))
    }

    pub(crate) fn upload_step(&self, batch: ForwardBatch, width: usize) -> Result<Arc<ActiveStep>> {
        let meta = StepMeta::build(&batch, width);
        let b = self.dev.alloc(meta.words.len(), 4, "step metadata")?;
        self.dev.htod(b.ptr, &meta.words)?;
        Ok(Arc::new(ActiveStep {
            batch,
            base: b.ptr,
            meta,
            pad_slot: u32::MAX,
            _hold: Some(b),
        }))
    }
}
