//! Extension ops, in the manner of candle's `CustomOp`: an op a family
//! needs that is not one of [`crate::Ops`]'s basics. Each op type carries
//! its CPU reference ([`ExtensionOp::cpu`], required); a backend with a
//! kernel of its own says so through [`crate::Ops::has_extension`] and
//! runs it in [`crate::Ops::extension`], reading the op's parameters by
//! downcasting [`ExtensionOp::as_any`]. A model checks that its backend
//! has every op it needs while it loads ([`require_extensions`]), so a
//! missing kernel is a load error, never a failed request.

use std::any::Any;

use crate::backend::Backend;
use crate::error::{Result, TensorError};

/// An op outside the basic set.
pub trait ExtensionOp: Send + Sync + std::fmt::Debug {
    /// The name backends know the op by (unique among extension ops).
    fn name(&self) -> &'static str;

    /// The reference: the op on host f32 data `x` of `shape`, returning the
    /// output's shape and data. Other backends are tested against it.
    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)>;

    /// The op itself, for a backend's kernel to read its parameters.
    fn as_any(&self) -> &dyn Any;
}

/// Fails unless `backend` runs every op of `ops`: the error names the
/// backend and the first op it lacks.
pub fn require_extensions<B: Backend + ?Sized>(
    backend: &B,
    ops: &[&dyn ExtensionOp],
) -> Result<()> {
    match ops.iter().find(|op| !backend.has_extension(op.name())) {
        Some(op) => Err(TensorError::Unsupported {
            backend: backend.name(),
            what: format!("the extension op `{}` ({op:?}) this model needs", op.name()),
        }),
        None => Ok(()),
    }
}

/// Soft-capping `tanh(x / cap) * cap`, elementwise: Gemma 2's final-logit
/// capping (`final_logit_softcapping`), which squashes logits into
/// `(-cap, cap)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftCap {
    pub cap: f32,
}

impl SoftCap {
    pub const NAME: &'static str = "softcap";
}

impl ExtensionOp for SoftCap {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu(&self, x: &[f32], shape: &[usize]) -> Result<(Vec<usize>, Vec<f32>)> {
        if !(self.cap > 0.0 && self.cap.is_finite()) {
            return Err(TensorError::Shape {
                op: "softcap",
                detail: format!("cap {} (must be positive and finite)", self.cap),
            });
        }
        let c = self.cap;
        Ok((
            shape.to_vec(),
            x.iter().map(|&v| (v / c).tanh() * c).collect(),
        ))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
