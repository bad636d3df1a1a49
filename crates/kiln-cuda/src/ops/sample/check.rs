//! The device sampler's check in `kiln dev cuda-check`: many rows of
//! random logits (ties, NaN and infinities among them) under mixed
//! parameters, the device's tokens and log-probabilities against the host
//! reference's (`reference.rs`).

use half::bf16;
use kiln_tensor::{Memory, SampleRow, Sampling};

use super::reference::reference;
#[cfg(test)]
use super::reference::{processed, Reference};
use crate::selfcheck::Check;
use crate::CudaBackend;

/// A small deterministic generator for the check's data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// One row's owned parameters, borrowed into a [`SampleRow`].
struct RowData {
    row: SampleRow<'static>,
    bias: Vec<(u32, f32)>,
    penalties: Vec<(u32, u32, bool)>,
    mask: Option<Vec<u32>>,
}

impl RowData {
    fn row(&self) -> SampleRow<'_> {
        SampleRow {
            logit_bias: &self.bias,
            penalties: &self.penalties,
            mask: self.mask.as_deref(),
            ..self.row
        }
    }
}

/// Random logits for row `r`: plain, coarsely quantized (many ties),
/// peaked, or with NaN and infinities.
fn row_logits(rng: &mut Rng, r: usize, vocab: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..vocab)
        .map(|_| match r % 4 {
            1 => (rng.unit() * 12.0).round() as f32 * 0.5 - 3.0,
            _ => (rng.unit() * 8.0 - 4.0) as f32,
        })
        .collect();
    if r % 4 == 2 {
        for _ in 0..5 {
            l[rng.below(vocab)] = 9.0 + rng.unit() as f32;
        }
    }
    if r % 4 == 3 {
        l[rng.below(vocab)] = f32::NAN;
        l[rng.below(vocab)] = f32::NEG_INFINITY;
        if r % 8 == 7 {
            l[rng.below(vocab)] = f32::INFINITY;
        }
    }
    l.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Mixed parameters for row `r`; row 5 allows nothing.
fn row_params(rng: &mut Rng, r: usize, vocab: usize, logits: &[f32]) -> RowData {
    let top_logprobs = match r % 7 {
        0 => 20,
        1 | 2 => 5,
        _ => 0,
    };
    let row = SampleRow {
        temperature: if r.is_multiple_of(6) {
            0.0
        } else {
            rng.pick(&[0.3, 0.7, 1.0, 1.5])
        },
        top_k: rng.pick(&[0, 0, 1, 5, 50]),
        top_p: rng.pick(&[1.0, 1.0, 0.9, 0.5]),
        min_p: rng.pick(&[0.0, 0.0, 0.05]),
        u: rng.unit(),
        top_logprobs,
        ..SampleRow::GREEDY
    };
    let mut data = RowData {
        row,
        bias: Vec::new(),
        penalties: Vec::new(),
        mask: None,
    };
    if r % 3 == 1 {
        // Ban the argmax, push two others.
        let best = (0..vocab).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        let mut ids = vec![best as u32];
        while ids.len() < 3 {
            let t = rng.below(vocab) as u32;
            if !ids.contains(&t) {
                ids.push(t);
            }
        }
        data.bias = vec![(ids[0], -100.0), (ids[1], 2.5), (ids[2], -1.25)];
    }
    if r % 4 == 2 || r % 5 == 1 {
        data.row.repetition_penalty = rng.pick(&[1.0, 1.3, 0.8]);
        data.row.frequency_penalty = rng.pick(&[0.0, 0.5, -0.4]);
        data.row.presence_penalty = rng.pick(&[0.0, 0.3, 1.0]);
        let mut ids: Vec<u32> = (0..40).map(|_| rng.below(vocab) as u32).collect();
        ids.sort_unstable();
        ids.dedup();
        data.penalties = ids
            .into_iter()
            .map(|t| (t, rng.below(4) as u32, rng.below(2) == 0))
            .collect();
    }
    let words = vocab.div_ceil(32);
    if r == 5 {
        data.mask = Some(vec![0; words]);
    } else if r % 5 == 3 {
        data.mask = Some((0..words).map(|_| rng.next() as u32).collect());
    }
    data
}

/// The device sampler against the reference at two vocabulary sizes, and
/// twice on the same data (a seeded request repeats exactly).
pub(crate) fn checks(gpu: &CudaBackend) -> Result<Vec<Check>, String> {
    let e = |x: kiln_tensor::TensorError| x.to_string();
    let mut checks = Vec::new();
    let mut rng = Rng(0x853C_49E6_748F_EA9B);
    for vocab in [1001usize, 49152] {
        let num_rows = 48;
        let mut data = Vec::new();
        let mut all = Vec::with_capacity(num_rows * vocab);
        for r in 0..num_rows {
            let l = row_logits(&mut rng, r, vocab);
            data.push(row_params(&mut rng, r, vocab, &l));
            all.extend(l);
        }
        let t = gpu.upload(&[num_rows, vocab], &all).map_err(e)?;
        let host = gpu.to_host(&t).map_err(e)?;
        let rows: Vec<SampleRow<'_>> = data.iter().map(RowData::row).collect();
        let Some(got) = gpu.sample_rows(&t, &rows).map_err(e)? else {
            return Err("sample_rows is not available".into());
        };
        let again = gpu.sample_rows(&t, &rows).map_err(e)?;
        let (mut wrong, mut fragile, mut worst) = (0usize, 0usize, 0f64);
        for (r, row) in rows.iter().enumerate() {
            let want = reference(&host[r * vocab..(r + 1) * vocab], row);
            match (got.get(r).cloned().flatten(), want) {
                (None, None) => {}
                (Some(g), Some(w)) => {
                    fragile += usize::from(w.fragile);
                    let top_ids = |t: &[(u32, f32)]| t.iter().map(|p| p.0).collect::<Vec<_>>();
                    if g.token != w.token || top_ids(&g.top) != top_ids(&w.top) {
                        wrong += usize::from(!w.fragile || top_ids(&g.top) != top_ids(&w.top));
                        continue;
                    }
                    worst = worst.max(f64::from((g.logprob - w.logprob).abs()));
                    for (a, b) in g.top.iter().zip(&w.top) {
                        worst = worst.max(f64::from((a.1 - b.1).abs()));
                    }
                }
                _ => wrong += 1,
            }
        }
        let repeat = again.as_ref() == Some(&got);
        checks.push(Check {
            op: format!(
                "sample_rows vocab {vocab}: {num_rows} rows, {wrong} wrong, {fragile} near a rounding boundary{}",
                if repeat { "" } else { ", NOT REPEATABLE" }
            ),
            rel_err: wrong as f64 / num_rows as f64,
            max_abs_err: worst,
            tolerance: 1e-3,
            pass: wrong == 0 && repeat && worst <= 1e-3,
        });
    }
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_sampling::{History, Sampler, SamplingParams, TokenId};

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            logprobs: Some(3),
            ..SamplingParams::default()
        }
    }

    /// The reference's answer for a host sampler's step (its `device_step`).
    fn reference_of(
        p: &SamplingParams,
        logits: &[f32],
        history: &History<'_>,
        seed: u64,
    ) -> (Reference, Sampler) {
        let p = SamplingParams {
            seed: Some(seed),
            ..p.clone()
        };
        let mut s = Sampler::new(p, logits.len(), 0).expect("valid params");
        let d = s.device_step(history).expect("device step");
        let row = SampleRow {
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            min_p: d.min_p,
            u: d.u,
            logit_bias: &d.logit_bias,
            repetition_penalty: d.repetition_penalty,
            frequency_penalty: d.frequency_penalty,
            presence_penalty: d.presence_penalty,
            penalties: &d.penalties,
            mask: None,
            top_logprobs: d.top_logprobs,
        };
        (reference(logits, &row).expect("candidates"), s)
    }

    fn cases() -> Vec<(Vec<f32>, SamplingParams)> {
        let ties = vec![1.0, 2.0, 2.0, 0.5, 2.0, 1.0, -1.0, 1.0, f32::NAN, 0.0];
        let spread: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 / 20.0).collect();
        let mut biased = params(0.8, 0, 0.9, 0.0);
        biased.logit_bias = vec![(TokenId(2), -100.0), (TokenId(3), 1.5)];
        biased.repetition_penalty = 1.4;
        biased.frequency_penalty = 0.5;
        biased.presence_penalty = -0.3;
        vec![
            (ties.clone(), params(1.0, 2, 1.0, 0.0)),
            (ties.clone(), params(1.0, 4, 1.0, 0.0)),
            (ties.clone(), params(0.7, 0, 0.5, 0.0)),
            (ties.clone(), params(1.3, 0, 0.8, 0.2)),
            (ties.clone(), params(0.0, 0, 1.0, 0.0)),
            (ties, biased),
            (spread.clone(), params(1.0, 50, 0.9, 0.0)),
            (spread.clone(), params(0.5, 0, 0.95, 0.05)),
            (spread, params(1.5, 5, 1.0, 0.3)),
        ]
    }

    #[test]
    fn host_sampler_draws_stay_in_the_reference_kept_set() {
        let prompt = [TokenId(1), TokenId(3)];
        let generated = [TokenId(4), TokenId(4), TokenId(0)];
        let history = History::new(&prompt, &generated);
        for (case, (logits, p)) in cases().into_iter().enumerate() {
            let (want, _) = reference_of(&p, &logits, &history, 0);
            let mut hits = std::collections::BTreeSet::new();
            for seed in 0..600 {
                let p = SamplingParams {
                    seed: Some(seed),
                    ..p.clone()
                };
                let mut s = Sampler::new(p.clone(), logits.len(), 0).expect("valid");
                let got = s.sample(&mut logits.clone(), &history).expect("sample");
                let top: Vec<(u32, f32)> = got.top.iter().map(|&(t, l)| (t.0, l)).collect();
                let close = top.len() == want.top.len()
                    && top
                        .iter()
                        .zip(&want.top)
                        .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() < 1e-6);
                assert!(close, "case {case}: top {top:?} vs {:?}", want.top);
                if p.temperature == 0.0 {
                    assert_eq!(got.token.0, want.token, "case {case}: greedy");
                    continue;
                }
                assert!(
                    want.kept.contains(&got.token.0),
                    "case {case}: host drew {} outside {:?}",
                    got.token.0,
                    want.kept
                );
                hits.insert(got.token.0);
            }
            if p.temperature != 0.0 && want.kept.len() <= 6 {
                // Each survivor here has a probability of several percent.
                assert_eq!(
                    hits.into_iter().collect::<Vec<_>>(),
                    want.kept,
                    "case {case}"
                );
            }
        }
    }

    #[test]
    fn reference_draws_the_host_token_when_the_orders_agree() {
        // Without truncation the host holds candidates in id order, so the
        // same u picks the same token as the reference's device order.
        let logits: Vec<f32> = (0..64).map(|i| ((i * 29) % 17) as f32 / 4.0).collect();
        let history = History::default();
        for temperature in [0.4, 1.0, 2.0] {
            let p = params(temperature, 0, 1.0, 0.0);
            for seed in 0..200 {
                let (want, _) = reference_of(&p, &logits, &history, seed);
                let mut s = Sampler::new(
                    SamplingParams {
                        seed: Some(seed),
                        ..p.clone()
                    },
                    logits.len(),
                    0,
                )
                .expect("valid");
                let got = s.sample(&mut logits.clone(), &history).expect("sample");
                assert_eq!(got.token.0, want.token);
                assert!((got.logprob - want.logprob).abs() < 1e-6);
            }
        }
    }

    /// `sample.cu`'s truncation and draw, step for step on the host (one
    /// thread), from the processed logits: the digit searches, the tie
    /// limits and the id-order draw.
    fn kernel_token(l: &[f32], p: &SampleRow<'_>) -> u32 {
        let key = |x: f32| {
            let u = (if x == 0.0 { 0.0f32 } else { x }).to_bits();
            if u & 0x8000_0000 != 0 {
                !u
            } else {
                u | 0x8000_0000
            }
        };
        let float_of = |k: u32| {
            f32::from_bits(if k & 0x8000_0000 != 0 {
                k & 0x7fff_ffff
            } else {
                !k
            })
        };
        // The largest t with f(t) >= goal, 4 bits at a time, and f(t + 1).
        fn search<T: PartialOrd + Copy>(f: impl Fn(u32) -> T, goal: T, zero: T) -> (u32, T) {
            let (mut t, mut above) = (0u32, zero);
            for shift in (0..=28).rev().step_by(4) {
                let mut pick = 0;
                for d in 1..16u32 {
                    let v = f(t + (d << shift));
                    if v >= goal {
                        pick = d;
                    } else if pick == d - 1 {
                        above = v;
                    }
                }
                t += pick << shift;
            }
            (t, above)
        }
        let tie_limit = |need: usize, tie: &dyn Fn(usize) -> bool| {
            let ties: Vec<usize> = (0..l.len()).filter(|&i| tie(i)).collect();
            if ties.len() <= need {
                l.len()
            } else {
                ties[need - 1] + 1
            }
        };
        let cand = |i: usize| l[i] > f32::NEG_INFINITY;
        let max = (0..l.len())
            .filter(|&i| cand(i))
            .fold(f32::NEG_INFINITY, |m, i| m.max(l[i]));
        let num_cand = (0..l.len()).filter(|&i| cand(i)).count();
        let use_k = p.top_k > 0 && (p.top_k as usize) < num_cand;
        let (mut tk, mut tk_limit) = (0, l.len());
        if use_k {
            let count = |t: u32| (0..l.len()).filter(|&i| cand(i) && key(l[i]) >= t).count();
            let (t, above) = search(count, p.top_k as usize, 0);
            tk = t;
            tk_limit = tie_limit(p.top_k as usize - above, &|i| cand(i) && key(l[i]) == t);
        }
        let kept_k =
            |i: usize| cand(i) && (!use_k || key(l[i]) > tk || (key(l[i]) == tk && i < tk_limit));
        let w = |i: usize| ((l[i] - max) / p.temperature).exp();
        let use_p = p.top_p < 1.0;
        let (mut tp, mut tp_limit) = (0, l.len());
        if use_p {
            let mass = |t: u32| -> f64 {
                (0..l.len())
                    .filter(|&i| kept_k(i) && key(w(i)) >= t)
                    .map(|i| f64::from(w(i)))
                    .sum()
            };
            let target = f64::from(p.top_p) * mass(0);
            let (t, above) = search(mass, target, 0.0);
            tp = t;
            let wt = float_of(t);
            let need = if wt > 0.0 {
                ((target - above) / f64::from(wt))
                    .ceil()
                    .clamp(1.0, l.len() as f64) as usize
            } else {
                l.len()
            };
            tp_limit = tie_limit(need, &|i| kept_k(i) && key(w(i)) == t);
        }
        let kept = |i: usize| {
            kept_k(i)
                && (!use_p || key(w(i)) > tp || (key(w(i)) == tp && i < tp_limit))
                && (p.min_p <= 0.0 || w(i) >= p.min_p)
        };
        let ids: Vec<usize> = (0..l.len()).filter(|&i| kept(i) && w(i) > 0.0).collect();
        let total: f64 = ids.iter().map(|&i| f64::from(w(i))).sum();
        let mut run = 0.0;
        ids.iter()
            .find(|&&i| {
                run += f64::from(w(i));
                run > p.u * total
            })
            .or(ids.last())
            .map_or(u32::MAX, |&i| i as u32)
    }

    #[test]
    fn the_kernel_algorithm_keeps_the_reference_survivors() {
        let mut rng = Rng(0x2545_F491_4F6C_DD1D);
        let (mut fragile, mut checked) = (0, 0);
        for r in 0..400 {
            let vocab = [7, 64, 1001][r % 3];
            let logits = row_logits(&mut rng, r, vocab);
            let data = row_params(&mut rng, r, vocab, &logits);
            let mut row = data.row();
            if row.temperature == 0.0 {
                row.temperature = 0.9;
            }
            let Some(want) = reference(&logits, &row) else {
                continue;
            };
            if want.fragile {
                fragile += 1;
                continue;
            }
            checked += 1;
            let got = kernel_token(&processed(&logits, &row), &row);
            assert_eq!(got, want.token, "row {r}: {:?}", want.kept);
        }
        assert!(
            checked > 300 && fragile < 40,
            "{checked} checked, {fragile} fragile"
        );
    }

    #[test]
    fn masked_and_banned_rows() {
        let logits = [3.0f32, 1.0, 2.0, 0.5];
        let mask = [0b0110u32];
        let row = SampleRow {
            mask: Some(&mask),
            top_logprobs: 4,
            ..SampleRow::GREEDY
        };
        let got = reference(&logits, &row).expect("candidates");
        assert_eq!(got.token, 2);
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 1]);
        let ban = [(1, -100.0), (2, -100.0)];
        let row = SampleRow {
            logit_bias: &ban,
            ..row
        };
        assert_eq!(reference(&logits, &row), None);
    }
}
