//! The CPU backend: f32 host tensors, multithreaded with rayon. It is the
//! reference implementation of every op.

mod attention;
pub mod matmul;
mod moe;
pub(crate) mod ops;
pub mod quant;
mod vmath;

use std::sync::Arc;

use crate::backend::{
    Activation, AttentionParams, Backend, ForwardBatch, KvCache, KvPoolShape, Memory, Ops,
    RopeParams, Sampling, StepFn, StepRecording,
};
use crate::error::{Result, TensorError};
use crate::extension::ExtensionOp;
use crate::tensor::{DType, Tensor};
use crate::weight::{BlockPart, BlockWeight, Weight, WeightKind};
use kiln_quant::QuantMatrix;

use attention::{CpuKv, E4m3, KvElem};
use half::f16;

/// How the CPU keeps its KV cache (`--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuKvDtype {
    /// Keys and values as computed (the goldens' numerics).
    #[default]
    F32,
    /// Each key and value rounded to the nearest f16 when written: half
    /// the bytes (twice the tokens in a pool, half the attention reads);
    /// the attention's arithmetic is the f32 cache's, on the rounded
    /// values, so still batch-invariant but not the goldens' bits.
    F16,
    /// Each key and value rounded to E4M3 at unit scale (as the CUDA FP8
    /// cache): a quarter of the bytes, a few percent of rounding a value.
    Fp8,
}

impl CpuKvDtype {
    /// Its `--kv-cache-dtype` name.
    pub fn name(self) -> &'static str {
        match self {
            CpuKvDtype::F32 => "f32",
            CpuKvDtype::F16 => "f16",
            CpuKvDtype::Fp8 => "fp8",
        }
    }
}

/// A host (CPU backend) tensor's values; another backend's tensor is an
/// error naming `op`.
pub(crate) fn host_data<'a>(t: &'a Tensor, op: &'static str) -> Result<&'a [f32]> {
    t.storage()
        .downcast_ref::<Vec<f32>>()
        .map(|v| v.as_slice())
        .ok_or(TensorError::WrongBackend {
            op,
            expected: "cpu",
        })
}

/// The CPU backend. Threads come from the rayon pool the caller set up,
/// or, for a rank of a tensor-parallel group, from a pool of its own.
#[derive(Debug, Default, Clone)]
pub struct CpuBackend {
    matmul: quant::CpuMatmul,
    kv: CpuKvDtype,
    /// Its rank of an in-process tensor-parallel group, if in one.
    rank: Option<crate::collective::HostRank>,
    /// The threads its steps run on (`None`: the global pool). A rank
    /// needs its own: ranks wait for each other inside a step, and a rank
    /// waiting on a shared pool's thread could hold the thread another
    /// rank's work is queued for.
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl CpuBackend {
    /// The exact backend (f32 activations, batch-invariant).
    pub fn new() -> Self {
        CpuBackend::default()
    }

    /// A backend whose packed products run in `mode` (`--cpu-matmul`).
    pub fn with_matmul(mode: quant::CpuMatmul) -> Self {
        CpuBackend {
            matmul: mode,
            ..CpuBackend::default()
        }
    }

    /// This backend with its KV cache kept as `dtype`.
    pub fn with_kv_dtype(self, dtype: CpuKvDtype) -> Self {
        CpuBackend { kv: dtype, ..self }
    }

    /// This backend as rank `rank` of `group` (the CPU twin of one GPU of
    /// a tensor-parallel group), its steps on a pool of `threads` threads
    /// of its own.
    pub fn in_group(
        self,
        group: Arc<crate::collective::HostGroup>,
        rank: usize,
        threads: usize,
    ) -> Result<Self> {
        if rank >= group.world() {
            return Err(TensorError::Shape {
                op: "in_group",
                detail: format!("rank {rank} of a group of {}", group.world()),
            });
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("kiln-tp{rank}-{i}"))
            .build()
            .map_err(|e| TensorError::Device {
                backend: "cpu",
                message: format!("starting rank {rank}'s threads: {e}"),
            })?;
        Ok(CpuBackend {
            rank: Some(crate::collective::HostRank { group, rank }),
            pool: Some(Arc::new(pool)),
            ..self
        })
    }

    /// The mode its packed products run in.
    pub fn matmul_mode(&self) -> quant::CpuMatmul {
        self.matmul
    }

    fn data<'a>(&self, t: &'a Tensor, op: &'static str) -> Result<&'a [f32]> {
        host_data(t, op)
    }

    fn wrap(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        Tensor::from_storage(shape, DType::F32, Arc::new(data))
    }

    fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
        if a.shape() != b.shape() {
            return Err(TensorError::Shape {
                op,
                detail: format!("{:?} vs {:?}", a.shape(), b.shape()),
            });
        }
        Ok(())
    }

    fn blocks<'a>(part: &'a BlockPart, op: &'static str) -> Result<&'a quant::Stored> {
        part.storage()
            .downcast_ref::<quant::Stored>()
            .ok_or(TensorError::WrongBackend {
                op,
                expected: "cpu",
            })
    }

    /// `+ bias` on every row of `out` (`m` wide).
    fn add_bias(&self, out: &mut [f32], m: usize, bias: Option<&Tensor>) -> Result<()> {
        let Some(b) = bias else { return Ok(()) };
        let b = self.data(b, "matmul bias")?;
        if b.len() != m {
            return Err(TensorError::Shape {
                op: "matmul",
                detail: format!("bias of {} for {} outputs", b.len(), m),
            });
        }
        for row in out.chunks_mut(m) {
            for (o, &bv) in row.iter_mut().zip(b) {
                *o += bv;
            }
        }
        Ok(())
    }

    /// The cache's layers, f32, f16 or E4M3.
    fn kv(cache: &mut KvCache) -> Result<Kv<'_>> {
        let storage = cache.storage_mut();
        if storage.is::<CpuKv<f32>>() {
            return Ok(Kv::F32(storage.downcast_mut::<CpuKv<f32>>().unwrap()));
        }
        if storage.is::<CpuKv<E4m3>>() {
            return Ok(Kv::Fp8(storage.downcast_mut::<CpuKv<E4m3>>().unwrap()));
        }
        match storage.downcast_mut::<CpuKv<f16>>() {
            Some(kv) => Ok(Kv::F16(kv)),
            None => Err(TensorError::WrongBackend {
                op: "attention",
                expected: "cpu",
            }),
        }
    }
}

/// A CPU KV cache of either element.
enum Kv<'a> {
    F32(&'a mut CpuKv<f32>),
    F16(&'a mut CpuKv<f16>),
    Fp8(&'a mut CpuKv<E4m3>),
}

/// Writes this step's keys and values (when given) into `layer`, then
/// attends over the layer.
fn attend_in<E: KvElem>(
    kv: &mut CpuKv<E>,
    layer: usize,
    new: Option<(&[f32], &[f32])>,
    qd: &[f32],
    batch: &ForwardBatch,
    p: &AttentionParams,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    if let Some((kd, vd)) = new {
        let slots = &batch.slot_mapping[p.kv_group];
        kv.write(layer, slots, kd, vd, (p.num_kv_heads, p.head_dim));
    }
    attention::attend_sinks(qd, batch, &kv.k[layer], &kv.v[layer], kv.kv_row, p, sinks)
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
}

/// Host memory; the defaults' element sizes (f32) are the CPU's.
impl Memory for CpuBackend {
    fn upload(&self, shape: &[usize], data: &[f32]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != data.len() {
            return Err(TensorError::Shape {
                op: "upload",
                detail: format!("shape {:?} for {} elements", shape, data.len()),
            });
        }
        Ok(Self::wrap(shape.to_vec(), data.to_vec()))
    }

    /// Dense f32 and every block format.
    fn supports_weight(&self, kind: WeightKind) -> bool {
        matches!(kind, WeightKind::Dense(_) | WeightKind::Blocks(_))
    }

    /// Quantized blocks repacked (the mapped pages let go), F16/BF16 as
    /// they are (in place, where they are a mapped file's).
    fn upload_blocks(&self, m: QuantMatrix) -> Result<BlockPart> {
        let (format, rows, cols) = (m.format(), m.rows(), m.cols());
        let stored = quant::Stored::new(m);
        Ok(BlockPart::from_storage(
            format,
            rows,
            cols,
            stored.num_bytes(),
            Arc::new(stored),
        ))
    }

    fn to_host(&self, t: &Tensor) -> Result<Vec<f32>> {
        Ok(self.data(t, "to_host")?.to_vec())
    }

    fn kv_bytes_per_element(&self) -> usize {
        match self.kv {
            CpuKvDtype::F32 => 4,
            CpuKvDtype::F16 => 2,
            CpuKvDtype::Fp8 => 1,
        }
    }

    fn alloc_kv_cache(&self, spec: KvPoolShape) -> Result<KvCache> {
        fn alloc<E: KvElem>(spec: &KvPoolShape) -> Result<CpuKv<E>> {
            let per_layer = spec.num_slots() * spec.kv_row;
            let layers = |what: &str| -> Result<Vec<Vec<E>>> {
                (0..spec.num_layers)
                    .map(|_| {
                        zeroed::<E>(per_layer).ok_or_else(|| TensorError::OutOfMemory {
                            backend: "cpu",
                            bytes: (per_layer * std::mem::size_of::<E>()) as u64,
                            what: format!("KV cache {what}"),
                        })
                    })
                    .collect()
            };
            Ok(CpuKv {
                k: layers("keys")?,
                v: layers("values")?,
                block_size: spec.block_size,
                kv_row: spec.kv_row,
            })
        }
        let storage: Box<dyn std::any::Any + Send> = match self.kv {
            CpuKvDtype::F32 => Box::new(alloc::<f32>(&spec)?),
            CpuKvDtype::F16 => Box::new(alloc::<f16>(&spec)?),
            CpuKvDtype::Fp8 => Box::new(alloc::<E4m3>(&spec)?),
        };
        Ok(KvCache::from_storage(spec, storage))
    }

    fn alloc_state(
        &self,
        shape: crate::recurrent::StateShape,
    ) -> Result<Box<dyn std::any::Any + Send>> {
        let n = shape.num_layers * shape.num_slots * shape.per_slot();
        let v = zeroed::<f32>(n).ok_or_else(|| TensorError::OutOfMemory {
            backend: "cpu",
            bytes: shape.bytes(),
            what: "recurrent state".into(),
        })?;
        Ok(Box::new(v))
    }
}

/// The reference ops. `matmul` is the default composition
/// ([`crate::matmul_unfused`]), so the fused forms are the unfused ops bit
/// for bit.
impl Ops for CpuBackend {
    fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        let (vocab, d) = table.dims2("embedding")?;
        let outside = |id: u32| TensorError::Shape {
            op: "embedding",
            detail: format!("token id {id} outside vocabulary of {vocab}"),
        };
        let mut out = Vec::with_capacity(ids.len() * d);
        match table {
            Weight::Blocks(bw) => {
                let [part] = bw.parts() else {
                    return Err(TensorError::Shape {
                        op: "embedding",
                        detail: format!("a table of {} parts", bw.parts().len()),
                    });
                };
                if let Some(id) = Self::blocks(part, "embedding")?.lookup(ids, &mut out) {
                    return Err(outside(id));
                }
            }
            _ => {
                let data = self.data(table.dense("embedding")?, "embedding")?;
                for &id in ids {
                    let i = id as usize;
                    if i >= vocab {
                        return Err(outside(id));
                    }
                    out.extend_from_slice(&data[i * d..(i + 1) * d]);
                }
            }
        }
        Ok(Self::wrap(vec![ids.len(), d], out))
    }

    fn matmul_dense(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (n, k) = x.dims2("matmul")?;
        let (m, kw) = w.dims2("matmul")?;
        if k != kw {
            return Err(TensorError::Shape {
                op: "matmul",
                detail: format!("x {:?} · w {:?}ᵀ", x.shape(), w.shape()),
            });
        }
        let mut out = matmul::matmul_t(self.data(x, "matmul")?, n, k, self.data(w, "matmul")?, m);
        self.add_bias(&mut out, m, bias)?;
        Ok(Self::wrap(vec![n, m], out))
    }

    /// Each part into its columns of the output, through
    /// [`quant::matmul`]: the dense product of the dequantized weight, bit
    /// for bit.
    fn matmul_blocks(&self, x: &Tensor, w: &BlockWeight, bias: Option<&Tensor>) -> Result<Tensor> {
        let (n, k) = x.dims2("matmul")?;
        let (m, kw) = (w.shape()[0], w.shape()[1]);
        if k != kw {
            return Err(TensorError::Shape {
                op: "matmul",
                detail: format!("x {:?} · w {:?}ᵀ", x.shape(), w.shape()),
            });
        }
        let xd = self.data(x, "matmul")?;
        let mut out = vec![0f32; n * m];
        let parts = w
            .parts()
            .iter()
            .map(|p| Self::blocks(p, "matmul"))
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: the parts stack to m columns in each of the n output rows
        // of m, and nothing else writes `out`.
        unsafe { quant::matmul_stacked(&parts, xd, n, out.as_mut_ptr(), m, self.matmul) };
        self.add_bias(&mut out, m, bias)?;
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
        let out = ops::rms_norm(
            self.data(x, "rms_norm")?,
            self.data(w, "rms_norm")?,
            eps,
            weight_offset,
        );
        Ok(Self::wrap(x.shape().to_vec(), out))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Self::same_shape("add", a, b)?;
        let (da, db) = (self.data(a, "add")?, self.data(b, "add")?);
        Ok(Self::wrap(
            a.shape().to_vec(),
            da.iter().zip(db).map(|(x, y)| x + y).collect(),
        ))
    }

    fn scale(&self, x: &Tensor, s: f32) -> Result<Tensor> {
        let d = self.data(x, "scale")?;
        Ok(Self::wrap(
            x.shape().to_vec(),
            d.iter().map(|v| v * s).collect(),
        ))
    }

    fn gated_activation(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        Self::same_shape("gated_activation", gate, up)?;
        let out = ops::gated(
            self.data(gate, "gated_activation")?,
            self.data(up, "gated_activation")?,
            act,
        );
        Ok(Self::wrap(gate.shape().to_vec(), out))
    }

    /// Both halves read in place: no copy of the gate and up columns.
    fn gated_packed(&self, y: &Tensor, act: Activation) -> Result<Tensor> {
        let (n, two_i) = y.dims2("gated_packed")?;
        if two_i % 2 != 0 {
            return Err(TensorError::Shape {
                op: "gated_packed",
                detail: format!("{two_i} packed gate/up columns"),
            });
        }
        let out = ops::gated_packed(self.data(y, "gated_packed")?, two_i / 2, act);
        Ok(Self::wrap(vec![n, two_i / 2], out))
    }

    fn rope(&self, x: &Tensor, positions: &[u32], p: &RopeParams<'_>) -> Result<Tensor> {
        crate::backend::check_rope_args(x, positions, p)?;
        let mut out = self.data(x, "rope")?.to_vec();
        ops::rope(&mut out, positions, p);
        Ok(Self::wrap(x.shape().to_vec(), out))
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        let (n, d) = x.dims2("gather_rows")?;
        let data = self.data(x, "gather_rows")?;
        let mut out = Vec::with_capacity(rows.len() * d);
        for &r in rows {
            let r = r as usize;
            if r >= n {
                return Err(TensorError::Shape {
                    op: "gather_rows",
                    detail: format!("row {r} of {n}"),
                });
            }
            out.extend_from_slice(&data[r * d..(r + 1) * d]);
        }
        Ok(Self::wrap(vec![rows.len(), d], out))
    }

    fn split_cols(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        let (n, d) = x.dims2("split_cols")?;
        if widths.iter().sum::<usize>() != d {
            return Err(TensorError::Shape {
                op: "split_cols",
                detail: format!("{widths:?} out of {d} columns"),
            });
        }
        let data = self.data(x, "split_cols")?;
        let mut start = 0;
        let mut out = Vec::with_capacity(widths.len());
        for &w in widths {
            let mut part = Vec::with_capacity(n * w);
            for row in data.chunks(d.max(1)).take(n) {
                part.extend_from_slice(&row[start..start + w]);
            }
            out.push(Self::wrap(vec![n, w], part));
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
        crate::backend::check_attention_args(q, k, v, &cache.spec, layer, batch, p)?;
        let (n, qw) = q.dims2("attention")?;
        let (qd, kd, vd) = (
            self.data(q, "attention")?,
            self.data(k, "attention")?,
            self.data(v, "attention")?,
        );
        let out = match Self::kv(cache)? {
            Kv::F32(kv) => attend_in(kv, layer, Some((kd, vd)), qd, batch, p, None),
            Kv::F16(kv) => attend_in(kv, layer, Some((kd, vd)), qd, batch, p, None),
            Kv::Fp8(kv) => attend_in(kv, layer, Some((kd, vd)), qd, batch, p, None),
        };
        Ok(Self::wrap(vec![n, qw], out))
    }

    fn attention_shared(
        &self,
        q: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        batch: &ForwardBatch,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        crate::backend::check_shared_attention_args(q, &cache.spec, layer, batch, p)?;
        let (n, qw) = q.dims2("attention_shared")?;
        let qd = self.data(q, "attention_shared")?;
        let out = match Self::kv(cache)? {
            Kv::F32(kv) => attend_in(kv, layer, None, qd, batch, p, None),
            Kv::F16(kv) => attend_in(kv, layer, None, qd, batch, p, None),
            Kv::Fp8(kv) => attend_in(kv, layer, None, qd, batch, p, None),
        };
        Ok(Self::wrap(vec![n, qw], out))
    }

    /// Causal and bidirectional, with or without a window.
    fn supports_attention(&self, _p: &AttentionParams) -> bool {
        true
    }

    fn supports_attention_sinks(&self) -> bool {
        true
    }

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
        crate::backend::check_attention_args(q, k, v, &cache.spec, layer, batch, p)?;
        let (n, qw) = q.dims2("attention")?;
        let sd = self.data(sinks, "attention sinks")?;
        if sd.len() != p.num_heads {
            return Err(TensorError::Shape {
                op: "attention sinks",
                detail: format!("{} sinks for {} heads", sd.len(), p.num_heads),
            });
        }
        let (qd, kd, vd) = (
            self.data(q, "attention")?,
            self.data(k, "attention")?,
            self.data(v, "attention")?,
        );
        let out = match Self::kv(cache)? {
            Kv::F32(kv) => attend_in(kv, layer, Some((kd, vd)), qd, batch, p, Some(sd)),
            Kv::F16(kv) => attend_in(kv, layer, Some((kd, vd)), qd, batch, p, Some(sd)),
            Kv::Fp8(kv) => attend_in(kv, layer, Some((kd, vd)), qd, batch, p, Some(sd)),
        };
        Ok(Self::wrap(vec![n, qw], out))
    }

    /// Every extension op: the CPU runs each op's reference.
    fn supports_lora(&self) -> bool {
        true
    }

    /// Each delta: the rows gathered, `(x·Aᵀ)·Bᵀ` by the dense product
    /// (row-invariant, so a row's delta does not depend on its group),
    /// scaled, added to its columns.
    fn lora_add(
        &self,
        y: &Tensor,
        x: &Tensor,
        deltas: &[crate::lora::LoraDelta<'_>],
    ) -> Result<Tensor> {
        let (n, width) = y.dims2("lora_add")?;
        let (nx, k) = x.dims2("lora_add")?;
        let shape_err = |detail: String| TensorError::Shape {
            op: "lora_add",
            detail,
        };
        if nx != n {
            return Err(shape_err(format!("{nx} rows of x for {n} of y")));
        }
        let mut out = self.data(y, "lora_add")?.to_vec();
        let xd = self.data(x, "lora_add")?;
        for d in deltas {
            let (r, ka) = d.proj.a.dims2("lora_add")?;
            let (o, rb) = d.proj.b.dims2("lora_add")?;
            if ka != k || rb != r || o != d.cols.len() || d.cols.end > width {
                return Err(shape_err(format!(
                    "A [{r}, {ka}] and B [{o}, {rb}] for x [{n}, {k}] into columns {:?} of {width}",
                    d.cols
                )));
            }
            let rows: Vec<usize> = d.rows.iter().flat_map(|r| r.clone()).collect();
            if let Some(&bad) = rows.iter().find(|&&i| i >= n) {
                return Err(shape_err(format!("row {bad} of {n}")));
            }
            let mut xs = Vec::with_capacity(rows.len() * k);
            for &i in &rows {
                xs.extend_from_slice(&xd[i * k..(i + 1) * k]);
            }
            let a = self.data(&d.proj.a, "lora_add")?;
            let b = self.data(&d.proj.b, "lora_add")?;
            let t = matmul::matmul_t(&xs, rows.len(), k, a, r);
            let delta = matmul::matmul_t(&t, rows.len(), r, b, o);
            for (j, &i) in rows.iter().enumerate() {
                let dst = &mut out[i * width + d.cols.start..i * width + d.cols.end];
                for (y, v) in dst.iter_mut().zip(&delta[j * o..(j + 1) * o]) {
                    *y += d.proj.scale * v;
                }
            }
        }
        Ok(Self::wrap(vec![n, width], out))
    }

    fn supports_moe(&self) -> bool {
        true
    }

    fn moe(&self, x: &Tensor, layer: &crate::moe::MoeLayer) -> Result<Tensor> {
        self.moe_layer(x, layer)
    }

    fn supports_recurrent(&self, _mixer: &crate::recurrent::RecurrentMixer) -> bool {
        true
    }

    fn recurrent_mixer(
        &self,
        x: &Tensor,
        layer: &crate::recurrent::RecurrentMixer,
        batch: &ForwardBatch,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (n, d) = x.dims2("recurrent_mixer")?;
        if d != layer.in_dim() || n != batch.num_tokens() {
            return Err(TensorError::Shape {
                op: "recurrent_mixer",
                detail: format!(
                    "input [{n}, {d}] for {} tokens of {} columns",
                    batch.num_tokens(),
                    layer.in_dim()
                ),
            });
        }
        let seqs: Vec<crate::recurrent::SeqRun> = batch
            .seqs
            .iter()
            .enumerate()
            .map(|(i, s)| crate::recurrent::SeqRun {
                rows: s.token_start..s.token_start + s.num_tokens,
                num_computed: s.num_computed,
                state: batch.seq_state(i),
            })
            .collect();
        let data = self.data(x, "recurrent_mixer")?;
        let Some((shape, storage)) = cache.state_mut() else {
            return Err(TensorError::Shape {
                op: "recurrent_mixer",
                detail: "a cache without recurrent state".into(),
            });
        };
        let state = storage
            .downcast_mut::<Vec<f32>>()
            .ok_or_else(|| TensorError::Shape {
                op: "recurrent_mixer",
                detail: "recurrent state of another backend".into(),
            })?;
        let out = crate::recurrent::recurrent_reference(layer, data, &seqs, &shape, state)?;
        Ok(Self::wrap(vec![n, layer.out_dim()], out))
    }

    fn has_extension(&self, _name: &str) -> bool {
        true
    }

    fn extension(&self, op: &dyn ExtensionOp, x: &Tensor) -> Result<Tensor> {
        let (shape, out) = op.cpu(self.data(x, op.name())?, x.shape())?;
        if shape.iter().product::<usize>() != out.len() {
            return Err(TensorError::Shape {
                op: op.name(),
                detail: format!("{} elements for shape {shape:?}", out.len()),
            });
        }
        Ok(Self::wrap(shape, out))
    }
}

/// Tokens are sampled on the host (the defaults).
impl Sampling for CpuBackend {}

/// A step runs on a worker of the compute pool (rayon's global pool), so
/// every op's parallel region starts on a pool thread. Called from any
/// other thread, each region would be handed to the pool while the caller
/// sleeps until it is done: measured ~20 µs a region on the 2-core VM (a
/// decode step has ~150 of them), against one such hand-off a step here.
impl StepRecording for CpuBackend {
    fn run_step(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        forward: &mut StepFn<'_>,
    ) -> Result<Tensor> {
        if let Some(pool) = &self.pool {
            return pool.install(|| forward(batch, cache));
        }
        if rayon::current_thread_index().is_some() {
            return forward(batch, cache);
        }
        rayon::scope(|_| forward(batch, cache))
    }
}

impl crate::collective::Collectives for CpuBackend {
    fn tp_rank(&self) -> (usize, usize) {
        self.rank
            .as_ref()
            .map_or((0, 1), |r| (r.rank, r.group.world()))
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        match &self.rank {
            Some(r) => r.all_reduce_sum(self, x),
            None => Ok(x.clone()),
        }
    }

    fn all_gather_columns(&self, x: &Tensor, keep: &[usize]) -> Result<Tensor> {
        match &self.rank {
            Some(r) => r.all_gather_columns(self, x, keep),
            None => Ok(x.clone()),
        }
    }

    fn abort_collectives(&self) {
        if let Some(r) = &self.rank {
            r.group.abort(r.rank);
        }
    }

    fn reset_collectives(&self) {
        if let Some(r) = &self.rank {
            r.group.reset();
        }
    }
}

/// `n` zeros from the allocator's zeroed memory (`calloc`): large pools
/// come from the kernel's zero pages, so a KV pool costs resident memory
/// only as its blocks are written. `None` when the allocation fails.
fn zeroed<E: KvElem>(n: usize) -> Option<Vec<E>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<E>(n).ok()?;
    // SAFETY: the layout has a non-zero size; a non-null result is an
    // allocation of `n` elements from the global allocator, all bits zero
    // (a valid 0.0 for f32 and f16, the only elements), which `Vec` may own
    // and free with the same layout.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut E;
        if ptr.is_null() {
            return None;
        }
        Some(Vec::from_raw_parts(ptr, n, n))
    }
}
