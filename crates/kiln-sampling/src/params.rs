//! Per-request sampling parameters, their validation, and the shared [`TokenId`].

use std::collections::HashSet;
use std::fmt;

use crate::{FinishReason, SamplingError};

/// The most top-logprob alternatives a request may ask for, as in the OpenAI API.
pub const MAX_LOGPROBS: usize = 20;

/// The largest temperature accepted. OpenAI caps at 2; higher values are allowed for
/// experiments, because they are harmless (the distribution only gets flatter).
pub const MAX_TEMPERATURE: f32 = 100.0;

/// The id of a token in a model's vocabulary. This is the only token id type that
/// crosses crate boundaries in Kiln.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct TokenId(pub u32);

impl TokenId {
    /// The id as an index into a per-token array such as a row of logits.
    pub const fn as_usize(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The n-gram repetition guard: generation stops when the last
/// `ngram_len * num_repeats` tokens repeat with a period of at most `ngram_len`
/// tokens (a loop of up to `ngram_len` tokens fills that window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NgramRepeat {
    /// The longest repeated n-gram looked for, in tokens (at least 1).
    pub ngram_len: usize,
    /// The window is this many copies of the longest n-gram (at least 2).
    pub num_repeats: usize,
}

/// How one request wants its tokens chosen and when it wants generation to end.
///
/// The defaults turn every option off: temperature 1, no truncation, no penalties,
/// no bias, no stop conditions other than end-of-sequence, no logprobs, no guards.
/// Build one, then call [`SamplingParams::validate`] at the API boundary; the
/// [`crate::Sampler`] validates again and refuses bad parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// Divides the logits before softmax. 0 means greedy: the highest logit wins,
    /// ties go to the lowest token id. Allowed range is [0, 100].
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off. Values at or above
    /// the vocabulary size also have no effect.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose probability
    /// reaches `top_p`. 1 turns it off. Allowed range is (0, 1].
    pub top_p: f32,
    /// Keep only tokens whose probability is at least `min_p` times that of the most
    /// likely token. 0 turns it off. Allowed range is [0, 1].
    pub min_p: f32,
    /// Hugging Face repetition penalty over every token in the prompt or generated
    /// so far: a positive logit is divided by it, any other logit is multiplied by it.
    /// 1 turns it off. Must be finite and positive.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from the logit of every token that
    /// occurs in the generated text (not the prompt). Allowed range is [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted from a token's logit once per occurrence
    /// in the generated text (not the prompt). Allowed range is [-2, 2].
    pub frequency_penalty: f32,
    /// Added to the logits of the named tokens, values in [-100, 100]. A bias of
    /// exactly -100 bans the token outright (its logit becomes `-inf`).
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Seed for this request's random number generator. `None` takes entropy from
    /// the caller of [`crate::Sampler::new`].
    pub seed: Option<u64>,
    /// The most tokens to generate; `None` leaves the limit to the context window.
    pub max_tokens: Option<usize>,
    /// Generation ends when the text contains one of these strings; the string
    /// itself is never emitted (see [`crate::StopMatcher`]).
    pub stop: Vec<String>,
    /// Generation ends when one of these tokens is sampled, even with `ignore_eos`.
    pub stop_token_ids: Vec<TokenId>,
    /// Keep generating past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// How many top alternatives to return with each token's logprob, at most 20.
    /// `None` returns none; the sampled token's own logprob is always computed.
    pub logprobs: Option<usize>,
    /// Stop after this many identical tokens in a row (at least 2). Off by default.
    pub max_consecutive_identical: Option<usize>,
    /// Stop when an n-gram repeats back to back at the tail. Off by default.
    pub ngram_repeat: Option<NgramRepeat>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            max_tokens: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            max_consecutive_identical: None,
            ngram_repeat: None,
        }
    }
}

/// Returns an [`SamplingError::OutOfRange`] unless `ok` holds; NaN never satisfies the
/// range checks below because every comparison with NaN is false.
fn check_range(
    ok: bool,
    param: &'static str,
    value: f32,
    range: &'static str,
) -> Result<(), SamplingError> {
    if ok {
        Ok(())
    } else {
        Err(SamplingError::OutOfRange {
            param,
            value: f64::from(value),
            range,
        })
    }
}

impl SamplingParams {
    /// Greedy parameters: temperature 0 and everything else at its default.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// Whether this request picks the argmax instead of drawing at random.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the next token is the plain argmax of the raw logits, with
    /// nothing asked beyond its own log-probability: no penalties, no
    /// bias, no top logprobs. Such rows can be sampled where the logits are.
    pub fn is_plain_argmax(&self) -> bool {
        self.is_greedy()
            && self.repetition_penalty == 1.0
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.logit_bias.is_empty()
            && self.logprobs.unwrap_or(0) == 0
    }

    /// Checks every field against its documented range for a model with `vocab_size`
    /// tokens, and returns the first problem found.
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingError> {
        if vocab_size == 0 {
            return Err(SamplingError::EmptyVocab);
        }
        let t = self.temperature;
        check_range(
            (0.0..=MAX_TEMPERATURE).contains(&t),
            "temperature",
            t,
            "[0, 100]",
        )?;
        let p = self.top_p;
        check_range(p > 0.0 && p <= 1.0, "top_p", p, "(0, 1]")?;
        check_range(
            (0.0..=1.0).contains(&self.min_p),
            "min_p",
            self.min_p,
            "[0, 1]",
        )?;
        let r = self.repetition_penalty;
        check_range(
            r.is_finite() && r > 0.0,
            "repetition_penalty",
            r,
            "(0, inf)",
        )?;
        for (param, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            check_range((-2.0..=2.0).contains(&value), param, value, "[-2, 2]")?;
        }
        let mut seen = HashSet::with_capacity(self.logit_bias.len());
        for &(TokenId(token_id), value) in &self.logit_bias {
            if token_id as usize >= vocab_size {
                return Err(SamplingError::LogitBiasTokenOutOfVocab {
                    token_id,
                    vocab_size,
                });
            }
            if !(-100.0..=100.0).contains(&value) {
                return Err(SamplingError::LogitBiasValueOutOfRange { token_id, value });
            }
            if !seen.insert(token_id) {
                return Err(SamplingError::DuplicateLogitBias { token_id });
            }
        }
        if self.max_tokens == Some(0) {
            return Err(SamplingError::ZeroMaxTokens);
        }
        if let Some(stop_idx) = self.stop.iter().position(String::is_empty) {
            return Err(SamplingError::EmptyStopString { stop_idx });
        }
        if let Some(&TokenId(token_id)) = self
            .stop_token_ids
            .iter()
            .find(|t| t.as_usize() >= vocab_size)
        {
            return Err(SamplingError::StopTokenOutOfVocab {
                token_id,
                vocab_size,
            });
        }
        if let Some(requested) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(SamplingError::TooManyLogprobs {
                requested,
                max: MAX_LOGPROBS,
            });
        }
        self.validate_guards()
    }

    fn validate_guards(&self) -> Result<(), SamplingError> {
        let too_small = |param, value, min| Err(SamplingError::GuardTooSmall { param, value, min });
        if let Some(value) = self.max_consecutive_identical.filter(|&n| n < 2) {
            return too_small("max_consecutive_identical", value, 2);
        }
        if let Some(guard) = self.ngram_repeat {
            if guard.ngram_len < 1 {
                return too_small("ngram_repeat.ngram_len", guard.ngram_len, 1);
            }
            if guard.num_repeats < 2 {
                return too_small("ngram_repeat.num_repeats", guard.num_repeats, 2);
            }
        }
        Ok(())
    }

    /// Whether generation ends because `token` was just sampled as the
    /// `num_generated`-th generated token (counting it).
    ///
    /// `eos_token_ids` are the model's end-of-sequence tokens; they end generation
    /// unless `ignore_eos` is set, while `stop_token_ids` always do. A stop token wins
    /// over `max_tokens` when both apply to the same token. Stop strings and repetition
    /// guards are checked elsewhere ([`crate::StopMatcher`], [`crate::RepetitionGuard`]).
    pub fn token_finish_reason(
        &self,
        token: TokenId,
        num_generated: usize,
        eos_token_ids: &[TokenId],
    ) -> Option<FinishReason> {
        let is_eos = !self.ignore_eos && eos_token_ids.contains(&token);
        if is_eos || self.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        match self.max_tokens {
            Some(max_tokens) if num_generated >= max_tokens => Some(FinishReason::Length),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VOCAB: usize = 100;

    fn err_of(params: SamplingParams) -> SamplingError {
        match params.validate(VOCAB) {
            Err(e) => e,
            Ok(()) => panic!("expected a validation error for {params:?}"),
        }
    }

    fn out_of_range_param(params: SamplingParams) -> &'static str {
        match err_of(params) {
            SamplingError::OutOfRange { param, .. } => param,
            other => panic!("expected OutOfRange, got {other:?}"),
        }
    }

    #[test]
    fn defaults_and_edges_are_valid() {
        let ok = [
            SamplingParams::default(),
            SamplingParams::greedy(),
            SamplingParams {
                temperature: 100.0,
                top_p: 1.0,
                min_p: 1.0,
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                repetition_penalty: 1e-3,
                logit_bias: vec![(TokenId(0), -100.0), (TokenId(99), 100.0)],
                logprobs: Some(20),
                max_tokens: Some(1),
                stop: vec!["\n\n".into()],
                stop_token_ids: vec![TokenId(99)],
                max_consecutive_identical: Some(2),
                ngram_repeat: Some(NgramRepeat {
                    ngram_len: 1,
                    num_repeats: 2,
                }),
                ..SamplingParams::default()
            },
        ];
        for params in ok {
            assert_eq!(params.validate(VOCAB), Ok(()), "{params:?}");
        }
    }

    #[test]
    fn numeric_ranges_are_enforced() {
        let d = SamplingParams::default;
        let cases: [(SamplingParams, &str); 14] = [
            (
                SamplingParams {
                    temperature: -0.1,
                    ..d()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..d()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: 100.5,
                    ..d()
                },
                "temperature",
            ),
            (SamplingParams { top_p: 0.0, ..d() }, "top_p"),
            (SamplingParams { top_p: 1.01, ..d() }, "top_p"),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..d()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: -0.01,
                    ..d()
                },
                "min_p",
            ),
            (SamplingParams { min_p: 1.5, ..d() }, "min_p"),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..d()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: f32::INFINITY,
                    ..d()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..d()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::NAN,
                    ..d()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.5,
                    ..d()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..d()
                },
                "frequency_penalty",
            ),
        ];
        for (params, expected) in cases {
            assert_eq!(out_of_range_param(params), expected);
        }
    }

    #[test]
    fn messages_name_the_parameter_and_range() {
        let e = err_of(SamplingParams {
            top_p: 1.5,
            ..SamplingParams::default()
        });
        assert_eq!(e.to_string(), "`top_p` must be in (0, 1], got 1.5");
        let e = err_of(SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        });
        assert_eq!(e.to_string(), "`temperature` must be in [0, 100], got -1");
    }

    #[test]
    fn structural_errors() {
        let d = SamplingParams::default;
        let bias = |b: Vec<(u32, f32)>| SamplingParams {
            logit_bias: b.into_iter().map(|(t, v)| (TokenId(t), v)).collect(),
            ..d()
        };
        assert_eq!(
            err_of(bias(vec![(100, 1.0)])),
            SamplingError::LogitBiasTokenOutOfVocab {
                token_id: 100,
                vocab_size: VOCAB
            }
        );
        assert_eq!(
            err_of(bias(vec![(3, -100.5)])),
            SamplingError::LogitBiasValueOutOfRange {
                token_id: 3,
                value: -100.5
            }
        );
        assert!(matches!(
            err_of(bias(vec![(3, f32::NAN)])),
            SamplingError::LogitBiasValueOutOfRange { token_id: 3, .. }
        ));
        assert_eq!(
            err_of(bias(vec![(3, 1.0), (4, 1.0), (3, 2.0)])),
            SamplingError::DuplicateLogitBias { token_id: 3 }
        );
        assert_eq!(
            err_of(SamplingParams {
                logprobs: Some(21),
                ..d()
            }),
            SamplingError::TooManyLogprobs {
                requested: 21,
                max: 20
            }
        );
        assert_eq!(
            err_of(SamplingParams {
                max_tokens: Some(0),
                ..d()
            }),
            SamplingError::ZeroMaxTokens
        );
        assert_eq!(
            err_of(SamplingParams {
                stop: vec!["a".into(), String::new()],
                ..d()
            }),
            SamplingError::EmptyStopString { stop_idx: 1 }
        );
        assert_eq!(
            err_of(SamplingParams {
                stop_token_ids: vec![TokenId(5), TokenId(1000)],
                ..d()
            }),
            SamplingError::StopTokenOutOfVocab {
                token_id: 1000,
                vocab_size: VOCAB
            }
        );
        assert_eq!(d().validate(0), Err(SamplingError::EmptyVocab));
    }

    #[test]
    fn guards_that_would_fire_on_any_text_are_rejected() {
        let d = SamplingParams::default;
        let guard = |ngram_len, num_repeats| SamplingParams {
            ngram_repeat: Some(NgramRepeat {
                ngram_len,
                num_repeats,
            }),
            ..d()
        };
        let cases = [
            (
                SamplingParams {
                    max_consecutive_identical: Some(1),
                    ..d()
                },
                "max_consecutive_identical",
            ),
            (guard(0, 3), "ngram_repeat.ngram_len"),
            (guard(2, 1), "ngram_repeat.num_repeats"),
        ];
        for (params, expected) in cases {
            match err_of(params) {
                SamplingError::GuardTooSmall { param, .. } => assert_eq!(param, expected),
                other => panic!("expected GuardTooSmall, got {other:?}"),
            }
        }
    }

    #[test]
    fn token_finish_reason_respects_ignore_eos_and_max_tokens() {
        let eos = [TokenId(2)];
        let mut params = SamplingParams {
            max_tokens: Some(3),
            stop_token_ids: vec![TokenId(7)],
            ..SamplingParams::default()
        };
        assert_eq!(
            params.token_finish_reason(TokenId(2), 1, &eos),
            Some(FinishReason::Stop)
        );
        assert_eq!(
            params.token_finish_reason(TokenId(7), 1, &eos),
            Some(FinishReason::Stop)
        );
        assert_eq!(params.token_finish_reason(TokenId(5), 2, &eos), None);
        assert_eq!(
            params.token_finish_reason(TokenId(5), 3, &eos),
            Some(FinishReason::Length)
        );
        assert_eq!(
            params.token_finish_reason(TokenId(7), 3, &eos),
            Some(FinishReason::Stop)
        );
        params.ignore_eos = true;
        assert_eq!(params.token_finish_reason(TokenId(2), 1, &eos), None);
        assert_eq!(
            params.token_finish_reason(TokenId(7), 1, &eos),
            Some(FinishReason::Stop)
        );
    }
}
