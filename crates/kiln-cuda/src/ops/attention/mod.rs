//! Attention over the paged KV cache (`cache.rs`): split-KV decode
//! attention for decode steps (`decode.cu`), flash-style prefill attention
//! for the rest (`prefill.cu`), the reference kernel (`reference.cu`) where
//! neither is loaded; the new keys and values are written first
//! (`ops::rope_kv_write`).

use std::sync::Arc;

use cudarc::driver::LaunchConfig;
use kiln_tensor::{
    AttentionParams, ForwardBatch, KvCache, QkNorm, Result, RopeParams, Tensor, TensorError,
};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, wrap, Device};
use crate::step::ActiveStep;

pub(crate) mod cache;

use cache::CudaKv;

/// Dynamic shared memory of the flash prefill kernel for `head_dim` (its
/// launch rule): a 128-row Q tile and double-buffered 64-key K and V
/// chunks of `head_dim + 8` bf16 (padded rows), plus the chunks' slots.
pub fn flash_smem_bytes(head_dim: usize) -> usize {
    768 * (head_dim + 8) + 512
}

/// The head size of a flash prefill entry point (bf16 or FP8 cache).
fn flash_head_dim(entry: &str) -> Option<usize> {
    entry
        .strip_prefix("flash_prefill_hd")
        .or_else(|| entry.strip_prefix("flash_prefill_fp8_hd"))
        .and_then(|h| h.parse().ok())
}

/// Raises the prefill kernels' dynamic shared memory limit (above the
/// default 48 KiB at every head size).
pub(crate) fn configure(dev: &mut Device) -> std::result::Result<(), crate::CudaError> {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    for (entry, f) in &dev.funcs {
        if let Some(hd) = flash_head_dim(entry) {
            f.set_attribute(attr, flash_smem_bytes(hd) as i32)
                .map_err(|e| crate::CudaError::Device(format!("{entry}: {e:?}")))?;
        }
    }
    Ok(())
}

/// Completion counters of the decode kernel's partitions, one per (row,
/// kv head) of a split step (`parts > 1` means rows × kv heads ≤ 128).
pub(crate) const DECODE_COUNTERS: usize = 256;

impl CudaBackend {
    /// Attention of `n` query rows (row stride `q_stride`) over the cache
    /// of `layer`, keys and values already written; `out [n, heads * hd]`.
    /// `sinks` (not 0): bf16 `[heads]` sink logits joining every
    /// softmax's denominator (every kernel takes them).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend(
        &self,
        q: u64,
        q_stride: usize,
        kv: &CudaKv,
        layer: usize,
        step: &ActiveStep,
        block_size: usize,
        p: &AttentionParams,
        sinks: u64,
    ) -> Result<Tensor> {
        let n = step.meta.num_rows;
        let qw = p.num_heads * p.head_dim;
        let out = self.alloc(n * qw, "attention output")?;
        let (kc, vc) = (kv.k[layer].ptr, kv.v[layer].ptr);
        let m = &step.meta;
        let word = |off: usize| step.base + 4 * off as u64;
        let tables = word(m.tables_of(p.kv_group));
        let (pos, row_seq) = (word(m.pos), word(m.row_seq));
        let (qs, os) = (q_stride as i64, qw as i64);
        let (width, bs) = (m.width as i32, block_size as i32);
        let (h, kvh) = (p.num_heads as i32, p.num_kv_heads as i32);
        // A slot's row in the pool (a narrower layer leaves its tail unused).
        let kv_stride = kv.row as i32;
        let window = p.sliding_window.map(|w| w as i32).unwrap_or(0);
        let softcap = p.softcap.unwrap_or(0.0);
        let hd = p.head_dim;
        let e = kv.tag();
        let decode = format!("decode_attention{e}_hd{hd}");
        let flash = format!("flash_prefill{e}_hd{hd}");
        if n == 0 {
            return Ok(wrap(vec![0, qw], out));
        }
        // Bidirectional attention (encoders) runs the reference kernel.
        if p.causal && m.decode_only && self.dev.has(&decode) {
            // Split the keys until there are enough blocks to fill the GPU
            // (few rows × kv heads). The kernel spreads each row's own keys
            // over the partitions, so a recorded step's grid (sized for the
            // table width) fits every batch it replays. (A recorded step
            // counts its padded rows, so below a bucket size it may split a
            // row into fewer partitions than an eager step: the same sum in
            // another order.)
            // A windowed layer's rows read at most `window` keys, whatever
            // the table width: no partitions that could only be empty.
            let table_keys = m.width * block_size;
            let max_keys = p
                .sliding_window
                .map_or(table_keys, |w| table_keys.min(w))
                .max(1);
            // Blocks to aim for and fewest keys a partition
            // (`CudaOptions::decode_target_blocks`, `decode_partition_keys`).
            let (target, min_keys) = (
                self.options.decode_target_blocks.max(1),
                self.options.decode_partition_keys.max(1),
            );
            let want = (target / (n * p.num_kv_heads)).max(1);
            let parts = want.min(max_keys.div_ceil(min_keys));
            let part = min_keys as i32;
            let (part_out, part_ml) = if parts > 1 {
                (
                    Some(self.dev.alloc(n * qw * parts, 4, "attention partials")?),
                    Some(
                        self.dev
                            .alloc(n * p.num_heads * parts * 2, 4, "attention partials")?,
                    ),
                )
            } else {
                (None, None)
            };
            let po = part_out.as_ref().map_or(0, |b| b.ptr);
            let pm = part_ml.as_ref().map_or(0, |b| b.ptr);
            // The last partition to finish combines them (no reduce kernel)
            // where the backend's counters cover the rows.
            let counters = match &self.decode_counters {
                Some(c) if parts > 1 && n * p.num_kv_heads <= DECODE_COUNTERS => c.ptr,
                _ => 0u64,
            };
            let cfg = LaunchConfig {
                grid_dim: (n as u32, p.num_kv_heads as u32, parts as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // Split steps hold few keys a block: their values' first round
            // goes out with the keys (one memory round trip less).
            let vpre = format!("decode_attention_vpre{e}_hd{hd}");
            let name = if parts > 1
                && self.decode_vpre.load(std::sync::atomic::Ordering::Relaxed)
                && self.dev.has(&vpre)
            {
                &vpre
            } else {
                &decode
            };
            let func = self.dev.func(name)?;
            let mut b = self.dev.launch(func);
            b.arg(&q)
                .arg(&qs)
                .arg(&kc)
                .arg(&vc)
                .arg(&pos)
                .arg(&row_seq)
                .arg(&tables)
                .arg(&width)
                .arg(&bs)
                .arg(&h)
                .arg(&kvh)
                .arg(&kv_stride)
                .arg(&p.scale)
                .arg(&window)
                .arg(&softcap)
                .arg(&part)
                .arg(&po)
                .arg(&pm)
                .arg(&counters)
                .arg(&out.ptr)
                .arg(&os)
                .arg(&sinks);
            // SAFETY: q rows [n, q_stride], caches [slots, kv_row], metadata
            // arrays of the step, partials sized [n, heads, parts, hd] and
            // [n, heads, parts, 2].
            unsafe { b.launch(cfg) }.map_err(dev_err)?;
            if parts > 1 && counters == 0 {
                let np = parts as i32;
                let cfg = LaunchConfig {
                    grid_dim: (n as u32, p.num_heads as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: partials as written above; out [n, heads * hd].
                unsafe {
                    self.dev
                        .launch(self.dev.func(&format!("decode_attention_reduce_hd{hd}"))?)
                        .arg(&po)
                        .arg(&pm)
                        .arg(&h)
                        .arg(&np)
                        .arg(&out.ptr)
                        .arg(&os)
                        .arg(&sinks)
                        .launch(cfg)
                        .map_err(dev_err)?;
                }
            }
            return Ok(wrap(vec![n, qw], out));
        }
        if p.causal && self.dev.has(&flash) {
            let tiles = word(m.tiles);
            let cfg = LaunchConfig {
                grid_dim: (m.num_tiles as u32, p.num_heads as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: flash_smem_bytes(hd) as u32,
            };
            // SAFETY: as for decode; tiles lie within the rows of the step.
            unsafe {
                self.dev
                    .launch(self.dev.func(&flash)?)
                    .arg(&q)
                    .arg(&qs)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&pos)
                    .arg(&row_seq)
                    .arg(&tables)
                    .arg(&width)
                    .arg(&bs)
                    .arg(&tiles)
                    .arg(&h)
                    .arg(&kvh)
                    .arg(&kv_stride)
                    .arg(&p.scale)
                    .arg(&window)
                    .arg(&softcap)
                    .arg(&out.ptr)
                    .arg(&os)
                    .arg(&sinks)
                    .launch(cfg)
                    .map_err(dev_err)?;
            }
            return Ok(wrap(vec![n, qw], out));
        }
        if q_stride != qw {
            return Err(dev_err(
                "the reference attention kernel needs packed q rows",
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (n as u32, p.num_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (128 + hd) as u32 * 4,
        };
        let hdi = hd as i32;
        let row_end = if p.causal { 0 } else { word(m.row_end) };
        // SAFETY: q [n, heads * hd]; metadata of the step (row_end: one
        // word a row, or null).
        unsafe {
            self.dev
                .launch(self.dev.func(&format!("paged_attention_{}", kv.elem()))?)
                .arg(&q)
                .arg(&kc)
                .arg(&vc)
                .arg(&out.ptr)
                .arg(&pos)
                .arg(&row_seq)
                .arg(&row_end)
                .arg(&tables)
                .arg(&width)
                .arg(&h)
                .arg(&kvh)
                .arg(&kv_stride)
                .arg(&hdi)
                .arg(&bs)
                .arg(&p.scale)
                .arg(&window)
                .arg(&softcap)
                .arg(&sinks)
                .launch(cfg)
                .map_err(dev_err)?;
        }
        Ok(wrap(vec![n, qw], out))
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    cuda: &CudaBackend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cache: &mut KvCache,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
) -> Result<Tensor> {
    attention_with_sinks(cuda, q, k, v, cache, layer, batch, p, None)
}

/// [`attention`] with a sink logit a query head (`sinks [heads]`, bf16) in
/// every softmax ([`kiln_tensor::Ops::attention_sinks`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_with_sinks(
    cuda: &CudaBackend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cache: &mut KvCache,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    kiln_tensor::check_attention_args(q, k, v, &cache.spec, layer, batch, p)?;
    let sinks = match sinks {
        Some(s) if s.dtype() == kiln_tensor::DType::BF16 && s.num_elements() == p.num_heads => {
            ptr(s, "attention_sinks")?
        }
        Some(s) => {
            return Err(kiln_tensor::TensorError::Shape {
                op: "attention_sinks",
                detail: format!(
                    "sinks {:?} {:?} for {} heads (bf16 wanted)",
                    s.shape(),
                    s.dtype(),
                    p.num_heads
                ),
            })
        }
        None => 0,
    };
    let (n, _) = q.dims2("attention")?;
    let step = cuda.step_meta(batch)?;
    let block_size = cache.spec.block_size;
    let kv = cache::kv(cache)?;
    if n > 0 {
        let (kp, vp) = (ptr(k, "attention")?, ptr(v, "attention")?);
        crate::ops::rope_kv_write::write_kv(cuda, n, kp, vp, kv, layer, &step, p)?;
    }
    let qp = ptr(q, "attention")?;
    cuda.attend(
        qp,
        p.num_heads * p.head_dim,
        kv,
        layer,
        &step,
        block_size,
        p,
        sinks,
    )
}

/// Attention of `q` over what `layer`'s cache already holds (a layer that
/// shares an earlier layer's keys and values): the same kernels, no write.
pub(crate) fn attention_shared(
    cuda: &CudaBackend,
    q: &Tensor,
    cache: &mut KvCache,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
) -> Result<Tensor> {
    kiln_tensor::backend::check_shared_attention_args(q, &cache.spec, layer, batch, p)?;
    let step = cuda.step_meta(batch)?;
    let block_size = cache.spec.block_size;
    let kv = cache::kv(cache)?;
    let qp = ptr(q, "attention_shared")?;
    cuda.attend(
        qp,
        p.num_heads * p.head_dim,
        kv,
        layer,
        &step,
        block_size,
        p,
        0,
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_attention(
    cuda: &CudaBackend,
    qkv: &Tensor,
    cache: &mut KvCache,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
    rope: &RopeParams<'_>,
    qk_norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    let hd = p.head_dim;
    let (elem, e) = {
        let kv = cache::kv(cache)?;
        (kv.elem(), kv.tag())
    };
    // Bidirectional attention runs the reference kernel, which reads packed
    // q rows: the ops one by one.
    let fused = p.causal
        && cuda.dev.has(&format!("qkv_rope_write_{elem}"))
        && cuda.dev.has(&format!("flash_prefill{e}_hd{hd}"))
        && cuda.dev.has(&format!("decode_attention{e}_hd{hd}"));
    if !fused {
        return kiln_tensor::backend::qkv_attention_unfused(
            cuda, qkv, cache, layer, batch, p, rope, qk_norm,
        );
    }
    let (n, width) = qkv.dims2("qkv_attention")?;
    let (qw, kw) = (p.num_heads * hd, p.num_kv_heads * hd);
    if width != qw + 2 * kw {
        return Err(TensorError::Shape {
            op: "qkv_attention",
            detail: format!("qkv {:?} for {p:?}", qkv.shape()),
        });
    }
    kiln_tensor::check_attention_shapes(n, qw, &[n, kw], &[n, kw], &cache.spec, layer, batch, p)?;
    if 2 * rope.inv_freq.len() > hd || rope.num_heads != p.num_heads || rope.head_dim != hd {
        return Err(TensorError::Shape {
            op: "qkv_attention",
            detail: format!("RoPE {rope:?} for {p:?}"),
        });
    }
    let step = cuda.step_meta(batch)?;
    let block_size = cache.spec.block_size;
    let kv = cache::kv(cache)?;
    // RoPE is applied in place: work on a private copy unless this
    // tensor is the only holder of its buffer.
    let private;
    let qkv_ptr = if Arc::strong_count(qkv.storage()) == 1 {
        ptr(qkv, "qkv_attention")?
    } else {
        private = cuda.alloc(n * width, "a qkv copy")?;
        cuda.dev
            .dtod(private.ptr, ptr(qkv, "qkv_attention")?, n * width * 2)?;
        private.ptr
    };
    if n > 0 {
        crate::ops::rope_kv_write::qkv_rope_write(
            cuda,
            n,
            qkv_ptr,
            width,
            kv,
            layer,
            &step,
            p,
            rope,
            qk_norm.as_ref(),
        )?;
    }
    cuda.attend(qkv_ptr, width, kv, layer, &step, block_size, p, 0)
}

#[cfg(test)]
mod tests {
    /// Every flash prefill kernel gets its shared memory raised at load
    /// (an FP8-cache entry once did not, and failed to launch).
    #[test]
    fn every_flash_entry_point_is_configured_for_its_head_size() {
        let flash: Vec<&str> = crate::kernels::ENTRY_POINTS
            .iter()
            .copied()
            .filter(|e| e.starts_with("flash_prefill"))
            .collect();
        assert_eq!(flash.len(), 6);
        for e in flash {
            let hd = super::flash_head_dim(e).unwrap_or_else(|| panic!("{e}"));
            assert!(e.ends_with(&format!("_hd{hd}")), "{e}");
        }
    }
}
