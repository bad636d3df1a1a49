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
    /// Recordings over this cache hold a weak reference: they are dropped
    /// once the cache is.
    pub alive: Arc<()>,
}

pub(crate) fn alloc_kv_cache(cuda: &CudaBackend, spec: KvPoolShape) -> Result<KvCache> {
    // One hidden block more than asked: the scratch block that padding
    // rows of recorded decode steps write to.
    let spec = KvPoolShape {
        num_blocks: spec.num_blocks + 1,
        ..spec
    };
    let per_layer = spec.num_slots() * spec.kv_row * 2;
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
