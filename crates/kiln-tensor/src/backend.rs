//! The [`Backend`] trait: every op a model needs, on opaque tensors.

use std::any::Any;

use crate::error::Result;
use crate::tensor::Tensor;

/// Gated activation applied as `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)` (Llama, Qwen, Mistral).
    Silu,
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
}

/// Rotary embedding applied by [`Backend::rope`]: Hugging Face's rotate-half
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
}

/// Shape of a KV cache to allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub num_layers: usize,
    pub capacity: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// A contiguous per-sequence KV cache whose storage belongs to a backend.
pub struct KvCache {
    pub spec: KvCacheSpec,
    storage: Box<dyn Any + Send>,
}

impl KvCache {
    pub fn from_storage(spec: KvCacheSpec, storage: Box<dyn Any + Send>) -> Self {
        KvCache { spec, storage }
    }

    pub fn storage_mut(&mut self) -> &mut (dyn Any + Send) {
        self.storage.as_mut()
    }

    pub fn storage(&self) -> &(dyn Any + Send) {
        self.storage.as_ref()
    }
}

/// Every op models are written against. Tensors are row-major; "rows" are
/// tokens. Implementations must match the CPU backend within the tolerance
/// their cross-backend tests state.
pub trait Backend: Send + Sync {
    /// A short name for logs and errors (`cpu`, `cuda:0`).
    fn name(&self) -> &'static str;

    /// Copy host f32 data into a backend tensor (weights, inputs).
    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor>;

    /// Copy a tensor back to the host as f32.
    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>>;

    /// Rows `ids` of `table` `[vocab, d]` → `[ids.len(), d]`.
    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor>;

    /// `x [n, k] · w[m, k]ᵀ (+ bias [m])` → `[n, m]`.
    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor>;

    /// RMSNorm over the last dimension: `x / rms(x) * (weight_offset + w)`.
    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, weight_offset: f32) -> Result<Tensor>;

    /// Elementwise `a + b` (same shape).
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;

    /// Elementwise `x * s`.
    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor>;

    /// `act(gate) * up` (same shape).
    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor>;

    /// Rotary embedding of `x [n, num_heads * head_dim]` at `positions[n]`.
    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor>;

    /// Allocate a zeroed KV cache.
    fn alloc_kv_cache(&self, spec: KvCacheSpec) -> Result<KvCache>;

    /// Write `k`, `v` (`[n, num_kv_heads * head_dim]`) of `n` new tokens at
    /// positions `start_pos..start_pos + n` of `layer`, then return causal
    /// attention `[n, num_heads * head_dim]` of `q` over positions
    /// `0..=start_pos + i` for each new token `i`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        start_pos: usize,
        p: &AttentionParams,
    ) -> Result<Tensor>;
}
