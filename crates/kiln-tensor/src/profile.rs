//! A backend wrapper that times every op it forwards, for "where does the
//! time go" reports. Times are wall-clock per call on the host; a device
//! backend must synchronize inside its ops for them to mean anything.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::{
    Activation, AttentionParams, Backend, DeviceMemory, ForwardBatch, KvCache, KvPoolShape, Memory,
    Ops, QkNorm, RopeParams, Sampling, StepFn, StepRecording,
};
use crate::error::Result;
use crate::extension::ExtensionOp;
use crate::matmul::{Epilogue, NormPrologue};
use crate::tensor::Tensor;
use crate::weight::{BlockPart, BlockWeight, Weight, WeightKind};
use kiln_quant::QuantMatrix;

/// Calls and total seconds of one op.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTime {
    pub calls: u64,
    pub seconds: f64,
}

/// Wraps a backend and accumulates per-op times.
pub struct ProfilingBackend {
    inner: Arc<dyn Backend>,
    times: Mutex<BTreeMap<&'static str, OpTime>>,
}

impl ProfilingBackend {
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        ProfilingBackend {
            inner,
            times: Mutex::new(BTreeMap::new()),
        }
    }

    /// Per-op totals so far.
    pub fn snapshot(&self) -> BTreeMap<&'static str, OpTime> {
        self.times.lock().map(|t| t.clone()).unwrap_or_default()
    }

    pub fn reset(&self) {
        if let Ok(mut t) = self.times.lock() {
            t.clear();
        }
    }

    fn timed<T>(&self, op: &'static str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let dt = start.elapsed().as_secs_f64();
        if let Ok(mut t) = self.times.lock() {
            let e = t.entry(op).or_default();
            e.calls += 1;
            e.seconds += dt;
        }
        out
    }
}

/// The report's name for one form of [`Ops::matmul`].
fn matmul_label(prologue: bool, e: &Epilogue<'_>) -> &'static str {
    match (prologue, e.gated.is_some(), e.residual.is_some()) {
        (false, false, false) => "matmul",
        (false, false, true) => "matmul+add",
        (false, true, false) => "matmul+gate",
        (false, true, true) => "matmul+gate+add",
        (true, false, false) => "norm+matmul",
        (true, false, true) => "norm+matmul+add",
        (true, true, false) => "norm+matmul+gate",
        (true, true, true) => "norm+matmul+gate+add",
    }
}

impl Backend for ProfilingBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn warnings(&self) -> Vec<String> {
        self.inner.warnings()
    }
}

impl Memory for ProfilingBackend {
    fn kv_bytes_per_element(&self) -> usize {
        self.inner.kv_bytes_per_element()
    }

    fn weight_bytes_per_element(&self) -> usize {
        self.inner.weight_bytes_per_element()
    }

    fn supports_weight(&self, kind: WeightKind) -> bool {
        self.inner.supports_weight(kind)
    }

    fn measure_copy_bandwidth_gbs(&self) -> Option<f64> {
        self.inner.measure_copy_bandwidth_gbs()
    }

    fn device_memory(&self) -> Option<DeviceMemory> {
        self.inner.device_memory()
    }

    fn reset_peak_memory(&self) {
        self.inner.reset_peak_memory()
    }

    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        self.timed("upload", || self.inner.upload(shape, data))
    }

    fn upload_bf16(&self, shape: &[usize], bits: &[u16]) -> Result<Tensor> {
        self.timed("upload", || self.inner.upload_bf16(shape, bits))
    }

    fn upload_blocks(&self, m: QuantMatrix) -> Result<BlockPart> {
        self.timed("upload", || self.inner.upload_blocks(m))
    }

    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>> {
        self.timed("to_host", || self.inner.to_host(t))
    }

    fn alloc_kv_cache(&self, spec: KvPoolShape) -> Result<KvCache> {
        self.timed("alloc_kv_cache", || self.inner.alloc_kv_cache(spec))
    }

    fn alloc_state(
        &self,
        shape: crate::recurrent::StateShape,
    ) -> Result<Box<dyn std::any::Any + Send>> {
        self.inner.alloc_state(shape)
    }
}

impl Ops for ProfilingBackend {
    fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        self.timed("embedding", || self.inner.embedding(table, ids))
    }

    fn matmul_dense(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.timed("matmul_dense", || self.inner.matmul_dense(x, w, bias))
    }

    fn matmul_blocks(&self, x: &Tensor, w: &BlockWeight, bias: Option<&Tensor>) -> Result<Tensor> {
        self.timed("matmul_blocks", || self.inner.matmul_blocks(x, w, bias))
    }

    fn matmul(
        &self,
        x: &Tensor,
        w: &Weight,
        prologue: Option<NormPrologue<'_>>,
        epilogue: Epilogue<'_>,
    ) -> Result<Tensor> {
        self.timed(matmul_label(prologue.is_some(), &epilogue), || {
            self.inner.matmul(x, w, prologue, epilogue)
        })
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, weight_offset: f32) -> Result<Tensor> {
        self.timed("rms_norm", || self.inner.rms_norm(x, w, eps, weight_offset))
    }

    fn rms_norm_add(
        &self,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        weight_offset: f32,
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.timed("rms_norm_add", || {
            self.inner.rms_norm_add(x, w, eps, weight_offset, residual)
        })
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.timed("add", || self.inner.add(a, b))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        self.timed("scale", || self.inner.scale(x, s))
    }

    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        self.timed("gated_activation", || {
            self.inner.gated_activation(gate, up, act)
        })
    }

    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor> {
        self.timed("rope", || self.inner.rope(x, positions, p))
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        self.timed("gather_rows", || self.inner.gather_rows(x, rows))
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        self.timed("split_cols", || self.inner.split_cols(x, widths))
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        self.timed("attention", || {
            self.inner.attention(q, k, v, cache, layer, batch, p)
        })
    }

    fn attention_shared(
        &self,
        q: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        self.timed("attention", || {
            self.inner.attention_shared(q, cache, layer, batch, p)
        })
    }

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
        self.timed("qkv_attention", || {
            self.inner
                .qkv_attention(qkv, cache, layer, batch, p, rope, qk_norm)
        })
    }

    fn supports_attention(&self, p: &AttentionParams) -> bool {
        self.inner.supports_attention(p)
    }

    fn supports_attention_sinks(&self) -> bool {
        self.inner.supports_attention_sinks()
    }

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
        self.timed("attention", || {
            self.inner
                .attention_sinks(q, k, v, cache, layer, batch, p, sinks)
        })
    }

    fn supports_lora(&self) -> bool {
        self.inner.supports_lora()
    }

    fn lora_add(
        &self,
        y: &Tensor,
        x: &Tensor,
        deltas: &[crate::lora::LoraDelta<'_>],
    ) -> Result<Tensor> {
        self.timed("lora_add", || self.inner.lora_add(y, x, deltas))
    }

    fn lora_apply(
        &self,
        y: &Tensor,
        x: &Tensor,
        deltas: &[crate::lora::LoraDelta<'_>],
        after: crate::Epilogue<'_>,
    ) -> Result<Tensor> {
        self.timed("lora_apply", || self.inner.lora_apply(y, x, deltas, after))
    }

    fn supports_moe(&self) -> bool {
        self.inner.supports_moe()
    }

    fn moe(&self, x: &Tensor, layer: &crate::moe::MoeLayer) -> Result<Tensor> {
        self.timed("moe", || self.inner.moe(x, layer))
    }

    fn supports_recurrent(&self, mixer: &crate::recurrent::RecurrentMixer) -> bool {
        self.inner.supports_recurrent(mixer)
    }

    fn recurrent_mixer(
        &self,
        x: &Tensor,
        mixer: &crate::recurrent::RecurrentMixer,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.timed("recurrent_mixer", || {
            self.inner.recurrent_mixer(x, mixer, batch, cache)
        })
    }

    fn has_extension(&self, name: &str) -> bool {
        self.inner.has_extension(name)
    }

    fn extension(&self, op: &dyn ExtensionOp, x: &Tensor) -> Result<Tensor> {
        self.timed(op.name(), || self.inner.extension(op, x))
    }
}

impl Sampling for ProfilingBackend {
    fn argmax_rows(&self, logits: &Tensor) -> Result<Option<Vec<(u32, f32)>>> {
        self.timed("argmax_rows", || self.inner.argmax_rows(logits))
    }

    fn argmax_rows_masked(
        &self,
        logits: &Tensor,
        masks: &[Option<&[u32]>],
    ) -> Result<Option<Vec<(u32, f32)>>> {
        self.timed("argmax_rows_masked", || {
            self.inner.argmax_rows_masked(logits, masks)
        })
    }

    fn sample_rows(
        &self,
        logits: &Tensor,
        rows: &[crate::SampleRow<'_>],
    ) -> Result<Option<Vec<Option<crate::SampledRow>>>> {
        self.timed("sample_rows", || self.inner.sample_rows(logits, rows))
    }
}

impl StepRecording for ProfilingBackend {
    fn run_step(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        forward: &mut StepFn<'_>,
    ) -> Result<Tensor> {
        self.inner.run_step(batch, cache, forward)
    }
}

impl crate::collective::Collectives for ProfilingBackend {
    fn tp_rank(&self) -> (usize, usize) {
        self.inner.tp_rank()
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.timed("all_reduce_sum", || self.inner.all_reduce_sum(x))
    }

    fn all_gather_columns(&self, x: &Tensor, keep: &[usize]) -> Result<Tensor> {
        self.timed("all_gather_columns", || {
            self.inner.all_gather_columns(x, keep)
        })
    }

    fn abort_collectives(&self) {
        self.inner.abort_collectives()
    }

    fn reset_collectives(&self) {
        self.inner.reset_collectives()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;

    /// Every capability the inner backend has, the wrapper has (a model
    /// checks them at load).
    #[test]
    fn reports_the_inner_backends_capabilities() {
        let p = ProfilingBackend::new(Arc::new(CpuBackend::new()));
        let cpu = CpuBackend::new();
        assert_eq!(p.supports_lora(), cpu.supports_lora());
        assert_eq!(p.supports_moe(), cpu.supports_moe());
        assert_eq!(p.supports_attention_sinks(), cpu.supports_attention_sinks());
        assert!(p.supports_lora() && p.supports_moe() && p.supports_attention_sinks());
    }

    #[test]
    fn counts_calls_and_forwards_results() {
        let p = ProfilingBackend::new(Arc::new(CpuBackend::new()));
        let a = p.upload(&[2], &[1.0, 2.0]).unwrap();
        let s = p.add(&a, &a).unwrap();
        assert_eq!(p.to_host(&s).unwrap(), vec![2.0, 4.0]);
        let snap = p.snapshot();
        assert_eq!(snap["add"].calls, 1);
        assert_eq!(snap["upload"].calls, 1);
        p.reset();
        assert!(p.snapshot().is_empty());
    }

    /// Every form of `matmul` (through the wrapper) against the basic ops
    /// it is defined by, composed by hand on the CPU: equal bit for bit.
    #[test]
    fn every_matmul_form_is_its_basic_ops_bit_for_bit() {
        let cpu = CpuBackend::new();
        let p = ProfilingBackend::new(Arc::new(CpuBackend::new()));
        let (n, k, m) = (3, 8, 6);
        let vals = |len: usize, s: f32| -> Vec<f32> {
            (0..len).map(|i| ((i * 7 % 11) as f32 - 5.0) * s).collect()
        };
        let up = |b: &dyn Backend, shape: &[usize], v: &[f32]| b.upload(shape, v).unwrap();
        let (x, nw, w, bias) = (
            vals(n * k, 0.3),
            vals(k, 0.1),
            vals(m * k, 0.05),
            vals(m, 0.2),
        );
        let (res_full, res_half) = (vals(n * m, 0.7), vals(n * m / 2, 0.9));
        let (cx, cw, cb) = (
            up(&cpu, &[n, k], &x),
            up(&cpu, &[m, k], &w),
            up(&cpu, &[m], &bias),
        );
        let (px, pw, pb, pn) = (
            up(&p, &[n, k], &x),
            Weight::Dense(up(&p, &[m, k], &w)),
            up(&p, &[m], &bias),
            up(&p, &[k], &nw),
        );
        let mut forms = 0;
        for offset in [None, Some(0.0f32), Some(1.0)] {
            let input = match offset {
                Some(o) => cpu.rms_norm(&cx, &up(&cpu, &[k], &nw), 1e-6, o).unwrap(),
                None => cx.clone(),
            };
            let prologue = offset.map(|o| NormPrologue {
                weight: &pn,
                eps: 1e-6,
                offset: o,
            });
            for with_bias in [false, true] {
                for gate in [None, Some(Activation::Silu), Some(Activation::GeluTanh)] {
                    for with_residual in [false, true] {
                        let mut want = cpu
                            .matmul_dense(&input, &cw, with_bias.then_some(&cb))
                            .unwrap();
                        if let Some(act) = gate {
                            let parts = cpu.split_cols(&want, &[m / 2, m / 2]).unwrap();
                            want = cpu.gated_activation(&parts[0], &parts[1], act).unwrap();
                        }
                        let width = if gate.is_some() { m / 2 } else { m };
                        let res = if gate.is_some() { &res_half } else { &res_full };
                        let pr = up(&p, &[n, width], res);
                        if with_residual {
                            want = cpu.add(&up(&cpu, &[n, width], res), &want).unwrap();
                        }
                        let epilogue = Epilogue {
                            bias: with_bias.then_some(&pb),
                            gated: gate,
                            residual: with_residual.then_some(&pr),
                        };
                        let got = p.matmul(&px, &pw, prologue, epilogue).unwrap();
                        assert_eq!(got.shape(), &[n, width]);
                        assert_eq!(p.to_host(&got).unwrap(), cpu.to_host(&want).unwrap());
                        forms += 1;
                    }
                }
            }
        }
        assert_eq!(forms, 36);
        let snap = p.snapshot();
        assert_eq!(snap["norm+matmul"].calls, 4);
        assert_eq!(snap["matmul+gate+add"].calls, 4);
    }
}
