//! Token mixers with a fixed-size state a sequence instead of a growing KV
//! cache ([`RecurrentMixer`]): the gated DeltaNet of Qwen3.5 / Qwen3-Next (a
//! short causal convolution, then the gated delta rule, a linear-attention
//! recurrence) and LFM2's gated short convolution.
//!
//! The state lives beside the KV blocks in the [`crate::KvCache`]
//! ([`StateShape`]): for each recurrent layer and each sequence slot, the
//! convolution's last `kernel - 1` inputs and the recurrence's matrices.
//! A step reads a sequence's slot from [`crate::ForwardBatch::seq_state`]; a
//! sequence with nothing computed yet starts from zeros (so a slot needs no
//! clearing when it passes to another request), one restored from a prefix
//! cache hit from the snapshot slot it names; and a step copies the state
//! after given token counts into snapshot slots (the prefix cache's
//! checkpoints).
//!
//! [`recurrent_reference`] is the op on host data, token by token in
//! f32, each sequence on its own (so a row's result depends only on its own
//! sequence: batched, chunked and alone are bit-identical); other backends
//! are tested against it.

use rayon::prelude::*;

use crate::error::{Result, TensorError};

/// A backend's own copy of a layer's small parameters (the convolution
/// taps, gates and norm), made on first use and kept with the layer.
pub type DeviceCopy = std::sync::Arc<std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>>;

/// The recurrent state a KV cache keeps: for each of `num_layers`
/// recurrent layers and each of `num_slots` sequence slots, `conv` f32
/// values (the convolution's past inputs) then `recurrent` ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateShape {
    pub num_layers: usize,
    pub num_slots: usize,
    pub conv: usize,
    pub recurrent: usize,
}

impl StateShape {
    /// f32 values of one layer's state for one slot.
    pub fn per_slot(&self) -> usize {
        self.conv + self.recurrent
    }

    /// Bytes of the whole state.
    pub fn bytes(&self) -> u64 {
        (self.num_layers * self.num_slots * self.per_slot() * 4) as u64
    }

    /// Where layer `layer`'s state of slot `slot` starts.
    pub fn offset(&self, layer: usize, slot: usize) -> usize {
        (layer * self.num_slots + slot) * self.per_slot()
    }
}

/// A gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`) as a
/// backend sees it. Its input is the packed in-projections of the batch's
/// rows, `qkv | z | b | a` (`conv_dim() + v_heads * v_dim + 2 * v_heads`
/// columns); its output, `[n, v_heads * v_dim]`, goes to the out-projection.
/// Per sequence, token by token:
/// - `qkv` through the causal depthwise convolution of `kernel` taps
///   (`conv [conv_dim][kernel]`, no bias) over the sequence's past inputs,
///   then SiLU; split into `q`, `k` (`k_heads × k_dim` each), `v`
///   (`v_heads × v_dim`);
/// - `q` and `k` L2-normalized per head (`x / sqrt(Σx² + 1e-6)`), `q`
///   scaled by `k_dim^-0.5`; value head `h` reads key head
///   `h / (v_heads / k_heads)`;
/// - `β = sigmoid(b)`, `g = -exp(a_log) · softplus(a + dt_bias)`;
/// - the state `S [k_dim][v_dim]` of head `h`: `S ← e^g S`, then
///   `S ← S + k (β (v − Sᵀk))ᵀ`; the output `Sᵀ q`;
/// - each head's output RMS-normalized (`eps`), times `norm`, times
///   `silu(z)`.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub kernel: usize,
    /// `[conv_dim][kernel]`.
    pub conv: Vec<f32>,
    /// `[v_heads]` each.
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// `[v_dim]`: the output norm's weight.
    pub norm: Vec<f32>,
    pub eps: f32,
    /// The layer's index among the model's recurrent layers (its state's).
    pub state_layer: usize,
    /// A backend's copy of `conv`, `a_log`, `dt_bias` and `norm`.
    pub device: DeviceCopy,
}

impl GatedDeltaNet {
    /// Channels through the convolution: `q`, `k` and `v`.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Columns of the packed input.
    pub fn in_dim(&self) -> usize {
        self.conv_dim() + self.v_heads * self.v_dim + 2 * self.v_heads
    }

    /// Columns of the output.
    pub fn out_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// f32 values of a slot's state: the convolution's past inputs, then
    /// one `k_dim × v_dim` matrix a value head.
    pub fn state(&self) -> (usize, usize) {
        (
            (self.kernel - 1) * self.conv_dim(),
            self.v_heads * self.k_dim * self.v_dim,
        )
    }

    fn check(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(TensorError::Shape {
                op: "gated_delta_net",
                detail,
            })
        };
        if self.kernel == 0 || self.k_heads == 0 || self.v_heads % self.k_heads != 0 {
            return bad(format!(
                "{} key heads, {} value heads, kernel {}",
                self.k_heads, self.v_heads, self.kernel
            ));
        }
        if self.conv.len() != self.conv_dim() * self.kernel
            || self.a_log.len() != self.v_heads
            || self.dt_bias.len() != self.v_heads
            || self.norm.len() != self.v_dim
        {
            return bad(format!(
                "weights conv {} a_log {} dt_bias {} norm {}",
                self.conv.len(),
                self.a_log.len(),
                self.dt_bias.len(),
                self.norm.len()
            ));
        }
        Ok(())
    }
}

/// LFM2's gated short convolution (transformers' `Lfm2ShortConv`): the
/// packed in-projection `b | c | x` (`3 · dim` columns) of each row;
/// `c ⊙ conv(b ⊙ x)`, the convolution causal and depthwise over the
/// sequence's last `kernel` values of `b ⊙ x` (`conv [dim][kernel]`, no
/// bias), no activation; `[n, dim]` out.
#[derive(Debug, Clone)]
pub struct ShortConv {
    pub dim: usize,
    pub kernel: usize,
    pub conv: Vec<f32>,
    /// The layer's index among the model's recurrent layers.
    pub state_layer: usize,
    /// A backend's copy of `conv`.
    pub device: DeviceCopy,
}

/// A recurrent token mixer, as [`crate::Ops::recurrent_mixer`] runs it.
#[derive(Debug, Clone)]
pub enum RecurrentMixer {
    GatedDeltaNet(GatedDeltaNet),
    ShortConv(ShortConv),
}

impl RecurrentMixer {
    /// Columns of the packed input.
    pub fn in_dim(&self) -> usize {
        match self {
            RecurrentMixer::GatedDeltaNet(g) => g.in_dim(),
            RecurrentMixer::ShortConv(c) => 3 * c.dim,
        }
    }

    /// Columns of the output.
    pub fn out_dim(&self) -> usize {
        match self {
            RecurrentMixer::GatedDeltaNet(g) => g.out_dim(),
            RecurrentMixer::ShortConv(c) => c.dim,
        }
    }

    /// f32 values of a slot's state: (convolution, recurrence).
    pub fn state(&self) -> (usize, usize) {
        match self {
            RecurrentMixer::GatedDeltaNet(g) => g.state(),
            RecurrentMixer::ShortConv(c) => ((c.kernel.max(1) - 1) * c.dim, 0),
        }
    }

    /// The layer's index among the model's recurrent layers.
    pub fn state_layer(&self) -> usize {
        match self {
            RecurrentMixer::GatedDeltaNet(g) => g.state_layer,
            RecurrentMixer::ShortConv(c) => c.state_layer,
        }
    }

    /// The mixer's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            RecurrentMixer::GatedDeltaNet(_) => "gated DeltaNet",
            RecurrentMixer::ShortConv(_) => "gated short convolution",
        }
    }

    fn sequence(
        &self,
        rows: &[f32],
        state: &mut [f32],
        fresh: bool,
        out: &mut [f32],
        snaps: &[usize],
    ) -> Result<Vec<(usize, Vec<f32>)>> {
        match self {
            RecurrentMixer::GatedDeltaNet(g) => {
                gated_delta_net_sequence(g, rows, state, fresh, out, snaps)
            }
            RecurrentMixer::ShortConv(c) => short_conv_sequence(c, rows, state, fresh, out, snaps),
        }
    }
}

/// One step of a causal depthwise convolution over `dim` channels: `past`
/// the last `kernel - 1` inputs (oldest first), `input` this one; the sum
/// over taps in order into `out`, then `past` moves on by one.
fn conv_step(
    w: &[f32],
    kernel: usize,
    past: &mut [f32],
    input: &[f32],
    window: &mut [f32],
    out: &mut [f32],
) {
    let dim = input.len();
    window[..past.len()].copy_from_slice(past);
    window[past.len()..].copy_from_slice(input);
    for (c, o) in out.iter_mut().enumerate() {
        let mut acc = 0f32;
        for (j, &wj) in w[c * kernel..(c + 1) * kernel].iter().enumerate() {
            acc += wj * window[j * dim + c];
        }
        *o = acc;
    }
    past.copy_from_slice(&window[dim..]);
}

/// One sequence of a [`ShortConv`] step (as [`gated_delta_net_sequence`]).
pub fn short_conv_sequence(
    layer: &ShortConv,
    rows: &[f32],
    state: &mut [f32],
    fresh: bool,
    out: &mut [f32],
    snaps: &[usize],
) -> Result<Vec<(usize, Vec<f32>)>> {
    let (d, kk) = (layer.dim, layer.kernel);
    if kk == 0
        || layer.conv.len() != d * kk
        || rows.len() % (3 * d) != 0
        || state.len() != (kk - 1) * d
        || out.len() != rows.len() / 3
    {
        return Err(TensorError::Shape {
            op: "short_conv",
            detail: format!(
                "dim {d} kernel {kk}: conv {} rows {} state {} out {}",
                layer.conv.len(),
                rows.len(),
                state.len(),
                out.len()
            ),
        });
    }
    if fresh {
        state.fill(0.0);
    }
    let mut kept = Vec::new();
    let mut window = vec![0f32; kk * d];
    let mut bx = vec![0f32; d];
    for (t, (row, o)) in rows
        .chunks_exact(3 * d)
        .zip(out.chunks_exact_mut(d))
        .enumerate()
    {
        let (b, rest) = row.split_at(d);
        let (c, x) = rest.split_at(d);
        for ((v, &b), &x) in bx.iter_mut().zip(b).zip(x) {
            *v = b * x;
        }
        conv_step(&layer.conv, kk, state, &bx, &mut window, o);
        for (o, &c) in o.iter_mut().zip(c) {
            *o *= c;
        }
        if snaps.contains(&(t + 1)) {
            kept.push((t + 1, state.to_vec()));
        }
    }
    Ok(kept)
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + e^x)`, linear past 20 (as `torch.nn.functional.softplus`).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn l2norm(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// One sequence of a [`GatedDeltaNet`] step: `rows` its packed inputs
/// (`rows.len() / in_dim` tokens), `state` its slot's state (zeroed first
/// when `fresh`), its output rows into `out`.
pub fn gated_delta_net_sequence(
    layer: &GatedDeltaNet,
    rows: &[f32],
    state: &mut [f32],
    fresh: bool,
    out: &mut [f32],
    snaps: &[usize],
) -> Result<Vec<(usize, Vec<f32>)>> {
    layer.check()?;
    let (cd, kk, vd) = (layer.conv_dim(), layer.kernel, layer.v_dim);
    let (kdim, kh, vh) = (layer.k_dim, layer.k_heads, layer.v_heads);
    let in_dim = layer.in_dim();
    let (conv_len, rec_len) = layer.state();
    if rows.len() % in_dim != 0 || state.len() != conv_len + rec_len {
        return Err(TensorError::Shape {
            op: "gated_delta_net",
            detail: format!(
                "{} input values of rows {in_dim} wide, state {} of {}",
                rows.len(),
                state.len(),
                conv_len + rec_len
            ),
        });
    }
    let n = rows.len() / in_dim;
    if out.len() != n * layer.out_dim() {
        return Err(TensorError::Shape {
            op: "gated_delta_net",
            detail: format!("{} output values for {n} rows", out.len()),
        });
    }
    if fresh {
        state.fill(0.0);
    }
    let mut kept = Vec::new();
    let (past, rec) = state.split_at_mut(conv_len);
    let group = vh / kh;
    let mut window = vec![0f32; kk * cd];
    let mut mixed = vec![0f32; cd];
    let mut kv_mem = vec![0f32; vd];
    for (t, row) in rows.chunks_exact(in_dim).enumerate() {
        // The convolution: the past kernel - 1 inputs, then this one.
        conv_step(&layer.conv, kk, past, &row[..cd], &mut window, &mut mixed);
        mixed.iter_mut().for_each(|m| *m = silu(*m));
        let (q, rest) = mixed.split_at_mut(kh * kdim);
        let (k, v) = rest.split_at_mut(kh * kdim);
        let scale = 1.0 / (kdim as f32).sqrt();
        for h in 0..kh {
            l2norm(&mut q[h * kdim..(h + 1) * kdim]);
            l2norm(&mut k[h * kdim..(h + 1) * kdim]);
        }
        q.iter_mut().for_each(|x| *x *= scale);
        let z = &row[cd..cd + vh * vd];
        let b = &row[cd + vh * vd..cd + vh * vd + vh];
        let a = &row[cd + vh * vd + vh..];
        let o = &mut out[t * vh * vd..(t + 1) * vh * vd];
        for h in 0..vh {
            let (qh, kh_) = (
                &q[h / group * kdim..(h / group + 1) * kdim],
                &k[h / group * kdim..(h / group + 1) * kdim],
            );
            let vh_ = &v[h * vd..(h + 1) * vd];
            let beta = sigmoid(b[h]);
            let decay = (-layer.a_log[h].exp() * softplus(a[h] + layer.dt_bias[h])).exp();
            let s = &mut rec[h * kdim * vd..(h + 1) * kdim * vd];
            s.iter_mut().for_each(|x| *x *= decay);
            kv_mem.fill(0.0);
            for (i, srow) in s.chunks_exact(vd).enumerate() {
                for (m, &x) in kv_mem.iter_mut().zip(srow) {
                    *m += x * kh_[i];
                }
            }
            for (m, &x) in kv_mem.iter_mut().zip(vh_) {
                *m = (x - *m) * beta;
            }
            let oh = &mut o[h * vd..(h + 1) * vd];
            oh.fill(0.0);
            for (i, srow) in s.chunks_exact_mut(vd).enumerate() {
                for (x, &d) in srow.iter_mut().zip(kv_mem.iter()) {
                    *x += kh_[i] * d;
                }
                for (y, &x) in oh.iter_mut().zip(srow.iter()) {
                    *y += x * qh[i];
                }
            }
            // The gated RMSNorm.
            let var = oh.iter().map(|x| x * x).sum::<f32>() / vd as f32;
            let inv = 1.0 / (var + layer.eps).sqrt();
            for ((y, &w), &g) in oh.iter_mut().zip(&layer.norm).zip(&z[h * vd..(h + 1) * vd]) {
                *y = w * (*y * inv) * silu(g);
            }
        }
        if snaps.contains(&(t + 1)) {
            kept.push((t + 1, [&past[..], &rec[..]].concat()));
        }
    }
    Ok(kept)
}

/// One sequence of a step for [`recurrent_reference`]: its rows of the
/// batch, the tokens computed before them, and its state's slots.
#[derive(Debug, Clone)]
pub struct SeqRun {
    pub rows: std::ops::Range<usize>,
    pub num_computed: usize,
    pub state: crate::backend::SeqState,
}

/// A [`RecurrentMixer`] step on host data: `x [n, in_dim]` of the batch's
/// sequences `seqs`, `state` the cache's whole state of `shape`. Each
/// sequence starts from its restore slot's state, from zeros when nothing is
/// computed yet, else from its own slot's; sequences run in parallel, each on
/// its own slot; then the snapshots are copied into their slots.
pub fn recurrent_reference(
    layer: &RecurrentMixer,
    x: &[f32],
    seqs: &[SeqRun],
    shape: &StateShape,
    state: &mut [f32],
) -> Result<Vec<f32>> {
    let bad = |detail: String| {
        Err(TensorError::Shape {
            op: "recurrent_mixer",
            detail,
        })
    };
    let (in_dim, od) = (layer.in_dim(), layer.out_dim());
    let (conv, rec) = layer.state();
    if shape.conv != conv || shape.recurrent != rec || layer.state_layer() >= shape.num_layers {
        return bad(format!(
            "layer {} state ({conv}, {rec}) against the cache's {shape:?}",
            layer.state_layer()
        ));
    }
    let n = x.len() / in_dim.max(1);
    let per = shape.per_slot();
    let base = shape.offset(layer.state_layer(), 0);
    let layer_state = &mut state[base..base + shape.num_slots * per];
    // Every slot named once at most, snapshots included.
    let mut named: Vec<u32> = seqs.iter().map(|s| s.state.slot).collect();
    named.extend(
        seqs.iter()
            .flat_map(|s| s.state.snapshots.iter().map(|&(_, slot)| slot)),
    );
    let mut sorted = named.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1])
        || sorted
            .last()
            .is_some_and(|&s| s as usize >= shape.num_slots)
    {
        return bad(format!("state slots {named:?} of {}", shape.num_slots));
    }
    // Restores first (a restore source is no sequence's own slot).
    for s in seqs {
        if let Some(from) = s.state.restore_from {
            let (from, to) = (from as usize, s.state.slot as usize);
            if from >= shape.num_slots || from == to || named.contains(&(from as u32)) {
                return bad(format!("restore of slot {to} from {from}"));
            }
            layer_state.copy_within(from * per..(from + 1) * per, to * per);
        }
    }
    let mut out = vec![0f32; n * od];
    let mut order: Vec<&SeqRun> = seqs.iter().collect();
    order.sort_by_key(|s| s.rows.start);
    let mut by_slot: Vec<Option<&mut [f32]>> =
        layer_state.chunks_exact_mut(per).map(Some).collect();
    let mut out_rest: &mut [f32] = &mut out;
    let mut consumed = 0;
    let mut work = Vec::new();
    for s in order {
        let (start, len) = (s.rows.start, s.rows.len());
        if start < consumed || start + len > n {
            return bad(format!("rows {start}..{} of {n}", start + len));
        }
        let (_, rest) = out_rest.split_at_mut((start - consumed) * od);
        let (mine, rest) = rest.split_at_mut(len * od);
        out_rest = rest;
        consumed = start + len;
        let st = by_slot[s.state.slot as usize]
            .take()
            .expect("slots are distinct");
        let fresh = s.num_computed == 0 && s.state.restore_from.is_none();
        work.push((
            &x[start * in_dim..(start + len) * in_dim],
            st,
            fresh,
            mine,
            s,
        ));
    }
    let snapshots = work
        .into_par_iter()
        .map(|(rows, st, fresh, o, s)| {
            let at: Vec<usize> = s.state.snapshots.iter().map(|&(t, _)| t).collect();
            let kept = layer.sequence(rows, st, fresh, o, &at)?;
            Ok(kept
                .into_iter()
                .flat_map(|(t, values)| {
                    s.state
                        .snapshots
                        .iter()
                        .filter(move |&&(after, _)| after == t)
                        .map(move |&(_, slot)| (slot, values.clone()))
                })
                .collect::<Vec<_>>())
        })
        .collect::<Result<Vec<_>>>()?;
    drop(by_slot);
    for (slot, values) in snapshots.into_iter().flatten() {
        let slot = slot as usize;
        layer_state[slot * per..(slot + 1) * per].copy_from_slice(&values);
    }
    Ok(out)
}
