//! Repetition guards: end generation when the model is stuck in a loop.
//!
//! Both guards are off by default and look only at generated tokens, never at the
//! prompt. They are checked after each accepted token and cost `O(n)` in the size of
//! the window they inspect, independent of the length of the generated text.

use crate::{FinishReason, NgramRepeat, SamplingParams, TokenId};

/// Detects a run of identical tokens or a repeated n-gram at the tail of the
/// generated tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RepetitionGuard {
    /// Fire when the last this-many tokens are all the same token.
    pub max_consecutive_identical: Option<usize>,
    /// Fire when the last `ngram_len * num_repeats` tokens are one n-gram of
    /// at most `ngram_len` tokens repeated.
    pub ngram_repeat: Option<NgramRepeat>,
}

impl RepetitionGuard {
    /// The guard configured by a request's parameters.
    pub fn from_params(params: &SamplingParams) -> Self {
        RepetitionGuard {
            max_consecutive_identical: params.max_consecutive_identical,
            ngram_repeat: params.ngram_repeat,
        }
    }

    /// Whether either guard is on.
    pub fn is_enabled(&self) -> bool {
        self.max_consecutive_identical.is_some() || self.ngram_repeat.is_some()
    }

    /// Returns [`FinishReason::Repetition`] if the tail of `generated` trips a guard:
    ///
    /// * `max_consecutive_identical = Some(n)`: the last `n` tokens are all equal.
    /// * `ngram_repeat = Some(g)`: the last `g.ngram_len * g.num_repeats` tokens
    ///   repeat with a period of at most `g.ngram_len` tokens: one loop of up to
    ///   `ngram_len` tokens fills the window (`num_repeats` copies of an
    ///   `ngram_len`-token phrase, more of a shorter one). A token run of the right
    ///   length counts too.
    ///
    /// Nothing fires before enough tokens exist, and a zero-sized setting (which
    /// validation rejects) never fires.
    pub fn check(&self, generated: &[TokenId]) -> Option<FinishReason> {
        let identical = self
            .max_consecutive_identical
            .is_some_and(|n| is_periodic_tail(generated, 1, n));
        let ngram = self.ngram_repeat.is_some_and(|g| {
            g.ngram_len
                .checked_mul(g.num_repeats)
                .is_some_and(|window| {
                    (1..=g.ngram_len).any(|period| is_periodic_tail(generated, period, window))
                })
        });
        (identical || ngram).then_some(FinishReason::Repetition)
    }
}

/// Whether the last `window` tokens (at least one) exist and repeat with period `period`, that is
/// `t[i] == t[i + period]` throughout the window.
fn is_periodic_tail(tokens: &[TokenId], period: usize, window: usize) -> bool {
    let Some(start) = tokens.len().checked_sub(window).filter(|_| window > 0) else {
        return false;
    };
    let tail = &tokens[start..];
    tail.iter()
        .zip(&tail[period.min(tail.len())..])
        .all(|(a, b)| a == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(raw: &[u32]) -> Vec<TokenId> {
        raw.iter().copied().map(TokenId).collect()
    }

    fn identical(n: usize) -> RepetitionGuard {
        RepetitionGuard {
            max_consecutive_identical: Some(n),
            ..RepetitionGuard::default()
        }
    }

    fn ngram(ngram_len: usize, num_repeats: usize) -> RepetitionGuard {
        RepetitionGuard {
            ngram_repeat: Some(NgramRepeat {
                ngram_len,
                num_repeats,
            }),
            ..RepetitionGuard::default()
        }
    }

    #[test]
    fn off_by_default() {
        let guard = RepetitionGuard::from_params(&SamplingParams::default());
        assert!(!guard.is_enabled());
        assert_eq!(guard.check(&ids(&[7; 1000])), None);
    }

    #[test]
    fn identical_run_fires_at_exactly_n() {
        let guard = identical(4);
        assert_eq!(guard.check(&ids(&[1, 5, 5, 5])), None);
        assert_eq!(
            guard.check(&ids(&[1, 5, 5, 5, 5])),
            Some(FinishReason::Repetition)
        );
        assert_eq!(guard.check(&ids(&[5, 5, 5, 5, 1])), None);
        assert_eq!(guard.check(&ids(&[5, 5, 5])), None);
        assert_eq!(guard.check(&[]), None);
    }

    #[test]
    fn ngram_repeat_fires_on_k_copies_at_the_tail() {
        let guard = ngram(3, 3);
        let looped = ids(&[9, 1, 2, 3, 1, 2, 3, 1, 2, 3]);
        assert_eq!(guard.check(&looped), Some(FinishReason::Repetition));
        assert_eq!(guard.check(&looped[..9]), None);
        assert_eq!(guard.check(&ids(&[1, 2, 3, 1, 2, 3, 1, 2, 4])), None);
        assert_eq!(guard.check(&ids(&[1, 2, 3, 1, 9, 3, 1, 2, 3])), None);
        // A single-token run is a repeated n-gram of any length.
        assert_eq!(guard.check(&ids(&[4; 9])), Some(FinishReason::Repetition));
    }

    #[test]
    fn ngram_repeat_catches_every_period_up_to_its_length() {
        let guard = ngram(4, 3);
        // Period 3 fills the 12-token window of a guard whose n-gram length is 4.
        let period3: Vec<u32> = [7, 8, 9].iter().copied().cycle().take(12).collect();
        assert_eq!(guard.check(&ids(&period3)), Some(FinishReason::Repetition));
        let period2: Vec<u32> = [7, 8].iter().copied().cycle().take(12).collect();
        assert_eq!(guard.check(&ids(&period2)), Some(FinishReason::Repetition));
        // Period 5 is longer than the guard's n-gram: not a loop it looks for.
        let period5: Vec<u32> = [1, 2, 3, 4, 5].iter().copied().cycle().take(40).collect();
        assert_eq!(guard.check(&ids(&period5)), None);
        // A loop that does not yet fill the window does not fire.
        assert_eq!(guard.check(&ids(&period3[..11])), None);
    }

    #[test]
    fn zero_sizes_never_fire() {
        assert_eq!(identical(0).check(&ids(&[1, 1])), None);
        assert_eq!(ngram(0, 3).check(&ids(&[1, 1])), None);
        assert_eq!(ngram(2, 0).check(&ids(&[1, 1])), None);
        assert_eq!(ngram(usize::MAX, 2).check(&ids(&[1, 1])), None);
    }
}
