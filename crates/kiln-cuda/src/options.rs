//! Every setting of the CUDA backend, in one place. The binary builds a
//! [`CudaOptions`] (from its flags and environment: `crates/kiln/src/cuda_env.rs`
//! lists the variables) and hands it to [`crate::CudaBackend::new`]; nothing
//! in this crate reads the environment. The defaults are the measured-fastest
//! settings; the switches exist for A/B comparisons against them.

/// The CUDA backend's settings. `Default` is what Kiln runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Programmatic dependent launch (sm_90 and newer): each kernel may be
    /// scheduled while the previous one finishes and waits for its inputs
    /// inside. Default `true`; `false` launches kernels strictly in turn.
    pub pdl: bool,
    /// Record decode steps as CUDA graphs and replay them. Default `true`;
    /// `false` runs every step eagerly.
    pub graphs: bool,
    /// Upload weights through two pinned 64 MiB buffers in turn. Default
    /// `true`; `false` copies from pageable memory.
    pub pinned_staging: bool,
    /// Run sampling (every parameter) on the device. Default `true`; `false`
    /// sends the logits to the host sampler.
    pub device_sampling: bool,
    /// Split decode attention's last partition to finish combines the
    /// partitions (zeroed counters). Default `true`; `false` runs the
    /// separate reduce kernel.
    pub decode_combine_in_kernel: bool,
    /// Split decode steps load a chunk's first values together with its
    /// keys (the `_vpre_` kernels). Default `true`.
    pub decode_vpre_split: bool,
    /// The decode GEMV's tile width for plain products: `None` (default)
    /// lets the host rule pick 8 or 16 columns by how full the last wave of
    /// blocks is; `Some(8)` or `Some(16)` forces one.
    pub direct_cols: Option<usize>,
    /// Split decode attention: the fewest keys a partition takes (default
    /// 32) and the blocks it aims for over a step's rows and KV heads
    /// (default 256); a step splits each row's keys into at most
    /// `target / (rows * kv_heads)` partitions of at least this many keys.
    pub decode_partition_keys: usize,
    pub decode_target_blocks: usize,
    /// Block-quantized decode products (`ops/matmul/blocks`): the blocks a
    /// multiprocessor they launch, one wave (each block stages x once, each
    /// warp runs its ring of loads over its rows). Default 2, the residency
    /// their register cap (`KILN_QGEMV_MIN_BLOCKS`) allows.
    pub qgemv_blocks_per_sm: usize,
    /// Keep keys and values in the KV cache as E4M3 FP8 at unit scale (one
    /// byte each: twice the tokens a pool of the same bytes), widened to
    /// bf16 as attention reads them. Default `false` (bf16).
    pub kv_cache_fp8: bool,
    /// FP8 weights' products past the decode rows on the FP8 tensor cores
    /// (W8A8: activations rounded to E4M3 a run of 128 of a row, as vLLM's
    /// FP8 does) where the GPU has them. Default `true`; `false` keeps the
    /// activations exact (W8A16: dequantized slabs through bf16 cuBLAS).
    pub fp8_activations: bool,
    /// Run hybrid models' recurrent layers (`ops/recurrent`: the
    /// convolution with its state, the gated delta rule). Default `true`
    /// (the kernels pass `kiln dev cuda-check` on an H100 and random
    /// checkpoints at released head sizes match transformers); `false`
    /// refuses a hybrid model at load, by name.
    pub recurrent: bool,
    /// Steps in which a sequence has at least this many new tokens run the
    /// delta rule in its chunk-parallel form (`delta_chunk.cu`: chunks of
    /// 64 tokens solved at once, the state carried from chunk to chunk);
    /// others token by token. Default 64: on an H100 the 9B shape's
    /// 4,096-token prefill runs 11.0k tok/s with it against 9.4k token by
    /// token (bench/results/2026-12-07_issue21-chunk-registers_h100_880222c.json).
    pub delta_chunk_rows: usize,
    /// LoRA deltas of steps of at least this many rows run on the tensor
    /// cores (`lora_shrink_mma_bf16` / `lora_expand_mma_bf16`: prefill);
    /// smaller steps (decode) on the CUDA-core kernels. Default
    /// `usize::MAX` (off): the tensor-core pair passes `kiln dev
    /// cuda-check` (which runs both pairs whatever this says; H100,
    /// 2026-12-07) but no round has timed it yet; 128 is the intended
    /// setting once `bench/gpu/lora_embed_round.sh` measures it faster.
    pub lora_mma_rows: usize,
    /// LoRA's CUDA-core expands take 8 adjacent columns a thread
    /// (`lora_expand8_bf16`, `lora_expand8_epi_bf16`: 16-byte pieces of
    /// the output, each staged low-rank value feeding 8 products) instead
    /// of one. Default `false` until a GPU has run them through `kiln dev
    /// cuda-check` (which runs both whatever this says) and a round has
    /// timed them.
    pub lora_expand8: bool,
    /// Overrides of kernels' `#ifndef` tuning macros, `NAME=VALUE` pairs
    /// separated by blanks or `+` (a bare `NAME` means `NAME=1`); each goes
    /// only into the sources that name it, so only their cache keys change.
    /// Default empty.
    pub kernel_defines: String,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            pdl: true,
            graphs: true,
            pinned_staging: true,
            device_sampling: true,
            decode_combine_in_kernel: true,
            decode_vpre_split: true,
            direct_cols: None,
            decode_partition_keys: 32,
            decode_target_blocks: 256,
            qgemv_blocks_per_sm: 2,
            kv_cache_fp8: false,
            fp8_activations: true,
            recurrent: true,
            delta_chunk_rows: 64,
            lora_mma_rows: usize::MAX,
            lora_expand8: false,
            kernel_defines: String::new(),
        }
    }
}
