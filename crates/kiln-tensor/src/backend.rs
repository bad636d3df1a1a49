//! The [`Backend`] traits (memory, ops, sampling, step recording) and the
//! plain data their methods take.

use std::any::Any;

use crate::error::{Result, TensorError};
use crate::extension::ExtensionOp;
use crate::matmul::{matmul_unfused, Epilogue, NormPrologue};
use crate::tensor::Tensor;
use crate::weight::{BlockPart, BlockWeight, Weight, WeightKind};
use kiln_quant::QuantMatrix;

/// Gated activation applied as `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)` (Llama, Qwen, Mistral).
    Silu,
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
    /// `sigmoid(x)`: a gate (Qwen3.5's gated attention output).
    Sigmoid,
}

/// Rotary embedding applied by [`Ops::rope`]: Hugging Face's rotate-half
/// layout (pairs `(i, i + rotary_dim/2)` within each head).
#[derive(Debug, Clone)]
pub struct RopeParams<'a> {
    pub num_heads: usize,
    pub head_dim: usize,
    /// Inverse frequencies, `rotary_dim / 2` of them; dims past
    /// `rotary_dim` pass through unrotated.
    pub inv_freq: &'a [f32],
    /// Multiplier applied to cos and sin (1 unless the scaling asks).
    pub attention_scaling: f32,
}

/// Attention of a chunk of new tokens of one sequence over its cache.
#[derive(Debug, Clone, Copy)]
pub struct AttentionParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier of q·k (usually `head_dim^-0.5`).
    pub scale: f32,
    /// Keys further back than this many positions are not attended to.
    pub sliding_window: Option<usize>,
    /// `tanh` soft-capping of attention scores, if the model uses it.
    pub softcap: Option<f32>,
    /// The layer's group of block tables in the batch ([`SeqSlice::block_tables`],
    /// [`ForwardBatch::slot_mapping`]); 0 for a model whose layers are alike.
    pub kv_group: usize,
    /// Causal: a token attends to keys up to its own position. Bidirectional
    /// (`false`, encoders such as EmbeddingGemma): to every key of its sequence
    /// after this step, and a sliding window keeps keys closer than `window` on
    /// both sides (`|query - key| < window`).
    pub causal: bool,
}

/// Device memory as a backend sees it (as the reference's
/// `getMemorySnapshot`): the driver's free/total and the backend's own
/// active (live buffers), peak active and reserved (held, incl. cached) bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceMemory {
    pub free_bytes: u64,
    pub total_bytes: u64,
    pub active_bytes: u64,
    pub peak_active_bytes: u64,
    pub reserved_bytes: u64,
}

/// One row's sampling request for [`Sampling::sample_rows`]: the parameters
/// and per-step data of the host sampler (`kiln_sampling::Sampler`, whose
/// module documentation defines the semantics), with the one uniform
/// number `u` drawn on the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow<'a> {
    /// 0 is greedy (the highest processed logit, ties to the lowest id).
    pub temperature: f32,
    /// 0 is off.
    pub top_k: u32,
    /// 1 is off.
    pub top_p: f32,
    /// 0 is off.
    pub min_p: f32,
    /// The draw's uniform number in `[0, 1)` (unused when greedy).
    pub u: f64,
    /// `(token, bias)`, distinct tokens; a bias of -100 or less bans the token.
    pub logit_bias: &'a [(u32, f32)],
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// `(token, generated_count, in_prompt)` for every distinct token the
    /// penalties apply to.
    pub penalties: &'a [(u32, u32, bool)],
    /// Allowed ids as bit words (as [`Sampling::argmax_rows_masked`]); `None`:
    /// every id.
    pub mask: Option<&'a [u32]>,
    /// How many top alternatives to return (at most 20).
    pub top_logprobs: u32,
}

impl SampleRow<'_> {
    /// A greedy row with nothing else asked: the plain argmax.
    pub const GREEDY: SampleRow<'static> = SampleRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        u: 0.0,
        logit_bias: &[],
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        penalties: &[],
        mask: None,
        top_logprobs: 0,
    };
}

/// One row's result from [`Sampling::sample_rows`].
#[derive(Debug, Clone, PartialEq)]
pub struct SampledRow {
    pub token: u32,
    /// The token's log-probability under the processed logits.
    pub logprob: f32,
    /// The `top_logprobs` best tokens, highest first, ties to lower ids.
    pub top: Vec<(u32, f32)>,
}

/// Per-head RMSNorm of q and k applied before RoPE (Qwen3, Gemma 3), and
/// optionally of v (Gemma 4, whose value norm has no weight of its own: a
/// weight of ones).
#[derive(Clone, Copy)]
pub struct QkNorm<'a> {
    pub q_weight: &'a Tensor,
    pub k_weight: &'a Tensor,
    pub v_weight: Option<&'a Tensor>,
    pub eps: f32,
    pub weight_offset: f32,
}

pub use crate::batch::{ForwardBatch, KvCache, KvPoolShape, SeqSlice, SeqState};

/// A backend: where tensors live and what computes on them, split by
/// concern into [`Memory`], [`Ops`], [`Sampling`], [`StepRecording`] and
/// [`crate::Collectives`] (tensor parallelism).
/// Models hold an `Arc<dyn Backend>` and call the methods of all of them on
/// it. Tensors are row-major; "rows" are tokens. Implementations must
/// match the CPU backend within the tolerance their cross-backend tests
/// state.
pub trait Backend:
    Memory + Ops + Sampling + StepRecording + crate::collective::Collectives + Send + Sync
{
    /// A short name for logs and errors (`cpu`, `cuda:0`).
    fn name(&self) -> &'static str;

    /// Problems the backend worked around (a kernel that did not load, a
    /// step shape that could not be recorded), for the caller to show.
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Where tensors live: uploads and downloads, the KV cache, device memory,
/// and the element sizes memory planning uses.
pub trait Memory {
    /// Bytes of one KV-cache element on this backend (f32 on the CPU).
    fn kv_bytes_per_element(&self) -> usize {
        4
    }

    /// Bytes of one stored weight element (f32 on the CPU).
    fn weight_bytes_per_element(&self) -> usize {
        4
    }

    /// Whether [`Ops::matmul`] takes weights of `kind`; the loader asks
    /// before it keeps a weight, so an unsupported kind fails the load.
    fn supports_weight(&self, kind: WeightKind) -> bool {
        matches!(kind, WeightKind::Dense(_))
    }

    /// Measured memory bandwidth of a large device-to-device copy in GB/s,
    /// reads plus writes (the roofline of weight-bound steps); `None` where
    /// the backend has no device memory.
    fn measure_copy_bandwidth_gbs(&self) -> Option<f64> {
        None
    }

    /// Device memory, for backends with memory of their own (`None` on the CPU).
    fn device_memory(&self) -> Option<DeviceMemory> {
        None
    }

    /// Restart peak-memory tracking from the current active bytes.
    fn reset_peak_memory(&self) {}

    /// Copy host f32 data into a backend tensor (weights, inputs).
    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor>;

    /// Copy bf16 host data (raw bits) into a backend tensor; backends that
    /// store bf16 take it as is, others convert.
    fn upload_bf16(&self, shape: &[usize], bits: &[u16]) -> Result<Tensor> {
        let data: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        self.upload(shape, &data)
    }

    /// Store a block-format matrix as this backend multiplies by it (in
    /// place where it can: the CPU keeps the mapped file's bytes), for a
    /// [`crate::BlockWeight`]. Default: not supported; the loader asks
    /// [`Memory::supports_weight`] first and dequantizes otherwise.
    fn upload_blocks(&self, m: QuantMatrix) -> Result<BlockPart> {
        Err(crate::weight::unsupported_weight(
            "this backend",
            WeightKind::Blocks(m.format()),
        ))
    }

    /// Copy a tensor back to the host as f32.
    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>>;

    /// Allocate a zeroed paged KV cache.
    fn alloc_kv_cache(&self, spec: KvPoolShape) -> Result<KvCache>;

    /// Allocate zeroed recurrent state ([`KvCache::with_state`]).
    fn alloc_state(&self, shape: crate::recurrent::StateShape) -> Result<Box<dyn Any + Send>> {
        let _ = shape;
        Err(TensorError::Unsupported {
            backend: "running",
            what: "recurrent (linear-attention) layers".into(),
        })
    }
}

/// The ops a forward pass is made of. A new backend implements the basic
/// ones; [`Ops::matmul`] and [`Ops::qkv_attention`] have unfused defaults
/// built from them, which backends replace with fused kernels.
pub trait Ops {
    /// Rows `ids` of `table` `[vocab, d]` → `[ids.len(), d]` (a block
    /// table's rows are dequantized as they are looked up).
    fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor>;

    /// The basic product of a dense weight: `x [n, k] · w[m, k]ᵀ (+ bias
    /// [m])` → `[n, m]`. Models call [`Ops::matmul`].
    fn matmul_dense(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor>;

    /// The basic product of a block weight, as [`Ops::matmul_dense`].
    /// Default: not supported (such a backend never gets block weights:
    /// its [`Memory::supports_weight`] says so).
    fn matmul_blocks(&self, x: &Tensor, w: &BlockWeight, bias: Option<&Tensor>) -> Result<Tensor> {
        let _ = (x, bias);
        Err(crate::weight::unsupported_weight(
            "this backend",
            WeightKind::Blocks(w.parts()[0].format()),
        ))
    }

    /// `epilogue(prologue(x) · wᵀ)`: every projection of a model, with the
    /// RMSNorm that feeds it and the bias, gated activation and residual
    /// add that follow it (see [`Epilogue`] for the order). Backends fuse
    /// behind it; the default is [`matmul_unfused`].
    fn matmul(
        &self,
        x: &Tensor,
        w: &Weight,
        prologue: Option<NormPrologue<'_>>,
        epilogue: Epilogue<'_>,
    ) -> Result<Tensor> {
        matmul_unfused(self, x, w, prologue, epilogue)
    }

    /// RMSNorm over the last dimension: `x / rms(x) * (weight_offset + w)`.
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, weight_offset: f32) -> Result<Tensor>;

    /// `residual + rms_norm(x)`: a post-norm block's sub-layer output
    /// joining the residual stream (Gemma). By default the two ops; a
    /// backend may fuse them (same rounding: the norm's output, then the sum).
    fn rms_norm_add(
        &self,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        weight_offset: f32,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let n = self.rms_norm(x, w, eps, weight_offset)?;
        self.add(residual, &n)
    }

    /// Elementwise `a + b` (same shape).
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;

    /// Elementwise `x * s`.
    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor>;

    /// `act(gate) * up` (same shape).
    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor>;

    /// `act(gate) * up` of `y [n, 2 * i]` whose rows are `gate | up`, as
    /// `[n, i]`: [`Ops::gated_activation`] of the two halves (the default
    /// splits them; a backend may read them in place).
    fn gated_packed(&self, y: &Tensor, act: Activation) -> Result<Tensor> {
        let (_, two_i) = y.dims2("gated_packed")?;
        if two_i % 2 != 0 {
            return Err(TensorError::Shape {
                op: "gated_packed",
                detail: format!("{two_i} packed gate/up columns"),
            });
        }
        let parts = self.split_cols(y, &[two_i / 2, two_i / 2])?;
        self.gated_activation(&parts[0], &parts[1], act)
    }

    /// Rotary embedding of `x [n, num_heads * head_dim]` at `positions[n]`.
    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor>;

    /// Rows `rows` of `x [n, d]` → `[rows.len(), d]`.
    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor>;

    /// Split `x [n, sum(widths)]` into column blocks `[n, widths[i]]`.
    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>>;

    /// Write `k`, `v` (`[n, num_kv_heads * head_dim]`) of the batch's `n` new
    /// tokens into their slots (group `p.kv_group`'s) of pool layer `layer`
    /// (the layer's place in its group's blocks), then return attention
    /// `[n, num_heads * head_dim]` of each new token over its own sequence's
    /// keys: up to and including its position when `p.causal`, all of them
    /// otherwise, within `p.sliding_window`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor>;

    /// Attention `[n, num_heads * head_dim]` of the batch's `n` query rows
    /// over the keys and values pool layer `layer` already holds, as
    /// [`Ops::attention`] attends, writing nothing: a layer that reads the
    /// cache an earlier layer of the step wrote (Gemma 4's KV sharing).
    fn attention_shared(
        &self,
        q: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor>;

    /// Whether [`Ops::attention_sinks`] runs here; models check it at load.
    fn supports_attention_sinks(&self) -> bool {
        false
    }

    /// [`Ops::attention`] with a learned logit a query head, `sinks
    /// [num_heads]`, in every softmax and its weight dropped (gpt-oss): a
    /// head's weights are `exp(s_j) / (Σ_i exp(s_i) + exp(sink))`.
    #[allow(clippy::too_many_arguments)]
    fn attention_sinks(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
        sinks: &Tensor,
    ) -> Result<Tensor> {
        let _ = (q, k, v, cache, layer, batch, p, sinks);
        Err(TensorError::Unsupported {
            backend: "running",
            what: "attention sinks".into(),
        })
    }

    /// Whether [`Ops::attention`] runs attention shaped `p` (by default
    /// causal only); models check every layer's at load, so an unsupported
    /// mask is refused before any request.
    fn supports_attention(&self, p: &AttentionParams) -> bool {
        p.causal
    }

    /// Attention from packed projections `qkv [n, (heads + 2 * kv_heads) *
    /// head_dim]` (q, then k, then v): optional per-head q/k RMSNorm, RoPE
    /// on q and k at the batch positions, then [`Ops::attention`].
    #[allow(clippy::too_many_arguments)]
    fn qkv_attention(
        &self,
        qkv: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
        rope: &RopeParams<'_>,
        qk_norm: Option<QkNorm<'_>>,
    ) -> Result<Tensor> {
        qkv_attention_unfused(self, qkv, cache, layer, batch, p, rope, qk_norm)
    }

    /// Whether [`Ops::lora_add`] runs here.
    fn supports_lora(&self) -> bool {
        false
    }

    /// `y` with each delta's low-rank product of `x`'s rows added to those
    /// rows' columns (see [`crate::lora`]); rows in no delta unchanged.
    fn lora_add(
        &self,
        y: &Tensor,
        x: &Tensor,
        deltas: &[crate::lora::LoraDelta<'_>],
    ) -> Result<Tensor> {
        let _ = (y, x, deltas);
        Err(TensorError::Unsupported {
            backend: "running",
            what: "LoRA adapters".into(),
        })
    }

    /// [`Ops::lora_add`], then the rest of the product's epilogue as the
    /// unfused product runs it: `after.gated` on packed `[gate | up]`
    /// columns ([`Ops::gated_packed`]), then `after.residual +` the result.
    /// `y` already holds the bias (`after.bias` must be none). Backends may
    /// fuse it all into the deltas' last pass, with the same bits.
    fn lora_apply(
        &self,
        y: &Tensor,
        x: &Tensor,
        deltas: &[crate::lora::LoraDelta<'_>],
        after: Epilogue<'_>,
    ) -> Result<Tensor> {
        lora_apply_unfused(self, y, x, deltas, after)
    }

    /// Whether [`Ops::moe`] runs here; models check it at load.
    fn supports_moe(&self) -> bool {
        false
    }

    /// A Mixture-of-Experts layer over `x [n, hidden]` (already
    /// normalized): each row routed by `layer.router` to its experts
    /// ([`crate::moe::route`]), their outputs summed with the routing
    /// weights, plus the shared expert where there is one; `[n, hidden]`.
    fn moe(&self, x: &Tensor, layer: &crate::moe::MoeLayer) -> Result<Tensor> {
        let _ = (x, layer);
        Err(TensorError::Unsupported {
            backend: "running",
            what: "Mixture-of-Experts layers".into(),
        })
    }

    /// Whether [`Ops::recurrent_mixer`] runs `mixer` here; models check
    /// it at load.
    fn supports_recurrent(&self, mixer: &crate::recurrent::RecurrentMixer) -> bool {
        let _ = mixer;
        false
    }

    /// A recurrent layer's token mixing over the batch's packed
    /// in-projections `x [n, mixer.in_dim()]`, each sequence from and into
    /// its state slot in `cache` ([`crate::recurrent`]) → `[n,
    /// mixer.out_dim()]`.
    fn recurrent_mixer(
        &self,
        x: &Tensor,
        mixer: &crate::recurrent::RecurrentMixer,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let _ = (x, batch, cache);
        Err(TensorError::Unsupported {
            backend: "running",
            what: format!("{} layers", mixer.name()),
        })
    }

    fn has_extension(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    /// Run extension op `op` on `x`. A backend that does not implement the
    /// op returns [`crate::TensorError::Unsupported`] (the default).
    fn extension(&self, op: &dyn ExtensionOp, x: &Tensor) -> Result<Tensor> {
        let _ = x;
        Err(TensorError::Unsupported {
            backend: "running",
            what: format!("the extension op {}", op.name()),
        })
    }
}

/// Choosing tokens from logits where the logits are, so only ids cross to
/// the host. Every method may answer `Ok(None)`: no such path here, the
/// caller samples on the host.
pub trait Sampling: Memory {
    /// The argmax of every row of `logits [rows, vocab]` with its
    /// log-probability (`logit - logsumexp(row)`); ties go to the lowest id.
    fn argmax_rows(&self, logits: &Tensor) -> Result<Option<Vec<(u32, f32)>>> {
        let _ = logits;
        Ok(None)
    }

    /// Like [`Sampling::argmax_rows`], each row restricted to the ids whose
    /// bit is set in its mask (`words` u32 words, bit `i % 32` of word
    /// `i / 32` for id `i`; `None`: every id), the log-probability taken
    /// over the allowed ids: greedy sampling under an output format. The
    /// default computes it on the host.
    fn argmax_rows_masked(
        &self,
        logits: &Tensor,
        masks: &[Option<&[u32]>],
    ) -> Result<Option<Vec<(u32, f32)>>> {
        let (rows, vocab) = logits.dims2("argmax_rows_masked")?;
        if masks.len() != rows {
            return Err(TensorError::Shape {
                op: "argmax_rows_masked",
                detail: format!("{} masks for {rows} rows", masks.len()),
            });
        }
        let host = self.to_host(logits)?;
        Ok(Some(
            host.chunks(vocab.max(1))
                .zip(masks)
                .map(|(row, mask)| masked_argmax(row, *mask))
                .collect(),
        ))
    }

    /// Samples every row of `logits [rows, vocab]`, one [`SampleRow`] per
    /// row. A row whose processed logits are all `-inf` comes back as
    /// `None`. The default has no such path.
    fn sample_rows(
        &self,
        logits: &Tensor,
        rows: &[SampleRow<'_>],
    ) -> Result<Option<Vec<Option<SampledRow>>>> {
        let _ = (logits, rows);
        Ok(None)
    }
}

/// A whole forward step as [`StepRecording::run_step`] is handed it: it
/// may run on another thread (the CPU's compute pool) while the caller
/// waits.
pub type StepFn<'a> = dyn FnMut(&ForwardBatch, &mut KvCache) -> Result<Tensor> + Send + 'a;

/// Running a whole forward step, which a backend may record and replay.
pub trait StepRecording {
    /// Run one forward step: `forward(batch)` returns the logits of
    /// `batch.logits_rows`. Backends may pad the batch and replay a
    /// recorded version of the step (CUDA graphs), or run it on their own
    /// threads (the CPU); the result is the same.
    fn run_step(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        forward: &mut StepFn<'_>,
    ) -> Result<Tensor> {
        forward(batch, cache)
    }
}

/// [`Ops::lora_apply`] as separate ops: the deltas, the gated activation,
/// the residual sum. The default, and the fallback of fused backends.
pub fn lora_apply_unfused<B: Ops + ?Sized>(
    b: &B,
    y: &Tensor,
    x: &Tensor,
    deltas: &[crate::lora::LoraDelta<'_>],
    after: Epilogue<'_>,
) -> Result<Tensor> {
    if after.bias.is_some() {
        return Err(TensorError::Shape {
            op: "lora_apply",
            detail: "a bias after the deltas (the product adds it first)".into(),
        });
    }
    let mut y = b.lora_add(y, x, deltas)?;
    if let Some(act) = after.gated {
        y = b.gated_packed(&y, act)?;
    }
    match after.residual {
        Some(r) => b.add(r, &y),
        None => Ok(y),
    }
}

/// [`Ops::qkv_attention`] as separate ops: split, q/k norms, RoPE,
/// [`Ops::attention`]. The default, and the fallback of fused backends.
#[allow(clippy::too_many_arguments)]
pub fn qkv_attention_unfused<B: Ops + ?Sized>(
    b: &B,
    qkv: &Tensor,
    cache: &mut KvCache,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
    rope: &RopeParams<'_>,
    qk_norm: Option<QkNorm<'_>>,
) -> Result<Tensor> {
    let (q, k, v) = qkv_rope(b, qkv, batch, p, rope, qk_norm)?;
    b.attention(&q, &k, &v, cache, layer, batch, p)
}

/// The first part of [`qkv_attention_unfused`]: `qkv` split into q, k and
/// v, the q/k (and value) norms applied, q and k rotated at the batch's
/// positions.
pub fn qkv_rope<B: Ops + ?Sized>(
    b: &B,
    qkv: &Tensor,
    batch: &ForwardBatch,
    p: &AttentionParams,
    rope: &RopeParams<'_>,
    qk_norm: Option<QkNorm<'_>>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (n, _) = qkv.dims2("qkv_attention")?;
    let (qw, kw) = (p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim);
    let parts = b.split_cols(qkv, &[qw, kw, kw])?;
    let (mut q, mut k, mut v) = (parts[0].clone(), parts[1].clone(), parts[2].clone());
    if let Some(nm) = qk_norm {
        if let Some(vw) = nm.v_weight {
            v = b
                .rms_norm(
                    &v.reshape(&[n * p.num_kv_heads, p.head_dim])?,
                    vw,
                    nm.eps,
                    nm.weight_offset,
                )?
                .reshape(&[n, kw])?;
        }
        q = b
            .rms_norm(
                &q.reshape(&[n * p.num_heads, p.head_dim])?,
                nm.q_weight,
                nm.eps,
                nm.weight_offset,
            )?
            .reshape(&[n, qw])?;
        k = b
            .rms_norm(
                &k.reshape(&[n * p.num_kv_heads, p.head_dim])?,
                nm.k_weight,
                nm.eps,
                nm.weight_offset,
            )?
            .reshape(&[n, kw])?;
    }
    let q = b.rope(&q, &batch.positions, rope)?;
    let krope = RopeParams {
        num_heads: p.num_kv_heads,
        ..rope.clone()
    };
    let k = b.rope(&k, &batch.positions, &krope)?;
    Ok((q, k, v))
}

/// Check the arguments of [`Ops::attention`] against each other, the
/// cache and the batch; every backend calls this before touching memory.
/// A slot past the pool is [`crate::TensorError::KvCacheFull`]; anything
/// else inconsistent is a shape error.
pub fn check_attention_args(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &KvPoolShape,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
) -> crate::Result<()> {
    let (n, qw) = q.dims2("attention")?;
    check_attention_shapes(n, qw, k.shape(), v.shape(), spec, layer, batch, p)
}

/// [`check_attention_args`] on shapes: `n` rows of q `qw` wide, k and v
/// shaped `k` and `v` (a fused backend checks its packed qkv this way).
#[allow(clippy::too_many_arguments)]
pub fn check_attention_shapes(
    n: usize,
    qw: usize,
    k: &[usize],
    v: &[usize],
    spec: &KvPoolShape,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
) -> crate::Result<()> {
    use crate::TensorError;
    let kv_row = p.num_kv_heads * p.head_dim;
    let bad = |detail: String| TensorError::Shape {
        op: "attention",
        detail,
    };
    let group = p.kv_group;
    if qw != p.num_heads * p.head_dim
        || k != [n, kv_row]
        || v != [n, kv_row]
        || p.num_kv_heads == 0
        || !p.num_heads.is_multiple_of(p.num_kv_heads)
        || layer >= spec.num_layers
        || group >= spec.num_groups
        || kv_row > spec.kv_row
        || batch.num_tokens() != n
        || batch.slot_mapping.len() != spec.num_groups
        || batch.slot_mapping.iter().any(|s| s.len() != n)
        || batch.positions.len() != n
        || batch.block_size != spec.block_size
    {
        return Err(bad(format!(
            "q [{n}, {qw}], k {k:?}, v {v:?}, layer {layer}, {n} batch rows, {} slot groups, params {p:?}, cache {spec:?}",
            batch.slot_mapping.len()
        )));
    }
    let num_slots = spec.num_slots();
    if let Some(&s) = batch.slot_mapping[group]
        .iter()
        .find(|&&s| s as usize >= num_slots)
    {
        return Err(TensorError::KvCacheFull {
            needed: s as usize + 1,
            capacity: num_slots,
        });
    }
    for seq in &batch.seqs {
        let end = seq.num_computed + seq.num_tokens;
        let table = seq.block_tables.get(group);
        if seq.token_start + seq.num_tokens > n
            || seq.block_tables.len() != spec.num_groups
            || table.is_none_or(|t| {
                t.len() * spec.block_size < end || t.iter().any(|&b| b as usize >= spec.num_blocks)
            })
        {
            return Err(bad(format!(
                "sequence of {} tokens after {} cached with {} block tables ({} blocks of {} in group {group}; pool {})",
                seq.num_tokens,
                seq.num_computed,
                seq.block_tables.len(),
                table.map_or(0, Vec::len),
                spec.block_size,
                spec.num_blocks
            )));
        }
    }
    Ok(())
}

/// Check the arguments of [`Ops::attention_shared`] (as
/// [`check_attention_args`], with no new keys and values).
pub fn check_shared_attention_args(
    q: &Tensor,
    spec: &KvPoolShape,
    layer: usize,
    batch: &ForwardBatch,
    p: &AttentionParams,
) -> crate::Result<()> {
    let (n, qw) = q.dims2("attention_shared")?;
    let kv = [n, p.num_kv_heads * p.head_dim];
    check_attention_shapes(n, qw, &kv, &kv, spec, layer, batch, p)
}

/// Check the arguments of [`Ops::rope`]; every backend calls this.
pub fn check_rope_args(x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> crate::Result<()> {
    let (n, width) = x.dims2("rope")?;
    if width != p.num_heads * p.head_dim
        || n != positions.len()
        || 2 * p.inv_freq.len() > p.head_dim
    {
        return Err(crate::TensorError::Shape {
            op: "rope",
            detail: format!(
                "x {:?}, {} positions, {} heads × {} dims, {} frequencies",
                x.shape(),
                positions.len(),
                p.num_heads,
                p.head_dim,
                p.inv_freq.len()
            ),
        });
    }
    Ok(())
}

/// The argmax of `row` over the ids `mask` allows (lowest id on ties, NaNs
/// ignored) and its log-probability over the allowed ids; a row with
/// nothing allowed gives id 0 and the uniform log-probability.
pub fn masked_argmax(row: &[f32], mask: Option<&[u32]>) -> (u32, f32) {
    let allowed =
        |i: usize| mask.is_none_or(|m| m.get(i / 32).is_some_and(|w| (w >> (i % 32)) & 1 == 1));
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if allowed(i) && v > f32::NEG_INFINITY && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    let Some((id, max)) = best else {
        return (0, -(row.len().max(1) as f32).ln());
    };
    let sum: f64 = row
        .iter()
        .enumerate()
        .filter(|&(i, &v)| allowed(i) && v > f32::NEG_INFINITY)
        .map(|(_, &v)| f64::from((v - max).exp()))
        .sum();
    (id as u32, -(sum.ln() as f32))
}
