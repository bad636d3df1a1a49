//! The one projection op, [`crate::Ops::matmul`]: `x · Wᵀ` with an
//! optional RMSNorm of `x` before it ([`NormPrologue`]) and a bias,
//! gated activation and residual add after it ([`Epilogue`]), so that a
//! backend can fuse what it can behind one call. [`matmul_unfused`] is the
//! composition from basic ops every backend gets by default.

use crate::backend::{Activation, Ops};
use crate::error::Result;
use crate::tensor::Tensor;
use crate::weight::Weight;

/// RMSNorm of the product's input: `x / rms(x) * (offset + weight)` over
/// its last dimension.
#[derive(Debug, Clone, Copy)]
pub struct NormPrologue<'a> {
    pub weight: &'a Tensor,
    pub eps: f32,
    /// 0 for most families, 1 for Gemma's `(1 + w)`.
    pub offset: f32,
}

/// What happens to the product `y = x · Wᵀ`, in this order: `+ bias`, then
/// `act(gate) * up` over `y`'s two halves (the weight holds the gate rows,
/// then the up rows, so the result is half as wide), then `+ residual`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Epilogue<'a> {
    /// `[out]`, added to every row.
    pub bias: Option<&'a Tensor>,
    pub gated: Option<Activation>,
    /// Same shape as the result: the residual stream the output joins.
    pub residual: Option<&'a Tensor>,
}

impl<'a> Epilogue<'a> {
    /// The plain product.
    pub const NONE: Epilogue<'static> = Epilogue {
        bias: None,
        gated: None,
        residual: None,
    };

    /// `+ bias` where there is one.
    pub fn bias(bias: Option<&'a Tensor>) -> Self {
        Epilogue {
            bias,
            ..Epilogue::NONE
        }
    }

    /// `act(gate) * up` of a packed gate/up product.
    pub fn gated(act: Activation) -> Self {
        Epilogue {
            gated: Some(act),
            ..Epilogue::NONE
        }
    }

    /// This epilogue, then `+ residual`.
    pub fn with_residual(self, residual: &'a Tensor) -> Self {
        Epilogue {
            residual: Some(residual),
            ..self
        }
    }
}

/// [`crate::Ops::matmul`] from basic ops: the norm
/// ([`crate::Ops::rms_norm`]), then the backend's own `matmul` of the
/// normalized rows (which may still fuse the epilogue); without a prologue,
/// [`crate::Ops::matmul_dense`] (or [`crate::Ops::matmul_blocks`]) with the bias, [`crate::Ops::split_cols`]
/// and [`crate::Ops::gated_activation`] for the gate, [`crate::Ops::add`]
/// for the residual. Fused backends fall back to it for what they do not
/// fuse.
pub fn matmul_unfused<B: Ops + ?Sized>(
    b: &B,
    x: &Tensor,
    w: &Weight,
    prologue: Option<NormPrologue<'_>>,
    epilogue: Epilogue<'_>,
) -> Result<Tensor> {
    if let Some(n) = prologue {
        let h = b.rms_norm(x, n.weight, n.eps, n.offset)?;
        return b.matmul(&h, w, None, epilogue);
    }
    let mut y = match w {
        Weight::Blocks(bw) => b.matmul_blocks(x, bw, epilogue.bias)?,
        _ => b.matmul_dense(x, w.dense("matmul")?, epilogue.bias)?,
    };
    if let Some(act) = epilogue.gated {
        y = b.gated_packed(&y, act)?;
    }
    match epilogue.residual {
        Some(r) => b.add(r, &y),
        None => Ok(y),
    }
}
