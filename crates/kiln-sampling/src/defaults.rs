//! Defaults for the sampling fields a request leaves out.
//!
//! A server fills a missing field from, in order: its own flags (`kiln serve
//! --temperature ...`), the model's generation defaults (Hugging Face
//! `generation_config.json`, or a GGUF file's `general.sampling.*` keys),
//! and llama.cpp's defaults. Like vLLM, a model that declares any sampling
//! field is taken as a whole: the fields it leaves out stay neutral (no
//! truncation, no penalty) rather than borrowing llama.cpp's. A model that
//! declares none gets llama.cpp's set, which keeps small models coherent
//! (temperature 1 with no truncation makes a 135M model ramble).

use std::fmt;

use crate::{NgramRepeat, SamplingParams};

/// Sampling fields that may each be set or not: what a model declares, or
/// what a server's flags override.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PartialSampling {
    /// Temperature (0 is greedy).
    pub temperature: Option<f32>,
    /// Top-k (0 turns it off).
    pub top_k: Option<usize>,
    /// Top-p (1 turns it off).
    pub top_p: Option<f32>,
    /// Min-p (0 turns it off).
    pub min_p: Option<f32>,
    /// Repetition penalty (1 turns it off).
    pub repetition_penalty: Option<f32>,
    /// The default token limit (`max_new_tokens`).
    pub max_tokens: Option<usize>,
}

impl PartialSampling {
    /// Whether any sampling field is set (the token limit does not count).
    pub fn declares_sampling(&self) -> bool {
        self.temperature.is_some()
            || self.top_k.is_some()
            || self.top_p.is_some()
            || self.min_p.is_some()
            || self.repetition_penalty.is_some()
    }

    /// Each field of `self`, else of `below`.
    pub fn or(self, below: PartialSampling) -> PartialSampling {
        PartialSampling {
            temperature: self.temperature.or(below.temperature),
            top_k: self.top_k.or(below.top_k),
            top_p: self.top_p.or(below.top_p),
            min_p: self.min_p.or(below.min_p),
            repetition_penalty: self.repetition_penalty.or(below.repetition_penalty),
            max_tokens: self.max_tokens.or(below.max_tokens),
        }
    }
}

/// llama.cpp's defaults (`common/common.h`: temperature 0.8, top-k 40,
/// top-p 0.95, min-p 0.05, no repetition penalty).
pub const LLAMA_CPP_DEFAULTS: PartialSampling = PartialSampling {
    temperature: Some(0.8),
    top_k: Some(40),
    top_p: Some(0.95),
    min_p: Some(0.05),
    repetition_penalty: Some(1.0),
    max_tokens: None,
};

/// The repetition guard a server applies unless told otherwise: a loop of
/// up to 32 tokens repeated until it fills the last 256 tokens (8 copies
/// of a 32-token phrase, 256 of one token) ends generation.
pub const DEFAULT_LOOP_GUARD: NgramRepeat = NgramRepeat {
    ngram_len: 32,
    num_repeats: 8,
};

/// Where the model-independent part of a server's defaults came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultsSource {
    /// The model's own generation defaults.
    Model,
    /// llama.cpp's defaults (the model declares none).
    LlamaCpp,
}

/// The resolved defaults: every sampling field has a value.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingDefaults {
    /// Temperature.
    pub temperature: f32,
    /// Top-k, 0 off.
    pub top_k: usize,
    /// Top-p, 1 off.
    pub top_p: f32,
    /// Min-p, 0 off.
    pub min_p: f32,
    /// Repetition penalty, 1 off.
    pub repetition_penalty: f32,
    /// The token limit of a request that sets none (`None`: the context).
    pub max_tokens: Option<usize>,
    /// The repetition guard applied to every request (`None`: off).
    pub loop_guard: Option<NgramRepeat>,
    /// Where the values under the flags came from.
    pub source: DefaultsSource,
    /// Fields the server's flags set (named as in the API).
    pub overridden: Vec<&'static str>,
}

impl SamplingDefaults {
    /// Resolves `flags` over the `model`'s declared defaults over llama.cpp's.
    pub fn resolve(
        flags: PartialSampling,
        model: PartialSampling,
        loop_guard: Option<NgramRepeat>,
    ) -> SamplingDefaults {
        let (below, source) = if model.declares_sampling() {
            (model, DefaultsSource::Model)
        } else {
            (
                PartialSampling {
                    max_tokens: model.max_tokens,
                    ..LLAMA_CPP_DEFAULTS
                },
                DefaultsSource::LlamaCpp,
            )
        };
        let merged = flags.or(below);
        let neutral = SamplingParams::default();
        let mut overridden = Vec::new();
        for (set, name) in [
            (flags.temperature.is_some(), "temperature"),
            (flags.top_k.is_some(), "top_k"),
            (flags.top_p.is_some(), "top_p"),
            (flags.min_p.is_some(), "min_p"),
            (flags.repetition_penalty.is_some(), "repetition_penalty"),
            (flags.max_tokens.is_some(), "max_tokens"),
        ] {
            if set {
                overridden.push(name);
            }
        }
        SamplingDefaults {
            temperature: merged.temperature.unwrap_or(neutral.temperature),
            top_k: merged.top_k.unwrap_or(neutral.top_k),
            top_p: merged.top_p.unwrap_or(neutral.top_p),
            min_p: merged.min_p.unwrap_or(neutral.min_p),
            repetition_penalty: merged
                .repetition_penalty
                .unwrap_or(neutral.repetition_penalty),
            max_tokens: merged.max_tokens,
            loop_guard,
            source,
            overridden,
        }
    }

    /// Neutral defaults (every option off, temperature 1, no guard): what a
    /// library caller gets from [`SamplingParams::default`].
    pub fn neutral() -> SamplingDefaults {
        let p = SamplingParams::default();
        SamplingDefaults {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            max_tokens: None,
            loop_guard: None,
            source: DefaultsSource::Model,
            overridden: Vec::new(),
        }
    }

    /// Parameters with every default applied and nothing else set.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            max_tokens: self.max_tokens,
            ngram_repeat: self.loop_guard,
            ..SamplingParams::default()
        }
    }
}

impl fmt::Display for SamplingDefaults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "temperature {}, top_k {}, top_p {}, min_p {}, repetition_penalty {}",
            self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        )?;
        if let Some(n) = self.max_tokens {
            write!(f, ", max_tokens {n}")?;
        }
        let source = match self.source {
            DefaultsSource::Model => "the model's generation config",
            DefaultsSource::LlamaCpp => "llama.cpp's defaults; the model declares none",
        };
        write!(f, " ({source}")?;
        if !self.overridden.is_empty() {
            write!(f, "; set by flags: {}", self.overridden.join(", "))?;
        }
        write!(f, ")")?;
        match self.loop_guard {
            Some(g) => write!(
                f,
                "; repetition guard: a loop of up to {} tokens filling the last {}",
                g.ngram_len,
                g.ngram_len * g.num_repeats
            ),
            None => write!(f, "; repetition guard off"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_without_sampling_fields_gets_llama_cpp_defaults() {
        let d =
            SamplingDefaults::resolve(PartialSampling::default(), PartialSampling::default(), None);
        assert_eq!(d.source, DefaultsSource::LlamaCpp);
        assert_eq!(
            (d.temperature, d.top_k, d.top_p, d.min_p),
            (0.8, 40, 0.95, 0.05)
        );
        assert_eq!(d.repetition_penalty, 1.0);
        assert!(d.params().validate(100).is_ok());
    }

    #[test]
    fn a_model_that_declares_some_fields_is_taken_whole() {
        let model = PartialSampling {
            temperature: Some(0.7),
            top_p: Some(0.8),
            max_tokens: Some(512),
            ..PartialSampling::default()
        };
        let d = SamplingDefaults::resolve(PartialSampling::default(), model, None);
        assert_eq!(d.source, DefaultsSource::Model);
        assert_eq!((d.temperature, d.top_p), (0.7, 0.8));
        // Fields the model leaves out stay neutral, not llama.cpp's.
        assert_eq!((d.top_k, d.min_p), (0, 0.0));
        assert_eq!(d.max_tokens, Some(512));
    }

    #[test]
    fn flags_win_field_by_field_and_are_named() {
        let flags = PartialSampling {
            temperature: Some(0.0),
            ..PartialSampling::default()
        };
        let d =
            SamplingDefaults::resolve(flags, PartialSampling::default(), Some(DEFAULT_LOOP_GUARD));
        assert_eq!(d.temperature, 0.0);
        assert_eq!(d.top_k, 40);
        assert_eq!(d.overridden, vec!["temperature"]);
        let text = d.to_string();
        assert!(
            text.contains("llama.cpp") && text.contains("temperature"),
            "{text}"
        );
        assert!(text.contains("last 256"), "{text}");
        assert_eq!(d.params().ngram_repeat, Some(DEFAULT_LOOP_GUARD));
    }

    #[test]
    fn neutral_defaults_are_the_plain_params() {
        assert_eq!(
            SamplingDefaults::neutral().params(),
            SamplingParams::default()
        );
    }
}
