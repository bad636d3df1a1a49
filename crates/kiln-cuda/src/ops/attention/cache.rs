//! The paged KV cache on the device: one keys and one values buffer per
//! layer, with a hidden scratch block at the end that padding rows of
//! recorded decode steps write to.

use std::sync::Arc;

use kiln_tensor::{KvCache, KvPoolShape, Result, TensorError};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, NAME};
use crate::driver::pool::DevBuf;

pub(crate) struct CudaKv {
    pub(crate) k: Vec<DevBuf>,
    pub(crate) v: Vec<DevBuf>,
    /// Elements from one slot's keys (values) to the next: the pool's
    /// `kv_row`, which a narrower layer's rows do not fill.
    pub(crate) row: usize,
    /// Keys and values as E4M3 (`--kv-cache-dtype fp8`, `kv_elem.cuh`), else bf16.
    pub(crate) fp8: bool,
    /// Recordings over this cache hold a weak reference: they are dropped
    /// once the cache is.
    pub alive: Arc<()>,
}

impl CudaKv {
    /// The element's kernel suffix (`write_kv_<elem>`, `paged_attention_<elem>`).
    pub(crate) fn elem(&self) -> &'static str {
        if self.fp8 {
            "fp8"
        } else {
            "bf16"
        }
    }

    /// The infix of the attention kernels' names (`decode_attention<tag>_hd128`).
    pub(crate) fn tag(&self) -> &'static str {
        if self.fp8 {
            "_fp8"
        } else {
            ""
        }
    }
}

/// Kernels a cache of E4M3 keys and values cannot do without.
const FP8_KERNELS: &[&str] = &["write_kv_fp8", "qkv_rope_write_fp8", "paged_attention_fp8"];

pub(crate) fn alloc_kv_cache(cuda: &CudaBackend, spec: KvPoolShape) -> Result<KvCache> {
    alloc_kv_cache_as(cuda, spec, cuda.options.kv_cache_fp8)
}

/// A cache of E4M3 (`fp8`) or bf16 keys and values, whatever the options say.
pub(crate) fn alloc_kv_cache_as(
    cuda: &CudaBackend,
    spec: KvPoolShape,
    fp8: bool,
) -> Result<KvCache> {
    if let Some(missing) = FP8_KERNELS.iter().find(|k| fp8 && !cuda.dev.has(k)) {
        return Err(dev_err(format!(
            "an FP8 KV cache needs the kernel {missing}, which did not load on this GPU"
        )));
    }
    // One hidden block more than asked: the scratch block that padding
    // rows of recorded decode steps write to.
    let spec = KvPoolShape {
        num_blocks: spec.num_blocks + 1,
        ..spec
    };
    let per_layer = spec.num_slots() * spec.kv_row * if fp8 { 1 } else { 2 };
    let mut k = Vec::with_capacity(spec.num_layers);
    let mut v = Vec::with_capacity(spec.num_layers);
    for layer in 0..spec.num_layers {
        for (side, list) in [("keys", &mut k), ("values", &mut v)] {
            let b = cuda
                .dev
                .alloc_exact(per_layer, &format!("KV cache {side} of layer {layer}"))?;
            // Zeroed so that never-written slots read as finite numbers.
            // SAFETY: b holds per_layer bytes.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    b.ptr,
                    0,
                    per_layer,
                    cuda.dev.stream.cu_stream(),
                )
                .map_err(dev_err)?;
            }
            list.push(b);
        }
    }
    Ok(KvCache::from_storage(
        spec,
        Box::new(CudaKv {
            k,
            v,
            row: spec.kv_row,
            fp8,
            alive: Arc::new(()),
        }),
    ))
}

pub(crate) fn kv(cache: &mut KvCache) -> Result<&mut CudaKv> {
    cache
        .storage_mut()
        .downcast_mut::<CudaKv>()
        .ok_or(TensorError::WrongBackend {
            op: "attention",
            expected: NAME,
        })
}
