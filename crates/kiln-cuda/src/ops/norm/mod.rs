//! RMSNorm of rows (`norm.cu`); the decode products fuse it as a prologue
//! instead (`ops::matmul::norm_prologue`).

use kiln_tensor::{Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, rows_cfg, wrap};

pub(crate) fn rms_norm(
    cuda: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    weight_offset: f32,
) -> Result<Tensor> {
    norm_rows(cuda, x, w, eps, weight_offset, None)
}

/// `residual + rms_norm(x)` in one kernel (post-norm blocks).
pub(crate) fn rms_norm_add(
    cuda: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    weight_offset: f32,
    residual: &Tensor,
) -> Result<Tensor> {
    if residual.shape() != x.shape() {
        return Err(TensorError::Shape {
            op: "rms_norm_add",
            detail: format!("x {:?}, residual {:?}", x.shape(), residual.shape()),
        });
    }
    norm_rows(cuda, x, w, eps, weight_offset, Some(residual))
}

fn norm_rows(
    cuda: &CudaBackend,
    x: &Tensor,
    w: &Tensor,
    eps: f32,
    weight_offset: f32,
    after: Option<&Tensor>,
) -> Result<Tensor> {
    let d = *x.shape().last().unwrap_or(&0);
    if w.num_elements() != d || d == 0 {
        return Err(TensorError::Shape {
            op: "rms_norm",
            detail: format!("x {:?}, weight {:?}", x.shape(), w.shape()),
        });
    }
    let rows = x.num_elements() / d;
    let out = cuda.alloc(rows * d, "a norm")?;
    let (xp, wp, null, di) = (ptr(x, "rms_norm")?, ptr(w, "rms_norm")?, 0u64, d as i32);
    let ap = match after {
        Some(a) => ptr(a, "rms_norm_add")?,
        None => 0u64,
    };
    if rows > 0 {
        // SAFETY: x, out and `after` (when set) [rows, d], w [d]; a null
        // residual skips the add before the norm, a null `after` the one
        // after it.
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("add_rms_norm_bf16")?)
                .arg(&xp)
                .arg(&null)
                .arg(&wp)
                .arg(&out.ptr)
                .arg(&di)
                .arg(&eps)
                .arg(&weight_offset)
                .arg(&ap)
                .launch(rows_cfg(rows, norm_threads(d), 0))
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(x.shape().to_vec(), out))
}

/// Threads per row of the RMSNorm kernel: about four elements each (a
/// decode step normalizes one row, so one block's latency is the cost).
pub(crate) fn norm_threads(d: usize) -> u32 {
    (d.div_ceil(4).next_multiple_of(32)).clamp(128, 1024) as u32
}

/// LayerNorm of rows (the `layer_norm` extension op): the op's f32 weight
/// and bias go up with each call (encoders run it a few times a step).
pub(crate) fn layer_norm(
    cuda: &CudaBackend,
    x: &Tensor,
    ln: &kiln_tensor::LayerNorm,
) -> Result<Tensor> {
    let d = ln.weight.len();
    if d == 0 || x.shape().last() != Some(&d) || ln.bias.len() != d {
        return Err(TensorError::Shape {
            op: "layer_norm",
            detail: format!(
                "input {:?} against weight [{d}] and bias [{}]",
                x.shape(),
                ln.bias.len()
            ),
        });
    }
    let rows = x.num_elements() / d;
    let out = cuda.alloc(rows * d, "a layer norm")?;
    let params = cuda.dev.alloc(2 * d, 4, "layer norm weight and bias")?;
    cuda.dev.htod(params.ptr, &ln.weight)?;
    cuda.dev.htod(params.ptr + 4 * d as u64, &ln.bias)?;
    let (xp, wp, bp, di) = (
        ptr(x, "layer_norm")?,
        params.ptr,
        params.ptr + 4 * d as u64,
        d as i32,
    );
    if rows > 0 {
        // SAFETY: x and out [rows, d], params 2d floats (weight, bias).
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("layer_norm_bf16")?)
                .arg(&xp)
                .arg(&out.ptr)
                .arg(&wp)
                .arg(&bp)
                .arg(&di)
                .arg(&ln.eps)
                .launch(rows_cfg(rows, 256, 0))
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(x.shape().to_vec(), out))
}
