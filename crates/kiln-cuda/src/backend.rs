//! `CudaBackend`: the `kiln_tensor::Backend` traits on one NVIDIA GPU. Activations and
//! weights are bf16 on the device, math in f32. This file opens the device,
//! loads the kernels and maps each trait method onto its op in
//! `crate::ops` (matmul, attention, rope_kv_write, norm, activation,
//! gather, elementwise, argmax, sample); steps run through
//! `crate::step` (metadata uploaded once, decode steps recorded as CUDA
//! graphs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use half::bf16;
use kiln_tensor::{
    Activation, AttentionParams, Backend, DType, Epilogue, ForwardBatch, KvCache, KvPoolShape,
    Memory, NormPrologue, Ops, QkNorm, Result, RopeParams, Sampling, StepFn, StepRecording, Tensor,
    TensorError, Weight,
};

use crate::driver::device::{buf, dev_err, to_bf16, wrap, Device, NAME};
use crate::driver::pool::{DevBuf, MemorySnapshot};
use crate::driver::staging::Uploader;
use crate::step::graphs::Recordings;
use crate::step::ActiveStep;
use crate::{kernels, CudaError, CudaOptions, KernelCompiler};

/// The backend. One stream; every op is queued on it in order.
pub struct CudaBackend {
    /// Weight uploads through pinned buffers (made on first use), declared
    /// before `dev` so that they are released while the context lives.
    pub(crate) uploader: Uploader,
    pub(crate) dev: Device,
    pub device_name: String,
    /// The metadata of the step `run_step` is running, if any.
    pub(crate) step: Mutex<Option<Arc<ActiveStep>>>,
    pub(crate) capturing: AtomicBool,
    pub(crate) recordings: Mutex<Recordings>,
    pub(crate) graphs_enabled: AtomicBool,
    pub(crate) warnings: Mutex<Vec<String>>,
    /// The settings the backend was opened with.
    pub(crate) options: CudaOptions,
    /// Device tables of RoPE inverse frequencies, by their host values.
    pub(crate) rope_tables: Mutex<Vec<(Vec<f32>, Arc<DevBuf>)>>,
    /// Zeroed partition counters of split decode attention (`None`: the
    /// separate reduce kernel combines the partitions).
    pub(crate) decode_counters: Option<DevBuf>,
    /// Split decode steps use the kernels that load values with keys
    /// (`decode_attention_vpre_hd*`; [`CudaOptions::decode_vpre_split`]).
    pub(crate) decode_vpre: AtomicBool,
    /// Its tensor-parallel group, if in one.
    pub(crate) group: Option<crate::collective::CudaGroup>,
    /// Mixture-of-Experts layers' device tables (`ops::moe`).
    pub(crate) moe: Mutex<crate::ops::moe::MoeTables>,
}

impl CudaBackend {
    /// Whether FP8 products past the decode rows run on the FP8 tensor
    /// cores (cuBLASLt's 1x128 block-scaled GEMM: Hopper;
    /// [`CudaOptions::fp8_activations`]), rather than as dequantized slabs.
    pub fn fp8_tensor_cores(&self) -> bool {
        self.options.fp8_activations
            && self.dev.lt.is_some()
            && self.dev.arch == "compute_90"
            && self.dev.has("quant_e4m3_rows")
    }

    /// Open GPU `ordinal` and load Kiln's kernels, compiled for its
    /// architecture by `compiler` (cached on disk), with `options`' settings
    /// (the compiler takes its tuning defines from them).
    pub fn new(
        ordinal: usize,
        mut compiler: KernelCompiler,
        options: CudaOptions,
    ) -> std::result::Result<Self, CudaError> {
        let mut dev = Device::open(ordinal, options.pdl)?;
        compiler.arch = dev.arch;
        compiler.machine = dev.machine;
        compiler.defines = options.kernel_defines.clone();
        let mut compiled = Vec::new();
        let mut warnings = Vec::new();
        // The units compile in parallel (NVRTC is thread-safe; a cold start
        // compiles every one).
        let started = std::time::Instant::now();
        let results = kernels::compile_units(&compiler);
        let fresh = results
            .iter()
            .filter(|(_, r)| r.as_ref().is_ok_and(|k| !k.cached))
            .count();
        tracing::info!(
            "kernels: {fresh} of {} units compiled by NVRTC in {:.1} s (the rest cached)",
            results.len(),
            started.elapsed().as_secs_f64()
        );
        for (name, result) in results {
            match result {
                Ok(k) => compiled.push(k),
                // The reference kernels are required; the fast ones have
                // fallbacks (and CI compiles every kernel before it lands).
                Err(e) if !kernels::REQUIRED.contains(&name.as_str()) => {
                    warnings.push(format!("{name} kernels unavailable, using fallbacks: {e}"))
                }
                Err(e) => return Err(e),
            }
        }
        let started = std::time::Instant::now();
        dev.load(&compiled)?;
        tracing::info!(
            "kernels: {} modules loaded in {:.1} s",
            compiled.len(),
            started.elapsed().as_secs_f64()
        );
        crate::ops::configure(&mut dev, &mut warnings)?;
        let device_name = dev.name.clone();
        let warnings = Mutex::new(warnings);
        let decode_counters = options
            .decode_combine_in_kernel
            .then(|| {
                dev.alloc_zeroed(
                    crate::ops::attention::DECODE_COUNTERS * 4,
                    "attention counters",
                )
                .ok()
            })
            .flatten();
        Ok(CudaBackend {
            dev,
            device_name,
            step: Mutex::new(None),
            capturing: AtomicBool::new(false),
            recordings: Mutex::new(Recordings::default()),
            graphs_enabled: AtomicBool::new(options.graphs),
            warnings,
            rope_tables: Mutex::new(Vec::new()),
            decode_counters,
            decode_vpre: AtomicBool::new(options.decode_vpre_split),
            uploader: Uploader::new(options.pinned_staging),
            options,
            group: None,
            moe: Mutex::new(Default::default()),
        })
    }

    /// This backend as a rank of `group`. A host-memory group's steps run
    /// eagerly (its exchanges wait on the host, which a recorded step
    /// cannot).
    pub fn in_group(mut self, group: crate::collective::CudaGroup) -> Self {
        if matches!(group, crate::collective::CudaGroup::Host(_)) {
            self.set_graphs_enabled(false);
        }
        self.group = Some(group);
        self
    }

    /// Split decode steps (few rows, keys spread over many blocks) load each
    /// chunk's first values together with its keys (steps recorded as
    /// graphs before the change keep what they recorded).
    pub fn set_decode_vpre(&self, on: bool) {
        self.decode_vpre
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Wait for all queued work (for timing and profiling).
    pub fn synchronize(&self) -> Result<()> {
        self.dev.synchronize()
    }

    /// Bytes held by this backend (as the reference's `getMemorySnapshot`).
    pub fn memory_snapshot(&self) -> MemorySnapshot {
        self.dev.pool.snapshot()
    }

    /// Restart peak tracking from the current active bytes.
    pub fn reset_peak_memory(&self) {
        self.dev.pool.reset_peak()
    }

    /// Free and total device memory as the driver reports them.
    pub fn driver_memory(&self) -> Result<(usize, usize)> {
        self.dev.ctx.mem_get_info().map_err(dev_err)
    }

    /// Record decode steps as CUDA graphs (on by default).
    pub fn set_graphs_enabled(&self, on: bool) {
        self.graphs_enabled.store(on, Ordering::Relaxed);
    }

    pub fn graphs_enabled(&self) -> bool {
        self.graphs_enabled.load(Ordering::Relaxed)
    }

    pub(crate) fn warn(&self, message: String) {
        if let Ok(mut w) = self.warnings.lock() {
            if !w.contains(&message) {
                w.push(message);
            }
        }
    }

    /// Recorded steps so far (CUDA graphs).
    pub fn num_recordings(&self) -> usize {
        self.recordings.lock().map(|r| r.len()).unwrap_or(0)
    }

    /// Decode steps over `cache` recorded as graphs, and the batch sizes
    /// whose recording failed (those run eagerly).
    pub fn recordings_of(&self, cache: &kiln_tensor::KvCache) -> (usize, usize) {
        self.recordings
            .lock()
            .map(|r| r.of_cache(cache.id()))
            .unwrap_or((0, 0))
    }

    pub(crate) fn alloc(&self, elems: usize, what: &str) -> Result<DevBuf> {
        self.dev.alloc(elems, 2, what)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn warnings(&self) -> Vec<String> {
        self.warnings.lock().map(|w| w.clone()).unwrap_or_default()
    }
}

impl Memory for CudaBackend {
    fn kv_bytes_per_element(&self) -> usize {
        if self.options.kv_cache_fp8 {
            1
        } else {
            2
        }
    }

    fn weight_bytes_per_element(&self) -> usize {
        2
    }

    fn measure_copy_bandwidth_gbs(&self) -> Option<f64> {
        self.dev.copy_bandwidth_gbs().ok()
    }

    /// Dense weights, and the GGUF block formats `ops::matmul::blocks` has
    /// kernels for (kept as stored).
    fn supports_weight(&self, kind: kiln_tensor::WeightKind) -> bool {
        match kind {
            kiln_tensor::WeightKind::Dense(_) => true,
            kiln_tensor::WeightKind::Blocks(f) => crate::ops::matmul::blocks::supported(self, f),
            _ => false,
        }
    }

    fn upload_blocks(&self, m: kiln_tensor::QuantMatrix) -> Result<kiln_tensor::BlockPart> {
        crate::ops::matmul::blocks::upload(self, m)
    }

    fn device_memory(&self) -> Option<kiln_tensor::DeviceMemory> {
        let (free, total) = self.driver_memory().ok()?;
        let snap = self.memory_snapshot();
        Some(kiln_tensor::DeviceMemory {
            free_bytes: free as u64,
            total_bytes: total as u64,
            active_bytes: snap.active_bytes,
            peak_active_bytes: snap.peak_active_bytes,
            reserved_bytes: snap.reserved_bytes,
        })
    }

    fn reset_peak_memory(&self) {
        self.dev.pool.reset_peak()
    }

    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(TensorError::Shape {
                op: "upload",
                detail: format!("shape {shape:?} for {} elements", data.len()),
            });
        }
        self.no_upload_while_recording("an upload")?;
        let b = self.dev.alloc_exact(data.len() * 2, "a weight")?;
        let convert = |first: usize, out: &mut [u16]| {
            for (o, &x) in out.iter_mut().zip(&data[first..]) {
                *o = bf16::from_f32(x).to_bits();
            }
        };
        if !self
            .uploader
            .upload(&self.dev, b.ptr, data.len(), &convert)?
        {
            self.dev.htod(b.ptr, &to_bf16(data))?;
        }
        Ok(wrap(shape.to_vec(), b))
    }

    fn upload_bf16(&self, shape: &[usize], bits: &[u16]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != bits.len() {
            return Err(TensorError::Shape {
                op: "upload",
                detail: format!("shape {shape:?} for {} elements", bits.len()),
            });
        }
        self.no_upload_while_recording("an upload")?;
        let b = self.dev.alloc_exact(bits.len() * 2, "a weight")?;
        let copy =
            |first: usize, out: &mut [u16]| out.copy_from_slice(&bits[first..first + out.len()]);
        if !self.uploader.upload(&self.dev, b.ptr, bits.len(), &copy)? {
            self.dev.htod(b.ptr, bits)?;
        }
        Ok(wrap(shape.to_vec(), b))
    }

    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>> {
        let b = buf(t, "to_host")?;
        match t.dtype() {
            DType::F32 => self.dev.dtoh::<f32>(b.ptr, t.num_elements()),
            _ => Ok(self
                .dev
                .dtoh::<u16>(b.ptr, t.num_elements())?
                .into_iter()
                .map(|x| bf16::from_bits(x).to_f32())
                .collect()),
        }
    }

    fn alloc_kv_cache(&self, spec: KvPoolShape) -> Result<KvCache> {
        crate::ops::attention::cache::alloc_kv_cache(self, spec)
    }

    fn alloc_state(&self, shape: kiln_tensor::StateShape) -> Result<Box<dyn std::any::Any + Send>> {
        crate::ops::recurrent::alloc_state(self, shape)
    }
}

impl Ops for CudaBackend {
    fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        match table {
            Weight::Blocks(b) => crate::ops::matmul::blocks::embedding(self, b, ids),
            _ => crate::ops::gather::embedding(self, table.dense("embedding")?, ids),
        }
    }

    fn matmul_dense(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        crate::ops::matmul::linear(self, x, w, bias)
    }

    fn matmul_blocks(
        &self,
        x: &Tensor,
        w: &kiln_tensor::BlockWeight,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        crate::ops::matmul::blocks::matmul(self, x, w, None, Epilogue::bias(bias))
    }

    /// The fused forms the kernels have; anything else is composed
    /// ([`kiln_tensor::matmul_unfused`]), fusing what it still can.
    fn matmul(
        &self,
        x: &Tensor,
        w: &Weight,
        prologue: Option<NormPrologue<'_>>,
        epilogue: Epilogue<'_>,
    ) -> Result<Tensor> {
        if let Weight::Blocks(b) = w {
            return crate::ops::matmul::blocks::matmul(self, x, b, prologue, epilogue);
        }
        let wd = w.dense("matmul")?;
        let Epilogue {
            bias,
            gated,
            residual,
        } = epilogue;
        match (prologue, gated, residual) {
            (None, None, None) => crate::ops::matmul::linear(self, x, wd, bias),
            (None, None, Some(r)) => crate::ops::matmul::linear_add(self, x, wd, bias, r),
            (None, Some(act), None) if bias.is_none() => {
                crate::ops::matmul::gated_linear(self, x, wd, act)
            }
            (Some(n), None, None) => {
                self.fused_rms_norm_linear(x, n.weight, n.eps, n.offset, wd, bias)
            }
            (Some(n), Some(act), None) if bias.is_none() => {
                self.fused_rms_norm_gated_linear(x, n.weight, n.eps, n.offset, wd, act)
            }
            _ => kiln_tensor::matmul_unfused(self, x, w, prologue, epilogue),
        }
    }

    fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f32, weight_offset: f32) -> Result<Tensor> {
        crate::ops::norm::rms_norm(self, x, w, eps, weight_offset)
    }

    fn rms_norm_add(
        &self,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
        weight_offset: f32,
        residual: &Tensor,
    ) -> Result<Tensor> {
        crate::ops::norm::rms_norm_add(self, x, w, eps, weight_offset, residual)
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        crate::ops::elementwise::add(self, a, b)
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        crate::ops::elementwise::scale(self, x, s)
    }

    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        crate::ops::activation::gated_activation(self, gate, up, act)
    }

    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor> {
        crate::ops::rope_kv_write::rope(self, x, positions, p)
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        crate::ops::gather::gather_rows(self, x, rows)
    }

    fn gated_packed(&self, y: &Tensor, act: Activation) -> Result<Tensor> {
        crate::ops::activation::gated_packed(self, y, act)
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        crate::ops::gather::split_cols(self, x, widths)
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
        crate::ops::attention::attention(self, q, k, v, cache, layer, batch, p)
    }

    /// Causal and bidirectional (the reference kernel), with or without a
    /// window.
    fn supports_attention(&self, _p: &AttentionParams) -> bool {
        true
    }

    /// The recurrent mixers have kernels (`ops::recurrent`), unless
    /// `CudaOptions::recurrent` is off.
    fn supports_recurrent(&self, mixer: &kiln_tensor::RecurrentMixer) -> bool {
        if !self.options.recurrent {
            return false;
        }
        match mixer {
            kiln_tensor::RecurrentMixer::ShortConv(_) => self.dev.has("recurrent_conv"),
            kiln_tensor::RecurrentMixer::GatedDeltaNet(g) => {
                self.dev.has("recurrent_conv")
                    && self.dev.has("gated_delta_rule")
                    && (g.k_dim * g.v_dim + 2 * g.k_dim) * 4
                        <= crate::ops::recurrent::DELTA_MAX_SMEM
                    && g.v_dim <= 1024
            }
        }
    }

    fn recurrent_mixer(
        &self,
        x: &Tensor,
        mixer: &kiln_tensor::RecurrentMixer,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        crate::ops::recurrent::recurrent_mixer(self, x, mixer, batch, cache)
    }

    fn has_extension(&self, name: &str) -> bool {
        let kernel = match name {
            kiln_tensor::SoftCap::NAME => "softcap_bf16",
            kiln_tensor::LayerNorm::NAME => "layer_norm_bf16",
            kiln_tensor::GeluErf::NAME => "gelu_erf_bf16",
            kiln_tensor::MlaQuery::NAME => "mla_query_bf16",
            kiln_tensor::MlaKv::NAME => "mla_kv_bf16",
            kiln_tensor::MlaOutput::NAME => "mla_output_bf16",
            _ => return false,
        };
        self.dev.has(kernel)
    }

    fn extension(&self, op: &dyn kiln_tensor::ExtensionOp, x: &Tensor) -> Result<Tensor> {
        let any = op.as_any();
        if let Some(s) = any.downcast_ref::<kiln_tensor::SoftCap>() {
            crate::ops::elementwise::softcap(self, x, s.cap)
        } else if let Some(ln) = any.downcast_ref::<kiln_tensor::LayerNorm>() {
            crate::ops::norm::layer_norm(self, x, ln)
        } else if any.is::<kiln_tensor::GeluErf>() {
            crate::ops::activation::gelu_erf(self, x)
        } else if let Some(m) = any.downcast_ref::<kiln_tensor::MlaQuery>() {
            crate::ops::mla::query(self, x, m)
        } else if let Some(m) = any.downcast_ref::<kiln_tensor::MlaKv>() {
            crate::ops::mla::kv(self, x, m)
        } else if let Some(m) = any.downcast_ref::<kiln_tensor::MlaOutput>() {
            crate::ops::mla::output(self, x, m)
        } else {
            Err(kiln_tensor::TensorError::Unsupported {
                backend: NAME,
                what: format!("the extension op `{}`", op.name()),
            })
        }
    }

    /// Attention sinks (gpt-oss): every attention kernel takes them.
    fn supports_attention_sinks(&self) -> bool {
        self.dev.has("paged_attention_bf16")
    }

    fn attention_sinks(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &kiln_tensor::AttentionParams,
        sinks: &Tensor,
    ) -> Result<Tensor> {
        crate::ops::attention::attention_with_sinks(
            self,
            q,
            k,
            v,
            cache,
            layer,
            batch,
            p,
            Some(sinks),
        )
    }

    /// Mixture-of-Experts layers (`ops::moe`): routed on the device;
    /// decode-sized steps by warp kernels (recorded as graphs), prefill by
    /// grouped products; block experts other than MXFP4 composed.
    fn supports_moe(&self) -> bool {
        true
    }

    fn moe(&self, x: &Tensor, layer: &kiln_tensor::MoeLayer) -> Result<Tensor> {
        crate::ops::moe::moe(self, x, layer)
    }

    /// LoRA deltas by the gathered shrink/expand kernels (`ops::lora`).
    fn supports_lora(&self) -> bool {
        self.dev.has("lora_shrink_bf16") && self.dev.has("lora_expand_bf16")
    }

    fn lora_add(
        &self,
        y: &Tensor,
        x: &Tensor,
        deltas: &[kiln_tensor::LoraDelta<'_>],
    ) -> Result<Tensor> {
        crate::ops::lora::lora_add(self, y, x, deltas)
    }

    fn lora_apply(
        &self,
        y: &Tensor,
        x: &Tensor,
        deltas: &[kiln_tensor::LoraDelta<'_>],
        after: kiln_tensor::Epilogue<'_>,
    ) -> Result<Tensor> {
        let o = &self.options;
        crate::ops::lora::lora_apply(self, y, x, deltas, after, o.lora_mma_rows, o.lora_expand8)
    }

    fn attention_shared(
        &self,
        q: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        crate::ops::attention::attention_shared(self, q, cache, layer, batch, p)
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
        crate::ops::attention::qkv_attention(self, qkv, cache, layer, batch, p, rope, qk_norm)
    }
}

impl Sampling for CudaBackend {
    fn argmax_rows(&self, logits: &Tensor) -> Result<Option<Vec<(u32, f32)>>> {
        crate::ops::argmax::argmax_rows(&self.dev, logits, None)
    }

    fn argmax_rows_masked(
        &self,
        logits: &Tensor,
        masks: &[Option<&[u32]>],
    ) -> Result<Option<Vec<(u32, f32)>>> {
        crate::ops::argmax::argmax_rows(&self.dev, logits, Some(masks))
    }

    fn sample_rows(
        &self,
        logits: &Tensor,
        rows: &[kiln_tensor::SampleRow<'_>],
    ) -> Result<Option<Vec<Option<kiln_tensor::SampledRow>>>> {
        if !self.options.device_sampling {
            return Ok(None);
        }
        crate::ops::sample::sample_rows(&self.dev, logits, rows)
    }
}

impl kiln_tensor::Collectives for CudaBackend {
    fn tp_rank(&self) -> (usize, usize) {
        self.group.as_ref().map_or((0, 1), |g| g.rank_world())
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        match &self.group {
            Some(g) => self.group_all_reduce(g, x),
            None => Ok(x.clone()),
        }
    }

    fn all_gather_columns(&self, x: &Tensor, keep: &[usize]) -> Result<Tensor> {
        match &self.group {
            Some(g) => self.group_all_gather_columns(g, x, keep),
            None => Ok(x.clone()),
        }
    }

    fn abort_collectives(&self) {
        if let Some(crate::collective::CudaGroup::Host(r)) = &self.group {
            r.group.abort(r.rank);
        }
    }

    fn reset_collectives(&self) {
        if let Some(crate::collective::CudaGroup::Host(r)) = &self.group {
            r.group.reset();
        }
    }
}

impl StepRecording for CudaBackend {
    fn run_step(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        forward: &mut StepFn<'_>,
    ) -> Result<Tensor> {
        let out = crate::step::graphs::run_step(self, batch, cache, forward)?;
        // Experts' token counts reach the layers' loads every few steps.
        crate::ops::moe::drain_counts(self, false)?;
        Ok(out)
    }
}
