//! A model's own sampling defaults: Hugging Face `generation_config.json`
//! or a GGUF file's `general.sampling.*` keys (llama.cpp's names).

use kiln_formats::GgufMetadata;
use kiln_sampling::PartialSampling;
use serde_json::Value;

/// The sampling fields `generation_config.json` declares. `do_sample:
/// false` means greedy (as in transformers), whatever else it says.
pub fn from_generation_config(gen: &Value) -> PartialSampling {
    let f = |key: &str| gen.get(key).and_then(Value::as_f64).map(|v| v as f32);
    let u = |key: &str| gen.get(key).and_then(Value::as_u64).map(|v| v as usize);
    let mut p = PartialSampling {
        temperature: f("temperature").filter(|t| t.is_finite() && *t >= 0.0),
        top_k: u("top_k"),
        top_p: f("top_p").filter(|p| *p > 0.0 && *p <= 1.0),
        min_p: f("min_p").filter(|p| (0.0..=1.0).contains(p)),
        repetition_penalty: f("repetition_penalty").filter(|r| r.is_finite() && *r > 0.0),
        max_tokens: u("max_new_tokens").filter(|&n| n > 0),
    };
    if gen.get("do_sample").and_then(Value::as_bool) == Some(false) {
        p.temperature = Some(0.0);
    }
    p
}

/// The sampling fields a GGUF file declares under `general.sampling.*`.
pub fn from_gguf(meta: &GgufMetadata) -> PartialSampling {
    let f = |key: &str| {
        meta.get(key)
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
            .filter(|v| v.is_finite())
    };
    let u = |key: &str| meta.get(key).and_then(|v| v.as_u64()).map(|v| v as usize);
    PartialSampling {
        temperature: f("general.sampling.temp").filter(|t| *t >= 0.0),
        top_k: u("general.sampling.top_k"),
        top_p: f("general.sampling.top_p").filter(|p| *p > 0.0 && *p <= 1.0),
        min_p: f("general.sampling.min_p").filter(|p| (0.0..=1.0).contains(p)),
        repetition_penalty: f("general.sampling.penalty_repeat").filter(|r| *r > 0.0),
        max_tokens: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_the_sampling_fields_and_skips_bad_ones() {
        let p = from_generation_config(&json!({
            "do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "repetition_penalty": 1.05, "max_new_tokens": 2048, "min_p": 7.0,
            "eos_token_id": [1, 2]
        }));
        assert_eq!(p.temperature, Some(0.7));
        assert_eq!(p.top_p, Some(0.8));
        assert_eq!(p.top_k, Some(20));
        assert_eq!(p.repetition_penalty, Some(1.05));
        assert_eq!(p.max_tokens, Some(2048));
        assert_eq!(p.min_p, None, "out of range");
        assert!(!from_generation_config(&json!({"bos_token_id": 1})).declares_sampling());
    }

    #[test]
    fn do_sample_false_is_greedy() {
        let p = from_generation_config(&json!({"do_sample": false, "temperature": 0.6}));
        assert_eq!(p.temperature, Some(0.0));
    }
}
