//! Gated activations (`activation.cu`): act(gate) * up with SiLU, GELU
//! (tanh) or a sigmoid, from separate tensors or packed [gate | up] rows.

use kiln_tensor::{Activation, Ops, Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, elems_cfg, ptr, wrap};

pub(crate) fn act_code(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::Sigmoid => 2,
    }
}

pub(crate) fn gated_activation(
    cuda: &CudaBackend,
    gate: &Tensor,
    up: &Tensor,
    act: Activation,
) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        return Err(TensorError::Shape {
            op: "gated_activation",
            detail: format!("{:?} vs {:?}", gate.shape(), up.shape()),
        });
    }
    let n = gate.num_elements();
    let out = cuda.alloc(n, "an activation")?;
    let (g, u, nl, a) = (
        ptr(gate, "gated_activation")?,
        ptr(up, "gated_activation")?,
        n as i64,
        act_code(act),
    );
    // SAFETY: gate, up, out hold n elements.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("gated_act_bf16")?)
            .arg(&g)
            .arg(&u)
            .arg(&out.ptr)
            .arg(&nl)
            .arg(&a)
            .launch(elems_cfg(n))
            .map_err(dev_err)?;
    }
    Ok(wrap(gate.shape().to_vec(), out))
}

/// `act(gate) * up` of a packed `[n, 2 * inter]` product (gate columns
/// first), read in place by `gated_act_packed_bf16`.
pub(crate) fn gated_packed(cuda: &CudaBackend, gu: &Tensor, act: Activation) -> Result<Tensor> {
    let (n, two_i) = gu.dims2("gated_packed")?;
    if two_i % 2 != 0 {
        return Err(TensorError::Shape {
            op: "gated_packed",
            detail: format!("{two_i} packed gate/up columns"),
        });
    }
    if !cuda.dev.has("gated_act_packed_bf16") {
        return gated_unfused(cuda, gu, act);
    }
    let inter = two_i / 2;
    let out = cuda.alloc(n * inter, "an MLP activation")?;
    let gp = ptr(gu, "gated_packed")?;
    let (nl, ii, a) = (n as i64, inter as i32, act_code(act));
    // SAFETY: gu [n, 2 * inter], out [n, inter].
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("gated_act_packed_bf16")?)
            .arg(&gp)
            .arg(&out.ptr)
            .arg(&nl)
            .arg(&ii)
            .arg(&a)
            .launch(elems_cfg(n * inter))
            .map_err(dev_err)?;
    }
    Ok(wrap(vec![n, inter], out))
}

pub(crate) fn gated_unfused(cuda: &CudaBackend, gu: &Tensor, act: Activation) -> Result<Tensor> {
    let (n, two_i) = gu.dims2("gated_linear")?;
    let parts = cuda.split_cols(gu, &[two_i / 2, two_i / 2])?;
    let _ = n;
    cuda.gated_activation(&parts[0], &parts[1], act)
}

/// GELU in its erf form (the `gelu_erf` extension op).
pub(crate) fn gelu_erf(cuda: &CudaBackend, x: &Tensor) -> Result<Tensor> {
    let n = x.num_elements();
    let out = cuda.alloc(n, "an activation")?;
    let (xp, nl) = (ptr(x, "gelu_erf")?, n as i64);
    // SAFETY: x and out hold n elements.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("gelu_erf_bf16")?)
            .arg(&xp)
            .arg(&out.ptr)
            .arg(&nl)
            .launch(elems_cfg(n))
            .map_err(dev_err)?;
    }
    Ok(wrap(x.shape().to_vec(), out))
}
