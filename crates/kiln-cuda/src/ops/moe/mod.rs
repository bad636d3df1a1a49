//! Mixture-of-Experts layers on the device (`moe.cu`): steps of up to
//! [`MAX_ROWS`] rows with bf16 experts route, group, run and sum on the
//! GPU with no host step (a decode step with them is recorded as a graph),
//! reading only the picked experts, each once a step. Larger steps
//! (prefill) and other expert kinds run
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
    DType, Epilogue, ExpertActivation, ExpertLoad, MoeLayer, Ops, Result, Scoring, Tensor,
    TensorError, Weight,
};

use crate::backend::CudaBackend;
use crate::driver::device::{dev_err, ptr, wrap};
use crate::driver::pool::DevBuf;

/// Steps of up to this many rows run on the device (every recorded decode
/// bucket); past it the experts' rows are gathered for the tensor cores.
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

/// Whether `layer` runs on the device over `n` rows of `x`, and if so its
/// (hidden, intermediate) sizes.
fn native_shape(x: &Tensor, layer: &MoeLayer, n: usize) -> Option<(usize, usize)> {
    let hidden = x.shape().get(1).copied()?;
    let experts = layer.num_experts();
    let k = layer.routing.top_k.min(experts);
    if n == 0
        || n > MAX_ROWS
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
    let mut inter = None;
    for e in &layer.experts {
        let (Weight::Dense(gu), Weight::Dense(d)) = (&e.gate_up, &e.down) else {
            return None;
        };
        let (two_i, h) = gu.dims2("moe").ok()?;
        let (dh, i) = d.dims2("moe").ok()?;
        let biases_ok = e
            .gate_up_bias
            .iter()
            .all(|b| b.dtype() == DType::BF16 && b.num_elements() == two_i)
            && e.down_bias
                .iter()
                .all(|b| b.dtype() == DType::BF16 && b.num_elements() == hidden);
        if gu.dtype() != DType::BF16
            || d.dtype() != DType::BF16
            || h != hidden
            || dh != hidden
            || two_i != 2 * i
            || i % 8 != 0
            || *inter.get_or_insert(i) != i
            || !biases_ok
        {
            return None;
        }
    }
    Some((hidden, inter?))
}

/// The expert pointers of `layer`, per expert id: gate/up, down, gate/up
/// bias, down bias (0 where absent or not held).
fn expert_ptrs(layer: &MoeLayer) -> Result<[Vec<u64>; 4]> {
    let e = layer.num_experts();
    let mut out = [vec![0u64; e], vec![0u64; e], vec![0u64; e], vec![0u64; e]];
    for id in 0..e {
        let Some(ex) = layer.expert(id) else {
            continue;
        };
        if let (Weight::Dense(gu), Weight::Dense(d)) = (&ex.gate_up, &ex.down) {
            out[0][id] = ptr(gu, "moe")?;
            out[1][id] = ptr(d, "moe")?;
        }
        if let Some(b) = &ex.gate_up_bias {
            out[2][id] = ptr(b, "moe")?;
        }
        if let Some(b) = &ex.down_bias {
            out[3][id] = ptr(b, "moe")?;
        }
    }
    Ok(out)
}

/// Device pointers of `layer`'s tables (made now if it has none):
/// (pointer tables, selection bias, counts).
fn tables(cuda: &CudaBackend, layer: &MoeLayer) -> Result<(u64, u64, u64)> {
    let [gu, d, gub, db] = expert_ptrs(layer)?;
    let host: Vec<u64> = gu.iter().chain(&d).copied().collect();
    let mut all = cuda.moe.lock().map_err(dev_err)?;
    all.layers.retain(|t| t.load.strong_count() > 0);
    let found = all.layers.iter().position(|t| {
        t.host == host
            && t.load
                .upgrade()
                .is_some_and(|l| Arc::ptr_eq(&l, &layer.load))
    });
    let t = match found {
        Some(i) => &all.layers[i],
        None => {
            cuda.no_upload_while_recording("a Mixture-of-Experts layer's expert tables")?;
            let e = gu.len();
            let ptrs = cuda.dev.alloc_exact(4 * e * 8, "expert tables")?;
            let flat: Vec<u64> = [gu, d, gub, db].concat();
            cuda.dev.htod(ptrs.ptr, &flat)?;
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
                ptrs,
                selection_bias,
                counts,
                seen: vec![0; e],
                experts: e,
            });
            all.layers.last().expect("pushed")
        }
    };
    Ok((
        t.ptrs.ptr,
        t.selection_bias.as_ref().map_or(0, |b| b.ptr),
        t.counts.ptr,
    ))
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
    let (n, _) = x.dims2("moe")?;
    let Some((hidden, inter)) = native_shape(x, layer, n).filter(|_| available(cuda)) else {
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
    let k = layer.routing.top_k.min(experts);
    let pairs = n * k;
    let (tab, sel_bias, counts) = tables(cuda, layer)?;
    let table = |i: u64| tab + i * 8 * experts as u64;
    let (gu_tab, d_tab, gub_tab, db_tab) = (table(0), table(1), table(2), table(3));
    let logits = cuda.matmul(
        x,
        &layer.router,
        None,
        Epilogue::bias(layer.router_bias.as_ref()),
    )?;
    let lp = ptr(&logits, "moe")?;
    // Padding rows of a recorded step write to the hidden scratch slot:
    // they are routed but not counted.
    let (slots, pad_slot) = match cuda.active() {
        Some(s) if s.meta.num_rows == n => (s.base + 4 * s.meta.slot as u64, s.pad_slot),
        _ => (0u64, u32::MAX),
    };
    let ids = cuda.dev.alloc(pairs, 4, "expert picks")?;
    let weights = cuda.dev.alloc(pairs, 4, "expert weights")?;
    let groups = cuda
        .dev
        .alloc(2 * experts + 2 + pairs, 4, "expert groups")?;
    let (used_count, used) = (groups.ptr, groups.ptr + 4);
    let offsets = used + 4 * experts as u64;
    let order = offsets + 4 * (experts as u64 + 1);
    let h = cuda.dev.alloc(pairs * inter, 2, "expert activations")?;
    let y = cuda.dev.alloc(pairs * hidden, 4, "expert outputs")?;
    let out = cuda.alloc(n * hidden, "moe output")?;
    let scoring: i32 = match layer.routing.scoring {
        Scoring::Softmax => 0,
        Scoring::TopKSoftmax => 1,
        Scoring::Sigmoid => 2,
    };
    let (act, alpha, limit): (i32, f32, f32) = match layer.activation {
        ExpertActivation::Gated(a) => (crate::ops::activation::act_code(a), 0.0, 0.0),
        ExpertActivation::ClampedSwiglu { alpha, limit } => (3, alpha, limit),
    };
    let shared = match &layer.shared {
        Some(s) => {
            let ExpertActivation::Gated(a) = layer.activation else {
                unreachable!("native_shape refuses a shared expert with the clamped SwiGLU")
            };
            let e = &s.expert;
            let epi = Epilogue {
                bias: e.gate_up_bias.as_ref(),
                gated: Some(a),
                residual: None,
            };
            let hs = cuda.matmul(x, &e.gate_up, None, epi)?;
            let ys = cuda.matmul(&hs, &e.down, None, Epilogue::bias(e.down_bias.as_ref()))?;
            let gate = match &s.gate {
                Some(g) => Some(cuda.matmul(x, g, None, Epilogue::NONE)?),
                None => None,
            };
            Some((ys, gate))
        }
        None => None,
    };
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
    let xp = ptr(x, "moe")?;
    let bound = experts.min(pairs) as u32;
    let cfg = |grid: (u32, u32, u32), block: u32, smem: u32| cudarc::driver::LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    };
    let (e_i, k_i, n_pairs) = (experts as i32, k as i32, pairs as i32);
    let (h_i, i_i) = (hidden as i32, inter as i32);
    let normalize = layer.routing.normalize as i32;
    let scale = layer.routing.scale;
    // SAFETY: logits [n, experts] bf16; ids/weights hold n*k; the tables
    // hold `experts` pointers each, to bf16 experts of [2*inter, hidden]
    // and [hidden, inter] (native_shape checked every held one) or 0;
    // groups holds 2*experts + 2 + pairs ints; h [pairs, inter] bf16, y
    // [pairs, hidden] f32; out [n, hidden] bf16; slots (when not 0) is the
    // running step's n slots.
    unsafe {
        cuda.dev
            .launch(cuda.dev.func("moe_route_bf16")?)
            .arg(&lp)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&scoring)
            .arg(&normalize)
            .arg(&scale)
            .arg(&sel_bias)
            .arg(&ids.ptr)
            .arg(&weights.ptr)
            .arg(&counts)
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
            .arg(&ids.ptr)
            .arg(&n_pairs)
            .arg(&e_i)
            .arg(&gu_tab)
            .arg(&used_count)
            .arg(&used)
            .arg(&offsets)
            .arg(&order)
            .launch(cfg((1, 1, 1), 256, (experts * 8) as u32))
            .map_err(dev_err)?;
        cuda.dev
            .launch(cuda.dev.func("moe_gate_up_bf16")?)
            .arg(&xp)
            .arg(&h_i)
            .arg(&i_i)
            .arg(&k_i)
            .arg(&gu_tab)
            .arg(&gub_tab)
            .arg(&used_count)
            .arg(&used)
            .arg(&offsets)
            .arg(&order)
            .arg(&act)
            .arg(&alpha)
            .arg(&limit)
            .arg(&h.ptr)
            .launch(cfg((bound, inter.div_ceil(8) as u32, 1), 256, 0))
            .map_err(dev_err)?;
        cuda.dev
            .launch(cuda.dev.func("moe_down_bf16")?)
            .arg(&h.ptr)
            .arg(&h_i)
            .arg(&i_i)
            .arg(&d_tab)
            .arg(&db_tab)
            .arg(&used_count)
            .arg(&used)
            .arg(&offsets)
            .arg(&order)
            .arg(&y.ptr)
            .launch(cfg((bound, hidden.div_ceil(8) as u32, 1), 256, 0))
            .map_err(dev_err)?;
        cuda.dev
            .launch(cuda.dev.func("moe_combine_bf16")?)
            .arg(&y.ptr)
            .arg(&ids.ptr)
            .arg(&weights.ptr)
            .arg(&k_i)
            .arg(&h_i)
            .arg(&e_i)
            .arg(&gu_tab)
            .arg(&shared_p)
            .arg(&shared_gate_p)
            .arg(&out.ptr)
            .launch(cfg((n as u32, hidden.div_ceil(256) as u32, 1), 256, 0))
            .map_err(dev_err)?;
    }
    drop(shared);
    Ok(wrap(vec![n, hidden], out))
}

/// Whether the device kernels are loaded.
pub(crate) fn available(cuda: &CudaBackend) -> bool {
    [
        "moe_route_bf16",
        "moe_group",
        "moe_gate_up_bf16",
        "moe_down_bf16",
        "moe_combine_bf16",
    ]
    .iter()
    .all(|k| cuda.dev.has(k))
}
