//! Mixture-of-Experts layers as a backend sees them: a router, the
//! experts' gated MLPs, an optional shared expert, and how a token picks
//! its experts ([`Routing`]). [`crate::Ops::moe`] runs a whole layer, so a
//! backend can keep the routing where the activations are; [`route`] is
//! the reference routing of one token every backend follows.
//!
//! A token's output is `Σ_j w_j · expert_{e_j}(x)` over its `top_k`
//! experts in the order [`route`] returns them (descending weight), then
//! `+ σ(x · g) · shared(x)` where the layer has a shared expert. Experts
//! may carry biases and gpt-oss's clamped SwiGLU ([`ExpertActivation`]). Each
//! token's sum is its own, so a token's result does not depend on which
//! other tokens share the step.

use crate::backend::{Activation, Memory, Ops};
use crate::error::{Result, TensorError};
use crate::matmul::Epilogue;
use crate::tensor::Tensor;
use crate::weight::Weight;

/// How a router's logits become the weights of the experts a token runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over every expert's logit, then the `top_k` largest
    /// probabilities (Mixtral, Qwen2-MoE, Qwen3-MoE).
    Softmax,
    /// The `top_k` largest logits, then a softmax over those alone
    /// (gpt-oss).
    TopKSoftmax,
    /// Each logit's sigmoid; the `top_k` largest of sigmoid plus the
    /// layer's selection bias ([`MoeLayer::selection_bias`], which picks but
    /// does not weigh), weighted by their sigmoids, renormalized over the
    /// kept ones with `1e-6` added to the sum (LFM2-MoE).
    Sigmoid,
    /// DeepSeek-V3's sigmoid routing (GLM-4.5): keys are sigmoid plus the
    /// selection bias as [`Scoring::Sigmoid`]; the experts split into
    /// `groups` equal runs, each scored by the sum of its two largest keys,
    /// and only the best `keep` groups' experts may be picked (`groups`
    /// 1: no limit). Weighted by their sigmoids, renormalized with `1e-20`
    /// added to the sum.
    SigmoidGroups { groups: u16, keep: u16 },
    /// DeepSeek-V2's `group_limited_greedy`: [`Scoring::Softmax`] with only
    /// the best `keep` of `groups` equal groups of experts eligible, a group
    /// scored by its largest probability.
    SoftmaxGroups { groups: u16, keep: u16 },
}

impl Scoring {
    /// Keys and weights are sigmoids of the logits.
    pub fn is_sigmoid(self) -> bool {
        matches!(self, Scoring::Sigmoid | Scoring::SigmoidGroups { .. })
    }
}

/// Which experts a token runs and with what weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub scoring: Scoring,
    /// Divide the kept weights by their sum (Mixtral always; Qwen's
    /// `norm_topk_prob`).
    pub normalize: bool,
    /// Multiplies every kept weight after that (`routed_scaling_factor`; 1
    /// for most families).
    pub scale: f32,
}

/// One expert: a gated MLP `down(act(gate(x) + b) · (up(x) + b)) + b`.
#[derive(Debug, Clone)]
pub struct Expert {
    /// `[2 * intermediate, hidden]`: the gate rows, then the up rows.
    pub gate_up: Weight,
    /// `[hidden, intermediate]`.
    pub down: Weight,
    /// `[2 * intermediate]` (gate, then up), where the expert has biases.
    pub gate_up_bias: Option<Tensor>,
    /// `[hidden]`.
    pub down_bias: Option<Tensor>,
}

impl Expert {
    /// An expert without biases.
    pub fn new(gate_up: Weight, down: Weight) -> Self {
        Expert {
            gate_up,
            down,
            gate_up_bias: None,
            down_bias: None,
        }
    }
}

/// How an expert joins its gate and up halves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertActivation {
    /// `act(gate) · up`.
    Gated(Activation),
    /// gpt-oss's clamped SwiGLU: `(clamp(up, ±limit) + 1) · g · σ(alpha · g)`
    /// with `g = min(gate, limit)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl ExpertActivation {
    /// The activation of packed rows `y [n, 2i]` (gate | up) as `[n, i]`,
    /// for [`ExpertActivation::ClampedSwiglu`] (the gated ones are a
    /// `matmul` epilogue).
    pub fn clamped_swiglu(y: &[f32], i: usize, alpha: f32, limit: f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(y.len() / 2);
        for row in y.chunks_exact(2 * i) {
            let (g, u) = row.split_at(i);
            out.extend(g.iter().zip(u).map(|(&g, &u)| {
                let g = g.min(limit);
                let u = u.clamp(-limit, limit);
                (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
            }));
        }
        out
    }
}

/// An expert every token runs, its output scaled by `σ(x · gate)` where
/// there is a gate (Qwen2-MoE's `shared_expert_gate`, `[1, hidden]`).
#[derive(Debug, Clone)]
pub struct SharedExpert {
    pub expert: Expert,
    pub gate: Option<Weight>,
}

/// Tokens routed to each expert of a layer since it loaded, counted by the
/// backend's [`crate::Ops::moe`] (the engine reports the recent steps').
#[derive(Debug)]
pub struct ExpertLoad {
    tokens: Vec<std::sync::atomic::AtomicU64>,
}

impl ExpertLoad {
    pub fn new(num_experts: usize) -> Self {
        ExpertLoad {
            tokens: (0..num_experts)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }

    /// `n` more tokens routed to `expert`.
    pub fn add(&self, expert: usize, n: u64) {
        if let Some(c) = self.tokens.get(expert) {
            c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Tokens each expert has been routed so far.
    pub fn snapshot(&self) -> Vec<u64> {
        self.tokens
            .iter()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            .collect()
    }
}

/// A whole sparse layer: what [`crate::Ops::moe`] runs on a step's
/// normalized hidden states.
#[derive(Debug, Clone)]
pub struct MoeLayer {
    /// `[num_experts, hidden]`: one logit an expert.
    pub router: Weight,
    /// `[num_experts]`, added to the logits (gpt-oss).
    pub router_bias: Option<Tensor>,
    /// `[num_experts]`, added to the scores only to pick the experts
    /// ([`Scoring::Sigmoid`]).
    pub selection_bias: Option<Vec<f32>>,
    /// The experts this layer holds: all of them, or (`held`) a range.
    pub experts: Vec<Expert>,
    /// Expert parallelism: the experts `experts` are (a rank's share);
    /// the others add nothing here — another rank adds them, and the
    /// ranks' outputs are summed. `None`: every expert.
    pub held: Option<std::ops::Range<usize>>,
    pub shared: Option<SharedExpert>,
    pub activation: ExpertActivation,
    pub routing: Routing,
    /// Tokens routed to each expert (shared with the model, which reports it).
    pub load: std::sync::Arc<ExpertLoad>,
}

impl MoeLayer {
    /// Experts the router picks among.
    pub fn num_experts(&self) -> usize {
        self.held
            .as_ref()
            .map_or(self.experts.len(), |_| self.router.shape()[0])
    }

    /// Expert `e`, if this layer holds it.
    pub fn expert(&self, e: usize) -> Option<&Expert> {
        match &self.held {
            None => self.experts.get(e),
            Some(r) if r.contains(&e) => self.experts.get(e - r.start),
            Some(_) => None,
        }
    }
}

/// The experts a token with router `logits` runs, with their weights,
/// largest first (ties: the lower expert id first), as transformers'
/// routers compute them in f32.
pub fn route(logits: &[f32], r: &Routing, selection_bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let k = r.top_k.min(logits.len());
    let mut order: Vec<usize> = (0..logits.len()).collect();
    let sigmoid = r.scoring.is_sigmoid();
    let sigmoids: Vec<f32> = match sigmoid {
        true => logits.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
        false => Vec::new(),
    };
    // A NaN logit sorts last, so a poisoned row still routes somewhere.
    let mut keys: Vec<f32> = (0..logits.len())
        .map(|i| {
            let v = match sigmoid {
                true => {
                    sigmoids[i]
                        + selection_bias
                            .and_then(|b| b.get(i))
                            .copied()
                            .unwrap_or(0.0)
                }
                false => logits[i],
            };
            if v.is_nan() {
                f32::NEG_INFINITY
            } else {
                v
            }
        })
        .collect();
    match r.scoring {
        Scoring::SigmoidGroups { groups, keep } => {
            limit_groups(&mut keys, groups as usize, keep as usize, true)
        }
        // A softmax keeps the logits' order: the group's largest logit
        // ranks it as its largest probability.
        Scoring::SoftmaxGroups { groups, keep } => {
            limit_groups(&mut keys, groups as usize, keep as usize, false)
        }
        _ => {}
    }
    order.sort_by(|&a, &b| keys[b].total_cmp(&keys[a]).then(a.cmp(&b)));
    order.truncate(k);
    let mut picked: Vec<(usize, f32)> = match r.scoring {
        Scoring::Softmax | Scoring::SoftmaxGroups { .. } => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
            order
                .iter()
                .map(|&e| (e, (logits[e] - max).exp() / sum))
                .collect()
        }
        Scoring::TopKSoftmax => {
            let max = order.first().map_or(0.0, |&e| logits[e]);
            let sum: f32 = order.iter().map(|&e| (logits[e] - max).exp()).sum();
            order
                .iter()
                .map(|&e| (e, (logits[e] - max).exp() / sum))
                .collect()
        }
        Scoring::Sigmoid | Scoring::SigmoidGroups { .. } => {
            order.iter().map(|&e| (e, sigmoids[e])).collect()
        }
    };
    if r.normalize {
        let mut sum: f32 = picked.iter().map(|p| p.1).sum();
        match r.scoring {
            Scoring::Sigmoid => sum += 1e-6,
            Scoring::SigmoidGroups { .. } => sum += 1e-20,
            _ => {}
        }
        if sum > 0.0 {
            for p in &mut picked {
                p.1 /= sum;
            }
        }
    }
    if r.scale != 1.0 {
        for p in &mut picked {
            p.1 *= r.scale;
        }
    }
    picked
}

/// The group limit of [`Scoring::SigmoidGroups`] (`top2`: a group scored
/// by its two largest keys' sum) and [`Scoring::SoftmaxGroups`] (by its
/// largest): every key outside the best `keep` of `groups` equal runs
/// becomes `-inf` (ties: the lower group). One group, or a split that does
/// not divide the keys, limits nothing (the family's parse refuses the
/// latter).
fn limit_groups(keys: &mut [f32], groups: usize, keep: usize, top2: bool) {
    if groups <= 1 || keep >= groups || keys.len() % groups != 0 {
        return;
    }
    let size = keys.len() / groups;
    let score: Vec<f32> = keys
        .chunks(size)
        .map(|g| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &k in g {
                if k > a {
                    (a, b) = (k, a);
                } else if k > b {
                    b = k;
                }
            }
            if size < 2 || !top2 {
                a
            } else {
                a + b
            }
        })
        .collect();
    let mut best: Vec<usize> = (0..groups).collect();
    best.sort_by(|&x, &y| score[y].total_cmp(&score[x]).then(x.cmp(&y)));
    for &g in &best[keep..] {
        keys[g * size..(g + 1) * size].fill(f32::NEG_INFINITY);
    }
}

/// One expert's gated MLP over `x`'s rows, on the host.
fn expert_rows<B: Ops + Memory + ?Sized>(
    b: &B,
    x: &Tensor,
    e: &Expert,
    layer: &MoeLayer,
) -> Result<Vec<f32>> {
    let bias = e.gate_up_bias.as_ref();
    let h = match layer.activation {
        ExpertActivation::Gated(act) => {
            let epilogue = Epilogue {
                bias,
                gated: Some(act),
                residual: None,
            };
            b.matmul(x, &e.gate_up, None, epilogue)?
        }
        ExpertActivation::ClampedSwiglu { alpha, limit } => {
            let y = b.matmul(x, &e.gate_up, None, Epilogue::bias(bias))?;
            let (n, two_i) = y.dims2("moe")?;
            let h = ExpertActivation::clamped_swiglu(&b.to_host(&y)?, two_i / 2, alpha, limit);
            b.upload(&[n, two_i / 2], &h)?
        }
    };
    let y = b.matmul(&h, &e.down, None, Epilogue::bias(e.down_bias.as_ref()))?;
    b.to_host(&y)
}

/// [`crate::Ops::moe`] composed of a backend's products and host
/// arithmetic: the router is one product over all rows; each row is routed
/// on the host ([`route`]); each expert multiplies the rows routed to it,
/// gathered, by [`crate::Ops::matmul`] (only the experts some row picked
/// are read); each row then sums its experts' outputs in its routing
/// order, then the shared expert's. The CPU's layer (the reference every
/// backend is checked against: a row's bits depend on its own input only,
/// since the CPU's products are row-invariant), and CUDA's until it has
/// kernels of its own (its products on the device, the routing and sums
/// on the host: steps with it run eagerly).
pub fn moe_composed<B: Ops + Memory + ?Sized>(
    b: &B,
    x: &Tensor,
    layer: &MoeLayer,
) -> Result<Tensor> {
    let (n, hidden) = x.dims2("moe")?;
    let num_experts = layer.num_experts();
    let (re, rh) = layer.router.dims2("moe")?;
    if re != num_experts || rh != hidden || num_experts == 0 || layer.routing.top_k == 0 {
        return Err(TensorError::Shape {
            op: "moe",
            detail: format!(
                "router [{re}, {rh}] for {num_experts} experts (top {}) over x [{n}, {hidden}]",
                layer.routing.top_k
            ),
        });
    }
    let logits = b.matmul(
        x,
        &layer.router,
        None,
        Epilogue::bias(layer.router_bias.as_ref()),
    )?;
    let logits = b.to_host(&logits)?;
    let routes: Vec<Vec<(usize, f32)>> = logits
        .chunks(num_experts)
        .map(|row| route(row, &layer.routing, layer.selection_bias.as_deref()))
        .collect();
    // Each expert's rows, and where each (row, pick) finds its output.
    let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); num_experts];
    let mut at: Vec<Vec<usize>> = Vec::with_capacity(n);
    for (row, picks) in routes.iter().enumerate() {
        at.push(
            picks
                .iter()
                .map(|&(e, _)| {
                    rows_of[e].push(row as u32);
                    rows_of[e].len() - 1
                })
                .collect(),
        );
    }
    for (e, rows) in rows_of.iter().enumerate() {
        layer.load.add(e, rows.len() as u64);
    }
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); num_experts];
    for (e, rows) in rows_of.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        // (An expert another rank holds adds nothing here.)
        let Some(expert) = layer.expert(e) else {
            continue;
        };
        let xs = b.gather_rows(x, rows)?;
        outs[e] = expert_rows(b, &xs, expert, layer)?;
        if outs[e].len() != rows.len() * hidden {
            return Err(TensorError::Shape {
                op: "moe",
                detail: format!(
                    "expert {e} returned {} values for {} rows of {hidden}",
                    outs[e].len(),
                    rows.len()
                ),
            });
        }
    }
    let mut out = vec![0f32; n * hidden];
    for (row, (picks, at)) in routes.iter().zip(&at).enumerate() {
        let dst = &mut out[row * hidden..(row + 1) * hidden];
        for (&(e, w), &i) in picks.iter().zip(at) {
            let Some(src) = outs[e].get(i * hidden..(i + 1) * hidden) else {
                continue;
            };
            for (d, &v) in dst.iter_mut().zip(src) {
                *d += w * v;
            }
        }
    }
    if let Some(shared) = &layer.shared {
        let ys = expert_rows(b, x, &shared.expert, layer)?;
        let gates = match &shared.gate {
            Some(g) => {
                let t = b.matmul(x, g, None, Epilogue::NONE)?;
                let t = b.to_host(&t)?;
                if t.len() != n {
                    return Err(TensorError::Shape {
                        op: "moe",
                        detail: format!("shared expert gate {:?}", g.shape()),
                    });
                }
                t.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect()
            }
            None => vec![1.0; n],
        };
        for ((dst, src), g) in out.chunks_mut(hidden).zip(ys.chunks(hidden)).zip(gates) {
            for (d, &v) in dst.iter_mut().zip(src) {
                *d += g * v;
            }
        }
    }
    b.upload(&[n, hidden], &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn softmax_routing_keeps_the_largest_probabilities_of_all_experts() {
        let logits = [0.0f32, 2.0, 1.0, -1.0];
        let r = Routing {
            top_k: 2,
            scoring: Scoring::Softmax,
            normalize: false,
            scale: 1.0,
        };
        let got = route(&logits, &r, None);
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2]);
        assert!(close(got[0].1, 2f32.exp() / z) && close(got[1].1, 1f32.exp() / z));
        // Normalized, the two kept weights sum to one in the same ratio.
        let n = route(
            &logits,
            &Routing {
                normalize: true,
                ..r
            },
            None,
        );
        assert!(close(n[0].1 + n[1].1, 1.0));
        assert!(close(n[0].1 / n[1].1, 1f32.exp()));
    }

    #[test]
    fn top_k_softmax_ignores_the_experts_left_out() {
        let r = Routing {
            top_k: 2,
            scoring: Scoring::TopKSoftmax,
            normalize: false,
            scale: 1.0,
        };
        let a = route(&[3.0, 1.0, 0.0, -5.0], &r, None);
        let b = route(&[3.0, 1.0, 0.5, 0.9], &r, None);
        assert_eq!(a.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1]);
        assert!(close(a[0].1, b[0].1) && close(a[1].1, b[1].1));
        assert!(close(a[0].1, 1.0 / (1.0 + (-2f32).exp())));
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_nan_routes_last() {
        let r = Routing {
            top_k: 2,
            scoring: Scoring::Softmax,
            normalize: true,
            scale: 1.0,
        };
        let got = route(&[1.0, f32::NAN, 1.0, 1.0], &r, None);
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2]);
        // More experts asked for than exist: every one, once.
        let all = route(&[0.5, 0.25], &Routing { top_k: 8, ..r }, None);
        assert_eq!(all.len(), 2);
    }

    #[test]
    fn sigmoid_routing_picks_with_the_bias_and_weighs_without_it() {
        let r = Routing {
            top_k: 2,
            scoring: Scoring::Sigmoid,
            normalize: true,
            scale: 1.5,
        };
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
        // Without a bias, the two largest logits.
        let plain = route(&logits, &r, None);
        assert_eq!(plain.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1]);
        // A bias lifts expert 3 past experts 1 and 0 for the choice (the
        // order is by biased score) but not in the weights.
        let biased = route(&logits, &r, Some(&[0.0, 0.0, 0.0, 0.9]));
        assert_eq!(biased.iter().map(|p| p.0).collect::<Vec<_>>(), [3, 0]);
        let sum = sig(2.0) + sig(-1.0) + 1e-6;
        assert!(close(biased[0].1, sig(-1.0) / sum * 1.5));
        assert!(close(biased[1].1, sig(2.0) / sum * 1.5));
    }

    #[test]
    fn grouped_sigmoid_routing_picks_only_from_the_best_groups() {
        let r = Routing {
            top_k: 3,
            scoring: Scoring::SigmoidGroups { groups: 4, keep: 2 },
            normalize: true,
            scale: 2.5,
        };
        let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
        // Groups of two: group 0 holds the single best expert but the
        // weakest pair; groups 1 and 3 have the best pairs.
        let logits = [3.0f32, -4.0, 1.0, 1.0, 0.5, -3.0, 0.9, 0.8];
        let got = route(&logits, &r, None);
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), [2, 3, 6]);
        let sum = sig(1.0) * 2.0 + sig(0.9) + 1e-20;
        assert!(close(got[0].1, sig(1.0) / sum * 2.5));
        assert!(close(got[2].1, sig(0.9) / sum * 2.5));
        // The bias moves group 2 (expert 4) past group 3 for the choice.
        let biased = route(&logits, &r, Some(&[0.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0]));
        assert_eq!(biased.iter().map(|p| p.0).collect::<Vec<_>>(), [4, 2, 3]);
        // Keeping every group is the plain top-k of the biased keys.
        let all = route(
            &logits,
            &Routing {
                scoring: Scoring::SigmoidGroups { groups: 4, keep: 4 },
                ..r
            },
            None,
        );
        assert_eq!(all.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2, 3]);
    }

    #[test]
    fn grouped_softmax_routing_ranks_groups_by_their_best_expert() {
        let r = Routing {
            top_k: 2,
            scoring: Scoring::SoftmaxGroups { groups: 3, keep: 1 },
            normalize: false,
            scale: 1.5,
        };
        // Group 0 has the single best expert; group 1 the best pair.
        let logits = [3.0f32, -5.0, 2.5, 2.4, 0.0, 0.1];
        let got = route(&logits, &r, None);
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 1]);
        // The weights are the softmax over every expert, scaled.
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert!(close(got[0].1, 3f32.exp() / z * 1.5));
        assert!(close(got[1].1, (-5f32).exp() / z * 1.5));
        // Two groups kept: the best two experts of groups 0 and 1.
        let two = Routing {
            scoring: Scoring::SoftmaxGroups { groups: 3, keep: 2 },
            ..r
        };
        let got = route(&logits, &two, None);
        assert_eq!(got.iter().map(|p| p.0).collect::<Vec<_>>(), [0, 2]);
    }
}
