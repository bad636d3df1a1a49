//! A backend wrapper that times every op it forwards, for "where does the
//! time go" reports. Times are wall-clock per call on the host; a device
//! backend must synchronize inside its ops for them to mean anything.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::{
    Activation, AttentionParams, Backend, DeviceMemory, ForwardBatch, KvCache, KvPoolShape, QkNorm,
    RopeParams,
};
use crate::error::Result;
use crate::tensor::Tensor;

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

impl Backend for ProfilingBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn kv_bytes_per_element(&self) -> usize {
        self.inner.kv_bytes_per_element()
    }

    fn weight_bytes_per_element(&self) -> usize {
        self.inner.weight_bytes_per_element()
    }

    fn warnings(&self) -> Vec<String> {
        self.inner.warnings()
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

    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>> {
        self.timed("to_host", || self.inner.to_host(t))
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        self.timed("embedding", || self.inner.embedding(table, ids))
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.timed("linear", || self.inner.linear(x, w, bias))
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, weight_offset: f32) -> Result<Tensor> {
        self.timed("rms_norm", || self.inner.rms_norm(x, w, eps, weight_offset))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.timed("add", || self.inner.add(a, b))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        self.timed("scale", || self.inner.scale(x, s))
    }

    fn softcap(&self, x: &Tensor, cap: f32) -> Result<Tensor> {
        self.timed("softcap", || self.inner.softcap(x, cap))
    }

    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        self.timed("gated_activation", || {
            self.inner.gated_activation(gate, up, act)
        })
    }

    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor> {
        self.timed("rope", || self.inner.rope(x, positions, p))
    }

    fn alloc_kv_cache(&self, spec: KvPoolShape) -> Result<KvCache> {
        self.timed("alloc_kv_cache", || self.inner.alloc_kv_cache(spec))
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

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        self.timed("gather_rows", || self.inner.gather_rows(x, rows))
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        self.timed("split_cols", || self.inner.split_cols(x, widths))
    }

    fn linear_add(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        self.timed("linear_add", || self.inner.linear_add(x, w, bias, residual))
    }

    fn gated_linear(&self, x: &Tensor, w_gate_up: &Tensor, act: Activation) -> Result<Tensor> {
        self.timed("gated_linear", || {
            self.inner.gated_linear(x, w_gate_up, act)
        })
    }

    fn rms_norm_linear(
        &self,
        x: &Tensor,
        norm_w: &Tensor,
        eps: f32,
        weight_offset: f32,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.timed("rms_norm_linear", || {
            self.inner
                .rms_norm_linear(x, norm_w, eps, weight_offset, w, bias)
        })
    }

    fn rms_norm_gated_linear(
        &self,
        x: &Tensor,
        norm_w: &Tensor,
        eps: f32,
        weight_offset: f32,
        w_gate_up: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        self.timed("rms_norm_gated_linear", || {
            self.inner
                .rms_norm_gated_linear(x, norm_w, eps, weight_offset, w_gate_up, act)
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

    fn run_step(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        forward: &mut dyn FnMut(&ForwardBatch, &mut KvCache) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.inner.run_step(batch, cache, forward)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;

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

    #[test]
    fn norm_fused_ops_are_the_unfused_ops_bit_for_bit() {
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
        for offset in [0.0f32, 1.0] {
            for with_bias in [false, true] {
                let h = cpu
                    .rms_norm(&up(&cpu, &[n, k], &x), &up(&cpu, &[k], &nw), 1e-6, offset)
                    .unwrap();
                let cb = up(&cpu, &[m], &bias);
                let want = cpu
                    .linear(&h, &up(&cpu, &[m, k], &w), with_bias.then_some(&cb))
                    .unwrap();
                let pb = up(&p, &[m], &bias);
                let got = p
                    .rms_norm_linear(
                        &up(&p, &[n, k], &x),
                        &up(&p, &[k], &nw),
                        1e-6,
                        offset,
                        &up(&p, &[m, k], &w),
                        with_bias.then_some(&pb),
                    )
                    .unwrap();
                assert_eq!(p.to_host(&got).unwrap(), cpu.to_host(&want).unwrap());
            }
            let h = cpu
                .rms_norm(&up(&cpu, &[n, k], &x), &up(&cpu, &[k], &nw), 1e-6, offset)
                .unwrap();
            let want = cpu
                .gated_linear(&h, &up(&cpu, &[m, k], &w), Activation::GeluTanh)
                .unwrap();
            let got = p
                .rms_norm_gated_linear(
                    &up(&p, &[n, k], &x),
                    &up(&p, &[k], &nw),
                    1e-6,
                    offset,
                    &up(&p, &[m, k], &w),
                    Activation::GeluTanh,
                )
                .unwrap();
            assert_eq!(got.shape(), &[n, m / 2]);
            assert_eq!(p.to_host(&got).unwrap(), cpu.to_host(&want).unwrap());
        }
        let snap = p.snapshot();
        assert_eq!(snap["rms_norm_linear"].calls, 4);
        assert_eq!(snap["rms_norm_gated_linear"].calls, 2);
    }
}
