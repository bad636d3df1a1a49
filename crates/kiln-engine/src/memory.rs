//! The memory equation and the one planner: what a model needs to run,
//! term by term, against what is free, and from it the KV pool and the
//! default context. `kiln fit` prints the plan, `kiln serve` runs it (the
//! same function, so the two agree by construction) and refuses to start
//! when one sequence of its context does not fit, and
//! [`EngineConfig::plan`] keeps [`step_reserve_bytes`] back from a
//! device's KV pool.
//!
//! The KV pool: on a device, 90 % of what is free after the weights and
//! overheads, less one step's activations (as vLLM's memory utilization);
//! on the CPU, up to 90 % of what is left after the weights, overheads and
//! one step's activations, but no more than [`CPU_KV_POOL_CAP`] or one
//! sequence of the trained context, whichever is larger (the machine is
//! shared with everything else the user runs). `--kv-mib` sets it. The
//! default context is the longest the pool holds, at most the trained
//! length.
//!
//! Terms: weights as Kiln stores them (every tensor of
//! `kiln_models::tensor_shapes`: a tensor the file stores in a block
//! format at its stored size where the target keeps blocks — the CPU
//! does, in place in the mapped file — any other at the backend's weight
//! element size); the KV cache ([`kv_bytes_for`]: full-attention layers
//! hold every token of every sequence, sliding-window layers only the
//! blocks of their window, plus what one step's prefill chunk adds to
//! them); one prefill chunk's activations; fixed overheads. On
//! the CPU the peak is the larger of loading (the parts of the weight file
//! not kept in place and one tensor's host copy on top of the weights)
//! and running (KV and
//! activations on top of the weights).
//!
//! [`EngineConfig::plan`]: crate::EngineConfig::plan

use std::collections::HashMap;

use kiln_models::ModelConfig;

use crate::error::{EngineError, Result};

const MIB: u64 = 1 << 20;

/// The CUDA context's own memory (kernels, driver state, NVRTC modules):
/// what an H200 run used outside Kiln's pool, less cuBLAS's workspace
/// (620 MiB in `bench/results/2026-11-30_fit_h200_*.json`).
pub const CUDA_CONTEXT_BYTES: u64 = 588 * MIB;
/// cuBLAS's workspace.
pub const CUBLAS_WORKSPACE_BYTES: u64 = 32 * MIB;
/// Buffers kept by recorded decode steps (their free list).
pub const GRAPH_RESERVE_BYTES: u64 = 128 * MIB;
/// The most the CPU KV pool takes by default unless one sequence of the
/// trained context needs more.
pub const CPU_KV_POOL_CAP: u64 = 1 << 30;
/// The process without weights on the CPU: code, tokenizer, metadata,
/// allocator slack (measured with `kiln generate --report-peak-rss` on
/// SmolLM2-135M Q4_1, whose 92 MiB of blocks stay in the mapped file:
/// peak RSS 127 MiB for a one-token prompt, 254–259 MiB for 2,000 tokens,
/// of which KV and activations predict 133 MiB; glibc keeps freed
/// activation buffers in its heap, so the slack grows with the step).
pub const CPU_PROCESS_BYTES: u64 = 32 * MIB;

/// KV bytes `batch` sequences of `context` tokens hold at once in
/// [`kiln_scheduler::DEFAULT_BLOCK_SIZE`]-token blocks of `elem`-byte
/// elements, when a step computes at most `max_chunk` prompt tokens: each
/// sequence's blocks in every layer group (a sliding-window group only
/// those its window reads), plus the blocks a step's chunk spans in the
/// sliding groups beyond the window (none when `max_chunk` is 0), and a
/// hybrid's recurrent state (three slots a sequence: its own and two
/// snapshots', and a spare slot for each sequence that may speculate).
pub fn kv_bytes_for(
    cfg: &ModelConfig,
    context: usize,
    batch: usize,
    max_chunk: usize,
    elem: usize,
) -> u64 {
    let bs = kiln_scheduler::DEFAULT_BLOCK_SIZE;
    let (spec, _) = cfg.kv_layout(bs);
    let per_block = cfg.kv_bytes_per_block(bs, elem) as u64;
    let full = context.div_ceil(bs);
    let mut blocks = 0u64;
    for g in &spec.groups {
        let steady = g.kind.max_needed_blocks(bs, context, 1);
        // A step's chunks together span at most `max_chunk` tokens (and one
        // partial block per sequence) past the windows.
        let chunk = max_chunk.min(context.saturating_mul(batch));
        let extra = if chunk == 0 {
            0
        } else {
            (chunk.div_ceil(bs) + batch).min((full - steady) * batch)
        };
        blocks += (steady * batch + extra) as u64;
    }
    // A hybrid's recurrent state: a slot a sequence, two snapshot slots and
    // the spares of speculative decodes (what the engine allocates), in the
    // pool's bytes.
    let slots = 3 * batch + batch.min(crate::speculative::DEFAULT_MAX_BATCH);
    blocks * per_block + slots as u64 * cfg.state_bytes_per_seq()
}

/// Tokens a CPU prefill step takes at most: 1024 keeps a 1.5B model's
/// step activations near 120 MB (f32, the MLP three intermediate rows
/// wide) at no cost in throughput (the CPU GEMM is as fast at 512 rows as
/// at 2048).
pub const CPU_PREFILL_CHUNK: usize = 1024;
/// Tokens a device prefill step takes at most (near the GEMM peak).
pub const DEVICE_PREFILL_CHUNK: usize = 8192;

/// The prefill chunk of a backend with (`on_device`) or without device
/// memory: what the engine schedules, `generate` feeds and `fit` prices.
pub fn prefill_chunk(on_device: bool) -> usize {
    if on_device {
        DEVICE_PREFILL_CHUNK
    } else {
        CPU_PREFILL_CHUNK
    }
}

/// Peak activations of one step of `num_tokens` tokens over `num_seqs`
/// sequences, in f32, as the reference (CPU) backend allocates them: per
/// token the residual stream and its normed copy, plus the wider of the
/// attention stage (packed q/k/v, its split, rotated q and k, the
/// attention output) and the MLP stage (packed gate/up and the activated
/// product, read from its halves in place); per sequence its logits row
/// and a host copy.
pub fn activation_bytes(cfg: &ModelConfig, num_tokens: usize, num_seqs: usize) -> u64 {
    f32_activations(cfg, num_tokens, num_seqs, 3)
}

/// [`activation_bytes`] with the MLP stage `mlp_widths` intermediate rows
/// wide.
fn f32_activations(
    cfg: &ModelConfig,
    num_tokens: usize,
    num_seqs: usize,
    mlp_widths: usize,
) -> u64 {
    // The widest layer's (Gemma 4's full-attention heads are twice its
    // sliding ones).
    let head_dim = cfg
        .layer_kv
        .iter()
        .map(|l| l.head_dim)
        .max()
        .unwrap_or(cfg.head_dim);
    let q = cfg.num_heads * head_dim;
    let kv = cfg.kv_row();
    let attention = 2 * (q + 2 * kv) + (q + kv) + q;
    let mlp = mlp_widths * cfg.intermediate_size;
    let per_token = 2 * cfg.hidden_size + attention.max(mlp);
    (4 * num_tokens * per_token + 2 * 4 * num_seqs * cfg.vocab_size) as u64
}

/// Activations as a backend holds them: on the CPU exactly
/// [`activation_bytes`]; on a device two fifths of the f32 figure with
/// the MLP stage five intermediate rows wide (the figure the measurement
/// below was taken against), plus the sampling
/// scratch (a vocabulary row of f32 per sequence) — the CUDA backend
/// keeps activations in bf16 and fuses intermediates, and an 8,192-token
/// step of the 8B shape on an H200 used 1,003–1,005 MiB above the weights,
/// the KV pool and the memory outside Kiln's pool (live buffers and the
/// allocator's cached size classes together) at four context × batch
/// settings, 0.40 of the f32 figure (`bench/results/2026-11-30_fit_h200_*.json`).
pub fn step_activation_bytes(
    cfg: &ModelConfig,
    num_tokens: usize,
    num_seqs: usize,
    on_device: bool,
) -> u64 {
    if on_device {
        // Plus the device sampler's f32 scratch: one row of the vocabulary
        // per sequence, beside the bf16 logits.
        f32_activations(cfg, num_tokens, num_seqs, 5) / 5 * 2
            + (4 * num_seqs * cfg.vocab_size) as u64
    } else {
        activation_bytes(cfg, num_tokens, num_seqs)
    }
}

/// What the engine keeps back from a device's KV pool for one full step.
pub fn step_reserve_bytes(
    cfg: &ModelConfig,
    max_num_batched_tokens: usize,
    max_num_seqs: usize,
) -> u64 {
    step_activation_bytes(cfg, max_num_batched_tokens, max_num_seqs, true)
}

/// Where the model would run, with the sizes that follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryTarget {
    /// A device with memory of its own (else the CPU).
    pub on_device: bool,
    /// Bytes an element of a weight the target expands costs.
    pub weight_bytes_per_element: usize,
    /// Weights stored in a block format (quantized, f16, bf16) are kept in
    /// it — on the CPU, in place in the mapped file — instead of expanded.
    pub keeps_blocks: bool,
    pub kv_bytes_per_element: usize,
    /// `EngineConfig::max_num_batched_tokens` there (the prefill chunk).
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// The CUDA context already exists (free memory was measured after it).
    pub context_counted: bool,
}

impl MemoryTarget {
    /// The CPU backend: block weights as stored, others and KV in f32,
    /// [`CPU_PREFILL_CHUNK`]-token chunks.
    pub fn cpu() -> Self {
        MemoryTarget {
            on_device: false,
            weight_bytes_per_element: 4,
            keeps_blocks: true,
            kv_bytes_per_element: 4,
            max_num_batched_tokens: CPU_PREFILL_CHUNK,
            max_num_seqs: 256,
            context_counted: false,
        }
    }

    /// The CUDA backend: GGUF block weights as stored, others and KV in
    /// bf16, 8192-token chunks.
    pub fn cuda(context_counted: bool) -> Self {
        MemoryTarget {
            on_device: true,
            weight_bytes_per_element: 2,
            keeps_blocks: true,
            kv_bytes_per_element: 2,
            max_num_batched_tokens: DEVICE_PREFILL_CHUNK,
            max_num_seqs: 256,
            context_counted,
        }
    }
}

/// The question: this model, this many sequences of this context, here.
#[derive(Debug, Clone)]
pub struct FitInput<'a> {
    pub config: &'a ModelConfig,
    pub target: MemoryTarget,
    /// Tokens per sequence; `None` asks for the longest the pool holds at
    /// `batch` (at most the trained length).
    pub context: Option<usize>,
    pub batch: usize,
    /// The KV pool's size when fixed (`--kv-mib`); `None` sizes it from
    /// what is free.
    pub kv_pool_bytes: Option<u64>,
    /// Memory free for the model (device memory, or `MemAvailable`).
    pub available_bytes: u64,
    /// Bytes of the weight files (mapped while loading on the CPU).
    pub file_bytes: u64,
    /// The stored bytes of the weights the file holds in a block format,
    /// by name (counted as stored where the target keeps blocks; an empty
    /// map counts every weight expanded).
    pub block_bytes: &'a HashMap<String, u64>,
    /// What LoRA adapters may hold (`--lora` and the reserve for adapters
    /// loaded at run time).
    pub adapter_bytes: u64,
}

/// Where a plan's context came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextSource {
    /// Asked for (`--context`).
    Requested,
    /// The model's trained length (memory allows it).
    Trained,
    /// The longest the KV pool holds (shorter than the trained length).
    Memory,
}

/// The answer, term by term.
#[derive(Debug, Clone, PartialEq)]
pub struct FitReport {
    pub context: usize,
    pub context_source: ContextSource,
    /// The model's trained context length.
    pub trained_context: usize,
    /// The KV pool `kiln serve` would allocate.
    pub kv_pool_bytes: u64,
    pub batch: usize,
    pub on_device: bool,
    pub weights_bytes: u64,
    /// The part of `weights_bytes` one decode token reads: all but the
    /// embedding rows it does not look up and, in a Mixture-of-Experts
    /// model, the experts it does not run (what bounds decode speed).
    pub decode_weight_bytes: u64,
    /// The part of `weights_bytes` held as the file stores it (blocks kept
    /// in place in the mapped file on the CPU).
    pub weights_in_place_bytes: u64,
    /// The part of `weights_bytes` held in the file's block formats
    /// (quantized, f16, bf16) rather than expanded.
    pub weights_blocks_bytes: u64,
    /// Extra while loading on the CPU: the mapped file and one host copy.
    pub loading_bytes: u64,
    /// Bytes per token of full attention in every layer.
    pub kv_bytes_per_token: u64,
    /// What the sequences hold ([`kv_bytes_for`]).
    pub kv_bytes: u64,
    /// What they would hold if every layer kept every token: more than
    /// `kv_bytes` when sliding-window layers keep only their window.
    pub kv_full_attention_bytes: u64,
    /// The part of `kv_bytes` a prefill chunk adds to the sliding layers
    /// while it passes (0 without them).
    pub kv_chunk_bytes: u64,
    pub activation_bytes: u64,
    /// Fixed costs by name.
    pub overheads: Vec<(&'static str, u64)>,
    /// The peak.
    pub total_bytes: u64,
    pub available_bytes: u64,
    pub fits: bool,
    /// The longest context that fits at `batch` (at most the model's).
    pub max_context: usize,
    /// The most sequences of `context` that fit.
    pub max_batch: usize,
}

struct Terms {
    weights: u64,
    /// Weight bytes one decode token reads ([`kiln_models::decode_share`]).
    decode_weights: u64,
    in_place: u64,
    blocks: u64,
    loading: u64,
    overheads: Vec<(&'static str, u64)>,
}

/// Every weight of `config` by name with the bytes the target holds it in
/// and the bytes of the f32 host copy loading it makes (0 for blocks kept
/// as stored).
pub fn held_weights(
    config: &ModelConfig,
    target: &MemoryTarget,
    block_bytes: &HashMap<String, u64>,
) -> Result<Vec<(String, u64, u64)>> {
    Ok(kiln_models::tensor_shapes(config)?
        .into_iter()
        .map(|(name, s)| {
            let n: u64 = s.iter().map(|&d| d as u64).product();
            match block_bytes.get(&name).filter(|_| target.keeps_blocks) {
                Some(&b) => (name, b, 0),
                None => (name, n * target.weight_bytes_per_element as u64, 4 * n),
            }
        })
        .collect())
}

fn terms(input: &FitInput<'_>) -> Result<Terms> {
    let t = input.target;
    let named = held_weights(input.config, &t, input.block_bytes)?;
    let decode_weights = named
        .iter()
        .map(|(name, h, _)| (*h as f64 * kiln_models::decode_share(input.config, name)) as u64)
        .sum();
    let held: Vec<(u64, u64)> = named.into_iter().map(|(_, h, copy)| (h, copy)).collect();
    let weights = held.iter().map(|h| h.0).sum::<u64>();
    // Loading uploads one tensor at a time from an f32 host copy: the peak
    // is the loaded prefix plus the copy in flight (the mapped file too,
    // less the blocks kept in place, which are the weights themselves).
    let mut prefix = 0u64;
    let mut in_flight = 0u64;
    for &(h, copy) in &held {
        prefix += h;
        in_flight = in_flight.max((prefix + copy).saturating_sub(weights));
    }
    let blocks: u64 = held.iter().filter(|h| h.1 == 0).map(|h| h.0).sum();
    let in_place = if t.on_device { 0 } else { blocks };
    let overheads = if t.on_device {
        let mut v = Vec::new();
        if !t.context_counted {
            v.push(("CUDA context", CUDA_CONTEXT_BYTES));
        }
        v.push(("cuBLAS workspace", CUBLAS_WORKSPACE_BYTES));
        v.push(("CUDA graph recordings", GRAPH_RESERVE_BYTES));
        v
    } else {
        vec![("process and tokenizer", CPU_PROCESS_BYTES)]
    };
    let mut overheads = overheads;
    if input.adapter_bytes > 0 {
        overheads.push(("LoRA adapters", input.adapter_bytes));
    }
    Ok(Terms {
        weights,
        decode_weights,
        in_place,
        blocks,
        loading: if t.on_device {
            0
        } else {
            input.file_bytes.saturating_sub(in_place) + in_flight
        },
        overheads,
    })
}

/// [`kv_bytes_for`] at `input`'s target.
fn kv_of(input: &FitInput<'_>, context: usize, batch: usize) -> u64 {
    let t = input.target;
    kv_bytes_for(
        input.config,
        context,
        batch,
        t.max_num_batched_tokens,
        t.kv_bytes_per_element,
    )
}

/// The largest `n` in `0..=hi` with `ok(n)`, for `ok` true up to some `n`
/// and false after.
fn largest(hi: usize, ok: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, hi);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if ok(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

fn peak(input: &FitInput<'_>, terms: &Terms, context: usize, batch: usize) -> (u64, u64, u64) {
    let t = input.target;
    let kv = kv_of(input, context, batch);
    let chunk = (context.saturating_mul(batch)).min(t.max_num_batched_tokens);
    let act = if batch == 0 {
        0
    } else {
        step_activation_bytes(input.config, chunk, batch.min(t.max_num_seqs), t.on_device)
    };
    let fixed = terms.weights + terms.overheads.iter().map(|o| o.1).sum::<u64>();
    let total = if t.on_device {
        fixed + kv + act
    } else {
        fixed + terms.loading.max(kv + act)
    };
    (total, kv, act)
}

/// The KV pool the plan allocates (see the module docs).
fn kv_pool_bytes(input: &FitInput<'_>, terms: &Terms) -> u64 {
    if let Some(b) = input.kv_pool_bytes {
        return b;
    }
    let t = input.target;
    let fixed = terms.weights + terms.overheads.iter().map(|o| o.1).sum::<u64>();
    let reserve = step_activation_bytes(
        input.config,
        t.max_num_batched_tokens,
        t.max_num_seqs,
        t.on_device,
    );
    let left = input.available_bytes.saturating_sub(fixed);
    if t.on_device {
        return ((left as f64 * 0.9) as u64).saturating_sub(reserve);
    }
    if input.available_bytes < fixed + terms.loading {
        return 0; // It cannot even load.
    }
    let usable = (left.saturating_sub(reserve) as f64 * 0.9) as u64;
    let one_trained = kv_of(input, input.config.max_position_embeddings, 1);
    usable.min(CPU_KV_POOL_CAP.max(one_trained))
}

/// Evaluate the memory equation and plan the KV pool and context.
pub fn fit(input: &FitInput<'_>) -> Result<FitReport> {
    let trained = input.config.max_position_embeddings.max(1);
    if input.batch == 0 || input.context == Some(0) {
        return Err(EngineError::Config(
            "context and batch must be at least 1".into(),
        ));
    }
    if let Some(c) = input.context.filter(|&c| c > trained) {
        return Err(EngineError::Config(format!(
            "a context of {c} tokens is beyond the model's trained length of {trained} tokens"
        )));
    }
    let terms = terms(input)?;
    let pool = kv_pool_bytes(input, &terms);
    let per_token = input
        .config
        .kv_bytes_per_token(input.target.kv_bytes_per_element)
        .max(1) as u64;
    let max_context = largest(trained, |c| kv_of(input, c, input.batch) <= pool);
    let (context, context_source) = match input.context {
        Some(c) => (c, ContextSource::Requested),
        None if max_context == trained => (trained, ContextSource::Trained),
        // Nothing fits: report the attempt at the trained length.
        None if max_context == 0 => (trained, ContextSource::Trained),
        None => (max_context, ContextSource::Memory),
    };
    let (total, kv, act) = peak(input, &terms, context, input.batch);
    let avail = input.available_bytes;
    let needed = kv;
    let per_seq = kv_of(input, context, 1).max(1);
    let max_batch = largest((pool / per_seq) as usize + 1, |b| {
        kv_of(input, context, b) <= pool
    });
    Ok(FitReport {
        context,
        context_source,
        trained_context: trained,
        kv_pool_bytes: pool,
        batch: input.batch,
        on_device: input.target.on_device,
        weights_bytes: terms.weights,
        decode_weight_bytes: terms.decode_weights,
        weights_in_place_bytes: terms.in_place,
        weights_blocks_bytes: terms.blocks,
        loading_bytes: terms.loading,
        kv_bytes_per_token: per_token,
        kv_bytes: kv,
        kv_full_attention_bytes: per_token * context as u64 * input.batch as u64,
        kv_chunk_bytes: kv.saturating_sub(kv_bytes_for(
            input.config,
            context,
            input.batch,
            0,
            input.target.kv_bytes_per_element,
        )),
        activation_bytes: act,
        max_context,
        max_batch,
        overheads: terms.overheads,
        total_bytes: total,
        available_bytes: avail,
        fits: pool > 0 && needed <= pool && total <= avail,
    })
}

impl std::fmt::Display for FitReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| format!("{:>10.1} MiB", b as f64 / MIB as f64);
        let w = if self.on_device && self.weights_blocks_bytes > 0 {
            "blocks as stored, the rest bf16"
        } else if self.on_device {
            "bf16"
        } else if self.weights_in_place_bytes == 0 {
            "f32"
        } else {
            // Blocks as the file stores them; vectors (norms) are f32.
            "as stored"
        };
        writeln!(
            f,
            "  {:<28}{}",
            format!("weights ({w})"),
            mib(self.weights_bytes)
        )?;
        // A sparse model reads a fraction of its weights a token.
        if (self.decode_weight_bytes as f64) < 0.9 * self.weights_bytes as f64 {
            writeln!(
                f,
                "    read per decoded token    {}  (the experts a token runs, not all of them)",
                mib(self.decode_weight_bytes)
            )?;
        }
        if self.kv_bytes < self.kv_full_attention_bytes {
            let full = self.kv_full_attention_bytes.max(1) as f64;
            let steady = self.kv_bytes - self.kv_chunk_bytes;
            writeln!(
                f,
                "  KV cache                    {}  ({} tokens x {} seqs; sliding-window layers keep only their window: {:.1} % of the {:.1} MiB full attention needs, plus {:.1} MiB while a prefill chunk passes)",
                mib(self.kv_bytes),
                self.context,
                self.batch,
                100.0 * steady as f64 / full,
                full / MIB as f64,
                self.kv_chunk_bytes as f64 / MIB as f64
            )?;
        } else {
            writeln!(
                f,
                "  KV cache                    {}  ({} B/token x {} tokens x {} seqs)",
                mib(self.kv_bytes),
                self.kv_bytes_per_token,
                self.context,
                self.batch
            )?;
        }
        writeln!(
            f,
            "  activations (one chunk)     {}",
            mib(self.activation_bytes)
        )?;
        if !self.on_device {
            writeln!(
                f,
                "  loading (file + one copy)   {}  (peak is the larger of loading and KV + activations)",
                mib(self.loading_bytes)
            )?;
        }
        for (name, b) in &self.overheads {
            writeln!(f, "  {name:<27} {}", mib(*b))?;
        }
        writeln!(f, "  total (peak)                {}", mib(self.total_bytes))?;
        writeln!(
            f,
            "  available                   {}",
            mib(self.available_bytes)
        )?;
        let source = match self.context_source {
            ContextSource::Requested => "asked for",
            ContextSource::Trained => "the model's trained length",
            ContextSource::Memory => "the longest the KV pool holds",
        };
        writeln!(
            f,
            "  KV pool                     {}  (context {} = {source}, trained {})",
            mib(self.kv_pool_bytes),
            self.context,
            self.trained_context
        )?;
        writeln!(
            f,
            "  verdict: {}; largest context at batch {}: {}; largest batch at context {}: {}",
            if self.fits { "fits" } else { "does not fit" },
            self.batch,
            self.max_context,
            self.context,
            self.max_batch
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Gemma-3-shaped config: 18 layers, every 6th global, a 512-token
    /// window, a 32k trained context.
    fn gemma3_shape() -> ModelConfig {
        ModelConfig::from_hf(&serde_json::json!({
            "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
            "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
            "max_position_embeddings": 32768, "query_pre_attn_scalar": 256}))
        .unwrap()
    }

    #[test]
    fn a_32k_gemma3_context_needs_a_sixth_plus_the_sliding_windows() {
        let cfg = gemma3_shape();
        let full = (cfg.kv_bytes_per_token(2) * 32768) as f64;
        let steady = kv_bytes_for(&cfg, 32768, 1, 0, 2) as f64;
        let want = 1.0 / 6.0 + 5.0 / 6.0 * 512.0 / 32768.0;
        // Whole blocks: a 512-key window spans 33 blocks of 16, not 32.
        assert!(
            (steady / full - want).abs() < 0.002,
            "{} vs {want}",
            steady / full
        );
        // A prefill chunk of 2048 tokens adds its blocks to the five
        // sliding groups while it passes.
        let with_chunk = kv_bytes_for(&cfg, 32768, 1, 2048, 2) as f64;
        let block = cfg.kv_bytes_per_block(16, 2) as f64;
        assert_eq!(with_chunk - steady, 5.0 * (128.0 + 1.0) * block);
        // A short context keeps every block: no saving below the window.
        assert_eq!(
            kv_bytes_for(&cfg, 400, 2, 2048, 2),
            (cfg.kv_bytes_per_token(2) * 400 * 2) as u64
        );
    }

    #[test]
    fn the_plan_reports_the_saving() {
        let cfg = gemma3_shape();
        let input = FitInput {
            config: &cfg,
            target: MemoryTarget::cuda(true),
            context: Some(32768),
            batch: 1,
            kv_pool_bytes: None,
            available_bytes: 16 << 30,
            file_bytes: 0,
            block_bytes: &HashMap::new(),
            adapter_bytes: 0,
        };
        let r = fit(&input).unwrap();
        assert!(r.fits);
        assert!(r.kv_bytes < r.kv_full_attention_bytes / 2, "{r:?}");
        let text = r.to_string();
        assert!(
            text.contains("sliding-window layers keep only their window: 18.0 %"),
            "{text}"
        );
    }

    /// A Qwen3-30B-A3B-shaped config: 48 layers of 128 experts, 8 a token.
    #[test]
    fn a_sparse_model_holds_every_expert_and_reads_its_top_k() {
        let cfg = ModelConfig::from_hf(&serde_json::json!({
            "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": true, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960}))
        .unwrap();
        let input = FitInput {
            config: &cfg,
            target: MemoryTarget::cuda(true),
            context: Some(4096),
            batch: 1,
            kv_pool_bytes: None,
            available_bytes: 80 << 30,
            file_bytes: 0,
            block_bytes: &HashMap::new(),
            adapter_bytes: 0,
        };
        let r = fit(&input).unwrap();
        let (h, e) = (2048u64, 3 * 2048 * 768u64);
        let experts = 48 * 128 * e * 2;
        let attention = 48 * 2 * (h * 32 * 128 + h * 4 * 128) * 2;
        // Held: every expert (and the rest: embeddings, head, norms, routers).
        assert!(r.weights_bytes > experts + attention, "{r:?}");
        // Read a token: 8 of 128 experts, no embedding table, all attention.
        let routers = 48 * 128 * h * 2;
        let rest = attention + routers + 151936 * h * 2 + 48 * (2 * h + 2 * 128) * 2 + 2 * h;
        let read = experts / 16 + rest;
        assert!(
            r.decode_weight_bytes.abs_diff(read) < read / 1000,
            "{} vs {read}",
            r.decode_weight_bytes
        );
        assert!(r.to_string().contains("read per decoded token"), "{r}");
    }

    /// Issue 18's sizing: a Qwen2.5-32B-shaped model in Q4_K_M (Q4_K
    /// everywhere but the value and down projections of every other layer
    /// and the output, Q6_K, as llama.cpp's mix) on a 24 GB card, its
    /// blocks kept as stored on the GPU: an 8k context fits; expanded to
    /// bf16 it would not (65 GB).
    #[test]
    fn a_32b_q4_k_m_model_fits_a_24_gb_card_with_an_8k_context() {
        let cfg = ModelConfig::from_hf(&serde_json::json!({
            "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648,
            "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
            "vocab_size": 152064, "max_position_embeddings": 32768,
            "tie_word_embeddings": false}))
        .unwrap();
        let (q4k, q6k) = (144.0 / 256.0, 210.0 / 256.0);
        let block_bytes: HashMap<String, u64> = kiln_models::tensor_shapes(&cfg)
            .unwrap()
            .into_iter()
            .filter(|(_, s)| s.len() == 2)
            .map(|(name, s)| {
                let layer: Option<usize> = name
                    .split('.')
                    .skip_while(|p| *p != "layers")
                    .nth(1)
                    .and_then(|l| l.parse().ok());
                let wide = name.contains("v_proj") || name.contains("down_proj");
                let bpe = match layer {
                    Some(l) if wide && l % 2 == 0 => q6k,
                    None if name.contains("lm_head") => q6k,
                    _ => q4k,
                };
                let n = (s[0] * s[1]) as f64;
                (name, (n * bpe) as u64)
            })
            .collect();
        let card = 24u64 << 30;
        let input = FitInput {
            config: &cfg,
            target: MemoryTarget::cuda(false),
            context: Some(8192),
            batch: 1,
            kv_pool_bytes: None,
            available_bytes: card,
            file_bytes: 0,
            block_bytes: &block_bytes,
            adapter_bytes: 0,
        };
        let r = fit(&input).unwrap();
        assert!(r.fits, "{r}");
        assert!(r.weights_bytes < 21_000_000_000, "{r}");
        assert!(
            r.to_string()
                .contains("weights (blocks as stored, the rest bf16)"),
            "{r}"
        );
        let expanded = fit(&FitInput {
            block_bytes: &HashMap::new(),
            ..input
        })
        .unwrap();
        assert!(
            !expanded.fits && expanded.weights_bytes > 60_000_000_000,
            "{expanded}"
        );
    }
}
