//! Rotary position embedding and the KV-cache write (`rope_kv_write.cu`):
//! RoPE in place, the cache write of new keys and values, and both at once
//! on packed qkv rows; the device tables of inverse frequencies.

use std::sync::Arc;

use cudarc::driver::LaunchConfig;
use kiln_tensor::{AttentionParams, QkNorm, Result, RopeParams, Tensor};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, rows_cfg, wrap};
use crate::driver::pool::DevBuf;
use crate::ops::attention::cache::CudaKv;
use crate::step::ActiveStep;

pub(crate) fn rope(
    cuda: &CudaBackend,
    x: &Tensor,
    positions: &[u32],
    p: &RopeParams<'_>,
) -> Result<Tensor> {
    kiln_tensor::check_rope_args(x, positions, p)?;
    let n = positions.len();
    let out = cuda.alloc(x.num_elements(), "a rotated tensor")?;
    cuda.dev
        .dtod(out.ptr, ptr(x, "rope")?, x.num_elements() * 2)?;
    if n > 0 {
        let dpos = cuda.dev_u32(positions, |m| m.pos)?;
        let freq = crate::ops::rope_kv_write::rope_table(cuda, p.inv_freq)?;
        let (h, hd, half) = (
            p.num_heads as i32,
            p.head_dim as i32,
            p.inv_freq.len() as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (n as u32, p.num_heads as u32, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: out [n, heads * head_dim], positions [n], inv_freq [half].
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("rope_bf16")?)
                .arg(&out.ptr)
                .arg(&dpos.ptr)
                .arg(&freq.ptr)
                .arg(&h)
                .arg(&hd)
                .arg(&half)
                .arg(&p.attention_scaling)
                .launch(cfg)
                .map_err(dev_err)?;
        }
    }
    Ok(wrap(x.shape().to_vec(), out))
}

pub(crate) fn rope_table(cuda: &CudaBackend, inv_freq: &[f32]) -> Result<Arc<DevBuf>> {
    let mut tables = cuda.rope_tables.lock().map_err(dev_err)?;
    if let Some((_, b)) = tables.iter().find(|(h, _)| h.as_slice() == inv_freq) {
        return Ok(b.clone());
    }
    cuda.no_upload_while_recording("a RoPE table")?;
    let b = Arc::new(
        cuda.dev
            .alloc_exact(inv_freq.len().max(1) * 4, "RoPE table")?,
    );
    cuda.dev.htod(b.ptr, inv_freq)?;
    tables.push((inv_freq.to_vec(), b.clone()));
    Ok(b)
}

/// Writes the step's `n` new keys at `kp` and values at `vp` (`[n, kv_heads
/// * head_dim]`) into `layer`'s cache at the step's slots.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_kv(
    cuda: &CudaBackend,
    n: usize,
    kp: u64,
    vp: u64,
    kv: &CudaKv,
    layer: usize,
    step: &ActiveStep,
    p: &AttentionParams,
) -> Result<()> {
    let slots = step.base + 4 * step.meta.slot_of(p.kv_group) as u64;
    let (kvi, kv_stride) = ((p.num_kv_heads * p.head_dim) as i32, kv.row as i32);
    let (kc, vc) = (kv.k[layer].ptr, kv.v[layer].ptr);
    // SAFETY: k, v [n, kv_row]; caches [slots, kv_stride >= kv_row]; slots
    // < num_slots (checked).
    unsafe {
        cuda.dev
            .launch(cuda.dev.func(&format!("write_kv_{}", kv.elem()))?)
            .arg(&kp)
            .arg(&vp)
            .arg(&kc)
            .arg(&vc)
            .arg(&slots)
            .arg(&kvi)
            .arg(&kv_stride)
            .launch(rows_cfg(n, 128, 0))
            .map_err(dev_err)?;
    }
    Ok(())
}

/// Normalizes (with `qk_norm`) and rotates q and k of the `n` packed qkv
/// rows at `qkv_ptr` (`[n, width]`) in place and writes the rotated keys and
/// the values into `layer`'s cache at the step's slots: one block per row
/// and head.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_rope_write(
    cuda: &CudaBackend,
    n: usize,
    qkv_ptr: u64,
    width: usize,
    kv: &CudaKv,
    layer: usize,
    step: &ActiveStep,
    p: &AttentionParams,
    rope: &RopeParams<'_>,
    qk_norm: Option<&QkNorm<'_>>,
) -> Result<()> {
    let hd = p.head_dim;
    let freq = rope_table(cuda, rope.inv_freq)?;
    let (qn, kn, vn, eps, offset) = match qk_norm {
        Some(nm) => {
            for w in [Some(nm.q_weight), Some(nm.k_weight), nm.v_weight]
                .into_iter()
                .flatten()
            {
                if w.num_elements() != hd {
                    return Err(kiln_tensor::TensorError::Shape {
                        op: "qk_norm",
                        detail: format!("norm weight {:?} for heads of {hd}", w.shape()),
                    });
                }
            }
            (
                ptr(nm.q_weight, "qk_norm")?,
                ptr(nm.k_weight, "qk_norm")?,
                nm.v_weight
                    .map(|v| ptr(v, "qk_norm"))
                    .transpose()?
                    .unwrap_or(0),
                nm.eps,
                nm.weight_offset,
            )
        }
        None => (0u64, 0u64, 0u64, 0f32, 0f32),
    };
    let m = &step.meta;
    let (pos, slots) = (
        step.base + 4 * m.pos as u64,
        step.base + 4 * m.slot_of(p.kv_group) as u64,
    );
    let (stride, half) = (width as i64, rope.inv_freq.len() as i32);
    let (h, kvh, hdi) = (p.num_heads as i32, p.num_kv_heads as i32, hd as i32);
    let kv_stride = kv.row as i32;
    let (kc, vc) = (kv.k[layer].ptr, kv.v[layer].ptr);
    // SAFETY: qkv [n, width]; caches [slots, kv_stride >= kv_row]; slots
    // checked; the norm weights (or null) hold head_dim elements.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func(&format!("qkv_rope_write_{}", kv.elem()))?)
            .arg(&qkv_ptr)
            .arg(&stride)
            .arg(&kc)
            .arg(&vc)
            .arg(&pos)
            .arg(&slots)
            .arg(&freq.ptr)
            .arg(&half)
            .arg(&rope.attention_scaling)
            .arg(&h)
            .arg(&kvh)
            .arg(&hdi)
            .arg(&kv_stride)
            .arg(&qn)
            .arg(&kn)
            .arg(&vn)
            .arg(&eps)
            .arg(&offset)
            .launch(LaunchConfig {
                grid_dim: (n as u32, (p.num_heads + p.num_kv_heads) as u32, 1),
                block_dim: ((hd / 2).next_multiple_of(32).clamp(32, 128) as u32, 1, 1),
                shared_mem_bytes: 0,
            })
            .map_err(dev_err)?;
    }
    Ok(())
}
