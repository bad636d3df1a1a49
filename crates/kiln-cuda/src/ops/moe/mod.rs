//! Mixture-of-Experts layers on the device (`moe.cu`) for bf16 experts:
//! every step routes and groups its rows' picks by expert on the GPU. Steps
//! of up to [`MAX_ROWS`] rows (decode) then run each picked expert once
//! over its rows by warps and sum on the GPU with no host step (so a decode
//! step with them is recorded as a graph), reading only the picked experts;
//! larger steps (prefill) read the group sizes back once, gather the rows
//! in expert order and run each projection as one grouped tensor-core
//! product (cuBLAS). Other expert kinds (blocks, MXFP4) run
//! [`kiln_tensor::moe::moe_composed`] (the device's products, routing on
//! the host).
//!
//! A layer's experts are found through device tables of their pointers,
//! made on the layer's first step and kept while its [`ExpertLoad`] lives;
//! the routing kernel counts each expert's tokens on the device, and
//! [`drain_counts`] adds them to the layer's [`ExpertLoad`] every
//! [`DRAIN_EVERY`] steps.

use std::sync::{Arc, Weak};

use kiln_tensor::{
    DType, Epilogue, ExpertActivation, ExpertLoad, MoeLayer, Ops, QuantFormat, Result, Scoring,
    Tensor, TensorError, Weight,
};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, wrap};
use crate::driver::pool::DevBuf;

/// Steps of up to this many rows run each expert by warps (every recorded
/// decode bucket); past it the experts' rows are gathered for the tensor
/// cores.
pub(crate) const MAX_ROWS: usize = 128;
/// Picks a row at most (the routing kernel's list).
const MAX_TOP_K: usize = 32;
/// Experts a layer at most (the routing kernel's shared memory).
const MAX_EXPERTS: usize = 4096;
/// Steps between two reads of the device's expert counts.
pub(crate) const DRAIN_EVERY: u64 = 16;

/// One layer's device tables.
struct Tables {
    /// The experts' weight pointers the tables were made from (gate/up,
    /// then down): a layer whose pointers differ gets new tables.
    host: Vec<u64>,
    load: Weak<ExpertLoad>,
    /// `[experts]` u64 each: gate/up, down, their biases (0: none / not held).
    ptrs: DevBuf,
    selection_bias: Option<DevBuf>,
    /// `[experts]` u64: tokens routed to each, on the device.
    counts: DevBuf,
    /// What of `counts` has been added to `load`.
    seen: Vec<u64>,
    experts: usize,
}

/// Every layer's tables on one backend.
#[derive(Default)]
pub(crate) struct MoeTables {
    layers: Vec<Tables>,
    steps: u64,
}

/// How a layer's experts are held, for the kernels that read them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Dense bf16 `[2I, H]` and `[H, I]`.
    Bf16,
    /// MXFP4 blocks: gate and up (two parts of `I` rows, or one of `2I`),
    /// down one part.
    Mxfp4,
}

/// Whether `layer` runs on the device's kernels over `x`, and if so its
/// experts' kind and (hidden, intermediate) sizes.
fn native_shape(x: &Tensor, layer: &MoeLayer) -> Option<(Kind, usize, usize)> {
    let (n, hidden) = x.dims2("moe").ok()?;
    let experts = layer.num_experts();
    let k = layer.routing.top_k.min(experts);
    if n == 0
        || k == 0
        || k > MAX_TOP_K
        || experts > MAX_EXPERTS
        || x.dtype() != DType::BF16
        || hidden % 8 != 0
    {
        return None;
    }
    if matches!(layer.activation, ExpertActivation::ClampedSwiglu { .. }) && layer.shared.is_some()
    {
        return None;
    }
    let mut found: Option<(Kind, usize)> = None;
    for e in &layer.experts {
        let (kind, two_i, h, dh, i) = match (&e.gate_up, &e.down) {
            (Weight::Dense(gu), Weight::Dense(d))
                if gu.dtype() == DType::BF16 && d.dtype() == DType::BF16 =>
            {
                let (two_i, h) = gu.dims2("moe").ok()?;
                let (dh, i) = d.dims2("moe").ok()?;
                (Kind::Bf16, two_i, h, dh, i)
            }
            (Weight::Blocks(gu), Weight::Blocks(d)) => {
                let mxfp4 = |p: &kiln_tensor::BlockPart| p.format() == QuantFormat::MXFP4;
                let parts_ok = gu.parts().iter().all(mxfp4)
                    && matches!(gu.parts().len(), 1 | 2)
                    && d.parts().len() == 1
                    && d.parts().iter().all(mxfp4);
                if !parts_ok || hidden % 32 != 0 {
                    return None;
                }
                let (two_i, h) = (gu.shape()[0], gu.shape()[1]);
                let (dh, i) = (d.shape()[0], d.shape()[1]);
                if gu.parts().len() == 2 && gu.parts()[0].rows() != i {
                    return None;
                }
                if i % 32 != 0 {
                    return None;
                }
                (Kind::Mxfp4, two_i, h, dh, i)
            }
            _ => return None,
        };
        let biases_ok = e
            .gate_up_bias
            .iter()
            .all(|b| b.dtype() == DType::BF16 && b.num_elements() == two_i)
            && e.down_bias
                .iter()
                .all(|b| b.dtype() == DType::BF16 && b.num_elements() == hidden);
        if h != hidden
            || dh != hidden
            || two_i != 2 * i
            || i % 8 != 0
            || *found.get_or_insert((kind, i)) != (kind, i)
            || !biases_ok
        {
            return None;
        }
    }
    let (kind, inter) = found?;
    Some((kind, hidden, inter))
}

/// Tables a layer keeps: weights' pointers (`TABLES - 2` of them), then
/// the gate/up and down biases'.
const TABLES: usize = 8;

/// The expert pointers of `layer`, per expert id (0 where absent or not
/// held): bf16 — gate/up, down; MXFP4 — gate body, gate meta, up body, up
/// meta, down body, down meta; then the gate/up and down biases (always
/// tables 6 and 7).
fn expert_ptrs(layer: &MoeLayer, inter: usize) -> Result<[Vec<u64>; TABLES]> {
    let e = layer.num_experts();
    let mut out: [Vec<u64>; TABLES] = std::array::from_fn(|_| vec![0u64; e]);
    for id in 0..e {
        let Some(ex) = layer.expert(id) else {
            continue;
        };
        match (&ex.gate_up, &ex.down) {
            (Weight::Dense(gu), Weight::Dense(d)) => {
                out[0][id] = ptr(gu, "moe")?;
                out[1][id] = ptr(d, "moe")?;
            }
            (Weight::Blocks(gu), Weight::Blocks(d)) => {
                use crate::ops::matmul::blocks::body_and_meta;
                let (gb, gm) = body_and_meta(&gu.parts()[0])?;
                // One part of 2I rows: the up rows start I rows in (an
                // MXFP4 row of H is H / 32 blocks of 16 + 1 bytes).
                let (ub, um) = match gu.parts().get(1) {
                    Some(up) => body_and_meta(up)?,
                    None => {
                        let blocks = (inter * (gu.shape()[1] / 32)) as u64;
                        (gb + 16 * blocks, gm + blocks)
                    }
                };
                let (db, dm) = body_and_meta(&d.parts()[0])?;
                [out[0][id], out[1][id], out[2][id], out[3][id]] = [gb, gm, ub, um];
                [out[4][id], out[5][id]] = [db, dm];
            }
            _ => {}
        }
        if let Some(b) = &ex.gate_up_bias {
            out[6][id] = ptr(b, "moe")?;
        }
        if let Some(b) = &ex.down_bias {
            out[7][id] = ptr(b, "moe")?;
        }
    }
    Ok(out)
}

/// A layer's tables on the device, and its experts' weight pointers.
struct Found {
    /// [`TABLES`] tables of `experts` pointers (see [`expert_ptrs`]).
    tables: [u64; TABLES],
    selection_bias: u64,
    counts: u64,
    /// The tables' host values (bf16 experts' gate/up and down pointers
    /// are the first two).
    ptrs: [Vec<u64>; TABLES],
}

/// `layer`'s tables (made now if it has none).
fn tables(cuda: &CudaBackend, layer: &MoeLayer, inter: usize) -> Result<Found> {
    let ptrs = expert_ptrs(layer, inter)?;
    let host: Vec<u64> = ptrs[..TABLES - 2].concat();
    let mut all = cuda.moe.lock().map_err(dev_err)?;
    all.layers.retain(|t| t.load.strong_count() > 0);
    // The layer's own load first (one pointer), then its experts' pointers.
    let found = all
        .layers
        .iter()
        .position(|t| std::ptr::eq(t.load.as_ptr(), Arc::as_ptr(&layer.load)) && t.host == host);
    let t = match found {
        Some(i) => &all.layers[i],
        None => {
            cuda.no_upload_while_recording("a Mixture-of-Experts layer's expert tables")?;
            let e = layer.num_experts();
            let buf = cuda.dev.alloc_exact(TABLES * e * 8, "expert tables")?;
            cuda.dev.htod(buf.ptr, &ptrs.concat())?;
            let selection_bias = match &layer.selection_bias {
                Some(b) if b.len() == e => {
                    let buf = cuda.dev.alloc_exact(e * 4, "expert selection bias")?;
                    cuda.dev.htod(buf.ptr, b)?;
                    Some(buf)
                }
                Some(b) => {
                    return Err(TensorError::Shape {
                        op: "moe",
                        detail: format!("selection bias of {} for {e} experts", b.len()),
                    })
                }
                None => None,
            };
            let counts = cuda.dev.alloc_zeroed(e * 8, "expert counts")?;
            all.layers.push(Tables {
                host,
                load: Arc::downgrade(&layer.load),
                ptrs: buf,
                selection_bias,
                counts,
                seen: vec![0; e],
                experts: e,
            });
            all.layers.last().expect("pushed")
        }
    };
    let e = t.experts as u64;
    Ok(Found {
        tables: std::array::from_fn(|i| t.ptrs.ptr + i as u64 * 8 * e),
        selection_bias: t.selection_bias.as_ref().map_or(0, |b| b.ptr),
        counts: t.counts.ptr,
        ptrs,
    })
}

/// Adds the tokens the device counted since the last call to each layer's
/// [`ExpertLoad`], every [`DRAIN_EVERY`]th call (`now`: this one). Not
/// while a step is being recorded.
pub(crate) fn drain_counts(cuda: &CudaBackend, now: bool) -> Result<()> {
    let mut all = cuda.moe.lock().map_err(dev_err)?;
    all.steps += 1;
    if all.layers.is_empty() || !(now || all.steps % DRAIN_EVERY == 0) {
        return Ok(());
    }
    for t in &mut all.layers {
        let Some(load) = t.load.upgrade() else {
            continue;
        };
        let counts: Vec<u64> = cuda.dev.dtoh(t.counts.ptr, t.experts)?;
        for (e, (&c, seen)) in counts.iter().zip(&mut t.seen).enumerate() {
            load.add(e, c.saturating_sub(*seen));
            *seen = c;
        }
    }
    Ok(())
}

/// A whole sparse layer over `x` ([`kiln_tensor::Ops::moe`]).
pub(crate) fn moe(cuda: &CudaBackend, x: &Tensor, layer: &MoeLayer) -> Result<Tensor> {
    let n = x.shape().first().copied().unwrap_or(0);
    // MXFP4 experts in larger steps: their products through the device's
    // dequantized slabs, routed on the host.
    let native = native_shape(x, layer)
        .filter(|&(kind, ..)| available(cuda, kind) && (kind == Kind::Bf16 || n <= MAX_ROWS));
    let Some((kind, hidden, inter)) = native else {
        cuda.no_upload_while_recording("a Mixture-of-Experts layer's host routing")?;
        return kiln_tensor::moe::moe_composed(cuda, x, layer);
    };
    let experts = layer.num_experts();
    let (re, rh) = layer.router.dims2("moe")?;
    if re != experts || rh != hidden {
        return Err(TensorError::Shape {
            op: "moe",
            detail: format!("router [{re}, {rh}] for {experts} experts over x [{n}, {hidden}]"),
        });
    }
    let s = Shape {
        n,
        experts,
        k: layer.routing.top_k.min(experts),
    };
    let found = tables(cuda, layer, inter)?;
    let logits = cuda.matmul(
        x,
        &layer.router,
        None,
        Epilogue::bias(layer.router_bias.as_ref()),
    )?;
    let grouped = n > MAX_ROWS;
    let r = route(cuda, &s, layer, &found, ptr(&logits, "moe")?, grouped)?;
    let (act, alpha, limit): (i32, f32, f32) = match layer.activation {
        ExpertActivation::Gated(a) => (crate::ops::activation::act_code(a), 0.0, 0.0),
        ExpertActivation::ClampedSwiglu { alpha, limit } => (3, alpha, limit),
    };
    let shared = shared_expert(cuda, x, layer)?;
    let (shared_p, shared_gate_p) = match &shared {
        Some((ys, g)) => (
            ptr(ys, "moe")?,
            match g {
                Some(g) => ptr(g, "moe")?,
                None => 0,
            },
        ),
        None => (0, 0),
    };
    let out = cuda.alloc(n * hidden, "moe output")?;
    let xp = ptr(x, "moe")?;
    let t = found.tables;
    let (gub_tab, db_tab) = (t[6], t[7]);
    let (k_i, h_i, i_i, e_i) = (s.k as i32, hidden as i32, inter as i32, experts as i32);
    if !grouped {
        // Each picked expert once over its pairs, by warps.
        let pairs = n * s.k;
        let bound = experts.min(pairs) as u32;
        let h = cuda.dev.alloc(pairs * inter, 2, "expert activations")?;
        let y = cuda.dev.alloc(pairs * hidden, 4, "expert outputs")?;
        // SAFETY: x [n, hidden] and h [pairs, inter] bf16, y [pairs,
        // hidden] f32, out [n, hidden] bf16; the route's arrays as `route`
        // made them; the tables' experts (native_shape checked every held
        // one) are bf16 [2*inter, hidden] and [hidden, inter], or MXFP4
        // parts of those rows and columns on the device, or 0.
        unsafe {
            let mut gate_up = cuda.dev.launch(cuda.dev.func(match kind {
                Kind::Bf16 => "moe_gate_up_bf16",
                Kind::Mxfp4 => "moe_gate_up_mxfp4",
            })?);
            gate_up.arg(&xp).arg(&h_i).arg(&i_i).arg(&k_i).arg(&t[0]);
            if kind == Kind::Mxfp4 {
                gate_up.arg(&t[1]).arg(&t[2]).arg(&t[3]);
            }
            gate_up
                .arg(&gub_tab)
                .arg(&r.used_count)
                .arg(&r.used)
                .arg(&r.offsets)
                .arg(&r.order)
                .arg(&act)
                .arg(&alpha)
                .arg(&limit)
                .arg(&h.ptr)
                .launch(cfg((bound, inter.div_ceil(8) as u32, 1), 256, 0))
                .map_err(dev_err)?;
            let mut down = cuda.dev.launch(cuda.dev.func(match kind {
                Kind::Bf16 => "moe_down_bf16",
                Kind::Mxfp4 => "moe_down_mxfp4",
            })?);
            down.arg(&h.ptr).arg(&h_i).arg(&i_i);
            match kind {
                Kind::Bf16 => down.arg(&t[1]),
                Kind::Mxfp4 => down.arg(&t[4]).arg(&t[5]),
            };
            down.arg(&db_tab)
                .arg(&r.used_count)
                .arg(&r.used)
                .arg(&r.offsets)
                .arg(&r.order)
                .arg(&y.ptr)
                .launch(cfg((bound, hidden.div_ceil(8) as u32, 1), 256, 0))
                .map_err(dev_err)?;
            cuda.dev
                .launch(cuda.dev.func("moe_combine_bf16")?)
                .arg(&y.ptr)
                .arg(&r.ids)
                .arg(&r.weights)
                .arg(&k_i)
                .arg(&h_i)
                .arg(&e_i)
                .arg(&t[0])
                .arg(&shared_p)
                .arg(&shared_gate_p)
                .arg(&out.ptr)
                .launch(cfg((n as u32, hidden.div_ceil(256) as u32, 1), 256, 0))
                .map_err(dev_err)?;
        }
    } else {
        // Prefill: the pairs' rows gathered in expert order, each expert's
        // rows through one grouped tensor-core product a projection (the
        // group sizes read back once).
        let head: Vec<i32> = cuda.dev.dtoh(r.used_count, 2 * experts + 2)?;
        let used_count = head[0].clamp(0, experts as i32) as usize;
        let used = &head[1..1 + used_count];
        let offsets = &head[1 + experts..2 + experts + used_count];
        let total = offsets[used_count].max(0) as usize;
        let xs = cuda.dev.alloc(total * hidden, 2, "expert rows")?;
        let gu = cuda.dev.alloc(total * 2 * inter, 2, "expert gate/up")?;
        let h = cuda.dev.alloc(total * inter, 2, "expert activations")?;
        let ys = cuda.dev.alloc(total * hidden, 2, "expert outputs")?;
        let problems = |w: &[u64], input: u64, in_w: usize, output: u64, out_w: usize| {
            used.iter()
                .zip(offsets.windows(2))
                .map(|(&e, o)| crate::ops::matmul::Problem {
                    w: w[e as usize],
                    x: input + 2 * (o[0] as usize * in_w) as u64,
                    out: output + 2 * (o[0] as usize * out_w) as u64,
                    n: (o[1] - o[0]).max(0) as usize,
                })
                .collect::<Vec<_>>()
        };
        if total > 0 {
            // SAFETY: x [n, hidden] bf16, order[total] rows of it; xs
            // [total, hidden], gu [total, 2*inter], h [total, inter] bf16.
            unsafe {
                cuda.dev
                    .launch(cuda.dev.func("moe_gather_bf16")?)
                    .arg(&xp)
                    .arg(&r.order)
                    .arg(&k_i)
                    .arg(&h_i)
                    .arg(&xs.ptr)
                    .launch(cfg((total as u32, hidden.div_ceil(2048) as u32, 1), 256, 0))
                    .map_err(dev_err)?;
            }
            let p = problems(&found.ptrs[0], xs.ptr, hidden, gu.ptr, 2 * inter);
            crate::ops::matmul::grouped_gemm(&cuda.dev, &p, hidden, 2 * inter)?;
            // SAFETY: gu [total, 2*inter] and h [total, inter] bf16; ids
            // and order as `route` made them; the bias table's entries are
            // bf16 [2*inter] or 0.
            unsafe {
                cuda.dev
                    .launch(cuda.dev.func("moe_act_bf16")?)
                    .arg(&gu.ptr)
                    .arg(&r.ids)
                    .arg(&r.order)
                    .arg(&i_i)
                    .arg(&gub_tab)
                    .arg(&act)
                    .arg(&alpha)
                    .arg(&limit)
                    .arg(&h.ptr)
                    .launch(cfg((total as u32, inter.div_ceil(256) as u32, 1), 256, 0))
                    .map_err(dev_err)?;
            }
            let p = problems(&found.ptrs[1], h.ptr, inter, ys.ptr, hidden);
            crate::ops::matmul::grouped_gemm(&cuda.dev, &p, inter, hidden)?;
        }
        // SAFETY: ys [total, hidden] bf16 at pos[] of each pair (or -1),
        // out [n, hidden].
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("moe_combine_sorted_bf16")?)
                .arg(&ys.ptr)
                .arg(&r.pos)
                .arg(&r.ids)
                .arg(&r.weights)
                .arg(&k_i)
                .arg(&h_i)
                .arg(&db_tab)
                .arg(&shared_p)
                .arg(&shared_gate_p)
                .arg(&out.ptr)
                .launch(cfg((n as u32, hidden.div_ceil(256) as u32, 1), 256, 0))
                .map_err(dev_err)?;
        }
    }
    drop((shared, r));
    Ok(wrap(vec![n, hidden], out))
}

/// The shared expert's output over `x` and its gate's logits, by the
/// device's products (the combine adds them).
fn shared_expert(
    cuda: &CudaBackend,
    x: &Tensor,
    layer: &MoeLayer,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    let Some(sh) = &layer.shared else {
        return Ok(None);
    };
    let ExpertActivation::Gated(a) = layer.activation else {
        unreachable!("native_shape refuses a shared expert with the clamped SwiGLU")
    };
    let e = &sh.expert;
    let epi = Epilogue {
        bias: e.gate_up_bias.as_ref(),
        gated: Some(a),
        residual: None,
    };
    let hs = cuda.matmul(x, &e.gate_up, None, epi)?;
    let ys = cuda.matmul(&hs, &e.down, None, Epilogue::bias(e.down_bias.as_ref()))?;
    let gate = match &sh.gate {
        Some(g) => Some(cuda.matmul(x, g, None, Epilogue::NONE)?),
        None => None,
    };
    Ok(Some((ys, gate)))
}

/// A layer's sizes for one step.
struct Shape {
    n: usize,
    experts: usize,
    /// Picks a row.
    k: usize,
}

/// A step's routing on the device: each row's picks and weights, and the
/// pairs grouped by expert (`moe_group`'s arrays).
struct Routed {
    ids: u64,
    weights: u64,
    used_count: u64,
    used: u64,
    offsets: u64,
    order: u64,
    /// Each pair's index in `order` (grouped steps; else 0).
    pos: u64,
    _bufs: [DevBuf; 3],
}

fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Routes every row of `logits` (`[n, experts]` bf16) and groups the picks.
fn route(
    cuda: &CudaBackend,
    s: &Shape,
    layer: &MoeLayer,
    found: &Found,
    logits: u64,
    with_pos: bool,
) -> Result<Routed> {
    let (n, experts, pairs) = (s.n, s.experts, s.n * s.k);
    // Padding rows of a recorded step write to the hidden scratch slot:
    // they are routed but not counted.
    let (slots, pad_slot) = match cuda.active() {
        Some(a) if a.meta.num_rows == n => (a.base + 4 * a.meta.slot as u64, a.pad_slot),
        _ => (0u64, u32::MAX),
    };
    let picks = cuda.dev.alloc(2 * pairs, 4, "expert picks")?;
    let groups = cuda
        .dev
        .alloc(2 * experts + 2 + pairs, 4, "expert groups")?;
    let pos = cuda
        .dev
        .alloc(if with_pos { pairs } else { 1 }, 4, "pair places")?;
    let (ids, weights) = (picks.ptr, picks.ptr + 4 * pairs as u64);
    let (used_count, used) = (groups.ptr, groups.ptr + 4);
    let offsets = used + 4 * experts as u64;
    let order = offsets + 4 * (experts as u64 + 1);
    let pos_p = if with_pos { pos.ptr } else { 0 };
    let (scoring, expert_groups, keep_groups): (i32, i32, i32) = match layer.routing.scoring {
        Scoring::Softmax => (0, 1, 1),
        Scoring::TopKSoftmax => (1, 1, 1),
        Scoring::Sigmoid => (2, 1, 1),
        Scoring::SigmoidGroups { groups, keep } | Scoring::SoftmaxGroups { groups, keep } => {
            if groups > 64 || experts % groups.max(1) as usize != 0 {
                return Err(TensorError::Unsupported {
                    backend: "cuda",
                    what: format!(
                        "{groups} expert groups of {experts} experts (at most 64, dividing them)"
                    ),
                });
            }
            let kind = match layer.routing.scoring {
                Scoring::SigmoidGroups { .. } => 3,
                _ => 4,
            };
            (kind, groups.max(1) as i32, keep.min(groups) as i32)
        }
    };
    let (e_i, k_i, pairs_i) = (experts as i32, s.k as i32, pairs as i32);
    let normalize = layer.routing.normalize as i32;
    let scale = layer.routing.scale;
    // Decode steps: a warp a row, routing and grouping in one launch.
    let one_launch_smem = ((n + 1) * 2 * experts + n * s.k) * 4 + experts.next_multiple_of(4);
    if n <= 32 && one_launch_smem <= 48 * 1024 && cuda.dev.has("moe_route_group_bf16") {
        let n_i = n as i32;
        // SAFETY: as below; the block's shared memory holds n rows of
        // 2*experts floats, 2*experts + n*k ints and experts bytes.
        unsafe {
            cuda.dev
                .launch(cuda.dev.func("moe_route_group_bf16")?)
                .arg(&logits)
                .arg(&n_i)
                .arg(&e_i)
                .arg(&k_i)
                .arg(&scoring)
                .arg(&expert_groups)
                .arg(&keep_groups)
                .arg(&normalize)
                .arg(&scale)
                .arg(&found.selection_bias)
                .arg(&ids)
                .arg(&weights)
                .arg(&found.counts)
                .arg(&slots)
                .arg(&pad_slot)
                .arg(&found.tables[0])
                .arg(&used_count)
                .arg(&used)
                .arg(&offsets)
                .arg(&order)
                .arg(&pos_p)
                .launch(cfg((1, 1, 1), 32 * n as u32, one_launch_smem as u32))
                .map_err(dev_err)?;
        }
        return Ok(Routed {
            ids,
            weights,
            used_count,
            used,
            offsets,
            order,
            pos: pos_p,
            _bufs: [picks, groups, pos],
        });
    }
    // SAFETY: logits [n, experts] bf16; picks holds 2*pairs words, groups
    // 2*experts + 2 + pairs, pos pairs (when asked); the counts and
    // selection bias (when not 0) `experts` entries; slots (when not 0)
    // the running step's n slots.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("moe_route_bf16")?)
            .arg(&logits)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&scoring)
            .arg(&expert_groups)
            .arg(&keep_groups)
            .arg(&normalize)
            .arg(&scale)
            .arg(&found.selection_bias)
            .arg(&ids)
            .arg(&weights)
            .arg(&found.counts)
            .arg(&slots)
            .arg(&pad_slot)
            .launch(cfg(
                (n as u32, 1, 1),
                128,
                (experts * 9).div_ceil(4) as u32 * 4,
            ))
            .map_err(dev_err)?;
        cuda.dev
            .launch(cuda.dev.func("moe_group")?)
            .arg(&ids)
            .arg(&pairs_i)
            .arg(&e_i)
            .arg(&found.tables[0])
            .arg(&used_count)
            .arg(&used)
            .arg(&offsets)
            .arg(&order)
            .arg(&pos_p)
            .launch(cfg(
                (1, 1, 1),
                256,
                (experts * 8 + experts.next_multiple_of(4)) as u32,
            ))
            .map_err(dev_err)?;
    }
    Ok(Routed {
        ids,
        weights,
        used_count,
        used,
        offsets,
        order,
        pos: pos_p,
        _bufs: [picks, groups, pos],
    })
}

/// Whether the device kernels for `kind` are loaded.
fn available(cuda: &CudaBackend, kind: Kind) -> bool {
    let mxfp4 = ["moe_gate_up_mxfp4", "moe_down_mxfp4"];
    (kind == Kind::Bf16 || mxfp4.iter().all(|k| cuda.dev.has(k)))
        && [
            "moe_route_bf16",
            "moe_group",
            "moe_gate_up_bf16",
            "moe_down_bf16",
            "moe_combine_bf16",
            "moe_gather_bf16",
            "moe_act_bf16",
            "moe_combine_sorted_bf16",
        ]
        .iter()
        .all(|k| cuda.dev.has(k))
}
