//! The host sampler: one request's logits in, one token and its logprobs out.
//!
//! # Semantics
//!
//! This is the reference a GPU sampler must reproduce. For one step with logits `l`
//! (one `f32` per vocabulary token), [`Sampler::sample`] does, in order:
//!
//! 1. **Logit bias.** For each `(token, b)` in `logit_bias`: `l[token] += b`, except that
//!    `b == -100` sets `l[token] = -inf` (a hard ban).
//! 2. **Penalties.** Repetition penalty `r` over the distinct tokens of prompt and
//!    generated text (`l > 0 ? l / r : l * r`), then `l -= frequency_penalty * count`
//!    and `l -= presence_penalty` for every token generated `count >= 1` times.
//!    Prompt tokens never get frequency or presence penalties.
//! 3. **Cleaning.** NaN becomes `-inf` and `+inf` becomes `f32::MAX`. The result is
//!    the *processed logits*; it is left in the caller's slice. If every processed
//!    logit is `-inf`, sampling fails with [`SamplingError::NoCandidates`].
//! 4. **Logprobs.** `logprob(i) = l_i - log Σ_j exp(l_j)` over the processed logits:
//!    bias and penalties are included, temperature and truncation are not. So these
//!    are the model's log-probabilities as shaped by the request's bias and penalties,
//!    not the distribution actually sampled from, and they do not depend on
//!    `temperature`, `top_k`, `top_p` or `min_p`. (vLLM's `raw_logprobs` mode is taken
//!    before bias and penalties too; its `processed_logprobs` after temperature and
//!    truncation. Ours sits between: a banned token gets `-inf`, as clients expect,
//!    and greedy requests still get meaningful numbers.) `top` holds the `logprobs`
//!    best tokens, highest first, ties by lower id, `-inf` tokens left out.
//! 5. **Greedy** (`temperature == 0`): the token with the highest processed logit, ties
//!    to the lowest id. No random numbers are drawn.
//! 6. Otherwise, over the tokens with a finite processed logit:
//!    1. **top_k** (if `0 < top_k`): keep exactly the `top_k` highest logits, ties at
//!       the boundary to lower ids.
//!    2. **Temperature**: weight `w_i = exp((l_i - max) / temperature)` in `f32`, where
//!       `max` is the highest processed logit. Probabilities are `w_i / Σ w`.
//!    3. **top_p** (if `< 1`): sort the survivors by weight, highest first, ties by
//!       lower id; keep token `i` iff the weight of the tokens before it is `< top_p *
//!       Σ w` (so the top token always stays, and the kept set is the smallest prefix
//!       whose mass reaches `top_p`). Sums are `f64`.
//!    4. **min_p** (if `> 0`): keep token `i` iff `w_i >= min_p * max_j w_j` among the
//!       survivors. This is the same as `p_i >= min_p * p_max` before or after
//!       renormalization.
//!    5. **Draw**: `u = U[0, 1) * Σ w` over the survivors, with `U` built from the top
//!       53 bits of exactly one xoshiro256** output; the token is the first survivor,
//!       in the order they are held, whose running `f64` weight sum exceeds `u`. Which
//!       order that is does not change the distribution, only which token a given `u`
//!       maps to, so a GPU sampler matches in distribution, not draw for draw.
//!
//! # Device order
//!
//! A backend that samples where the logits are ([`Sampler::device_step`] gives it
//! this step's data) keeps exactly the same survivors (up to `f64` summation order
//! where `top_p`'s boundary falls) and computes the same logprobs, but draws in
//! **id order**: with the same `U` (one xoshiro256** output, top 53 bits, drawn only
//! when not greedy), the token is the first survivor by increasing id whose running
//! weight sum exceeds `U * Σ w`. So a seeded request repeats exactly on the device,
//! and device and host agree in distribution. If rounding leaves no such token, the
//! highest-id survivor of positive weight is taken.
//!
//! The RNG is seeded once per request with splitmix64 from `seed` (or caller entropy),
//! so a seeded request repeats exactly given the same logits.

use crate::logprobs::{log_normalizer, top_logprobs};
use crate::processors::{apply_logit_bias, penalties_enabled, PenaltyState};
use crate::rng::Rng;
use crate::truncation::{apply_min_p, apply_top_k, apply_top_p, Candidate};
use crate::{DeviceStep, SamplingError, SamplingParams, TokenId, MAX_LOGPROBS};

/// The tokens a request has seen so far, passed to every [`Sampler::sample`] call.
///
/// `prompt` must stay the same for the life of a sampler. `generated` grows by the
/// tokens accepted since the last call; if it shrinks (a rollback), the sampler
/// recounts it from scratch.
#[derive(Debug, Clone, Copy, Default)]
pub struct History<'a> {
    /// The prompt tokens, which count for the repetition penalty only.
    pub prompt: &'a [TokenId],
    /// The tokens generated so far, which count for every penalty.
    pub generated: &'a [TokenId],
}

impl<'a> History<'a> {
    /// A history from prompt and generated tokens.
    pub fn new(prompt: &'a [TokenId], generated: &'a [TokenId]) -> Self {
        History { prompt, generated }
    }
}

/// The outcome of one sampling step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampled {
    /// The chosen token.
    pub token: TokenId,
    /// The chosen token's log-probability under the processed logits (see the module
    /// documentation: after bias and penalties, before temperature and truncation).
    pub logprob: f32,
    /// The `logprobs` most likely tokens with their log-probabilities, best first;
    /// empty when the request asked for none. May or may not contain `token`.
    pub top: Vec<(TokenId, f32)>,
}

/// Per-request sampling state: parameters, random number generator, penalty counts
/// and scratch buffers reused from step to step.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    vocab_size: usize,
    rng: Rng,
    penalties: PenaltyState,
    /// Scratch space for the candidates of one step; keeps its capacity between steps.
    candidates: Vec<Candidate>,
}

impl Sampler {
    /// Creates the sampler for one request over a vocabulary of `vocab_size` logits.
    ///
    /// The RNG is seeded from `params.seed`, or from `entropy` when the request has no
    /// seed; the caller supplies `entropy` (for example from the clock or a counter)
    /// because nothing below the binary reads the environment. Fails if `params` do
    /// not [validate](SamplingParams::validate).
    pub fn new(
        params: SamplingParams,
        vocab_size: usize,
        entropy: u64,
    ) -> Result<Self, SamplingError> {
        params.validate(vocab_size)?;
        let rng = Rng::from_seed(params.seed.unwrap_or(entropy));
        Ok(Sampler {
            params,
            vocab_size,
            rng,
            penalties: PenaltyState::default(),
            candidates: Vec::new(),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The number of logits each step must supply.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Chooses the next token from `logits` given the request's `history`.
    ///
    /// On success `logits` holds the processed logits (bias, penalties and cleaning
    /// applied; no temperature). Fails without drawing a random number if `logits` does
    /// not have `vocab_size` entries, if `history` holds a token outside the vocabulary
    /// (checked only when a penalty is on), or if every processed logit is `-inf`.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        history: &History<'_>,
    ) -> Result<Sampled, SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLenMismatch {
                expected: self.vocab_size,
                actual: logits.len(),
            });
        }
        let penalize = penalties_enabled(&self.params);
        if penalize {
            self.penalties.update(history, self.vocab_size)?;
        }
        apply_logit_bias(logits, &self.params.logit_bias);
        if penalize {
            self.penalties.apply(logits, &self.params);
        }
        let max = clean_and_max(logits).ok_or(SamplingError::NoCandidates)?;

        let token_id = if self.params.is_greedy() {
            argmax(logits, max)
        } else {
            self.draw(logits, max)
        }
        .ok_or(SamplingError::NoCandidates)?;

        let log_z = log_normalizer(logits, max);
        let logit = *logits
            .get(token_id as usize)
            .expect("a sampled token id indexes the logits it came from; this is a bug");
        let top = match self.params.logprobs {
            Some(k) => top_logprobs(logits, k, log_z),
            None => Vec::new(),
        };
        Ok(Sampled {
            token: TokenId(token_id),
            logprob: (f64::from(logit) - log_z) as f32,
            top,
        })
    }

    /// Whether a backend may sample this request's rows where the logits are
    /// (see [`Sampler::device_step`]).
    pub fn device_supported(&self) -> bool {
        self.params.logprobs.unwrap_or(0) <= MAX_LOGPROBS && u32::try_from(self.vocab_size).is_ok()
    }

    /// This step's data for a device sampler (the module documentation's *device
    /// order*), without touching logits: brings the penalty counts up to date with
    /// `history` and reads the draw's uniform number without consuming it. Once the
    /// device's token is taken, [`Sampler::finish_device_step`] consumes it, so a
    /// step that falls back to [`Sampler::sample`] draws the same number.
    pub fn device_step(&mut self, history: &History<'_>) -> Result<DeviceStep, SamplingError> {
        let params = &self.params;
        let penalties = if penalties_enabled(params) {
            self.penalties.update(history, self.vocab_size)?;
            self.penalties
                .device_entries(params.repetition_penalty != 1.0)
        } else {
            Vec::new()
        };
        let u = if params.is_greedy() {
            0.0
        } else {
            self.rng.clone().next_f64()
        };
        Ok(DeviceStep {
            temperature: params.temperature,
            top_k: u32::try_from(params.top_k)
                .ok()
                .filter(|&k| (k as usize) < self.vocab_size)
                .unwrap_or(0),
            top_p: params.top_p,
            min_p: params.min_p,
            u,
            logit_bias: params.logit_bias.iter().map(|&(t, b)| (t.0, b)).collect(),
            repetition_penalty: params.repetition_penalty,
            frequency_penalty: params.frequency_penalty,
            presence_penalty: params.presence_penalty,
            penalties,
            top_logprobs: params.logprobs.unwrap_or(0).min(MAX_LOGPROBS) as u32,
        })
    }

    /// Consumes the uniform number [`Sampler::device_step`] read (nothing when
    /// greedy), after the device sampled a token with it.
    pub fn finish_device_step(&mut self) {
        if !self.params.is_greedy() {
            self.rng.next_f64();
        }
    }

    /// Steps 6.1 to 6.5 of the module documentation.
    fn draw(&mut self, logits: &[f32], max: f32) -> Option<u32> {
        let params = &self.params;
        let candidates = &mut self.candidates;
        candidates.clear();
        candidates.extend(
            (0u32..)
                .zip(logits)
                .filter(|&(_, &l)| l > f32::NEG_INFINITY)
                .map(|(id, &value)| Candidate { id, value }),
        );
        if params.top_k > 0 {
            apply_top_k(candidates, params.top_k);
        }
        let temperature = params.temperature;
        for c in candidates.iter_mut() {
            c.value = ((c.value - max) / temperature).exp();
        }
        if params.top_p < 1.0 {
            apply_top_p(candidates, params.top_p);
        }
        if params.min_p > 0.0 {
            apply_min_p(candidates, params.min_p);
        }
        let total: f64 = candidates.iter().map(|c| f64::from(c.value)).sum();
        let u = self.rng.next_f64() * total;
        let mut cumulative = 0.0f64;
        for c in candidates.iter() {
            cumulative += f64::from(c.value);
            if cumulative > u {
                return Some(c.id);
            }
        }
        // Only reachable through rounding: fall back to the last possible token.
        candidates
            .iter()
            .rev()
            .find(|c| c.value > 0.0)
            .map(|c| c.id)
    }
}

/// Replaces NaN with `-inf` and `+inf` with `f32::MAX`, and returns the largest
/// logit, or `None` when every logit is `-inf`.
fn clean_and_max(logits: &mut [f32]) -> Option<f32> {
    let mut max = f32::NEG_INFINITY;
    for l in logits.iter_mut() {
        if l.is_nan() {
            *l = f32::NEG_INFINITY;
        } else if *l == f32::INFINITY {
            *l = f32::MAX;
        }
        max = max.max(*l);
    }
    (max > f32::NEG_INFINITY).then_some(max)
}

/// The lowest id whose logit equals `max`.
fn argmax(logits: &[f32], max: f32) -> Option<u32> {
    (0u32..)
        .zip(logits)
        .find(|&(_, &l)| l == max)
        .map(|(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: History<'static> = History {
        prompt: &[],
        generated: &[],
    };

    fn sampler(params: SamplingParams, vocab_size: usize) -> Sampler {
        match Sampler::new(params, vocab_size, 0xfeed) {
            Ok(s) => s,
            Err(e) => panic!("valid params rejected: {e}"),
        }
    }

    fn draw(s: &mut Sampler, logits: &[f32], history: &History<'_>) -> Sampled {
        let mut row = logits.to_vec();
        match s.sample(&mut row, history) {
            Ok(sampled) => sampled,
            Err(e) => panic!("sampling failed: {e}"),
        }
    }

    fn tokens(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<u32> {
        (0..n).map(|_| draw(s, logits, &NONE).token.0).collect()
    }

    fn seeded(seed: u64) -> SamplingParams {
        SamplingParams {
            seed: Some(seed),
            ..SamplingParams::default()
        }
    }

    const FLAT: [f32; 8] = [0.1, 0.0, 0.2, -0.1, 0.05, 0.15, -0.05, 0.0];

    #[test]
    fn greedy_is_argmax_with_ties_to_lowest_id() {
        let mut s = sampler(SamplingParams::greedy(), 6);
        assert_eq!(
            draw(&mut s, &[0.0, 3.0, -1.0, 3.0, 2.9, f32::NAN], &NONE).token,
            TokenId(1)
        );
        assert_eq!(
            draw(&mut s, &[5.0, 3.0, 1.0, 3.0, 2.9, 4.0], &NONE).token,
            TokenId(0)
        );
        let inf = draw(&mut s, &[0.0, f32::INFINITY, 1.0, 0.0, 0.0, 0.0], &NONE);
        assert_eq!((inf.token, inf.logprob), (TokenId(1), 0.0));
    }

    #[test]
    fn seeded_runs_repeat_and_seeds_differ() {
        let a = tokens(&mut sampler(seeded(42), 8), &FLAT, 200);
        let b = tokens(&mut sampler(seeded(42), 8), &FLAT, 200);
        let c = tokens(&mut sampler(seeded(43), 8), &FLAT, 200);
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Without a seed, the caller's entropy decides; with one, entropy is ignored.
        let with_entropy = |params: SamplingParams, entropy| {
            let mut s = Sampler::new(params, 8, entropy).expect("valid params");
            tokens(&mut s, &FLAT, 200)
        };
        let d = SamplingParams::default;
        assert_eq!(with_entropy(d(), 7), with_entropy(d(), 7));
        assert_ne!(with_entropy(d(), 7), with_entropy(d(), 8));
        assert_eq!(with_entropy(seeded(42), 1), with_entropy(seeded(42), 2));
    }

    #[test]
    fn top_k_ties_at_the_boundary_go_to_lower_ids() {
        let params = SamplingParams {
            top_k: 2,
            ..seeded(1)
        };
        let seen = tokens(&mut sampler(params, 4), &[1.0, 1.0, 1.0, 0.0], 2000);
        assert!(seen.iter().all(|&t| t < 2));
        assert!(seen.contains(&0) && seen.contains(&1));
    }

    #[test]
    fn tiny_truncation_leaves_only_the_top_token() {
        let logits = [0.5, 2.0, 1.9, -1.0];
        let cases = [
            SamplingParams {
                top_k: 1,
                ..seeded(3)
            },
            SamplingParams {
                top_p: 1e-6,
                ..seeded(3)
            },
            SamplingParams {
                min_p: 1.0,
                ..seeded(3)
            },
        ];
        for params in cases {
            let seen = tokens(&mut sampler(params, 4), &logits, 200);
            assert!(seen.iter().all(|&t| t == 1));
        }
    }

    #[test]
    fn bias_of_minus_100_bans_a_token() {
        let logits = [0.0, 50.0, 0.0, 0.0];
        let params = SamplingParams {
            logit_bias: vec![(TokenId(1), -100.0), (TokenId(3), 0.5)],
            temperature: 2.0,
            logprobs: Some(4),
            ..seeded(9)
        };
        let mut s = sampler(params, 4);
        for _ in 0..2000 {
            let got = draw(&mut s, &logits, &NONE);
            assert_ne!(got.token, TokenId(1));
            assert_eq!(got.top.len(), 3, "banned tokens are left out of top");
        }
        let mut greedy = sampler(
            SamplingParams {
                logit_bias: vec![(TokenId(1), -100.0)],
                ..SamplingParams::greedy()
            },
            4,
        );
        let mut row = logits.to_vec();
        let got = greedy.sample(&mut row, &NONE).expect("sampling succeeds");
        assert_eq!(got.token, TokenId(0));
        assert_eq!(row, [0.0, f32::NEG_INFINITY, 0.0, 0.0]);
    }

    #[test]
    fn sample_leaves_processed_logits_in_place() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            logit_bias: vec![(TokenId(3), 1.0)],
            temperature: 0.7,
            ..seeded(5)
        };
        let mut s = sampler(params, 5);
        let (prompt, generated) = ([TokenId(0)], [TokenId(1), TokenId(3), TokenId(1)]);
        let history = History::new(&prompt, &generated);
        let mut row = vec![4.0, -1.0, 2.0, -3.0, f32::NAN];
        assert!(s.sample(&mut row, &history).is_ok());
        // 0: prompt only, 4 / 2. 1: -1 * 2 - 0.5 * 2 - 0.25.
        // 3: bias first, then (-3 + 1) * 2 - 0.5 - 0.25. 4: NaN cleaned to -inf.
        assert_eq!(row, [2.0, -3.25, 2.0, -4.75, f32::NEG_INFINITY]);
    }

    #[test]
    fn logprobs_are_of_processed_logits_and_ignore_temperature() {
        let logits = [1.0f32, 2.0, 0.5, -1.0];
        let log_z = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        for temperature in [0.0, 0.3, 1.0, 5.0] {
            let params = SamplingParams {
                temperature,
                top_k: 2,
                logprobs: Some(2),
                ..seeded(11)
            };
            let mut s = sampler(params, 4);
            for _ in 0..50 {
                let got = draw(&mut s, &logits, &NONE);
                let expected = f64::from(logits[got.token.as_usize()]) - log_z;
                assert!((f64::from(got.logprob) - expected).abs() < 1e-5);
                assert_eq!(got.top.len(), 2);
                assert_eq!((got.top[0].0, got.top[1].0), (TokenId(1), TokenId(0)));
                assert!((f64::from(got.top[0].1) - (2.0 - log_z)).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert!(matches!(
            Sampler::new(bad, 4, 0),
            Err(SamplingError::OutOfRange { param: "top_p", .. })
        ));
        let mut s = sampler(SamplingParams::default(), 4);
        assert_eq!(
            s.sample(&mut [0.0; 3], &NONE),
            Err(SamplingError::LogitsLenMismatch {
                expected: 4,
                actual: 3
            })
        );
        let mut masked = [f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY, f32::NAN];
        assert_eq!(
            s.sample(&mut masked, &NONE),
            Err(SamplingError::NoCandidates)
        );
        let mut g = sampler(SamplingParams::greedy(), 4);
        assert_eq!(
            g.sample(&mut masked, &NONE),
            Err(SamplingError::NoCandidates)
        );
        let mut p = sampler(
            SamplingParams {
                presence_penalty: 1.0,
                ..SamplingParams::default()
            },
            4,
        );
        let generated = [TokenId(4)];
        assert_eq!(
            p.sample(&mut [0.0; 4], &History::new(&[], &generated)),
            Err(SamplingError::HistoryTokenOutOfVocab {
                token_id: 4,
                vocab_size: 4
            })
        );
    }

    #[test]
    fn large_vocab_with_small_top_k_and_top_p() {
        // A 150k vocabulary exercises the select and the top_p cutoff passes.
        let vocab = 150_000;
        let logits: Vec<f32> = (0..vocab)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        for params in [
            SamplingParams {
                top_k: 5,
                ..seeded(1)
            },
            SamplingParams {
                top_p: 0.5,
                ..seeded(1)
            },
            SamplingParams {
                top_p: 0.999_99,
                min_p: 0.5,
                ..seeded(1)
            },
        ] {
            let mut s = sampler(params.clone(), vocab);
            for _ in 0..20 {
                let got = draw(&mut s, &logits, &NONE);
                let logit = logits[got.token.as_usize()];
                if params.top_k == 5 {
                    assert_eq!(logit, max, "the 5 best are all at the max");
                }
                if params.min_p == 0.5 {
                    assert!(logit >= max + 0.5f32.ln() - 1e-4);
                }
            }
        }
    }
}
