//! RMSNorm fused into the decode projections that consume it
//! (the norm-prologue forms of `Ops::matmul`): for
//! decode-sized rows (≤ 8) one GEMV kernel per product, each block
//! recomputing the rows' inverse RMS (`rms_prologue.cuh`) before its
//! dot products; larger row counts (prefill, cuBLAS) run the norm and the
//! product as separate ops. The fused kernels reproduce `add_rms_norm_bf16`'s
//! summation order and bf16 rounding, so their results equal the unfused
//! ops' on the same inputs.

use cudarc::driver::LaunchConfig;
use kiln_tensor::{Activation, Ops, Result, Tensor, TensorError};

use super::{linear_dims, GEMV_MAX_ROWS};
use crate::driver::device::{dev_err, ptr, wrap, Device};
use crate::ops::activation::act_code;
use crate::ops::norm::norm_threads;
use crate::CudaBackend;

/// Dynamic shared memory the direct-load norm kernels may use (their
/// attribute is raised to this at load): the normalized rows,
/// `rows * (2 * k + 64)` bytes. With the kernel's 9 KiB of static shared
/// memory this fits every GPU of compute capability 8.0+ (99 KiB a block
/// on 8.6/8.9) and two blocks an SM on an H100/H200; a larger product (8
/// rows of more than 5600 columns, 5 of 8192) runs unfused.
pub(crate) const NORM_GEMV_MAX_SMEM: usize = 88 << 10;

/// Shared memory the direct-load norm kernel needs for `n` rows of `k`.
fn direct_smem(n: usize, k: usize) -> usize {
    n * (2 * k + 64)
}

/// The norm weight matches x's columns.
fn check_norm(op: &'static str, x: &Tensor, norm_w: &Tensor, k: usize) -> Result<()> {
    if norm_w.num_elements() != k {
        return Err(TensorError::Shape {
            op,
            detail: format!("x {:?}, norm weight {:?}", x.shape(), norm_w.shape()),
        });
    }
    Ok(())
}

/// A fused launch that can run: the kernel and its dynamic shared memory.
struct Plan {
    name: String,
    smem: usize,
}

impl CudaBackend {
    /// The fused kernel for `n` rows of `k` into `out_cols` outputs, if the
    /// shape is for one.
    fn norm_gemv_plan(&self, n: usize, k: usize, out_cols: usize) -> Option<Plan> {
        let name = format!("rms_norm_gemv_direct_bf16_m{n}");
        let smem = direct_smem(n, k);
        let fits = (1..=GEMV_MAX_ROWS).contains(&n)
            && k > 0
            && k.is_multiple_of(8)
            && out_cols > 0
            && smem <= NORM_GEMV_MAX_SMEM;
        (fits && self.dev.has(&name)).then_some(Plan { name, smem })
    }

    /// `out[n, out_cols] = rms_norm(x)[n, k] · w[m, k]ᵀ` with the plan's
    /// epilogue `mode` (`extra`: the bias of mode 1).
    #[allow(clippy::too_many_arguments)]
    fn norm_gemv(
        &self,
        plan: &Plan,
        x: u64,
        norm_w: u64,
        eps: f32,
        weight_offset: f32,
        w: u64,
        out: u64,
        extra: u64,
        k: usize,
        out_cols: usize,
        mode: i32,
    ) -> Result<()> {
        let (ni, ki, nt) = (out_cols as i32, k as i32, norm_threads(k) as i32);
        // The plain GEMV's launch (`direct_launch`).
        let (grid, mode) = self.direct_launch(out_cols, mode);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: plan.smem as u32,
        };
        let func = self.dev.func(&plan.name)?;
        let mut b = self.dev.launch(func);
        b.arg(&x)
            .arg(&norm_w)
            .arg(&w)
            .arg(&out)
            .arg(&extra)
            .arg(&ni)
            .arg(&ki)
            .arg(&mode);
        b.arg(&eps).arg(&weight_offset).arg(&nt);
        // SAFETY: x [n, k], norm_w [k], w [m, k], out [n, out_cols], extra as
        // `mode` needs; k % 8 == 0 (the plan); the kernel's dynamic
        // shared memory is within the attribute set at load; nt =
        // norm_threads(k) is a multiple of 32 in [128, 1024].
        unsafe { b.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }

    /// The fused norm + GEMV of `x [n, k]` (normed by `norm` = weight, eps,
    /// weight offset) against `w` into `[n, out_cols]` in `mode`, when a
    /// kernel takes these shapes; `None` sends the caller to the unfused ops.
    #[allow(clippy::too_many_arguments)]
    fn try_norm_gemv(
        &self,
        op: &'static str,
        x: &Tensor,
        norm: (&Tensor, f32, f32),
        w: &Tensor,
        extra: u64,
        out_cols: usize,
        mode: i32,
    ) -> Result<Option<Tensor>> {
        let (n, k) = x.dims2(op)?;
        let Some(plan) = self.norm_gemv_plan(n, k, out_cols) else {
            return Ok(None);
        };
        let out = self.alloc(n * out_cols, op)?;
        let (norm_w, eps, weight_offset) = norm;
        let (xp, np, wp) = (ptr(x, op)?, ptr(norm_w, op)?, ptr(w, op)?);
        self.norm_gemv(
            &plan,
            xp,
            np,
            eps,
            weight_offset,
            wp,
            out.ptr,
            extra,
            k,
            out_cols,
            mode,
        )?;
        Ok(Some(wrap(vec![n, out_cols], out)))
    }

    pub(crate) fn fused_rms_norm_linear(
        &self,
        x: &Tensor,
        norm_w: &Tensor,
        eps: f32,
        weight_offset: f32,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (_, k, m) = linear_dims(x, w)?;
        check_norm("rms_norm_linear", x, norm_w, k)?;
        if let Some(b) = bias {
            if b.num_elements() != m {
                return Err(TensorError::Shape {
                    op: "rms_norm_linear",
                    detail: format!("bias of {} for {m} outputs", b.num_elements()),
                });
            }
        }
        let (mode, extra) = match bias {
            Some(b) => (1, ptr(b, "rms_norm_linear bias")?),
            None => (0, 0),
        };
        let norm = (norm_w, eps, weight_offset);
        if let Some(out) = self.try_norm_gemv("rms_norm_linear", x, norm, w, extra, m, mode)? {
            return Ok(out);
        }
        let h = self.rms_norm(x, norm_w, eps, weight_offset)?;
        super::linear(self, &h, w, bias)
    }

    pub(crate) fn fused_rms_norm_gated_linear(
        &self,
        x: &Tensor,
        norm_w: &Tensor,
        eps: f32,
        weight_offset: f32,
        w_gate_up: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        let (_, k, two_i) = linear_dims(x, w_gate_up)?;
        check_norm("rms_norm_gated_linear", x, norm_w, k)?;
        if two_i % 2 != 0 {
            return Err(TensorError::Shape {
                op: "rms_norm_gated_linear",
                detail: format!("{two_i} packed gate/up rows"),
            });
        }
        let inter = two_i / 2;
        let mode = 3 + act_code(act);
        let norm = (norm_w, eps, weight_offset);
        let op = "rms_norm_gated_linear";
        if let Some(out) = self.try_norm_gemv(op, x, norm, w_gate_up, 0, inter, mode)? {
            return Ok(out);
        }
        let h = self.rms_norm(x, norm_w, eps, weight_offset)?;
        super::gated_linear(self, &h, w_gate_up, act)
    }
}

/// Raises the fused kernels' dynamic shared memory limit to
/// [`NORM_GEMV_MAX_SMEM`]; a kernel the GPU cannot give that much is left
/// out (the unfused norm runs instead).
pub(crate) fn configure(dev: &mut Device, warnings: &mut Vec<String>) {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    dev.funcs.retain(|entry, f| {
        if !entry.starts_with("rms_norm_gemv_direct_bf16_m") {
            return true;
        }
        match f.set_attribute(attr, NORM_GEMV_MAX_SMEM as i32) {
            Ok(()) => true,
            Err(e) => {
                warnings.push(format!(
                    "{entry} unavailable, using the unfused norm: {e:?}"
                ));
                false
            }
        }
    });
}
