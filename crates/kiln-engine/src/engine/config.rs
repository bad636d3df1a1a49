//! The engine's sizes: [`EngineConfig`] (KV pool, step, queue, served
//! context) and [`EngineConfig::plan`], which sizes the KV pool from what a
//! device has free once the weights are there.

use crate::error::{EngineError, Result};
use crate::load::LoadedModel;

/// Sizes of the engine's KV pool and step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
    /// The longest sequence served, prompt and output (`None`: the model's
    /// trained context length). Longer prompts are refused at submit.
    pub context_length: Option<usize>,
}

impl EngineConfig {
    /// A pool of `kv_bytes` of KV memory for `model`, at its backend's KV
    /// element size.
    pub fn for_memory(model: &LoadedModel, kv_bytes: usize) -> Self {
        let block_size = 16;
        let elem = model.model.backend().kv_bytes_per_element();
        let per_block = model
            .model
            .rank_config()
            .kv_bytes_per_block(block_size, elem);
        // A device runs large prefill chunks near its GEMM peak; on the CPU
        // smaller chunks keep decode steps of other requests responsive.
        let on_device = model.model.backend().device_memory().is_some();
        EngineConfig {
            block_size,
            num_blocks: (kv_bytes / per_block.max(1)).max(1),
            max_num_seqs: 256,
            max_num_batched_tokens: crate::memory::prefill_chunk(on_device),
            max_waiting: 1024,
            context_length: None,
        }
    }
}

impl EngineConfig {
    /// This configuration with a draft model's KV carved out of the pool:
    /// the draft keeps as many blocks as the target (at most what
    /// `max_batch` sequences of the served context need), and the two
    /// pools together take the bytes planned for the target's alone.
    pub fn with_draft(
        self,
        target: &LoadedModel,
        draft: &LoadedModel,
        max_batch: usize,
    ) -> EngineConfig {
        let elem = draft.model.backend().kv_bytes_per_element();
        let d = draft
            .model
            .rank_config()
            .kv_bytes_per_block(self.block_size, elem);
        self.carve(target, d, max_batch)
    }

    /// This configuration with the KV of the target's multi-token-prediction
    /// head (one attention layer) carved out of the pool, as
    /// [`EngineConfig::with_draft`] does a draft model's.
    pub fn with_mtp_head(self, target: &LoadedModel, max_batch: usize) -> EngineConfig {
        let cfg = target.model.config();
        let elem = target.model.backend().kv_bytes_per_element();
        let d = 2 * cfg.num_kv_heads * cfg.head_dim * self.block_size * elem;
        self.carve(target, d, max_batch)
    }

    /// `n` target blocks and `min(n, cap)` blocks of `d` bytes of a second
    /// pool within the target's bytes.
    fn carve(self, target: &LoadedModel, d: usize, max_batch: usize) -> EngineConfig {
        let bs = self.block_size;
        let elem = target.model.backend().kv_bytes_per_element();
        let t = target
            .model
            .rank_config()
            .kv_bytes_per_block(bs, elem)
            .max(1);
        let d = d.max(1);
        let context = self
            .context_length
            .unwrap_or(target.context_length())
            .min(target.context_length());
        let cap = max_batch.max(1) * context.div_ceil(bs);
        let budget = self.num_blocks * t;
        let even = budget / (t + d);
        let n = if even <= cap {
            even
        } else {
            budget.saturating_sub(cap * d) / t
        };
        EngineConfig {
            num_blocks: n.max(1),
            ..self
        }
    }
}

/// How the KV pool was sized, for the start-up log.
#[derive(Debug, Clone, PartialEq)]
pub struct KvPlan {
    pub config: EngineConfig,
    pub kv_bytes: usize,
    /// Device memory before the pool (`None` on the CPU).
    pub free_bytes: Option<u64>,
    pub weights_bytes: Option<u64>,
    /// Bytes kept back for activations and workspace.
    pub reserve_bytes: usize,
    /// Tokens the pool holds in all, when every layer group keeps them
    /// (sliding-window groups free theirs, so more fit in practice).
    pub max_tokens: usize,
}

impl std::fmt::Display for KvPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "KV pool {:.0} MiB = {} blocks of {} tokens ({} tokens)",
            mib(self.kv_bytes as u64),
            self.config.num_blocks,
            self.config.block_size,
            self.max_tokens
        )?;
        if let (Some(free), Some(w)) = (self.free_bytes, self.weights_bytes) {
            write!(
                f,
                "; device: weights {:.0} MiB, {:.0} MiB free before the pool, {:.0} MiB kept for activations",
                mib(w),
                mib(free),
                mib(self.reserve_bytes as u64)
            )?;
        }
        Ok(())
    }
}

impl EngineConfig {
    /// Size the KV pool for a served context of `context` tokens:
    /// `kv_bytes` when given (`--kv-mib`, or the CPU pool of
    /// [`memory::fit`](crate::memory::fit)'s plan); else, on a device
    /// backend, 90 % of the memory left after the weights minus
    /// [`step_reserve_bytes`](crate::memory::step_reserve_bytes); else
    /// 1 GiB. A pool that cannot hold one sequence of `context` tokens is
    /// refused with the breakdown (the rule `kiln fit` and `kiln serve`
    /// apply before loading).
    pub fn plan(model: &LoadedModel, kv_bytes: Option<usize>, context: usize) -> Result<KvPlan> {
        let kv_mib = kv_bytes;
        let cfg = model.model.config();
        let backend = model.model.backend();
        let probe = EngineConfig::for_memory(model, 0);
        let elem = backend.kv_bytes_per_element();
        let one_seq = crate::memory::kv_bytes_for(
            model.model.rank_config(),
            context,
            1,
            probe.max_num_batched_tokens,
            elem,
        ) as usize;
        let mem = backend.device_memory();
        let reserve = crate::memory::step_reserve_bytes(
            cfg,
            probe.max_num_batched_tokens,
            probe.max_num_seqs,
        ) as usize;
        let kv_bytes = match (kv_mib, mem) {
            (Some(b), _) => b,
            (None, Some(m)) => ((m.free_bytes as f64 * 0.9) as usize).saturating_sub(reserve),
            (None, None) => 1 << 30,
        };
        let config = EngineConfig::for_memory(model, kv_bytes);
        // Each token takes a block slot in every layer group.
        let groups = cfg.kv_layout(config.block_size).0.groups.len().max(1);
        let max_tokens = config.num_blocks * config.block_size / groups;
        if kv_bytes < one_seq {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            let device = mem.map_or(String::new(), |m| {
                format!(
                    "\n  weights on the device {:.0} MiB, free after them {:.0} MiB, 10 % headroom and {:.0} MiB kept for one step's activations",
                    mib(m.active_bytes),
                    mib(m.free_bytes),
                    mib(reserve as u64)
                )
            });
            return Err(EngineError::Config(format!(
                "not enough memory for one sequence of {context} tokens:\n  KV cache needed {:.1} MiB ({context} tokens)\n  KV pool {:.1} MiB{device}\nuse a shorter --context, --kv-mib, or a smaller model",
                mib(one_seq as u64),
                mib(kv_bytes as u64),
            )));
        }
        Ok(KvPlan {
            config,
            kv_bytes,
            free_bytes: mem.map(|m| m.free_bytes),
            weights_bytes: mem.map(|m| m.active_bytes),
            reserve_bytes: if mem.is_some() && kv_mib.is_none() {
                reserve
            } else {
                0
            },
            max_tokens,
        })
    }
}
