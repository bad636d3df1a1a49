//! Soft-capping `tanh(x / cap) * cap` of logits (Gemma 2's
//! `final_logit_softcapping`), run as the [`SoftCap`] extension op. A model
//! that needs it builds this layer while it loads, and that fails on a
//! backend without the op, so a request never finds it missing.

use kiln_tensor::{require_extensions, Backend, SoftCap, Tensor};

use crate::error::Result;

pub struct SoftCapping {
    op: SoftCap,
}

impl SoftCapping {
    /// Soft-capping at `cap`, checked against `backend`'s extension ops.
    pub fn load(backend: &dyn Backend, cap: f32) -> Result<Self> {
        let op = SoftCap { cap };
        require_extensions(backend, &[&op])?;
        Ok(SoftCapping { op })
    }

    pub fn cap(&self) -> f32 {
        self.op.cap
    }

    /// `tanh(x / cap) * cap`, elementwise.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(b.extension(&self.op, x)?)
    }
}
