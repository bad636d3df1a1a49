//! Tensor parallelism: one model split over the ranks of a group, each a
//! backend with its [`kiln_tensor::Collectives`] (NCCL on GPUs, a
//! [`kiln_tensor::HostGroup`] on the CPU — the twin CI checks).
//!
//! The split is Megatron's: q/k/v and gate/up are column-parallel (each
//! rank holds a slice of the heads and of the intermediate size, whole
//! heads; KV heads are replicated where there are fewer than ranks),
//! o and down are row-parallel and end in one all-reduce each, after
//! which the residual is added (so it is rounded once, as in the whole
//! model; a fused all-reduce + add is the next step); biases of
//! row-parallel products are held by rank 0 alone. The embedding and the output head are
//! vocabulary-parallel: rank `r` holds rows `[r·c, (r+1)·c)` (c = ⌈V/N⌉)
//! and one zero row, a token outside its rows is looked up as the zero
//! row, and the looked-up rows are all-reduced (a sum with one non-zero
//! term: exact); the head's logits are all-gathered by columns. A Mixture
//! of Experts splits every expert (and the shared one) like a dense MLP:
//! the router is replicated, so every rank routes alike, and the layer's
//! output is one all-reduce.
//!
//! A family opts in with [`TensorParallel`] on its registry entry: which
//! role each of its tensors plays, and its own keys cut to one rank's
//! share. [`load_tensor_parallel`] loads each rank through a
//! [`ShardSource`] (the rank's slices of the checkpoint, read through the
//! family's unchanged loader with the rank's config) and returns a
//! [`TensorParallelLm`], which runs every rank's step on its own thread.

use std::path::Path;
use std::sync::Arc;

use kiln_formats::{HostTensor, StoredTensor, WeightSource};
use kiln_tensor::{Backend, ForwardBatch, KvCache, Tensor};
use kiln_tensor::{QuantMatrix, SharedBytes};

use crate::config::{err, ModelConfig};
use crate::error::{ModelError, Result};
use crate::families::FamilyConfig;
use crate::layers::{LoadProgress, WeightBytes};
use crate::registry;
use crate::CausalLm;

/// One rank's place in a tensor-parallel model, kept in its
/// [`ModelConfig::tensor_parallel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpShard {
    pub rank: usize,
    pub world: usize,
    /// The whole vocabulary.
    pub vocab_size: usize,
    /// Expert parallelism: the routed experts a layer has, which the ranks
    /// hold whole, an equal run each (`None`: every expert split like a
    /// dense MLP).
    pub experts: Option<usize>,
}

impl TpShard {
    /// Rows of the vocabulary each rank holds (the last may hold fewer).
    pub fn vocab_chunk(&self) -> usize {
        self.vocab_size.div_ceil(self.world)
    }

    /// The vocabulary rows rank `rank` holds.
    pub fn vocab_range(&self, rank: usize) -> std::ops::Range<usize> {
        let c = self.vocab_chunk();
        let start = (rank * c).min(self.vocab_size);
        start..((rank + 1) * c).min(self.vocab_size)
    }

    /// Tokens as this rank's embedding rows: its own ids shifted to its
    /// slice, every other id the zero row after it.
    pub fn local_ids(&self, ids: &[u32]) -> Vec<u32> {
        let r = self.vocab_range(self.rank);
        let zero = self.vocab_chunk() as u32;
        ids.iter()
            .map(|&t| match r.contains(&(t as usize)) {
                true => t - r.start as u32,
                false => zero,
            })
            .collect()
    }

    /// The routed experts this rank holds whole (expert parallelism).
    pub fn held_experts(&self) -> Option<std::ops::Range<usize>> {
        self.experts.map(|n| {
            let per = n / self.world;
            self.rank * per..(self.rank + 1) * per
        })
    }

    /// Columns of each rank's logits that are real tokens.
    pub fn vocab_widths(&self) -> Vec<usize> {
        (0..self.world).map(|r| self.vocab_range(r).len()).collect()
    }
}

/// How a tensor is split over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpRole {
    /// Every rank holds all of it (norms, routers).
    Replicated,
    /// Output rows split (the second-to-last axis; a bias's only axis).
    Column,
    /// Output rows split by key/value heads, replicated where there are
    /// fewer heads than ranks.
    KvColumn,
    /// A fused gate|up stack: each half's output rows split.
    ColumnHalves,
    /// Input columns split (the last axis).
    Row,
    /// Rank 0 holds it, the others zeros (a row-parallel product's bias).
    FirstRank,
    /// Vocabulary rows: this rank's slice and one zero row.
    Vocab,
}

/// A family's support for tensor parallelism, on its registry entry.
pub struct TensorParallel {
    /// The role of each of its tensors, by Hugging Face name.
    pub role: fn(&str) -> TpRole,
    /// Its own config keys as one of `world` ranks holds them (sizes the
    /// split divides), or an error naming the key that does not divide;
    /// with expert parallelism (the flag), also the routed experts a
    /// layer has (which must split evenly), else an error.
    pub shard: fn(&FamilyConfig, usize, bool) -> Result<(FamilyConfig, Option<usize>)>,
}

/// The size `key` has on each of `world` ranks, or why it does not split.
pub fn split(key: &str, size: usize, world: usize) -> Result<usize> {
    if size % world != 0 {
        return Err(err(
            key,
            format!("{size} does not split over a tensor-parallel degree of {world}"),
        ));
    }
    Ok(size / world)
}

/// Checks that `cfg` splits over `world` ranks (its family supports it,
/// the heads divide, the KV heads divide or are divided), naming the key
/// that does not.
pub fn check_degree(cfg: &ModelConfig, world: usize) -> Result<()> {
    shard_config(cfg, 0, world, false).map(|_| ())
}

/// `cfg` as rank `rank` of `world` holds it: its share of the heads, KV
/// heads (at least one), intermediate size and the family's own sizes,
/// and a vocabulary of its slice and the zero row; with
/// `expert_parallel`, its run of whole experts instead of a slice of each.
pub fn shard_config(
    cfg: &ModelConfig,
    rank: usize,
    world: usize,
    expert_parallel: bool,
) -> Result<ModelConfig> {
    let family = registry::find(&cfg.model_type).ok_or_else(|| ModelError::UnsupportedModel {
        model_type: cfg.model_type.clone(),
        supported: registry::supported_model_types(),
    })?;
    let Some(tp) = family.tensor_parallel else {
        return Err(err(
            "model_type",
            format!(
                "the {} family ({}) does not run tensor parallel yet \
                 (the llama and moe families do)",
                family.name, cfg.model_type
            ),
        ));
    };
    if world == 0 || world > 64 {
        return Err(err(
            "tensor_parallel",
            format!("a degree of {world} (1 to 64)"),
        ));
    }
    let mut out = cfg.clone();
    if world == 1 {
        return Ok(out);
    }
    out.num_heads = split("num_attention_heads", cfg.num_heads, world)?;
    let kv = cfg.num_kv_heads;
    if kv % world != 0 && world % kv != 0 {
        return Err(err(
            "num_key_value_heads",
            format!(
                "{kv} KV heads neither split over {world} ranks nor are replicated evenly \
                 ({world} is not a multiple of {kv})"
            ),
        ));
    }
    out.num_kv_heads = (kv / world).max(1);
    for l in &mut out.layer_kv {
        l.num_kv_heads = out.num_kv_heads;
    }
    out.intermediate_size = split("intermediate_size", cfg.intermediate_size, world)?;
    let (family, experts) = (tp.shard)(&cfg.family, world, expert_parallel)?;
    out.family = family;
    let shard = TpShard {
        rank,
        world,
        vocab_size: cfg.vocab_size,
        experts,
    };
    out.vocab_size = shard.vocab_chunk() + 1;
    out.tensor_parallel = Some(shard);
    Ok(out)
}

/// A checkpoint as one rank sees it: each tensor its family's role gives
/// it, sliced to the rank's part.
pub struct ShardSource<'a> {
    inner: &'a dyn WeightSource,
    role: fn(&str) -> TpRole,
    shard: TpShard,
    /// The whole model's KV heads (how k/v rows split).
    kv_heads: usize,
}

/// One axis of a tensor cut to `pieces` (ranges of the axis, in order;
/// `pad` zero entries after them).
struct Cut {
    axis: usize,
    pieces: Vec<std::ops::Range<usize>>,
    pad: usize,
}

impl<'a> ShardSource<'a> {
    pub fn new(
        inner: &'a dyn WeightSource,
        tp: &TensorParallel,
        shard: TpShard,
        kv_heads: usize,
    ) -> Self {
        ShardSource {
            inner,
            role: tp.role,
            shard,
            kv_heads,
        }
    }

    /// How `name` of `shape` is cut for this rank (`None`: whole).
    fn cut(&self, name: &str, shape: &[usize]) -> Option<Cut> {
        let TpShard { rank, world, .. } = self.shard;
        if let Some(held) = self.shard.held_experts() {
            // Expert parallel: a routed expert's tensors whole (the loader
            // asks for the held ones only), a fused stack cut to them.
            let mut parts = name.rsplit('.');
            let (last, module) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            if module == "experts" && matches!(last, "gate_up_proj" | "down_proj") {
                return Some(Cut {
                    axis: 0,
                    pieces: vec![held],
                    pad: 0,
                });
            }
            if name.contains(".experts.") {
                return None;
            }
        }
        let n = shape.len();
        let out_axis = n.saturating_sub(2);
        let part = |len: usize, parts: usize, i: usize| {
            let c = len / parts;
            i * c..(i + 1) * c
        };
        match (self.role)(name) {
            TpRole::Replicated => None,
            TpRole::FirstRank => Some(Cut {
                axis: 0,
                pieces: match rank {
                    0 => vec![0..shape[0]],
                    _ => Vec::new(),
                },
                pad: if rank == 0 { 0 } else { shape[0] },
            }),
            TpRole::Column => Some(Cut {
                axis: out_axis,
                pieces: vec![part(shape[out_axis], world, rank)],
                pad: 0,
            }),
            TpRole::KvColumn => {
                let parts = world.min(self.kv_heads);
                Some(Cut {
                    axis: out_axis,
                    pieces: vec![part(shape[out_axis], parts, rank * parts / world)],
                    pad: 0,
                })
            }
            TpRole::ColumnHalves => {
                let half = shape[out_axis] / 2;
                let p = part(half, world, rank);
                Some(Cut {
                    axis: out_axis,
                    pieces: vec![p.clone(), half + p.start..half + p.end],
                    pad: 0,
                })
            }
            TpRole::Row => Some(Cut {
                axis: n - 1,
                pieces: vec![part(shape[n - 1], world, rank)],
                pad: 0,
            }),
            TpRole::Vocab => {
                let r = self.shard.vocab_range(rank);
                Some(Cut {
                    axis: 0,
                    pad: self.shard.vocab_chunk() + 1 - r.len(),
                    pieces: vec![r],
                })
            }
        }
    }

    fn local_shape(&self, name: &str, shape: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        if let Some(c) = self.cut(name, shape) {
            s[c.axis] = c.pieces.iter().map(|p| p.len()).sum::<usize>() + c.pad;
        }
        s
    }

    /// `data` (row-major, `shape`) cut as `c` says.
    fn apply<T: Copy + Default>(c: &Cut, shape: &[usize], data: &[T]) -> Vec<T> {
        let outer: usize = shape[..c.axis].iter().product();
        let inner: usize = shape[c.axis + 1..].iter().product();
        let dim = shape[c.axis];
        let kept: usize = c.pieces.iter().map(|p| p.len()).sum::<usize>() + c.pad;
        let mut out = Vec::with_capacity(outer * kept * inner);
        for o in 0..outer {
            let base = o * dim * inner;
            for p in &c.pieces {
                out.extend_from_slice(&data[base + p.start * inner..base + p.end * inner]);
            }
            out.resize(out.len() + c.pad * inner, T::default());
        }
        out
    }

    /// A block matrix cut by rows, or by columns on whole blocks (`None`:
    /// the cut splits blocks, so the caller loads it dense).
    fn cut_blocks(&self, name: &str, m: QuantMatrix) -> Result<Option<QuantMatrix>> {
        let shape = [m.rows(), m.cols()];
        let Some(c) = self.cut(name, &shape) else {
            return Ok(Some(m));
        };
        let (rb, format) = (m.row_bytes(), m.format());
        let bytes: Vec<u8> = if c.axis == 0 {
            let mut b = Vec::new();
            for p in &c.pieces {
                b.extend_from_slice(m.rows_bytes(p.clone()));
            }
            b.resize(b.len() + c.pad * rb, 0);
            b
        } else {
            let bs = format.block_size();
            if c.pieces
                .iter()
                .any(|p| p.start % bs != 0 || p.end % bs != 0)
            {
                return Ok(None);
            }
            let block_bytes = rb / (m.cols() / bs);
            let all = m.rows_bytes(0..m.rows());
            let mut b = Vec::new();
            for row in all.chunks(rb) {
                for p in &c.pieces {
                    b.extend_from_slice(&row[p.start / bs * block_bytes..p.end / bs * block_bytes]);
                }
            }
            b
        };
        let local = self.local_shape(name, &shape);
        QuantMatrix::new(format, local[0], local[1], SharedBytes::from_vec(bytes))
            .map(Some)
            .map_err(|what| {
                kiln_formats::FormatError::Invalid {
                    path: self.inner.path().to_path_buf(),
                    what: format!("{name} for rank {}: {what}", self.shard.rank),
                }
                .into()
            })
    }
}

impl WeightSource for ShardSource<'_> {
    fn path(&self) -> &Path {
        self.inner.path()
    }

    fn tensors(&self) -> Vec<StoredTensor> {
        self.inner
            .tensors()
            .into_iter()
            .map(|mut t| {
                let local = self.local_shape(&t.name, &t.shape);
                let (full, part) = (
                    t.shape.iter().product::<usize>().max(1) as u64,
                    local.iter().product::<usize>() as u64,
                );
                t.num_bytes = t.num_bytes * part / full;
                t.shape = local;
                t
            })
            .collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn load_f32(&self, name: &str) -> kiln_formats::Result<HostTensor> {
        let t = self.inner.load_f32(name)?;
        Ok(match self.cut(name, &t.shape) {
            Some(c) => HostTensor::new(
                self.local_shape(name, &t.shape),
                Self::apply(&c, &t.shape, &t.data),
            ),
            None => t,
        })
    }

    fn load_bf16(&self, name: &str) -> kiln_formats::Result<Option<(Vec<usize>, Vec<u16>)>> {
        Ok(self
            .inner
            .load_bf16(name)?
            .map(|(shape, bits)| match self.cut(name, &shape) {
                Some(c) => (
                    self.local_shape(name, &shape),
                    Self::apply(&c, &shape, &bits),
                ),
                None => (shape, bits),
            }))
    }

    fn load_blocks(&self, name: &str) -> kiln_formats::Result<Option<QuantMatrix>> {
        match self.inner.load_blocks(name)? {
            Some(m) => self.cut_blocks(name, m).map_err(|e| match e {
                ModelError::Format(f) => f,
                other => kiln_formats::FormatError::Invalid {
                    path: self.inner.path().to_path_buf(),
                    what: other.to_string(),
                },
            }),
            None => Ok(None),
        }
    }

    fn load_bytes(
        &self,
        name: &str,
    ) -> kiln_formats::Result<Option<(String, Vec<usize>, Vec<u8>)>> {
        match (self.role)(name) {
            TpRole::Replicated => self.inner.load_bytes(name),
            _ => Ok(None),
        }
    }
}

/// A model split over the ranks of a group: each rank's part is the
/// family's own model with the rank's config; a step runs every rank at
/// once (rank 0 on the caller's thread) and returns rank 0's logits,
/// which hold the whole vocabulary.
pub struct TensorParallelLm {
    cfg: ModelConfig,
    ranks: Vec<Box<dyn CausalLm>>,
    weight_bytes: WeightBytes,
    /// The other nodes' ranks, which run every step this node runs.
    followers: Option<Arc<Followers>>,
    /// Names of this model's caches, for the followers.
    next_cache: std::sync::atomic::AtomicU64,
}

/// A tensor-parallel model's KV cache: one a rank of this node, and the
/// name its followers keep theirs by.
struct RankCaches {
    caches: Vec<KvCache>,
    remote: Option<(Arc<Followers>, u64)>,
}

impl Drop for RankCaches {
    fn drop(&mut self) {
        if let Some((f, id)) = &self.remote {
            let _ = f.send(&NodeCommand::DropCache { id: *id });
        }
    }
}

/// What the leading node tells the others' ranks, in step order.
#[derive(serde::Serialize, serde::Deserialize)]
enum NodeCommand {
    /// Make a cache (`max_seqs`: with recurrent state for that many).
    NewCache {
        id: u64,
        num_blocks: usize,
        block_size: usize,
        max_seqs: Option<usize>,
    },
    /// Run a step on a cache (`hidden`: the final hidden states).
    Forward {
        id: u64,
        batch: ForwardBatch,
        hidden: bool,
    },
    DropCache {
        id: u64,
    },
}

/// The connections to the other nodes of a tensor-parallel model, from
/// the node that serves it.
pub struct Followers {
    nodes: Vec<std::sync::Mutex<std::net::TcpStream>>,
}

impl Followers {
    pub fn new(nodes: Vec<std::net::TcpStream>) -> Arc<Self> {
        Arc::new(Followers {
            nodes: nodes.into_iter().map(std::sync::Mutex::new).collect(),
        })
    }

    fn send(&self, c: &NodeCommand) -> Result<()> {
        use std::io::Write;
        let body = serde_json::to_vec(c).map_err(|e| err("tensor_parallel", e.to_string()))?;
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        for n in &self.nodes {
            let mut n = n.lock().unwrap_or_else(|p| p.into_inner());
            n.write_all(&frame).map_err(|e| {
                err(
                    "tensor_parallel",
                    format!("a following node is gone ({e}); restart every node"),
                )
            })?;
        }
        Ok(())
    }
}

fn read_command(r: &mut impl std::io::Read) -> std::io::Result<NodeCommand> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Runs the steps the leading node sends on `model` (this node's ranks)
/// until it disconnects: the loop of every node but the one serving.
pub fn follow(model: &dyn CausalLm, leader: &mut std::net::TcpStream) -> Result<()> {
    let mut caches: std::collections::HashMap<u64, KvCache> = Default::default();
    loop {
        let cmd = match read_command(leader) {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(err("tensor_parallel", format!("the leading node: {e}"))),
        };
        match cmd {
            NodeCommand::NewCache {
                id,
                num_blocks,
                block_size,
                max_seqs,
            } => {
                let c = match max_seqs {
                    Some(m) => model.new_cache(num_blocks, block_size, m),
                    None => model.new_kv_cache(num_blocks, block_size),
                };
                match c {
                    Ok(c) => {
                        caches.insert(id, c);
                    }
                    // Without it this node cannot follow; its going away
                    // fails the leader's steps.
                    Err(e) => return Err(e),
                }
            }
            NodeCommand::Forward { id, batch, hidden } => {
                let Some(c) = caches.get_mut(&id) else {
                    return Err(err(
                        "tensor_parallel",
                        format!("the leader ran a cache {id} this node lacks"),
                    ));
                };
                let r = match hidden {
                    true => model.hidden_states(&batch, c),
                    false => model.forward(&batch, c),
                };
                if let Err(e) = r {
                    tracing::warn!("tensor parallel: a step failed here: {e}");
                }
            }
            NodeCommand::DropCache { id } => {
                caches.remove(&id);
            }
        }
    }
}

/// Loads the model `config` describes from `source` split over a group:
/// `backends` are consecutive ranks of it (their
/// [`kiln_tensor::Collectives::tp_rank`]), all of the group's or, on one
/// node of several, this node's (the others load theirs and follow this
/// one's steps: [`TensorParallelLm::with_followers`], [`follow`]).
pub fn load_tensor_parallel(
    backends: Vec<Arc<dyn Backend>>,
    source: &dyn WeightSource,
    config: ModelConfig,
    progress: Option<LoadProgress<'_>>,
) -> Result<Box<dyn CausalLm>> {
    Ok(Box::new(load_ranks(
        backends, source, config, progress, false,
    )?))
}

/// [`load_tensor_parallel`], as the concrete model; `expert_parallel`
/// gives each rank a run of whole experts instead of a slice of each.
pub fn load_ranks(
    backends: Vec<Arc<dyn Backend>>,
    source: &dyn WeightSource,
    config: ModelConfig,
    progress: Option<LoadProgress<'_>>,
    expert_parallel: bool,
) -> Result<TensorParallelLm> {
    let (first, world) = backends
        .first()
        .map(|b| b.tp_rank())
        .ok_or_else(|| err("tensor_parallel", "no backends".to_string()))?;
    shard_config(&config, 0, world, expert_parallel)?;
    let family = registry::find(&config.model_type).expect("checked by shard_config");
    let tp = family.tensor_parallel.expect("checked by shard_config");
    (family.check_weights)(&config, &source.tensors())?;
    let mut ranks = Vec::with_capacity(backends.len());
    let mut weight_bytes = WeightBytes::default();
    for (i, backend) in backends.into_iter().enumerate() {
        let rank = first + i;
        if backend.tp_rank() != (rank, world) {
            return Err(err(
                "tensor_parallel",
                format!(
                    "backend {i} is rank {:?} of a group, not rank {rank} of {world}",
                    backend.tp_rank()
                ),
            ));
        }
        let local = shard_config(&config, rank, world, expert_parallel)?;
        let shard = local.tensor_parallel.unwrap_or(TpShard {
            rank,
            world,
            vocab_size: config.vocab_size,
            experts: None,
        });
        let src = ShardSource::new(source, tp, shard, config.num_kv_heads);
        let model = registry::load_model_with_progress(backend, &src, local, progress)?;
        for (k, v) in model
            .weight_bytes()
            .map(|w| w.0.clone())
            .unwrap_or_default()
        {
            *weight_bytes.0.entry(k).or_default() += v;
        }
        ranks.push(model);
    }
    Ok(TensorParallelLm {
        cfg: config,
        ranks,
        weight_bytes,
        followers: None,
        next_cache: std::sync::atomic::AtomicU64::new(1),
    })
}

impl TensorParallelLm {
    /// The group's size.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// This model, whose every step and cache the nodes behind
    /// `followers` mirror with their ranks.
    pub fn with_followers(mut self, followers: Arc<Followers>) -> Self {
        self.followers = Some(followers);
        self
    }

    /// Caches of every rank of this node, made as `make` makes them, and
    /// the followers' made to match.
    fn caches(
        &self,
        make: impl Fn(&dyn CausalLm) -> Result<KvCache>,
        num_blocks: usize,
        block_size: usize,
        max_seqs: Option<usize>,
    ) -> Result<KvCache> {
        let caches = self
            .ranks
            .iter()
            .map(|m| make(m.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let remote = match &self.followers {
            Some(f) => {
                let id = self
                    .next_cache
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                f.send(&NodeCommand::NewCache {
                    id,
                    num_blocks,
                    block_size,
                    max_seqs,
                })?;
                Some((f.clone(), id))
            }
            None => None,
        };
        let spec = caches[0].spec;
        Ok(KvCache::from_storage(
            spec,
            Box::new(RankCaches { caches, remote }),
        ))
    }

    /// `step` on every rank at once, each with its own cache; rank 0's
    /// result. A rank that fails aborts the group's collectives, so the
    /// others return too.
    fn each(
        &self,
        batch: &ForwardBatch,
        cache: &mut KvCache,
        hidden: bool,
        step: impl Fn(&dyn CausalLm, &ForwardBatch, &mut KvCache) -> Result<Tensor> + Sync,
    ) -> Result<Tensor> {
        let Some(RankCaches { caches, remote }) = cache.storage_mut().downcast_mut::<RankCaches>()
        else {
            return Err(err(
                "tensor_parallel",
                "a cache this tensor-parallel model did not make".to_string(),
            ));
        };
        if let Some((f, id)) = remote {
            if !batch.lora.is_empty() {
                return Err(err(
                    "tensor_parallel",
                    "LoRA adapters do not run on a model split over nodes".to_string(),
                ));
            }
            f.send(&NodeCommand::Forward {
                id: *id,
                batch: batch.clone(),
                hidden,
            })?;
        }
        let first = self.ranks[0].backend();
        first.reset_collectives();
        let run = |m: &dyn CausalLm, c: &mut KvCache| {
            let r = step(m, batch, c);
            if r.is_err() {
                m.backend().abort_collectives();
            }
            r
        };
        let (head, rest) = caches.split_at_mut(1);
        std::thread::scope(|s| {
            let others: Vec<_> = self.ranks[1..]
                .iter()
                .zip(rest.iter_mut())
                .map(|(m, c)| s.spawn(move || run(m.as_ref(), c)))
                .collect();
            let mine = run(self.ranks[0].as_ref(), &mut head[0]);
            let mut first_err = None;
            for h in others {
                match h.join() {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        first_err.get_or_insert(e);
                    }
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            match (mine, first_err) {
                (Ok(t), None) => Ok(t),
                (Err(e), _) | (Ok(_), Some(e)) => Err(e),
            }
        })
    }
}

impl CausalLm for TensorParallelLm {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        self.ranks[0].backend()
    }

    fn rank_config(&self) -> &ModelConfig {
        self.ranks[0].config()
    }

    fn weight_bytes(&self) -> Option<&WeightBytes> {
        Some(&self.weight_bytes)
    }

    fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        self.caches(
            |m| m.new_kv_cache(num_blocks, block_size),
            num_blocks,
            block_size,
            None,
        )
    }

    fn new_cache(&self, num_blocks: usize, block_size: usize, max_seqs: usize) -> Result<KvCache> {
        self.caches(
            |m| m.new_cache(num_blocks, block_size, max_seqs),
            num_blocks,
            block_size,
            Some(max_seqs),
        )
    }

    fn forward(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        self.each(batch, cache, false, |m, b, c| m.forward(b, c))
    }

    fn hidden_states(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        self.each(batch, cache, true, |m, b, c| m.hidden_states(b, c))
    }

    fn generates(&self) -> bool {
        self.ranks[0].generates()
    }

    fn expert_load(&self) -> Vec<Vec<u64>> {
        // Every rank routes alike (the router is replicated).
        self.ranks[0].expert_load()
    }
}
