//! Decode steps as CUDA graphs. A decode batch (one new token per
//! sequence) is padded to its bucket size and its block tables to a power
//! of two; the first step of each (cache, bucket, width) runs once eagerly
//! to fill the recording free list, is then recorded, and every later step
//! of that shape only uploads its metadata into the recording's buffer and
//! replays it. Prefill and mixed steps run eagerly.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use kiln_tensor::{DType, ForwardBatch, KvCache, Result, Tensor, TensorError};

use super::meta::{bucket_for, is_graphable, pad_decode, table_width, StepMeta};
use super::ActiveStep;
use crate::backend::CudaBackend;
use crate::driver::device::dev_err;
use crate::driver::pool::DevBuf;

type Key = (u64, usize, usize);

struct Recorded {
    cache_alive: std::sync::Weak<()>,
    graph: CudaGraph,
    meta: DevBuf,
    meta_words: usize,
    out: Tensor,
}

/// The recordings of one backend.
#[derive(Default)]
pub struct Recordings {
    graphs: HashMap<Key, Recorded>,
    failed: HashSet<Key>,
}

// SAFETY: graphs are launched and destroyed only under the backend's
// mutex, on the backend's one stream.
unsafe impl Send for Recordings {}

impl Recordings {
    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Recordings over the cache `cache_id`, and the batch sizes whose
    /// recording failed for it.
    pub fn of_cache(&self, cache_id: u64) -> (usize, usize) {
        (
            self.graphs.keys().filter(|k| k.0 == cache_id).count(),
            self.failed.iter().filter(|k| k.0 == cache_id).count(),
        )
    }
}

type Forward<'a> = &'a mut dyn FnMut(&ForwardBatch, &mut KvCache) -> Result<Tensor>;

fn set_step(b: &CudaBackend, step: Option<Arc<ActiveStep>>) {
    if let Ok(mut s) = b.step.lock() {
        *s = step;
    }
}

fn eager(
    b: &CudaBackend,
    batch: &ForwardBatch,
    cache: &mut KvCache,
    forward: Forward,
) -> Result<Tensor> {
    let step = b.upload_step(batch.clone(), table_width(batch))?;
    set_step(b, Some(step));
    let out = forward(batch, cache);
    set_step(b, None);
    out
}

/// The first `rows` rows of a recording's output.
fn rows_of(out: &Tensor, rows: usize) -> Result<Tensor> {
    let (_, vocab) = out.dims2("run_step")?;
    Ok(Tensor::from_storage(
        vec![rows, vocab],
        DType::BF16,
        out.storage().clone(),
    ))
}

pub(crate) fn run_step(
    b: &CudaBackend,
    batch: &ForwardBatch,
    cache: &mut KvCache,
    forward: Forward,
) -> Result<Tensor> {
    let bucket = bucket_for(batch.seqs.len());
    // Steps of a model with recurrent state record too: its slots and
    // snapshots are in the metadata (room for one snapshot a sequence, so
    // a step taking more runs eagerly), padding sequences name no state.
    let state_slots = cache.state_shape().map(|s| s.num_slots);
    if let Some(slots) = state_slots {
        crate::ops::recurrent::check_states(batch, slots)?;
    }
    let one_snapshot = batch.states.iter().all(|s| s.snapshots.len() <= 1);
    let (true, true, true, Some(bucket)) = (
        b.graphs_enabled(),
        is_graphable(batch),
        one_snapshot,
        bucket,
    ) else {
        return eager(b, batch, cache, forward);
    };
    let width = table_width(batch);
    let key = (cache.id(), bucket, width);
    // The hidden last block of every CUDA cache (see `alloc_kv_cache`).
    let scratch = cache.spec.num_blocks as u32 - 1;
    if batch
        .seqs
        .iter()
        .any(|s| s.block_tables.iter().flatten().any(|&blk| blk >= scratch))
    {
        return Err(TensorError::Shape {
            op: "run_step",
            detail: format!("a block table names a block past the pool of {scratch}"),
        });
    }
    let padded = pad_decode(batch, bucket, scratch, state_slots.is_some());
    let pad_slot = scratch * batch.block_size as u32;
    let meta = StepMeta::build(&padded, width);
    let mut recs = b.recordings.lock().map_err(dev_err)?;
    if recs.failed.contains(&key) {
        drop(recs);
        return eager(b, batch, cache, forward);
    }
    if let Some(rec) = recs.graphs.get(&key) {
        if rec.meta_words != meta.words.len() {
            return Err(dev_err("recorded step metadata changed shape"));
        }
        b.dev.htod(rec.meta.ptr, &meta.words)?;
        rec.graph.launch().map_err(dev_err)?;
        return rows_of(&rec.out, batch.seqs.len());
    }
    let Some(alive) = cache
        .storage()
        .downcast_ref::<crate::ops::attention::cache::CudaKv>()
        .map(|kv| Arc::downgrade(&kv.alive))
    else {
        return Err(TensorError::WrongBackend {
            op: "run_step",
            expected: "cuda",
        });
    };
    // Recordings over caches that are gone are dropped.
    recs.graphs.retain(|_, r| r.cache_alive.strong_count() > 0);
    match record(b, &padded, meta, pad_slot, cache, forward) {
        Ok(mut rec) => {
            rec.cache_alive = alive;
            rec.graph.launch().map_err(dev_err)?;
            let out = rows_of(&rec.out, batch.seqs.len());
            recs.graphs.insert(key, rec);
            out
        }
        Err(e) => {
            b.warn(format!(
                "decode steps of batch {bucket} are not recorded as a CUDA graph ({e}); running them eagerly"
            ));
            recs.failed.insert(key);
            drop(recs);
            eager(b, batch, cache, forward)
        }
    }
}

fn record(
    b: &CudaBackend,
    padded: &ForwardBatch,
    meta: StepMeta,
    pad_slot: u32,
    cache: &mut KvCache,
    forward: Forward,
) -> Result<Recorded> {
    let words = meta.words.len();
    let meta_buf = b.dev.alloc_exact(words * 4, "recorded step metadata")?;
    // The warm-up runs the step for real: recurrent state must not advance
    // twice, so it runs with every sequence's state slot unnamed (the
    // recurrent kernels skip them) and the real metadata goes up after it.
    let stateless_words = (!padded.states.is_empty()).then(|| {
        let mut warm = padded.clone();
        for st in &mut warm.states {
            st.slot = u32::MAX;
        }
        StepMeta::build(&warm, meta.width).words
    });
    b.dev.htod(
        meta_buf.ptr,
        stateless_words.as_ref().unwrap_or(&meta.words),
    )?;
    let real_words = stateless_words.is_some().then(|| meta.words.clone());
    let step = Arc::new(ActiveStep {
        batch: padded.clone(),
        meta,
        base: meta_buf.ptr,
        pad_slot,
        _hold: None,
    });
    set_step(b, Some(step));
    // Warm-up: fills the recording free list with every buffer the step uses.
    b.dev.pool.set_recording(true, false);
    let result = forward(padded, cache).and_then(|warm| {
        drop(warm);
        b.dev.synchronize()?;
        if let Some(w) = &real_words {
            b.dev.htod(meta_buf.ptr, w)?;
        }
        b.dev.pool.set_recording(true, true);
        b.capturing.store(true, Ordering::Relaxed);
        b.dev
            .stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(dev_err)?;
        let out = forward(padded, cache);
        let graph = b.dev.stream.end_capture(CUgraphInstantiate_flags(0));
        let out = out?;
        let graph = graph
            .map_err(dev_err)?
            .ok_or_else(|| dev_err("empty recording"))?;
        Ok((graph, out))
    });
    b.capturing.store(false, Ordering::Relaxed);
    b.dev.pool.set_recording(false, false);
    set_step(b, None);
    let (graph, out) = result?;
    graph.upload().map_err(dev_err)?;
    Ok(Recorded {
        cache_alive: std::sync::Weak::new(),
        graph,
        meta: meta_buf,
        meta_words: words,
        out,
    })
}
