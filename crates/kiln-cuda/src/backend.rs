//! `CudaBackend`: `kiln_tensor::Backend` on one NVIDIA GPU. Activations and
//! weights are bf16 on the device, math in f32; linear layers go through
//! cuBLAS (bf16 in, f32 accumulate), everything else through Kiln's kernels.
//! This first version favours being obviously correct over speed: every op
//! allocates its output, metadata is uploaded per call, attention is the
//! reference paged kernel. CUDA graphs, fused kernels and flash-style
//! attention come next.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use kiln_tensor::{
    Activation, AttentionParams, Backend, DType, ForwardBatch, KvCache, KvCacheSpec, Result,
    RopeParams, Tensor, TensorError,
};

use crate::{driver_available, CudaError, KernelCompiler};

const NAME: &str = "cuda";

fn dev_err(e: impl std::fmt::Debug) -> TensorError {
    TensorError::Device {
        backend: NAME,
        message: format!("{e:?}"),
    }
}

/// The backend. One stream; every op is queued on it in order.
pub struct CudaBackend {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<String, CudaFunction>,
    pub device_name: String,
}

struct CudaKv {
    k: Vec<CudaSlice<bf16>>,
    v: Vec<CudaSlice<bf16>>,
}

fn grid_for(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Open GPU `ordinal` and load Kiln's kernels, compiled for its
    /// architecture by `compiler` (cached on disk).
    pub fn new(
        ordinal: usize,
        mut compiler: KernelCompiler,
    ) -> std::result::Result<Self, CudaError> {
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CudaError::Device(format!("GPU {ordinal}: {e:?}")))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::Device(format!("GPU {ordinal}: {e:?}")))?;
        if major < 8 {
            return Err(CudaError::Device(format!(
                "GPU {ordinal} has compute capability {major}.{minor}; Kiln needs 8.0 or newer"
            )));
        }
        compiler.arch = match (major, minor) {
            (9, _) => "compute_90",
            (8, 9) => "compute_89",
            (8, 6) => "compute_86",
            (8, _) => "compute_80",
            _ => "compute_90",
        };
        let device_name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| CudaError::Device(format!("cuBLAS: {e:?}")))?;
        let mut funcs = HashMap::new();
        for k in compiler.compile_all()? {
            let module = ctx
                .load_module(Ptx::from_src(k.ptx.clone()))
                .map_err(|e| CudaError::Device(format!("loading {}: {e:?}", k.name)))?;
            for line in k.ptx.lines() {
                if let Some(rest) = line.trim().strip_prefix(".visible .entry ") {
                    let entry = rest.split('(').next().unwrap_or(rest).to_string();
                    let f = module
                        .load_function(&entry)
                        .map_err(|e| CudaError::Device(format!("{entry}: {e:?}")))?;
                    funcs.insert(entry, f);
                }
            }
        }
        Ok(CudaBackend {
            stream,
            blas,
            funcs,
            device_name,
        })
    }

    fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| dev_err(format!("kernel {name} not loaded")))
    }

    fn buf<'a>(&self, t: &'a Tensor, op: &'static str) -> Result<&'a CudaSlice<bf16>> {
        t.storage()
            .downcast_ref::<CudaSlice<bf16>>()
            .ok_or(TensorError::WrongBackend { op, expected: NAME })
    }

    fn wrap(shape: Vec<usize>, s: CudaSlice<bf16>) -> Tensor {
        Tensor::from_storage(shape, DType::BF16, Arc::new(s))
    }

    fn alloc(&self, n: usize) -> Result<CudaSlice<bf16>> {
        self.stream
            .alloc_zeros::<bf16>(n.max(1))
            .map_err(|e| TensorError::OutOfMemory {
                backend: NAME,
                bytes: (n * 2) as u64,
                what: format!("a tensor ({e:?})"),
            })
    }

    fn upload_u32(&self, v: &[u32]) -> Result<CudaSlice<u32>> {
        if v.is_empty() {
            return self.stream.alloc_zeros::<u32>(1).map_err(dev_err);
        }
        self.stream.clone_htod(v).map_err(dev_err)
    }

    /// Wait for all queued work (for timing and profiling).
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev_err)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn kv_bytes_per_element(&self) -> usize {
        2
    }

    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(TensorError::Shape {
                op: "upload",
                detail: format!("shape {shape:?} for {} elements", data.len()),
            });
        }
        let host: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
        let dev = if host.is_empty() {
            self.alloc(0)?
        } else {
            self.stream.clone_htod(&host).map_err(dev_err)?
        };
        Ok(Self::wrap(shape.to_vec(), dev))
    }

    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>> {
        let host = self
            .stream
            .clone_dtoh(self.buf(t, "to_host")?)
            .map_err(dev_err)?;
        Ok(host[..t.num_elements()]
            .iter()
            .map(|x| x.to_f32())
            .collect())
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let (vocab, d) = table.dims2("embedding")?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(TensorError::Shape {
                op: "embedding",
                detail: format!("token id {bad} outside vocabulary of {vocab}"),
            });
        }
        let dids = self.upload_u32(ids)?;
        let mut out = self.alloc(ids.len() * d)?;
        let cfg = LaunchConfig {
            grid_dim: (ids.len().max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let di = d as i32;
        if !ids.is_empty() {
            // SAFETY: table [vocab, d], ids < vocab (checked), out [len, d].
            unsafe {
                self.stream
                    .launch_builder(self.func("embedding_bf16")?)
                    .arg(self.buf(table, "embedding")?)
                    .arg(&dids)
                    .arg(&mut out)
                    .arg(&di)
                    .launch(cfg)
                    .map_err(dev_err)?;
            }
        }
        Ok(Self::wrap(vec![ids.len(), d], out))
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (n, k) = x.dims2("linear")?;
        let (m, kw) = w.dims2("linear")?;
        if k != kw {
            return Err(TensorError::Shape {
                op: "linear",
                detail: format!("x {:?} · w {:?}ᵀ", x.shape(), w.shape()),
            });
        }
        let mut out = self.alloc(n * m)?;
        if n > 0 {
            // Row-major y[n, m] = x[n, k] · w[m, k]ᵀ is column-major yᵀ = wᵀᵀ · xᵀ.
            let cfg = GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_T,
                transb: cublasOperation_t::CUBLAS_OP_N,
                m: m as i32,
                n: n as i32,
                k: k as i32,
                alpha: bf16::ONE,
                lda: k as i32,
                ldb: k as i32,
                beta: bf16::ZERO,
                ldc: m as i32,
            };
            // SAFETY: dimensions and leading dimensions describe the three buffers exactly.
            unsafe {
                self.blas
                    .gemm(
                        cfg,
                        self.buf(w, "linear")?,
                        self.buf(x, "linear")?,
                        &mut out,
                    )
                    .map_err(dev_err)?;
            }
        }
        if let Some(b) = bias {
            if b.num_elements() != m {
                return Err(TensorError::Shape {
                    op: "linear",
                    detail: format!("bias of {} for {m} outputs", b.num_elements()),
                });
            }
            let (nl, mi) = (n as i64, m as i32);
            // SAFETY: out [n, m], bias [m].
            unsafe {
                self.stream
                    .launch_builder(self.func("add_bias_bf16")?)
                    .arg(&mut out)
                    .arg(self.buf(b, "linear bias")?)
                    .arg(&nl)
                    .arg(&mi)
                    .launch(grid_for(n * m))
                    .map_err(dev_err)?;
            }
        }
        Ok(Self::wrap(vec![n, m], out))
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
        let mut out = self.alloc(rows * d)?;
        let none: Option<&CudaSlice<bf16>> = None;
        let null = 0u64;
        let di = d as i32;
        let cfg = LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let _ = none;
        if rows > 0 {
            // SAFETY: x and out [rows, d], w [d]; a null residual pointer skips the add.
            unsafe {
                self.stream
                    .launch_builder(self.func("add_rms_norm_bf16")?)
                    .arg(self.buf(x, "rms_norm")?)
                    .arg(&null)
                    .arg(self.buf(w, "rms_norm")?)
                    .arg(&mut out)
                    .arg(&di)
                    .arg(&eps)
                    .arg(&weight_offset)
                    .launch(cfg)
                    .map_err(dev_err)?;
            }
        }
        Ok(Self::wrap(x.shape().to_vec(), out))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if a.shape() != b.shape() {
            return Err(TensorError::Shape {
                op: "add",
                detail: format!("{:?} vs {:?}", a.shape(), b.shape()),
            });
        }
        let n = a.num_elements();
        let mut out = self.alloc(n)?;
        let (nl, s) = (n as i64, 1f32);
        // SAFETY: a, b, out all hold n elements.
        unsafe {
            self.stream
                .launch_builder(self.func("add_scale_bf16")?)
                .arg(self.buf(a, "add")?)
                .arg(self.buf(b, "add")?)
                .arg(&mut out)
                .arg(&nl)
                .arg(&s)
                .launch(grid_for(n))
                .map_err(dev_err)?;
        }
        Ok(Self::wrap(a.shape().to_vec(), out))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        let n = x.num_elements();
        let mut out = self.alloc(n)?;
        let (nl, null) = (n as i64, 0u64);
        // SAFETY: x and out hold n elements; a null b selects scaling.
        unsafe {
            self.stream
                .launch_builder(self.func("add_scale_bf16")?)
                .arg(self.buf(x, "scale")?)
                .arg(&null)
                .arg(&mut out)
                .arg(&nl)
                .arg(&s)
                .launch(grid_for(n))
                .map_err(dev_err)?;
        }
        Ok(Self::wrap(x.shape().to_vec(), out))
    }

    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        if gate.shape() != up.shape() {
            return Err(TensorError::Shape {
                op: "gated_activation",
                detail: format!("{:?} vs {:?}", gate.shape(), up.shape()),
            });
        }
        let n = gate.num_elements();
        let mut out = self.alloc(n)?;
        let (nl, a) = (n as i64, if act == Activation::Silu { 0i32 } else { 1 });
        // SAFETY: gate, up, out hold n elements.
        unsafe {
            self.stream
                .launch_builder(self.func("gated_act_bf16")?)
                .arg(self.buf(gate, "gated_activation")?)
                .arg(self.buf(up, "gated_activation")?)
                .arg(&mut out)
                .arg(&nl)
                .arg(&a)
                .launch(grid_for(n))
                .map_err(dev_err)?;
        }
        Ok(Self::wrap(gate.shape().to_vec(), out))
    }

    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor> {
        kiln_tensor::check_rope_args(x, positions, p)?;
        let n = positions.len();
        let mut out = self
            .stream
            .clone_dtod(self.buf(x, "rope")?)
            .map_err(dev_err)?;
        if n > 0 {
            let dpos = self.upload_u32(positions)?;
            let dfreq = self.stream.clone_htod(p.inv_freq).map_err(dev_err)?;
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
                self.stream
                    .launch_builder(self.func("rope_bf16")?)
                    .arg(&mut out)
                    .arg(&dpos)
                    .arg(&dfreq)
                    .arg(&h)
                    .arg(&hd)
                    .arg(&half)
                    .arg(&p.attention_scaling)
                    .launch(cfg)
                    .map_err(dev_err)?;
            }
        }
        Ok(Self::wrap(x.shape().to_vec(), out))
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        let (n, d) = x.dims2("gather_rows")?;
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
            return Err(TensorError::Shape {
                op: "gather_rows",
                detail: format!("row {r} of {n}"),
            });
        }
        let mut out = self.alloc(rows.len() * d)?;
        if !rows.is_empty() {
            let drows = self.upload_u32(rows)?;
            let di = d as i32;
            let cfg = LaunchConfig {
                grid_dim: (rows.len() as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: rows < n (checked); out [len, d].
            unsafe {
                self.stream
                    .launch_builder(self.func("gather_rows_bf16")?)
                    .arg(self.buf(x, "gather_rows")?)
                    .arg(&drows)
                    .arg(&mut out)
                    .arg(&di)
                    .launch(cfg)
                    .map_err(dev_err)?;
            }
        }
        Ok(Self::wrap(vec![rows.len(), d], out))
    }

    fn alloc_kv_cache(&self, spec: KvCacheSpec) -> Result<KvCache> {
        let per_layer = spec.num_slots() * spec.num_kv_heads * spec.head_dim;
        let mut k = Vec::with_capacity(spec.num_layers);
        let mut v = Vec::with_capacity(spec.num_layers);
        for _ in 0..spec.num_layers {
            k.push(self.alloc(per_layer)?);
            v.push(self.alloc(per_layer)?);
        }
        Ok(KvCache::from_storage(spec, Box::new(CudaKv { k, v })))
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
        let (n, qw) = q.dims2("attention")?;
        let kv_row = p.num_kv_heads * p.head_dim;
        let spec = cache.spec;
        // Per-row position and block-table offset; block tables flattened.
        let mut tables = Vec::new();
        let mut row_table = vec![0u32; n];
        for seq in &batch.seqs {
            let off = tables.len() as u32;
            tables.extend_from_slice(&seq.block_table);
            row_table[seq.token_start..seq.token_start + seq.num_tokens].fill(off);
        }
        let kv = cache
            .storage_mut()
            .downcast_mut::<CudaKv>()
            .ok_or(TensorError::WrongBackend {
                op: "attention",
                expected: NAME,
            })?;
        let (kc, vc) = (&mut kv.k[layer], &mut kv.v[layer]);
        let dslots = self.upload_u32(&batch.slot_mapping)?;
        let kvi = kv_row as i32;
        let cfg = LaunchConfig {
            grid_dim: (n.max(1) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut out = self.alloc(n * qw)?;
        if n == 0 {
            return Ok(Self::wrap(vec![0, qw], out));
        }
        // SAFETY: k, v [n, kv_row]; slots < num_slots (checked); caches [num_slots, kv_row].
        unsafe {
            self.stream
                .launch_builder(self.func("write_kv_bf16")?)
                .arg(self.buf(k, "attention")?)
                .arg(self.buf(v, "attention")?)
                .arg(&mut *kc)
                .arg(&mut *vc)
                .arg(&dslots)
                .arg(&kvi)
                .launch(cfg)
                .map_err(dev_err)?;
        }
        let dpos = self.upload_u32(&batch.positions)?;
        let drow = self.upload_u32(&row_table)?;
        let dtables = self.upload_u32(&tables)?;
        let threads = 128u32;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, p.num_heads as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: (threads as usize + p.head_dim) as u32 * 4,
        };
        let (h, kvh, hd, bs) = (
            p.num_heads as i32,
            p.num_kv_heads as i32,
            p.head_dim as i32,
            spec.block_size as i32,
        );
        let window = p.sliding_window.map(|w| w as i32).unwrap_or(0);
        let softcap = p.softcap.unwrap_or(0.0);
        // SAFETY: q [n, heads * head_dim]; metadata arrays sized above; every
        // table entry < num_blocks (checked).
        unsafe {
            self.stream
                .launch_builder(self.func("paged_attention_bf16")?)
                .arg(self.buf(q, "attention")?)
                .arg(&*kc)
                .arg(&*vc)
                .arg(&mut out)
                .arg(&dpos)
                .arg(&drow)
                .arg(&dtables)
                .arg(&h)
                .arg(&kvh)
                .arg(&hd)
                .arg(&bs)
                .arg(&p.scale)
                .arg(&window)
                .arg(&softcap)
                .launch(cfg)
                .map_err(dev_err)?;
        }
        Ok(Self::wrap(vec![n, qw], out))
    }
}
