//! Distribution tests for the host sampler.
//!
//! For each configuration, 200,000 tokens are drawn with a fixed seed from a fixed
//! 12-token logit vector and compared with the exact distribution, computed here in
//! `f64` from the documented semantics without using any sampler code. The Pearson
//! chi-square statistic must stay below the 0.999 quantile for its degrees of freedom,
//! and tokens the configuration truncates must never appear. With a fixed seed every
//! run is identical, so these tests cannot flake.

use kiln_sampling::{History, Sampler, SamplingParams, TokenId};

const NUM_DRAWS: usize = 200_000;

/// Distinct logits with a wide spread, so truncation boundaries are unambiguous.
const LOGITS: [f64; 12] = [
    2.0, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0,
];

/// Upper 0.999 quantiles of the chi-square distribution, indexed by degrees of
/// freedom (index 0 unused), from standard tables.
const CHI2_999: [f64; 12] = [
    0.0, 10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588, 31.264,
];

/// Penalties applied to the reference logits, mirroring what the request asks for.
#[derive(Default)]
struct Shaping {
    /// `(token, bias)`; a bias of -100 bans the token.
    bias: Vec<(usize, f64)>,
    prompt: Vec<usize>,
    generated: Vec<usize>,
}

/// The expected probability of each token, from first principles in `f64`.
fn expected(params: &SamplingParams, shaping: &Shaping) -> Vec<f64> {
    let mut logits = LOGITS.to_vec();
    for &(token, bias) in &shaping.bias {
        logits[token] = if bias <= -100.0 {
            f64::NEG_INFINITY
        } else {
            logits[token] + bias
        };
    }
    let r = f64::from(params.repetition_penalty);
    for (token, l) in logits.iter_mut().enumerate() {
        let count = shaping.generated.iter().filter(|&&t| t == token).count();
        if count > 0 || shaping.prompt.contains(&token) {
            *l = if *l > 0.0 { *l / r } else { *l * r };
        }
        if count > 0 {
            *l -= f64::from(params.frequency_penalty) * count as f64;
            *l -= f64::from(params.presence_penalty);
        }
    }
    // Rank tokens by processed logit, best first (all distinct here).
    let mut order: Vec<usize> = (0..logits.len())
        .filter(|&t| logits[t].is_finite())
        .collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    let t = f64::from(params.temperature);
    let mut probs = vec![0.0; logits.len()];
    for &token in &order {
        probs[token] = (logits[token] / t).exp();
    }
    normalize(&mut probs);
    if params.top_p < 1.0 {
        let top_p = f64::from(params.top_p);
        let mut mass_before = 0.0;
        for &token in &order {
            let keep = mass_before < top_p;
            assert!(
                (mass_before - top_p).abs() > 1e-6,
                "top_p sits on a boundary"
            );
            mass_before += probs[token];
            if !keep {
                probs[token] = 0.0;
            }
        }
        normalize(&mut probs);
    }
    if params.min_p > 0.0 {
        let p_max = probs.iter().copied().fold(0.0, f64::max);
        let min_p = f64::from(params.min_p);
        for p in probs.iter_mut().filter(|p| **p > 0.0) {
            assert!(
                (*p / p_max - min_p).abs() > 1e-6,
                "min_p sits on a boundary"
            );
            if *p < min_p * p_max {
                *p = 0.0;
            }
        }
        normalize(&mut probs);
    }
    probs
}

fn normalize(probs: &mut [f64]) {
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
}

/// Draws `NUM_DRAWS` tokens and checks them against `expected`.
fn check(params: SamplingParams, shaping: Shaping) {
    let probs = expected(&params, &shaping);
    let ids = |v: &[usize]| v.iter().map(|&t| TokenId(t as u32)).collect::<Vec<_>>();
    let (prompt, generated) = (ids(&shaping.prompt), ids(&shaping.generated));
    let history = History::new(&prompt, &generated);
    let params = SamplingParams {
        seed: Some(0x5eed),
        logit_bias: shaping
            .bias
            .iter()
            .map(|&(t, b)| (TokenId(t as u32), b as f32))
            .collect(),
        ..params
    };
    let mut sampler = Sampler::new(params.clone(), LOGITS.len(), 0).expect("valid params");
    let mut counts = vec![0usize; LOGITS.len()];
    let mut row = [0.0f32; LOGITS.len()];
    for _ in 0..NUM_DRAWS {
        for (dst, &src) in row.iter_mut().zip(&LOGITS) {
            *dst = src as f32;
        }
        let sampled = sampler
            .sample(&mut row, &history)
            .expect("sampling succeeds");
        counts[sampled.token.as_usize()] += 1;
    }
    let mut chi2 = 0.0;
    let mut num_kept = 0;
    for (token, (&count, &p)) in counts.iter().zip(&probs).enumerate() {
        if p == 0.0 {
            assert_eq!(count, 0, "truncated token {token} was sampled; {params:?}");
            continue;
        }
        let e = p * NUM_DRAWS as f64;
        assert!(e >= 5.0, "expected count {e} too small for chi-square");
        chi2 += (count as f64 - e).powi(2) / e;
        num_kept += 1;
    }
    let df = num_kept - 1;
    assert!(df >= 1, "configuration keeps a single token; {params:?}");
    assert!(
        chi2 < CHI2_999[df],
        "chi2 {chi2:.2} >= {} for df {df}; counts {counts:?}; {params:?}",
        CHI2_999[df]
    );
}

fn with(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        ..SamplingParams::default()
    }
}

#[test]
fn temperature() {
    for t in [1.0, 0.7, 1.8, 2.0] {
        check(with(t), Shaping::default());
    }
}

#[test]
fn top_k() {
    check(
        SamplingParams {
            top_k: 4,
            ..with(1.0)
        },
        Shaping::default(),
    );
    check(
        SamplingParams {
            top_k: 11,
            ..with(1.5)
        },
        Shaping::default(),
    );
}

#[test]
fn top_p() {
    check(
        SamplingParams {
            top_p: 0.8,
            ..with(1.0)
        },
        Shaping::default(),
    );
    check(
        SamplingParams {
            top_p: 0.5,
            ..with(0.6)
        },
        Shaping::default(),
    );
}

#[test]
fn min_p() {
    check(
        SamplingParams {
            min_p: 0.1,
            ..with(1.0)
        },
        Shaping::default(),
    );
    check(
        SamplingParams {
            min_p: 0.3,
            ..with(1.7)
        },
        Shaping::default(),
    );
}

#[test]
fn combinations() {
    let cases = [
        SamplingParams {
            top_k: 6,
            top_p: 0.9,
            ..with(0.8)
        },
        SamplingParams {
            top_k: 8,
            top_p: 0.95,
            min_p: 0.05,
            ..with(1.3)
        },
        SamplingParams {
            top_p: 0.97,
            min_p: 0.02,
            ..with(0.5)
        },
        SamplingParams {
            top_k: 10,
            min_p: 0.15,
            ..with(2.0)
        },
    ];
    for params in cases {
        check(params, Shaping::default());
    }
}

#[test]
fn penalties_and_bias_shape_the_distribution() {
    let params = SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.2,
        top_k: 9,
        ..with(1.0)
    };
    let shaping = Shaping {
        bias: vec![(0, -100.0), (11, 2.5), (5, -0.3)],
        prompt: vec![1, 2, 8],
        generated: vec![2, 3, 3, 9, 3],
    };
    check(params, shaping);
}
