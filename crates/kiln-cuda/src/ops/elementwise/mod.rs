//! Elementwise sums, scaling, bias adds and soft-capping (`elementwise.cu`).

use kiln_tensor::{Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, elems_cfg, ptr, wrap};

pub(crate) fn add(cuda: &CudaBackend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return Err(TensorError::Shape {
            op: "add",
            detail: format!("{:?} vs {:?}", a.shape(), b.shape()),
        });
    }
    let n = a.num_elements();
    let out = cuda.alloc(n, "a sum")?;
    let (ap, bp, nl, s) = (ptr(a, "add")?, ptr(b, "add")?, n as i64, 1f32);
    // SAFETY: a, b, out all hold n elements.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("add_scale_bf16")?)
            .arg(&ap)
            .arg(&bp)
            .arg(&out.ptr)
            .arg(&nl)
            .arg(&s)
            .launch(elems_cfg(n))
            .map_err(dev_err)?;
    }
    Ok(wrap(a.shape().to_vec(), out))
}

pub(crate) fn scale(cuda: &CudaBackend, x: &Tensor, s: f32) -> Result<Tensor> {
    let n = x.num_elements();
    let out = cuda.alloc(n, "a scaled tensor")?;
    let (xp, null, nl) = (ptr(x, "scale")?, 0u64, n as i64);
    // SAFETY: x and out hold n elements; a null b selects scaling.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("add_scale_bf16")?)
            .arg(&xp)
            .arg(&null)
            .arg(&out.ptr)
            .arg(&nl)
            .arg(&s)
            .launch(elems_cfg(n))
            .map_err(dev_err)?;
    }
    Ok(wrap(x.shape().to_vec(), out))
}

/// The soft-capping extension op ([`kiln_tensor::SoftCap`]).
pub(crate) fn softcap(cuda: &CudaBackend, x: &Tensor, cap: f32) -> Result<Tensor> {
    if !(cap > 0.0 && cap.is_finite()) {
        return Err(TensorError::Shape {
            op: "softcap",
            detail: format!("cap {cap} (must be positive and finite)"),
        });
    }
    let n = x.num_elements();
    let out = cuda.alloc(n, "soft-capped logits")?;
    let (xp, nl) = (ptr(x, "softcap")?, n as i64);
    // SAFETY: x and out hold n elements.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("softcap_bf16")?)
            .arg(&xp)
            .arg(&out.ptr)
            .arg(&nl)
            .arg(&cap)
            .launch(elems_cfg(n))
            .map_err(dev_err)?;
    }
    Ok(wrap(x.shape().to_vec(), out))
}

pub(crate) fn add_bias(
    cuda: &CudaBackend,
    out: u64,
    bias: &Tensor,
    n: usize,
    m: usize,
) -> Result<()> {
    if bias.num_elements() != m {
        return Err(TensorError::Shape {
            op: "linear",
            detail: format!("bias of {} for {m} outputs", bias.num_elements()),
        });
    }
    let (nl, mi, b) = (n as i64, m as i32, ptr(bias, "linear bias")?);
    // SAFETY: out [n, m], bias [m].
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("add_bias_bf16")?)
            .arg(&out)
            .arg(&b)
            .arg(&nl)
            .arg(&mi)
            .launch(elems_cfg(n * m))
            .map_err(dev_err)?;
    }
    Ok(())
}
