//! Mixture-of-Experts layers (`Ops::moe`, composed of the device's
//! products with host routing) against the CPU reference: Qwen-style
//! softmax top-k with a gated shared expert, and gpt-oss-style biased
//! experts with the clamped SwiGLU and a router bias, over rows whose
//! routing is clear (every row's k-th and (k+1)-th router logits at least
//! a margin apart, so bf16 products cannot pick other experts).

use kiln_tensor::{
    Activation, Expert, ExpertActivation, ExpertLoad, MoeLayer, Routing, Scoring, SharedExpert,
    Tensor, Weight,
};

use kiln_tensor::prelude::*;

use super::{e, Pair, Rng, R, TOL};

struct Case {
    name: &'static str,
    hidden: usize,
    experts: usize,
    inter: usize,
    top_k: usize,
    shared: Option<usize>,
    clamped: bool,
}

/// One layer on each backend from the same bf16-exact values.
/// Also the router's host values and bias, to pick rows by.
#[allow(clippy::type_complexity)]
fn layers(p: &Pair, rng: &mut Rng, c: &Case) -> R<(MoeLayer, MoeLayer, Vec<f32>, Vec<f32>)> {
    let (h, i) = (c.hidden, c.inter);
    let router = rng.vec(c.experts * h, 0.5);
    let (rg, rc) = p.up(&[c.experts, h], &router)?;
    let mut eg = Vec::new();
    let mut ec = Vec::new();
    for _ in 0..c.experts {
        let (gu_g, gu_c) = p.up(&[2 * i, h], &rng.vec(2 * i * h, 0.2))?;
        let (d_g, d_c) = p.up(&[h, i], &rng.vec(h * i, 0.2))?;
        let mut g = Expert::new(Weight::Dense(gu_g), Weight::Dense(d_g));
        let mut cpu = Expert::new(Weight::Dense(gu_c), Weight::Dense(d_c));
        if c.clamped {
            let (bg, bc) = p.up(&[2 * i], &rng.vec(2 * i, 0.2))?;
            let (dbg, dbc) = p.up(&[h], &rng.vec(h, 0.2))?;
            (g.gate_up_bias, cpu.gate_up_bias) = (Some(bg), Some(bc));
            (g.down_bias, cpu.down_bias) = (Some(dbg), Some(dbc));
        }
        eg.push(g);
        ec.push(cpu);
    }
    let shared = match c.shared {
        Some(s) => {
            let (gu_g, gu_c) = p.up(&[2 * s, h], &rng.vec(2 * s * h, 0.2))?;
            let (d_g, d_c) = p.up(&[h, s], &rng.vec(h * s, 0.2))?;
            let (gg, gc) = p.up(&[1, h], &rng.vec(h, 0.5))?;
            Some((
                SharedExpert {
                    expert: Expert::new(Weight::Dense(gu_g), Weight::Dense(d_g)),
                    gate: Some(Weight::Dense(gg)),
                },
                SharedExpert {
                    expert: Expert::new(Weight::Dense(gu_c), Weight::Dense(d_c)),
                    gate: Some(Weight::Dense(gc)),
                },
            ))
        }
        None => None,
    };
    let bias = match c.clamped {
        true => rng.vec(c.experts, 0.5),
        false => vec![0.0; c.experts],
    };
    let (router_bias, activation, normalize) = match c.clamped {
        true => (
            Some(p.up(&[c.experts], &bias)?),
            ExpertActivation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
            true,
        ),
        false => (None, ExpertActivation::Gated(Activation::Silu), false),
    };
    let layer = |router: Tensor, bias: Option<Tensor>, experts, shared| MoeLayer {
        router: Weight::Dense(router),
        router_bias: bias,
        selection_bias: None,
        experts,
        held: None,
        shared,
        activation,
        routing: Routing {
            top_k: c.top_k,
            scoring: Scoring::Softmax,
            normalize,
            scale: 1.0,
        },
        load: std::sync::Arc::new(ExpertLoad::new(c.experts)),
    };
    let (sg, sc) = match shared {
        Some((g, cpu)) => (Some(g), Some(cpu)),
        None => (None, None),
    };
    let (bg, bc) = match router_bias {
        Some((g, cpu)) => (Some(g), Some(cpu)),
        None => (None, None),
    };
    Ok((layer(rg, bg, eg, sg), layer(rc, bc, ec, sc), router, bias))
}

/// `n` rows whose routing is clear under `router` (`[experts, hidden]`)
/// and its `bias`.
fn clear_rows(rng: &mut Rng, router: &[f32], bias: &[f32], c: &Case, n: usize) -> Vec<f32> {
    let mut rows = Vec::with_capacity(n * c.hidden);
    while rows.len() < n * c.hidden {
        let x = rng.vec(c.hidden, 1.0);
        let mut logits: Vec<f64> = router
            .chunks(c.hidden)
            .zip(bias)
            .map(|(w, b)| {
                *b as f64
                    + w.iter()
                        .zip(&x)
                        .map(|(a, v)| *a as f64 * *v as f64)
                        .sum::<f64>()
            })
            .collect();
        logits.sort_by(|a, b| b.total_cmp(a));
        if logits[c.top_k - 1] - logits[c.top_k] > 0.25 {
            rows.extend(x);
        }
    }
    rows
}

pub(super) fn moe_ops(p: &mut Pair, rng: &mut Rng) -> R<()> {
    let cases = [
        Case {
            name: "qwen-style top 4 of 16, gated shared expert",
            hidden: 128,
            experts: 16,
            inter: 96,
            top_k: 4,
            shared: Some(160),
            clamped: false,
        },
        Case {
            name: "gpt-oss-style top 2 of 8, biases, clamped SwiGLU",
            hidden: 64,
            experts: 8,
            inter: 48,
            top_k: 2,
            shared: None,
            clamped: true,
        },
    ];
    for c in &cases {
        let (g, cpu, router, bias) = layers(p, rng, c)?;
        for n in [1usize, 7, 33] {
            let x = clear_rows(rng, &router, &bias, c, n);
            let (xg, xc) = p.up(&[n, c.hidden], &x)?;
            let yg = p.gpu.moe(&xg, &g).map_err(e)?;
            let yc = p.cpu.moe(&xc, &cpu).map_err(e)?;
            p.compare(format!("moe {} rows={n}", c.name), &yg, &yc, TOL)?;
        }
    }
    Ok(())
}
