//! The sampling parameters shared by chat and completions, turned from wire
//! values into validated [`SamplingParams`].

use std::collections::BTreeMap;

use kiln_sampling::{SamplingDefaults, SamplingParams, TokenId, MAX_LOGPROBS};
use serde_json::Value;

use crate::errors::ApiError;

/// The sampling fields of a request as they came in (already typed, not yet
/// checked against the model or each other).
#[derive(Debug, Default)]
pub struct SamplingFields {
    /// The token limit and the name it was given under (`max_tokens` or
    /// `max_completion_tokens`).
    pub max_tokens: Option<(i64, &'static str)>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    /// Top alternatives per token, when logprobs are wanted at all.
    pub logprobs: Option<usize>,
    /// The API's own upper bound on `temperature` (OpenAI 2, Anthropic 1);
    /// 0 means the engine's bound.
    pub max_temperature: f32,
}

/// OpenAI's documented temperature range is [0, 2].
pub const OPENAI_MAX_TEMPERATURE: f32 = 2.0;
/// Anthropic's documented temperature range is [0, 1].
pub const ANTHROPIC_MAX_TEMPERATURE: f32 = 1.0;

impl SamplingFields {
    /// Validated parameters for a model with `vocab_size` tokens, the
    /// fields left out taken from `defaults` (the server's).
    pub fn into_params(
        self,
        vocab_size: usize,
        defaults: &SamplingDefaults,
    ) -> Result<SamplingParams, ApiError> {
        let defaults = defaults.params();
        let max_tokens = match self.max_tokens {
            None => defaults.max_tokens,
            Some((n, param)) if n <= 0 => {
                return Err(ApiError::invalid(
                    param,
                    format!("`{param}` must be at least 1, got {n}"),
                ))
            }
            Some((n, _)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        };
        let top_k = match self.top_k {
            None => defaults.top_k,
            Some(-1) | Some(0) => 0,
            Some(k) if k < -1 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be -1 or 0 (off) or positive, got {k}"),
                ))
            }
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("at most {MAX_LOGPROBS} top logprobs can be returned, got {n}"),
            ));
        }
        if let Some(t) = self.temperature {
            if self.max_temperature > 0.0 && !(0.0..=self.max_temperature).contains(&t) {
                return Err(ApiError::invalid(
                    "temperature",
                    format!(
                        "`temperature` must be between 0 and {}, got {t}",
                        self.max_temperature
                    ),
                ));
            }
        }
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            logit_bias: logit_bias(self.logit_bias)?,
            // Negative seeds are valid in the API; the bits are the seed.
            seed: self.seed.map(|s| s as u64),
            max_tokens,
            stop: stop_strings(self.stop)?,
            stop_token_ids: self
                .stop_token_ids
                .unwrap_or_default()
                .into_iter()
                .map(TokenId)
                .collect(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs: self.logprobs,
            ..defaults
        };
        params.validate(vocab_size)?;
        Ok(params)
    }
}

/// The token limit a request sets, under the first of the names clients
/// use that it carries (`named`, in order of precedence), then llama.cpp's
/// `n_predict`, whose negative values mean no limit.
pub fn token_limit(
    named: &[(Option<i64>, &'static str)],
    n_predict: Option<i64>,
) -> Option<(i64, &'static str)> {
    named
        .iter()
        .find_map(|&(v, name)| v.map(|n| (n, name)))
        .or(n_predict.filter(|&n| n >= 0).map(|n| (n, "n_predict")))
}

/// `logit_bias` has token ids as string keys.
fn logit_bias(map: Option<BTreeMap<String, f32>>) -> Result<Vec<(TokenId, f32)>, ApiError> {
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    map.into_iter()
        .map(|(key, bias)| match key.trim().parse::<u32>() {
            Ok(id) => Ok((TokenId(id), bias)),
            Err(_) => Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` keys must be token ids, got {key:?}"),
            )),
        })
        .collect()
}

/// `stop` is a string or a list of strings.
fn stop_strings(stop: Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "stop",
            "`stop` must be a string or a list of strings".to_string(),
        )
    };
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(bad()),
            })
            .collect(),
        Some(_) => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn neutral() -> SamplingDefaults {
        SamplingDefaults::neutral()
    }

    fn param_of(f: SamplingFields) -> String {
        let e = f.into_params(100, &neutral()).unwrap_err();
        e.body()["error"]["param"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    #[test]
    fn maps_fields_and_defaults() {
        let p = SamplingFields {
            max_tokens: Some((5, "max_tokens")),
            temperature: Some(0.0),
            top_k: Some(-1),
            logit_bias: Some([("7".to_string(), -100.0)].into()),
            stop: Some(json!(["a", "b"])),
            seed: Some(-1),
            ..Default::default()
        }
        .into_params(100, &neutral())
        .unwrap();
        assert_eq!(p.max_tokens, Some(5));
        assert_eq!(p.top_k, 0);
        assert_eq!(p.logit_bias, vec![(TokenId(7), -100.0)]);
        assert_eq!(p.stop, vec!["a", "b"]);
        assert_eq!(p.seed, Some(u64::MAX));
        let d = SamplingFields::default()
            .into_params(100, &neutral())
            .unwrap();
        let hot = SamplingFields {
            temperature: Some(1.5),
            max_temperature: ANTHROPIC_MAX_TEMPERATURE,
            ..SamplingFields::default()
        };
        assert_eq!(param_of(hot), "temperature");
        assert_eq!(d, SamplingParams::default());
    }

    #[test]
    fn fields_left_out_take_the_servers_defaults() {
        use kiln_sampling::{PartialSampling, DEFAULT_LOOP_GUARD};
        let defaults = SamplingDefaults::resolve(
            PartialSampling::default(),
            PartialSampling::default(),
            Some(DEFAULT_LOOP_GUARD),
        );
        let p = SamplingFields::default()
            .into_params(100, &defaults)
            .unwrap();
        assert_eq!(
            (p.temperature, p.top_k, p.top_p, p.min_p),
            (0.8, 40, 0.95, 0.05)
        );
        assert_eq!(p.ngram_repeat, Some(DEFAULT_LOOP_GUARD));
        assert_eq!(p.max_tokens, None);
        // What a request sets wins, field by field; `top_k: -1` turns it off.
        let p = SamplingFields {
            temperature: Some(0.0),
            top_k: Some(-1),
            ..Default::default()
        }
        .into_params(100, &defaults)
        .unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.0, 0, 0.95));
    }

    #[test]
    fn token_limits_under_every_name() {
        let named = |a, b| [(a, "max_completion_tokens"), (b, "max_tokens")];
        assert_eq!(
            token_limit(&named(Some(5), Some(9)), Some(7)),
            Some((5, "max_completion_tokens"))
        );
        assert_eq!(
            token_limit(&named(None, Some(9)), Some(7)),
            Some((9, "max_tokens"))
        );
        assert_eq!(
            token_limit(&named(None, None), Some(7)),
            Some((7, "n_predict"))
        );
        assert_eq!(token_limit(&named(None, None), Some(-1)), None);
        assert_eq!(token_limit(&named(None, None), None), None);
    }

    #[test]
    fn refuses_bad_values_by_name() {
        let f = |max: i64| SamplingFields {
            max_tokens: Some((max, "max_completion_tokens")),
            ..Default::default()
        };
        assert_eq!(param_of(f(0)), "max_completion_tokens");
        assert_eq!(param_of(f(-3)), "max_completion_tokens");
        let t = SamplingFields {
            temperature: Some(-1.0),
            ..Default::default()
        };
        assert_eq!(param_of(t), "temperature");
        let b = SamplingFields {
            logit_bias: Some([("x".to_string(), 1.0)].into()),
            ..Default::default()
        };
        assert_eq!(param_of(b), "logit_bias");
        let s = SamplingFields {
            stop: Some(json!([1])),
            ..Default::default()
        };
        assert_eq!(param_of(s), "stop");
        let k = SamplingFields {
            top_k: Some(-2),
            ..Default::default()
        };
        assert_eq!(param_of(k), "top_k");
    }
}
