//! Logit processors that run before the sampling decision, in this order: logit
//! bias, repetition penalty, frequency penalty, presence penalty.
//!
//! The penalty state counts tokens incrementally, so a step costs time proportional
//! to the number of distinct penalized tokens, not to the length of the history.

use std::collections::HashMap;

use crate::{History, SamplingError, SamplingParams, TokenId};

/// Adds each bias to its token's logit; a bias of -100 or less sets the logit to
/// `-inf`, which bans the token. Ids outside `logits` are skipped (validation
/// rejects them before this runs).
pub(crate) fn apply_logit_bias(logits: &mut [f32], logit_bias: &[(TokenId, f32)]) {
    for &(token, bias) in logit_bias {
        if let Some(logit) = logits.get_mut(token.as_usize()) {
            if bias <= -100.0 {
                *logit = f32::NEG_INFINITY;
            } else {
                *logit += bias;
            }
        }
    }
}

/// Whether any of the three penalties is switched on.
pub(crate) fn penalties_enabled(params: &SamplingParams) -> bool {
    params.repetition_penalty != 1.0
        || params.frequency_penalty != 0.0
        || params.presence_penalty != 0.0
}

/// Token statistics of one request, kept up to date from its [`History`].
#[derive(Debug, Default)]
pub(crate) struct PenaltyState {
    /// The distinct prompt tokens, sorted, for the repetition penalty.
    prompt_ids: Vec<u32>,
    /// The prompt length `prompt_ids` was built from; `None` before the first step.
    num_prompt_seen: Option<usize>,
    /// How often each token occurs in the generated tokens counted so far.
    generated_counts: HashMap<u32, u32>,
    /// How many generated tokens `generated_counts` covers.
    num_generated_counted: usize,
}

fn check_in_vocab(tokens: &[TokenId], vocab_size: usize) -> Result<(), SamplingError> {
    match tokens.iter().find(|t| t.as_usize() >= vocab_size) {
        Some(&TokenId(token_id)) => Err(SamplingError::HistoryTokenOutOfVocab {
            token_id,
            vocab_size,
        }),
        None => Ok(()),
    }
}

impl PenaltyState {
    /// Brings the statistics up to date with `history`.
    ///
    /// The prompt is read once (again only if its length changes). Generated tokens
    /// are counted from where the last call stopped; if `generated` got shorter, as
    /// after a rollback, everything is recounted. Token ids at or above `vocab_size`
    /// are an error and leave the statistics unchanged.
    pub(crate) fn update(
        &mut self,
        history: &History<'_>,
        vocab_size: usize,
    ) -> Result<(), SamplingError> {
        if self.num_prompt_seen != Some(history.prompt.len()) {
            check_in_vocab(history.prompt, vocab_size)?;
            self.prompt_ids.clear();
            self.prompt_ids.extend(history.prompt.iter().map(|t| t.0));
            self.prompt_ids.sort_unstable();
            self.prompt_ids.dedup();
            self.num_prompt_seen = Some(history.prompt.len());
        }
        if history.generated.len() < self.num_generated_counted {
            self.generated_counts.clear();
            self.num_generated_counted = 0;
        }
        let new_tokens = &history.generated[self.num_generated_counted..];
        check_in_vocab(new_tokens, vocab_size)?;
        for token in new_tokens {
            *self.generated_counts.entry(token.0).or_insert(0) += 1;
        }
        self.num_generated_counted = history.generated.len();
        Ok(())
    }

    /// `(token, generated_count, in_prompt)` for every distinct generated token,
    /// and for every distinct prompt token when `with_prompt` (the repetition
    /// penalty is on), sorted by token: what a device sampler needs to apply
    /// the penalties as [`PenaltyState::apply`] does.
    pub(crate) fn device_entries(&self, with_prompt: bool) -> Vec<(u32, u32, bool)> {
        let mut entries: Vec<(u32, u32, bool)> = self
            .generated_counts
            .iter()
            .map(|(&id, &count)| (id, count, self.prompt_ids.binary_search(&id).is_ok()))
            .collect();
        if with_prompt {
            entries.extend(
                self.prompt_ids
                    .iter()
                    .filter(|id| !self.generated_counts.contains_key(id))
                    .map(|&id| (id, 0, true)),
            );
        }
        entries.sort_unstable_by_key(|e| e.0);
        entries
    }

    /// Applies the penalties of `params` to `logits`, in this order:
    ///
    /// 1. Repetition penalty `r`, once per distinct token in prompt or generated text:
    ///    `l = if l > 0 { l / r } else { l * r }`.
    /// 2. Frequency penalty `f`, for each generated token occurring `c` times:
    ///    `l = l - f * c` (`f * c` computed in `f32`).
    /// 3. Presence penalty `p`, for each token occurring in the generated text:
    ///    `l = l - p`.
    pub(crate) fn apply(&self, logits: &mut [f32], params: &SamplingParams) {
        let r = params.repetition_penalty;
        if r != 1.0 {
            let penalize = |logit: &mut f32| {
                if *logit > 0.0 {
                    *logit /= r;
                } else {
                    *logit *= r;
                }
            };
            for &id in &self.prompt_ids {
                if let Some(logit) = logits.get_mut(id as usize) {
                    penalize(logit);
                }
            }
            for &id in self.generated_counts.keys() {
                if self.prompt_ids.binary_search(&id).is_err() {
                    if let Some(logit) = logits.get_mut(id as usize) {
                        penalize(logit);
                    }
                }
            }
        }
        let (f, p) = (params.frequency_penalty, params.presence_penalty);
        if f != 0.0 || p != 0.0 {
            for (&id, &count) in &self.generated_counts {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit -= f * count as f32;
                    *logit -= p;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(raw: &[u32]) -> Vec<TokenId> {
        raw.iter().copied().map(TokenId).collect()
    }

    fn penalized(
        logits: &[f32],
        prompt: &[u32],
        generated: &[u32],
        params: &SamplingParams,
    ) -> Vec<f32> {
        let (prompt, generated) = (ids(prompt), ids(generated));
        let mut state = PenaltyState::default();
        let history = History::new(&prompt, &generated);
        assert_eq!(state.update(&history, logits.len()), Ok(()));
        let mut out = logits.to_vec();
        state.apply(&mut out, params);
        out
    }

    #[test]
    fn logit_bias_adds_and_minus_100_bans() {
        let mut logits = vec![1.0, 2.0, 3.0, 4.0];
        let bias = [(TokenId(0), 0.5), (TokenId(2), -100.0), (TokenId(3), -99.5)];
        apply_logit_bias(&mut logits, &bias);
        assert_eq!(logits, [1.5, 2.0, f32::NEG_INFINITY, -95.5]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_others() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        // Token 0 (prompt, positive), 1 (generated twice, negative), 2 (both, zero),
        // 3 (untouched), 4 (prompt twice, positive): each penalized exactly once.
        let logits = [3.0, -1.5, 0.0, 5.0, 8.0];
        let got = penalized(&logits, &[0, 2, 4, 4], &[1, 2, 1], &params);
        assert_eq!(got, [1.5, -3.0, 0.0, 5.0, 4.0]);
    }

    #[test]
    fn frequency_and_presence_use_generated_tokens_only() {
        let params = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SamplingParams::default()
        };
        // Token 0 is only in the prompt; token 1 generated 3 times; token 2 once.
        let logits = [1.0, 1.0, -1.0, 2.0];
        let got = penalized(&logits, &[0, 0], &[1, 2, 1, 1], &params);
        assert_eq!(got, [1.0, 1.0 - 1.5 - 0.25, -1.0 - 0.5 - 0.25, 2.0]);
    }

    #[test]
    fn negative_penalties_encourage_repetition() {
        let params = SamplingParams {
            frequency_penalty: -1.0,
            presence_penalty: -2.0,
            ..SamplingParams::default()
        };
        let got = penalized(&[0.0, 0.0], &[], &[1, 1], &params);
        assert_eq!(got, [0.0, 4.0]);
    }

    #[test]
    fn all_penalties_compose_in_documented_order() {
        let params = SamplingParams {
            repetition_penalty: 1.25,
            frequency_penalty: 0.5,
            presence_penalty: 1.0,
            ..SamplingParams::default()
        };
        // Token 1: 2.5 / 1.25 = 2.0, then - 0.5 * 2 = 1.0, then - 1.0 = 0.0.
        // Token 2 (prompt only): -2.0 * 1.25 = -2.5.
        let got = penalized(&[1.0, 2.5, -2.0], &[2], &[1, 1], &params);
        assert_eq!(got, [1.0, 0.0, -2.5]);
    }

    #[test]
    fn counts_are_incremental_and_recounted_after_rollback() {
        let params = SamplingParams {
            frequency_penalty: 1.0,
            ..SamplingParams::default()
        };
        let mut state = PenaltyState::default();
        let generated = ids(&[1, 1, 2]);
        for len in 0..=generated.len() {
            let history = History::new(&[], &generated[..len]);
            assert_eq!(state.update(&history, 3), Ok(()));
        }
        let mut logits = vec![0.0; 3];
        state.apply(&mut logits, &params);
        assert_eq!(logits, [0.0, -2.0, -1.0]);
        // Roll back to one token, then a different continuation.
        let rolled = ids(&[1, 2, 2]);
        assert_eq!(state.update(&History::new(&[], &rolled[..1]), 3), Ok(()));
        assert_eq!(state.update(&History::new(&[], &rolled), 3), Ok(()));
        let mut logits = vec![0.0; 3];
        state.apply(&mut logits, &params);
        assert_eq!(logits, [0.0, -1.0, -2.0]);
    }

    #[test]
    fn out_of_vocab_history_is_an_error() {
        let mut state = PenaltyState::default();
        let bad = ids(&[0, 7]);
        let e = state.update(&History::new(&bad, &[]), 4);
        assert_eq!(
            e,
            Err(SamplingError::HistoryTokenOutOfVocab {
                token_id: 7,
                vocab_size: 4
            })
        );
        let e = state.update(&History::new(&[], &bad), 4);
        assert!(e.is_err());
    }
}
