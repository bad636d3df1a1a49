//! Multi-head latent attention's per-head projections (`mla.cu`): the
//! extension ops of [`kiln_tensor::mla`] — a query into latent space, the
//! compressed KV into one KV head, each head's attended latent into its
//! value. Weights are the ops' device tensors (bf16), uploaded with the
//! model.

use kiln_tensor::{MlaKv, MlaOutput, MlaQuery, Result, Tensor, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, rows_cfg, wrap};

fn check(
    op: &'static str,
    x: &Tensor,
    width: usize,
    weights: &[(&Tensor, usize)],
) -> Result<usize> {
    let bad = x.shape().len() != 2
        || x.shape()[1] != width
        || weights.iter().any(|(w, n)| w.num_elements() != *n);
    if bad {
        return Err(TensorError::Shape {
            op,
            detail: format!("input {:?}, {width} columns expected", x.shape()),
        });
    }
    Ok(x.shape()[0])
}

/// [`MlaQuery`]: `[n, heads · (nope + rope)]` → `[n, heads · (rope + latent)]`.
pub(crate) fn query(cuda: &CudaBackend, x: &Tensor, m: &MlaQuery) -> Result<Tensor> {
    let (h, dn, dr, c) = (m.heads, m.nope, m.rope, m.latent);
    let n = check(MlaQuery::NAME, x, h * (dn + dr), &[(&m.w_uk, h * dn * c)])?;
    let out = cuda.alloc(n * h * (dr + c), "latent queries")?;
    let (xp, wp) = (ptr(x, MlaQuery::NAME)?, ptr(&m.w_uk, MlaQuery::NAME)?);
    let dims = [h as i32, dn as i32, dr as i32, c as i32];
    if n > 0 {
        // SAFETY: x [n, h(dn+dr)], w [h, dn, c], out [n, h(dr+c)]; the
        // block's shared memory holds dn floats.
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("mla_query_bf16")?)
                .arg(&xp)
                .arg(&wp)
                .arg(&out.ptr)
                .arg(&dims[0])
                .arg(&dims[1])
                .arg(&dims[2])
                .arg(&dims[3])
                .launch(rows_cfg(n * h, 256, 4 * dn as u32))
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(vec![n, h * (dr + c)], out))
}

/// [`MlaKv`]: `[n, latent + rope]` → `[n, rope + latent]`, the latent normed.
pub(crate) fn kv(cuda: &CudaBackend, x: &Tensor, m: &MlaKv) -> Result<Tensor> {
    let (dr, c) = (m.rope, m.latent);
    let n = check(MlaKv::NAME, x, dr + c, &[(&m.weight, c)])?;
    let out = cuda.alloc(n * (dr + c), "a latent KV head")?;
    let (xp, wp) = (ptr(x, MlaKv::NAME)?, ptr(&m.weight, MlaKv::NAME)?);
    let (dri, ci) = (dr as i32, c as i32);
    if n > 0 {
        // SAFETY: x and out [n, dr + c], w [c].
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("mla_kv_bf16")?)
                .arg(&xp)
                .arg(&wp)
                .arg(&out.ptr)
                .arg(&dri)
                .arg(&ci)
                .arg(&m.eps)
                .launch(rows_cfg(n, 256, 0))
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(vec![n, dr + c], out))
}

/// [`MlaOutput`]: `[n, heads · (rope + latent)]` → `[n, heads · value]`.
pub(crate) fn output(cuda: &CudaBackend, x: &Tensor, m: &MlaOutput) -> Result<Tensor> {
    let (h, dr, c, dv) = (m.heads, m.rope, m.latent, m.value);
    let n = check(MlaOutput::NAME, x, h * (dr + c), &[(&m.w_uv, h * dv * c)])?;
    let out = cuda.alloc(n * h * dv, "latent attention values")?;
    let (xp, wp) = (ptr(x, MlaOutput::NAME)?, ptr(&m.w_uv, MlaOutput::NAME)?);
    let dims = [h as i32, dr as i32, c as i32, dv as i32];
    if n > 0 {
        // SAFETY: x [n, h(dr+c)], w [h, dv, c], out [n, h dv]; the block's
        // shared memory holds c floats.
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("mla_output_bf16")?)
                .arg(&xp)
                .arg(&wp)
                .arg(&out.ptr)
                .arg(&dims[0])
                .arg(&dims[1])
                .arg(&dims[2])
                .arg(&dims[3])
                .launch(rows_cfg(n * h, 256, 4 * c as u32))
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(vec![n, h * dv], out))
}
