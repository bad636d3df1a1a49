//! The recurrent mixers (`ops/recurrent`) against the CPU reference: the
//! gated DeltaNet at Qwen3.5's head shape (16 key heads of 128, 32 value
//! heads of 128, a 4-tap convolution) and a small odd one, LFM2's short
//! convolution; three sequences in one step (one fresh, one continuing a
//! state, one restored from a snapshot slot), snapshots taken mid-step;
//! the outputs and every slot's state afterwards — short steps through
//! the token-order kernels, long ones (150 and 70 tokens) through the
//! delta rule's chunk-parallel form too.

use kiln_tensor::recurrent::{GatedDeltaNet, RecurrentMixer, ShortConv};
use kiln_tensor::{ForwardBatch, KvPoolShape, SeqState, StateShape};

use super::{e, Pair, Rng, R, TOL};
use crate::ops::recurrent::DeltaKernel;

/// The state's tolerance: f32 on both sides, the kernels' sums in another
/// order (and exp/rsqrt intrinsics), through a few tokens of recurrence.
const TOL_STATE: f64 = 2e-3;

/// Blocks of each sequence's table in the checks' pool (the longest
/// reaches position 160).
const BLOCKS_A_SEQ: u32 = 11;

/// The KV pool beside the checks' recurrent state (the mixers keep no KV;
/// a decode step needs a block table).
const KV: KvPoolShape = KvPoolShape {
    num_layers: 1,
    num_groups: 1,
    num_blocks: 3 * BLOCKS_A_SEQ as usize,
    block_size: 16,
    kv_row: 8,
};

fn delta(
    rng: &mut Rng,
    (kh, vh, kd, vd, k): (usize, usize, usize, usize, usize),
) -> RecurrentMixer {
    let cd = 2 * kh * kd + vh * vd;
    RecurrentMixer::GatedDeltaNet(GatedDeltaNet {
        k_heads: kh,
        v_heads: vh,
        k_dim: kd,
        v_dim: vd,
        kernel: k,
        conv: rng.vec(cd * k, 0.5),
        a_log: rng.vec(vh, 1.0),
        dt_bias: rng.vec(vh, 0.5),
        norm: rng.vec(vd, 1.0).iter().map(|x| 1.0 + 0.3 * x).collect(),
        eps: 1e-6,
        state_layer: 1,
        device: Default::default(),
    })
}

pub(super) fn recurrent_ops(p: &mut Pair, rng: &mut Rng) -> R<()> {
    let cases = [
        (
            "gated_delta_net 16x128/32x128 k4",
            delta(rng, (16, 32, 128, 128, 4)),
        ),
        ("gated_delta_net 2x8/6x12 k3", delta(rng, (2, 6, 8, 12, 3))),
        // Keys wider than gated_delta_rule_k128 keeps in registers: the
        // shared-memory kernel.
        (
            "gated_delta_net 2x160/2x40 k4 (shared-memory state)",
            delta(rng, (2, 2, 160, 40, 4)),
        ),
        (
            "short_conv 96 k3",
            RecurrentMixer::ShortConv(ShortConv {
                dim: 96,
                kernel: 3,
                conv: rng.vec(96 * 3, 0.5),
                state_layer: 1,
                device: Default::default(),
            }),
        ),
    ];
    for (name, mixer) in cases {
        let delta = match &mixer {
            RecurrentMixer::GatedDeltaNet(g) => Some(g.k_dim),
            RecurrentMixer::ShortConv(_) => None,
        };
        // Short sequences through the token-order kernels (both, for the
        // delta rule); long ones through the chunk-parallel form where it
        // takes the heads (keys of up to 128) and the token order.
        let token = |registers| DeltaKernel {
            registers,
            chunk_rows: usize::MAX,
        };
        let chunked = DeltaKernel {
            registers: false,
            chunk_rows: 64,
        };
        let mut short: Vec<(DeltaKernel, &str)> = vec![(token(false), "")];
        let mut long: Vec<(DeltaKernel, &str)> = Vec::new();
        if let Some(kd) = delta {
            short.push((token(true), ", register kernel"));
            long.push((token(false), ", long"));
            if kd <= 128 {
                long.push((chunked, ", long, chunk-parallel"));
            }
        }
        let runs = [(Steps::SHORT, short), (Steps::LONG, long)];
        for (steps, kernels) in runs {
            if !kernels.is_empty() {
                check_mixer(p, rng, name, &mixer, steps, &kernels)?;
            }
        }
    }
    Ok(())
}

/// A step's sequences for a check: their new tokens, tokens computed
/// before, and snapshots of the first (`(tokens, slot)`); slots 0–2 are
/// the sequences', the third restored from slot 5, and the state has
/// [`STATE_SLOTS`].
struct Steps {
    lens: [usize; 3],
    computed: [usize; 3],
    snapshots: &'static [(usize, u32)],
}

/// Slots of the checks' recurrent state.
const STATE_SLOTS: usize = 7;

impl Steps {
    /// 5 fresh tokens on slot 0 (snapshots after 2 and 5), 1 token
    /// continuing slot 1's state, 7 tokens restored from slot 5's after 11
    /// computed tokens.
    const SHORT: Steps = Steps {
        lens: [5, 1, 7],
        computed: [0, 9, 11],
        snapshots: &[(2, 3), (5, 4)],
    };
    /// The same with 150 and 70 tokens: three chunks of the chunk-parallel
    /// form (the last partial) and two, snapshots inside the first chunk,
    /// at its end and inside the second.
    const LONG: Steps = Steps {
        lens: [150, 1, 70],
        computed: [0, 9, 11],
        snapshots: &[(2, 3), (64, 4), (100, 6)],
    };
}

fn check_mixer(
    p: &mut Pair,
    rng: &mut Rng,
    name: &str,
    mixer: &RecurrentMixer,
    steps: Steps,
    kernels: &[(DeltaKernel, &str)],
) -> R<()> {
    let (conv, rec) = mixer.state();
    let shape = StateShape {
        num_layers: 2,
        num_slots: STATE_SLOTS,
        conv,
        recurrent: rec,
    };
    // Layer 0's state (another layer's) stays as it was.
    let n: usize = steps.lens.iter().sum();
    let mut batch = ForwardBatch {
        block_size: 16,
        ..ForwardBatch::default()
    };
    for (i, (&len, &computed)) in steps.lens.iter().zip(&steps.computed).enumerate() {
        // (Each sequence its own blocks, enough for its last position.)
        let blocks = (computed + len).div_ceil(16) as u32;
        let first = i as u32 * BLOCKS_A_SEQ;
        batch.push_seq(
            &vec![1; len],
            computed,
            (first..first + blocks).collect(),
            true,
        );
    }
    batch.states = vec![
        SeqState {
            slot: 0,
            restore_from: None,
            snapshots: steps.snapshots.to_vec(),
        },
        SeqState {
            slot: 1,
            ..SeqState::default()
        },
        SeqState {
            slot: 2,
            restore_from: Some(5),
            snapshots: Vec::new(),
        },
    ];
    let x = rng.vec(n * mixer.in_dim(), 1.0);
    let start = rng.vec(shape.num_layers * shape.num_slots * shape.per_slot(), 0.5);
    let gpu = p.gpu;
    // The GPU with the given delta-rule kernel (`Some`), or the CPU.
    let run =
        |b: &dyn kiln_tensor::Backend, kernel: Option<DeltaKernel>| -> R<(Vec<f32>, Vec<f32>)> {
            let mut cache = b.alloc_kv_cache(KV).map_err(e)?;
            let st = b.alloc_state(shape).map_err(e)?;
            cache = cache.with_state(shape, st);
            state_io(gpu, &mut cache, Some(&start))?;
            let xt = b.upload(&[n, mixer.in_dim()], &x).map_err(e)?;
            let y = match kernel {
                Some(k) => crate::ops::recurrent::recurrent_mixer_with(
                    gpu, &xt, mixer, &batch, &mut cache, k,
                ),
                None => b.recurrent_mixer(&xt, mixer, &batch, &mut cache),
            }
            .map_err(e)?;
            Ok((b.to_host(&y).map_err(e)?, state_io(gpu, &mut cache, None)?))
        };
    let (cy, cs) = run(&p.cpu, None)?;
    for &(kernel, label) in kernels {
        let (gy, gs) = run(p.gpu, Some(kernel))?;
        p.push(format!("recurrent {name}{label}: output"), &gy, &cy, TOL);
        p.push(
            format!("recurrent {name}{label}: state"),
            &gs,
            &cs,
            TOL_STATE,
        );
    }
    Ok(())
}

/// Write a cache's whole state (f32, slot order) from `values`, or read
/// it: host storage (the CPU's) or the device's.
fn state_io(
    gpu: &crate::CudaBackend,
    cache: &mut kiln_tensor::KvCache,
    values: Option<&[f32]>,
) -> R<Vec<f32>> {
    let (shape, st) = cache.state_mut().ok_or("no state")?;
    let n = shape.num_layers * shape.num_slots * shape.per_slot();
    if let Some(v) = st.downcast_mut::<Vec<f32>>() {
        if let Some(values) = values {
            v.copy_from_slice(values);
        }
        return Ok(v.clone());
    }
    let s = st
        .downcast_ref::<crate::ops::recurrent::CudaState>()
        .ok_or("unknown state storage")?;
    match values {
        Some(values) => {
            gpu.dev.htod(s.buf.ptr, values).map_err(e)?;
            Ok(values.to_vec())
        }
        None => gpu.dev.dtoh::<f32>(s.buf.ptr, n).map_err(e),
    }
}

/// Decode steps of a toy hybrid (two DeltaNet layers, each with its in- and
/// out-projection) through `run_step` against the CPU: prompts of three
/// sequences on state slots 4, 0 and 2, then decode steps (bucket 4, one
/// padding sequence; the GPU records them) of which one takes a snapshot
/// into slot 5 and a later one starts a sequence from it, then two
/// sequences (bucket 2); every step's logits, and every slot's state at the
/// end (the padding sequence and the recording's warm-up touch none).
pub(super) fn recorded_recurrent_steps(p: &mut Pair, rng: &mut Rng) -> R<()> {
    use kiln_tensor::prelude::*;
    use kiln_tensor::{KvCache, Tensor, Weight};
    let (vocab, d) = (256usize, 64usize);
    let mut mixers = [delta(rng, (2, 4, 16, 16, 4)), delta(rng, (2, 4, 16, 16, 4))];
    if let RecurrentMixer::GatedDeltaNet(g) = &mut mixers[0] {
        g.state_layer = 0;
    }
    let (emb_g, emb_c) = p.up(&[vocab, d], &rng.vec(vocab * d, 1.0))?;
    let (head_g, head_c) = p.up(&[vocab, d], &rng.vec(vocab * d, 0.1))?;
    let mut proj = Vec::new();
    for m in &mixers {
        let wi = p.up(&[m.in_dim(), d], &rng.vec(m.in_dim() * d, 0.1))?;
        let wo = p.up(&[d, m.out_dim()], &rng.vec(d * m.out_dim(), 0.1))?;
        proj.push((wi, wo));
    }
    let (conv, rec) = mixers[0].state();
    let shape = StateShape {
        num_layers: 2,
        num_slots: 6,
        conv,
        recurrent: rec,
    };
    let step = |b: &dyn Backend, batch: &ForwardBatch, cache: &mut KvCache, gpu: bool| {
        let pick = |t: &(Tensor, Tensor)| if gpu { t.0.clone() } else { t.1.clone() };
        let emb = if gpu { &emb_g } else { &emb_c };
        let mut x = b.embedding(&Weight::Dense(emb.clone()), &batch.token_ids)?;
        for (m, (wi, wo)) in mixers.iter().zip(&proj) {
            let h = b.matmul(&x, &Weight::Dense(pick(wi)), None, Default::default())?;
            let y = b.recurrent_mixer(&h, m, batch, cache)?;
            x = super::linear_add(b, &y, &pick(wo), None, &x)?;
        }
        let x = b.gather_rows(&x, &batch.logits_rows)?;
        super::linear(b, &x, if gpu { &head_g } else { &head_c }, None)
    };
    let mut caches = Vec::new();
    for b in [p.gpu as &dyn Backend, &p.cpu] {
        let cache = b.alloc_kv_cache(KV).map_err(e)?;
        let st = b.alloc_state(shape).map_err(e)?;
        caches.push(cache.with_state(shape, st));
    }
    let start = rng.vec(shape.num_layers * shape.num_slots * shape.per_slot(), 0.5);
    for c in &mut caches {
        state_io(p.gpu, c, Some(&start))?;
    }
    let slots = [4u32, 0, 2];
    let mut pos = [5usize, 3, 7];
    let mut batch = ForwardBatch {
        block_size: 16,
        ..ForwardBatch::default()
    };
    for (s, &len) in pos.iter().enumerate() {
        let toks: Vec<u32> = (0..len).map(|_| rng.below(vocab) as u32).collect();
        batch.push_seq(&toks, 0, vec![s as u32], true);
    }
    batch.states = slots
        .iter()
        .map(|&slot| SeqState {
            slot,
            ..SeqState::default()
        })
        .collect();
    for it in 0..8 {
        if it > 0 {
            let live = if it < 6 { 3 } else { 2 };
            batch = ForwardBatch {
                block_size: 16,
                ..ForwardBatch::default()
            };
            for s in 0..live {
                batch.push_seq(&[rng.below(vocab) as u32], pos[s], vec![s as u32], true);
                pos[s] += 1;
                batch.states.push(SeqState {
                    slot: slots[s],
                    restore_from: (it == 4 && s == 2).then_some(5),
                    snapshots: if it == 2 && s == 0 {
                        vec![(1, 5)]
                    } else {
                        Vec::new()
                    },
                });
            }
        }
        let (gc, cc) = caches.split_at_mut(1);
        let g = p
            .gpu
            .run_step(&batch, &mut gc[0], &mut |bt, c| step(p.gpu, bt, c, true))
            .map_err(e)?;
        let c = p
            .cpu
            .run_step(&batch, &mut cc[0], &mut |bt, c| step(&p.cpu, bt, c, false))
            .map_err(e)?;
        let (gh, ch) = (p.gpu.to_host(&g).map_err(e)?, p.cpu.to_host(&c).map_err(e)?);
        p.push(
            format!("recurrent run_step {it} ({} seqs)", batch.seqs.len()),
            &gh,
            &ch,
            TOL,
        );
    }
    let gs = state_io(p.gpu, &mut caches[0], None)?;
    let cs = state_io(p.gpu, &mut caches[1], None)?;
    p.push(
        "recurrent run_step: every slot's state".into(),
        &gs,
        &cs,
        TOL_STATE,
    );
    // Both batch sizes (buckets 4 and 2) recorded over this cache, none
    // refused (a refused one runs eagerly and still passes the checks above).
    let (recorded, failed) = p.gpu.recordings_of(&caches[0]);
    p.checks.push(super::Check {
        op: format!("recurrent decode steps recorded as graphs ({recorded}, {failed} refused)"),
        rel_err: 0.0,
        max_abs_err: 0.0,
        tolerance: 0.0,
        pass: !p.gpu.graphs_enabled() || (recorded == 2 && failed == 0),
    });
    Ok(())
}
