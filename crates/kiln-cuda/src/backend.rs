//! `CudaBackend`: the `kiln_tensor::Backend` traits on one NVIDIA GPU. Activations and
//! weights are bf16 on the device, math in f32. Decode-sized products
//! (≤ 8 rows) run Kiln's GEMV kernels with fused epilogues (bias, residual
//! add, gated activation) and, where an RMSNorm feeds them, a fused norm
//! prologue (`norm_gemv.rs`); 9–64 rows the skinny GEMM with the same
//! epilogues (`skinny.rs`); larger ones go through cuBLAS. Attention is
//! split-KV for decode steps and flash-style (tensor cores, no
//! materialized scores) for prefill, over the paged cache. Each step's
//! metadata is uploaded once ([`crate::meta::StepMeta`]); decode steps are
//! recorded as CUDA graphs per batch-size bucket and replayed
//! ([`crate::graphs`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::LaunchConfig;
use half::bf16;
use kiln_tensor::{
    Activation, AttentionParams, Backend, DType, Epilogue, ForwardBatch, KvCache, KvCacheSpec,
    Memory, NormPrologue, Ops, QkNorm, Result, RopeParams, Sampling, StepRecording, Tensor,
    TensorError, Weight,
};

use crate::device::{buf, dev_err, elems_cfg, ptr, rows_cfg, to_bf16, wrap, Device, NAME};
use crate::graphs::Recordings;
use crate::meta::{table_width, StepMeta};
use crate::pool::{DevBuf, MemorySnapshot};
use crate::{CudaError, KernelCompiler};

/// Largest row count served by the GEMV kernels.
pub(crate) const GEMV_MAX_ROWS: usize = 8;

/// The backend. One stream; every op is queued on it in order.
pub struct CudaBackend {
    /// Pinned buffers for weight uploads (`staging.rs`), made on first use;
    /// declared before `dev` so that they are released while the context lives.
    pub(crate) staging: Mutex<Option<crate::staging::Staging>>,
    pub(crate) staging_tried: AtomicBool,
    pub(crate) dev: Device,
    pub device_name: String,
    /// The metadata of the step `run_step` is running, if any.
    pub(crate) step: Mutex<Option<Arc<ActiveStep>>>,
    pub(crate) capturing: AtomicBool,
    pub(crate) recordings: Mutex<Recordings>,
    pub(crate) graphs_enabled: AtomicBool,
    pub(crate) warnings: Mutex<Vec<String>>,
    rope_tables: Mutex<Vec<(Vec<f32>, Arc<DevBuf>)>>,
    pub(crate) skinny: crate::skinny::Skinny,
    /// Zeroed partition counters of split decode attention (`None`: the
    /// separate reduce kernel combines the partitions).
    pub(crate) decode_counters: Option<DevBuf>,
    /// Decode steps rotate q and the new key inside decode attention
    /// (`decode_rope_attention_hd*`) instead of running the RoPE kernel
    /// first: `KILN_DECODE_ROPE=1` or [`CudaBackend::set_decode_rope_fused`]
    /// (off by default until timed on a GPU).
    pub(crate) decode_rope: AtomicBool,
    /// Split decode steps use the kernels that load values with keys
    /// (`decode_*attention_vpre_hd*`; `KILN_DECODE_VPRE_SPLIT=0` off).
    pub(crate) decode_vpre: AtomicBool,
    /// The last kernel launched was decode attention (reads little memory):
    /// the next direct-load GEMV prefetches its weights into L2 before its
    /// PDL wait. Taken (cleared) by the next product of any kind.
    pub(crate) prefetch_next: AtomicBool,
}

/// A step's metadata on the device.
pub(crate) struct ActiveStep {
    pub batch: ForwardBatch,
    pub meta: StepMeta,
    pub base: u64,
    pub _hold: Option<DevBuf>,
}

/// A `u32` array on the device: part of the step's metadata or uploaded
/// for this call.
struct DevU32 {
    ptr: u64,
    _hold: Option<DevBuf>,
}

pub(crate) struct CudaKv {
    pub(crate) k: Vec<DevBuf>,
    pub(crate) v: Vec<DevBuf>,
    /// Recordings over this cache hold a weak reference: they are dropped
    /// once the cache is.
    pub alive: Arc<()>,
}

impl CudaBackend {
    /// Open GPU `ordinal` and load Kiln's kernels, compiled for its
    /// architecture by `compiler` (cached on disk).
    pub fn new(ordinal: usize, compiler: KernelCompiler) -> std::result::Result<Self, CudaError> {
        let dev = Device::open(ordinal, compiler)?;
        let device_name = dev.name.clone();
        let warnings = Mutex::new(dev.warnings.clone());
        let skinny = crate::skinny::Skinny::new(&dev);
        // KILN_DECODE_FUSED=0: the separate reduce kernel (for comparisons).
        let fused = std::env::var("KILN_DECODE_FUSED").map_or(true, |v| v != "0");
        let decode_counters = fused
            .then(|| {
                dev.alloc_zeroed(crate::attention::DECODE_COUNTERS * 4, "attention counters")
                    .ok()
            })
            .flatten();
        Ok(CudaBackend {
            dev,
            device_name,
            step: Mutex::new(None),
            capturing: AtomicBool::new(false),
            recordings: Mutex::new(Recordings::default()),
            graphs_enabled: AtomicBool::new(true),
            warnings,
            rope_tables: Mutex::new(Vec::new()),
            skinny,
            decode_counters,
            decode_rope: AtomicBool::new(std::env::var("KILN_DECODE_ROPE").is_ok_and(|v| v == "1")),
            prefetch_next: AtomicBool::new(false),
            decode_vpre: AtomicBool::new(
                std::env::var("KILN_DECODE_VPRE_SPLIT").map_or(true, |v| v != "0"),
            ),
            staging: Mutex::new(None),
            staging_tried: AtomicBool::new(false),
        })
    }

    /// Fold RoPE and the cache write into decode attention on decode steps
    /// (steps recorded as graphs before the change keep what they recorded).
    pub fn set_decode_rope_fused(&self, on: bool) {
        self.decode_rope
            .store(on, std::sync::atomic::Ordering::Relaxed);
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

    pub(crate) fn alloc(&self, elems: usize, what: &str) -> Result<DevBuf> {
        self.dev.alloc(elems, 2, what)
    }

    fn active(&self) -> Option<Arc<ActiveStep>> {
        self.step.lock().ok().and_then(|s| s.clone())
    }

    fn no_upload_while_recording(&self, what: &str) -> Result<()> {
        if self.capturing.load(Ordering::Relaxed) {
            return Err(dev_err(format!(
                "{what} is not part of the recorded step's metadata"
            )));
        }
        Ok(())
    }

    /// `host` on the device: found in the running step's metadata at
    /// `offset(meta)` when it is that array, else uploaded now.
    fn dev_u32(&self, host: &[u32], offset: fn(&StepMeta) -> usize) -> Result<DevU32> {
        if let Some(step) = self.active() {
            let off = offset(&step.meta);
            if step.meta.words.get(off..off + host.len()) == Some(host) {
                return Ok(DevU32 {
                    ptr: step.base + 4 * off as u64,
                    _hold: None,
                });
            }
        }
        self.no_upload_while_recording("an index array")?;
        let b = self.dev.alloc(host.len(), 4, "indices")?;
        self.dev.htod(b.ptr, host)?;
        Ok(DevU32 {
            ptr: b.ptr,
            _hold: Some(b),
        })
    }

    /// The metadata of `batch`: the running step's, or built and uploaded now.
    fn step_meta(&self, batch: &ForwardBatch) -> Result<Arc<ActiveStep>> {
        if let Some(step) = self.active() {
            if step.batch == *batch {
                return Ok(step);
            }
        }
        self.no_upload_while_recording("a batch")?;
        self.upload_step(batch.clone(), table_width(batch))
    }

    pub(crate) fn upload_step(&self, batch: ForwardBatch, width: usize) -> Result<Arc<ActiveStep>> {
        let meta = StepMeta::build(&batch, width);
        let b = self.dev.alloc(meta.words.len(), 4, "step metadata")?;
        self.dev.htod(b.ptr, &meta.words)?;
        Ok(Arc::new(ActiveStep {
            batch,
            base: b.ptr,
            meta,
            _hold: Some(b),
        }))
    }

    fn rope_table(&self, inv_freq: &[f32]) -> Result<Arc<DevBuf>> {
        let mut tables = self.rope_tables.lock().map_err(dev_err)?;
        if let Some((_, b)) = tables.iter().find(|(h, _)| h.as_slice() == inv_freq) {
            return Ok(b.clone());
        }
        self.no_upload_while_recording("a RoPE table")?;
        let b = Arc::new(
            self.dev
                .alloc_exact(inv_freq.len().max(1) * 4, "RoPE table")?,
        );
        self.dev.htod(b.ptr, inv_freq)?;
        tables.push((inv_freq.to_vec(), b.clone()));
        Ok(b)
    }

    fn add_bias(&self, out: u64, bias: &Tensor, n: usize, m: usize) -> Result<()> {
        if bias.num_elements() != m {
            return Err(TensorError::Shape {
                op: "linear",
                detail: format!("bias of {} for {m} outputs", bias.num_elements()),
            });
        }
        let (nl, mi, b) = (n as i64, m as i32, ptr(bias, "linear bias")?);
        // SAFETY: out [n, m], bias [m].
        unsafe {
            self.dev
                .launch(self.dev.func("add_bias_bf16")?)
                .arg(&out)
                .arg(&b)
                .arg(&nl)
                .arg(&mi)
                .launch(elems_cfg(n * m))
                .map_err(dev_err)?;
        }
        Ok(())
    }

    fn kv(cache: &mut KvCache) -> Result<&mut CudaKv> {
        cache
            .storage_mut()
            .downcast_mut::<CudaKv>()
            .ok_or(TensorError::WrongBackend {
                op: "attention",
                expected: NAME,
            })
    }

    fn gated_unfused(&self, gu: &Tensor, act: Activation) -> Result<Tensor> {
        let (n, two_i) = gu.dims2("gated_linear")?;
        let parts = self.split_cols(gu, &[two_i / 2, two_i / 2])?;
        let _ = n;
        self.gated_activation(&parts[0], &parts[1], act)
    }
}

pub(crate) fn act_code(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
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
        2
    }

    fn weight_bytes_per_element(&self) -> usize {
        2
    }

    fn measure_copy_bandwidth_gbs(&self) -> Option<f64> {
        self.dev.copy_bandwidth_gbs().ok()
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
        if !self.upload_staged(b.ptr, data.len(), &convert)? {
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
        if !self.upload_staged(b.ptr, bits.len(), &copy)? {
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

    fn alloc_kv_cache(&self, spec: KvCacheSpec) -> Result<KvCache> {
        // One hidden block more than asked: the scratch block that padding
        // rows of recorded decode steps write to.
        let spec = KvCacheSpec {
            num_blocks: spec.num_blocks + 1,
            ..spec
        };
        let per_layer = spec.num_slots() * spec.num_kv_heads * spec.head_dim * 2;
        let mut k = Vec::with_capacity(spec.num_layers);
        let mut v = Vec::with_capacity(spec.num_layers);
        for layer in 0..spec.num_layers {
            for (side, list) in [("keys", &mut k), ("values", &mut v)] {
                let b = self
                    .dev
                    .alloc_exact(per_layer, &format!("KV cache {side} of layer {layer}"))?;
                // Zeroed so that never-written slots read as finite numbers.
                // SAFETY: b holds per_layer bytes.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        b.ptr,
                        0,
                        per_layer,
                        self.dev.stream.cu_stream(),
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
                alive: Arc::new(()),
            }),
        ))
    }
}

/// The products [`Ops::matmul`] dispatches to: GEMV, skinny GEMM or cuBLAS
/// with their fused epilogues (the norm-fused ones are in `norm_gemv.rs`).
impl CudaBackend {
    pub(crate) fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (n, k, m) = linear_dims(x, w)?;
        let out = self.alloc(n * m, "a projection")?;
        let (xp, wp) = (ptr(x, "linear")?, ptr(w, "linear")?);
        if let Some(b) = bias {
            if b.num_elements() != m {
                return Err(TensorError::Shape {
                    op: "linear",
                    detail: format!("bias of {} for {m} outputs", b.num_elements()),
                });
            }
        }
        let (mode, extra) = match bias {
            Some(b) => (1, ptr(b, "linear bias")?),
            None => (0, 0),
        };
        if !self.gemv(xp, wp, out.ptr, extra, n, k, m, mode)? {
            self.dev.gemm(xp, wp, out.ptr, n, k, m, 0.0)?;
            if let Some(b) = bias {
                self.add_bias(out.ptr, b, n, m)?;
            }
        }
        Ok(wrap(vec![n, m], out))
    }

    pub(crate) fn linear_add(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let (n, k, m) = linear_dims(x, w)?;
        if residual.shape() != [n, m] {
            return Err(TensorError::Shape {
                op: "linear_add",
                detail: format!("residual {:?} for [{n}, {m}]", residual.shape()),
            });
        }
        let out = self.alloc(n * m, "a projection")?;
        let (xp, wp, rp) = (
            ptr(x, "linear")?,
            ptr(w, "linear")?,
            ptr(residual, "linear")?,
        );
        if bias.is_none() && self.gemv(xp, wp, out.ptr, rp, n, k, m, 2)? {
            return Ok(wrap(vec![n, m], out));
        }
        self.dev.dtod(out.ptr, rp, n * m * 2)?;
        self.dev.gemm(xp, wp, out.ptr, n, k, m, 1.0)?;
        if let Some(b) = bias {
            self.add_bias(out.ptr, b, n, m)?;
        }
        Ok(wrap(vec![n, m], out))
    }

    pub(crate) fn gated_linear(
        &self,
        x: &Tensor,
        w_gate_up: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        let (n, k, two_i) = linear_dims(x, w_gate_up)?;
        let inter = two_i / 2;
        if two_i % 2 != 0 {
            return Err(TensorError::Shape {
                op: "gated_linear",
                detail: format!("{two_i} packed gate/up rows"),
            });
        }
        let (xp, wp) = (ptr(x, "gated_linear")?, ptr(w_gate_up, "gated_linear")?);
        let out = self.alloc(n * inter, "an MLP activation")?;
        if self.gemv(xp, wp, out.ptr, 0, n, k, inter, 3 + act_code(act))? {
            return Ok(wrap(vec![n, inter], out));
        }
        let gu = self.alloc(n * two_i, "an MLP projection")?;
        self.dev.gemm(xp, wp, gu.ptr, n, k, two_i, 0.0)?;
        if !self.dev.has("gated_act_packed_bf16") {
            return self.gated_unfused(&wrap(vec![n, two_i], gu), act);
        }
        let (nl, ii, a) = (n as i64, inter as i32, act_code(act));
        // SAFETY: gu [n, 2 * inter], out [n, inter].
        unsafe {
            self.dev
                .launch(self.dev.func("gated_act_packed_bf16")?)
                .arg(&gu.ptr)
                .arg(&out.ptr)
                .arg(&nl)
                .arg(&ii)
                .arg(&a)
                .launch(elems_cfg(n * inter))
                .map_err(dev_err)?;
        }
        Ok(wrap(vec![n, inter], out))
    }
}

impl Ops for CudaBackend {
    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let (vocab, d) = table.dims2("embedding")?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(TensorError::Shape {
                op: "embedding",
                detail: format!("token id {bad} outside vocabulary of {vocab}"),
            });
        }
        let out = self.alloc(ids.len() * d, "embeddings")?;
        if !ids.is_empty() {
            let dids = self.dev_u32(ids, |m| m.tok)?;
            let (t, di) = (ptr(table, "embedding")?, d as i32);
            // SAFETY: table [vocab, d], ids < vocab (checked), out [len, d].
            unsafe {
                self.dev
                    .launch(self.dev.func("embedding_bf16")?)
                    .arg(&t)
                    .arg(&dids.ptr)
                    .arg(&out.ptr)
                    .arg(&di)
                    .launch(rows_cfg(ids.len(), 256, 0))
                    .map_err(dev_err)?;
            }
        }
        Ok(wrap(vec![ids.len(), d], out))
    }

    fn matmul_dense(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear(x, w, bias)
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
        let wd = w.dense("matmul")?;
        let Epilogue {
            bias,
            gated,
            residual,
        } = epilogue;
        match (prologue, gated, residual) {
            (None, None, None) => self.linear(x, wd, bias),
            (None, None, Some(r)) => self.linear_add(x, wd, bias, r),
            (None, Some(act), None) if bias.is_none() => self.gated_linear(x, wd, act),
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
        let d = *x.shape().last().unwrap_or(&0);
        if w.num_elements() != d || d == 0 {
            return Err(TensorError::Shape {
                op: "rms_norm",
                detail: format!("x {:?}, weight {:?}", x.shape(), w.shape()),
            });
        }
        let rows = x.num_elements() / d;
        let out = self.alloc(rows * d, "a norm")?;
        let (xp, wp, null, di) = (ptr(x, "rms_norm")?, ptr(w, "rms_norm")?, 0u64, d as i32);
        if rows > 0 {
            // SAFETY: x and out [rows, d], w [d]; a null residual skips the add.
            unsafe {
                self.dev
                    .launch(self.dev.func("add_rms_norm_bf16")?)
                    .arg(&xp)
                    .arg(&null)
                    .arg(&wp)
                    .arg(&out.ptr)
                    .arg(&di)
                    .arg(&eps)
                    .arg(&weight_offset)
                    .launch(rows_cfg(rows, norm_threads(d), 0))
                    .map_err(dev_err)?;
            }
        }
        Ok(wrap(x.shape().to_vec(), out))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if a.shape() != b.shape() {
            return Err(TensorError::Shape {
                op: "add",
                detail: format!("{:?} vs {:?}", a.shape(), b.shape()),
            });
        }
        let n = a.num_elements();
        let out = self.alloc(n, "a sum")?;
        let (ap, bp, nl, s) = (ptr(a, "add")?, ptr(b, "add")?, n as i64, 1f32);
        // SAFETY: a, b, out all hold n elements.
        unsafe {
            self.dev
                .launch(self.dev.func("add_scale_bf16")?)
                .arg(&ap)
                .arg(&bp)
                .arg(&out.ptr)
                .arg(&nl)
                .arg(&s)
                .launch(elems_cfg(n))
                .map_err(dev_err)?;
        }
        Ok(wrap(a.shape().to_vec(), out))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        let n = x.num_elements();
        let out = self.alloc(n, "a scaled tensor")?;
        let (xp, null, nl) = (ptr(x, "scale")?, 0u64, n as i64);
        // SAFETY: x and out hold n elements; a null b selects scaling.
        unsafe {
            self.dev
                .launch(self.dev.func("add_scale_bf16")?)
                .arg(&xp)
                .arg(&null)
                .arg(&out.ptr)
                .arg(&nl)
                .arg(&s)
                .launch(elems_cfg(n))
                .map_err(dev_err)?;
        }
        Ok(wrap(x.shape().to_vec(), out))
    }

    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        if gate.shape() != up.shape() {
            return Err(TensorError::Shape {
                op: "gated_activation",
                detail: format!("{:?} vs {:?}", gate.shape(), up.shape()),
            });
        }
        let n = gate.num_elements();
        let out = self.alloc(n, "an activation")?;
        let (g, u, nl, a) = (
            ptr(gate, "gated_activation")?,
            ptr(up, "gated_activation")?,
            n as i64,
            act_code(act),
        );
        // SAFETY: gate, up, out hold n elements.
        unsafe {
            self.dev
                .launch(self.dev.func("gated_act_bf16")?)
                .arg(&g)
                .arg(&u)
                .arg(&out.ptr)
                .arg(&nl)
                .arg(&a)
                .launch(elems_cfg(n))
                .map_err(dev_err)?;
        }
        Ok(wrap(gate.shape().to_vec(), out))
    }

    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor> {
        kiln_tensor::check_rope_args(x, positions, p)?;
        let n = positions.len();
        let out = self.alloc(x.num_elements(), "a rotated tensor")?;
        self.dev
            .dtod(out.ptr, ptr(x, "rope")?, x.num_elements() * 2)?;
        if n > 0 {
            let dpos = self.dev_u32(positions, |m| m.pos)?;
            let freq = self.rope_table(p.inv_freq)?;
            let (h, hd, half) = (
                p.num_heads as i32,
                p.head_dim as i32,
                p.inv_freq.len() as i32,
            );
            let cfg = LaunchConfig {
                grid_dim: (n as u32, p.num_heads as u32, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: out [n, heads * head_dim], positions [n], inv_freq [half].
            unsafe {
                self.dev
                    .launch(self.dev.func("rope_bf16")?)
                    .arg(&out.ptr)
                    .arg(&dpos.ptr)
                    .arg(&freq.ptr)
                    .arg(&h)
                    .arg(&hd)
                    .arg(&half)
                    .arg(&p.attention_scaling)
                    .launch(cfg)
                    .map_err(dev_err)?;
            }
        }
        Ok(wrap(x.shape().to_vec(), out))
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        let (n, d) = x.dims2("gather_rows")?;
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
            return Err(TensorError::Shape {
                op: "gather_rows",
                detail: format!("row {r} of {n}"),
            });
        }
        // Every row in order (decode steps): the rows themselves.
        if rows.len() == n && rows.iter().enumerate().all(|(i, &r)| r as usize == i) {
            return Ok(x.clone());
        }
        let out = self.alloc(rows.len() * d, "gathered rows")?;
        if !rows.is_empty() {
            let drows = self.dev_u32(rows, |m| m.logits)?;
            let (xp, di) = (ptr(x, "gather_rows")?, d as i32);
            // SAFETY: rows < n (checked); out [len, d].
            unsafe {
                self.dev
                    .launch(self.dev.func("gather_rows_bf16")?)
                    .arg(&xp)
                    .arg(&drows.ptr)
                    .arg(&out.ptr)
                    .arg(&di)
                    .launch(rows_cfg(rows.len(), 256, 0))
                    .map_err(dev_err)?;
            }
        }
        Ok(wrap(vec![rows.len(), d], out))
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        let (n, d) = x.dims2("split_cols")?;
        if widths.iter().sum::<usize>() != d {
            return Err(TensorError::Shape {
                op: "split_cols",
                detail: format!("{widths:?} out of {d} columns"),
            });
        }
        let xp = ptr(x, "split_cols")?;
        let mut start = 0;
        let mut out = Vec::with_capacity(widths.len());
        for &w in widths {
            let part = self.alloc(n * w, "a column block")?;
            let (src, ss, wi, nl) = (xp + 2 * start as u64, d as i64, w as i32, n as i64);
            if n * w > 0 {
                // SAFETY: columns start..start + w of every row of x [n, d] into part [n, w].
                unsafe {
                    self.dev
                        .launch(self.dev.func("copy_cols_bf16")?)
                        .arg(&src)
                        .arg(&ss)
                        .arg(&part.ptr)
                        .arg(&wi)
                        .arg(&nl)
                        .launch(elems_cfg(n * w))
                        .map_err(dev_err)?;
                }
            }
            out.push(wrap(vec![n, w], part));
            start += w;
        }
        Ok(out)
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
        kiln_tensor::check_attention_args(q, k, v, &cache.spec, layer, batch, p)?;
        let (n, _) = q.dims2("attention")?;
        let step = self.step_meta(batch)?;
        let block_size = cache.spec.block_size;
        let kv = Self::kv(cache)?;
        if n > 0 {
            let slots = step.base + 4 * step.meta.slot as u64;
            let kvi = (p.num_kv_heads * p.head_dim) as i32;
            let (kp, vp) = (ptr(k, "attention")?, ptr(v, "attention")?);
            let (kc, vc) = (kv.k[layer].ptr, kv.v[layer].ptr);
            // SAFETY: k, v [n, kv_row]; slots < num_slots (checked).
            unsafe {
                self.dev
                    .launch(self.dev.func("write_kv_bf16")?)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&slots)
                    .arg(&kvi)
                    .launch(rows_cfg(n, 128, 0))
                    .map_err(dev_err)?;
            }
        }
        let qp = ptr(q, "attention")?;
        self.attend(
            qp,
            p.num_heads * p.head_dim,
            kv,
            layer,
            &step,
            block_size,
            p,
            None,
        )
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
        let hd = p.head_dim;
        let fused = qk_norm.is_none()
            && self.dev.has("qkv_rope_write_bf16")
            && self.dev.has(&format!("flash_prefill_hd{hd}"))
            && self.dev.has(&format!("decode_attention_hd{hd}"));
        if !fused {
            return kiln_tensor::backend::qkv_attention_unfused(
                self, qkv, cache, layer, batch, p, rope, qk_norm,
            );
        }
        let (n, width) = qkv.dims2("qkv_attention")?;
        let (qw, kw) = (p.num_heads * hd, p.num_kv_heads * hd);
        if width != qw + 2 * kw {
            return Err(TensorError::Shape {
                op: "qkv_attention",
                detail: format!("qkv {:?} for {p:?}", qkv.shape()),
            });
        }
        kiln_tensor::check_attention_shapes(
            n,
            qw,
            &[n, kw],
            &[n, kw],
            &cache.spec,
            layer,
            batch,
            p,
        )?;
        if 2 * rope.inv_freq.len() > hd || rope.num_heads != p.num_heads || rope.head_dim != hd {
            return Err(TensorError::Shape {
                op: "qkv_attention",
                detail: format!("RoPE {rope:?} for {p:?}"),
            });
        }
        let step = self.step_meta(batch)?;
        let block_size = cache.spec.block_size;
        let kv = Self::kv(cache)?;
        // Decode steps (one new token a sequence): the attention kernel
        // rotates q and the new key itself and writes the key and value.
        let half = rope.inv_freq.len();
        if step.meta.decode_only
            && n > 0
            && self.decode_rope.load(std::sync::atomic::Ordering::Relaxed)
            && half > 0
            && half.is_multiple_of(8)
            && self.dev.has(&format!("decode_rope_attention_hd{hd}"))
        {
            let freq = self.rope_table(rope.inv_freq)?;
            let fold = crate::attention::RopeFold {
                freq: freq.ptr,
                half: half as i32,
                scaling: rope.attention_scaling,
                slots: step.base + 4 * step.meta.slot as u64,
            };
            let qkv_ptr = ptr(qkv, "qkv_attention")?;
            return self.attend(qkv_ptr, width, kv, layer, &step, block_size, p, Some(fold));
        }
        // RoPE is applied in place: work on a private copy unless this
        // tensor is the only holder of its buffer.
        let private;
        let qkv_ptr = if Arc::strong_count(qkv.storage()) == 1 {
            ptr(qkv, "qkv_attention")?
        } else {
            private = self.alloc(n * width, "a qkv copy")?;
            self.dev
                .dtod(private.ptr, ptr(qkv, "qkv_attention")?, n * width * 2)?;
            private.ptr
        };
        if n > 0 {
            let freq = self.rope_table(rope.inv_freq)?;
            let m = &step.meta;
            let (pos, slots) = (step.base + 4 * m.pos as u64, step.base + 4 * m.slot as u64);
            let (stride, half) = (width as i64, rope.inv_freq.len() as i32);
            let (h, kvh, hdi) = (p.num_heads as i32, p.num_kv_heads as i32, hd as i32);
            let (kc, vc) = (kv.k[layer].ptr, kv.v[layer].ptr);
            // SAFETY: qkv [n, width]; caches [slots, kv_row]; slots checked.
            unsafe {
                self.dev
                    .launch(self.dev.func("qkv_rope_write_bf16")?)
                    .arg(&qkv_ptr)
                    .arg(&stride)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&pos)
                    .arg(&slots)
                    .arg(&freq.ptr)
                    .arg(&half)
                    .arg(&rope.attention_scaling)
                    .arg(&h)
                    .arg(&kvh)
                    .arg(&hdi)
                    .launch(LaunchConfig {
                        grid_dim: (n as u32, (p.num_heads + p.num_kv_heads) as u32, 1),
                        block_dim: ((hd / 2).next_multiple_of(32).clamp(32, 128) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    })
                    .map_err(dev_err)?;
            }
        }
        self.attend(qkv_ptr, width, kv, layer, &step, block_size, p, None)
    }
}

impl Sampling for CudaBackend {
    fn argmax_rows(&self, logits: &Tensor) -> Result<Option<Vec<(u32, f32)>>> {
        crate::argmax::argmax_rows(&self.dev, logits, None)
    }

    fn argmax_rows_masked(
        &self,
        logits: &Tensor,
        masks: &[Option<&[u32]>],
    ) -> Result<Option<Vec<(u32, f32)>>> {
        crate::argmax::argmax_rows(&self.dev, logits, Some(masks))
    }

    fn sample_rows(
        &self,
        logits: &Tensor,
        rows: &[kiln_tensor::SampleRow<'_>],
    ) -> Result<Option<Vec<Option<kiln_tensor::SampledRow>>>> {
        crate::sample::sample_rows(&self.dev, logits, rows)
    }
}

impl StepRecording for CudaBackend {
    fn run_step(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        forward: &mut dyn FnMut(&ForwardBatch, &mut KvCache) -> Result<Tensor>,
    ) -> Result<Tensor> {
        crate::graphs::run_step(self, batch, cache, forward)
    }
}

/// Threads per row of the RMSNorm kernel: about four elements each (a
/// decode step normalizes one row, so one block's latency is the cost).
pub(crate) fn norm_threads(d: usize) -> u32 {
    (d.div_ceil(4).next_multiple_of(32)).clamp(128, 1024) as u32
}

pub(crate) fn linear_dims(x: &Tensor, w: &Tensor) -> Result<(usize, usize, usize)> {
    let (n, k) = x.dims2("linear")?;
    let (m, kw) = w.dims2("linear")?;
    if k != kw {
        return Err(TensorError::Shape {
            op: "linear",
            detail: format!("x {:?} · w {:?}ᵀ", x.shape(), w.shape()),
        });
    }
    Ok((n, k, m))
}
