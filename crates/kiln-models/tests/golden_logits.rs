//! The Llama-family decoder against transformers' f32 logits on the real
//! SmolLM2-135M (llama, Q4_1 with a Q8_0 embedding) and Qwen2.5-Coder-0.5B
//! and 1.5B (qwen2, Q4_K_M: Q4_K, Q5_K, Q6_K and Q8_0 blocks) GGUFs, the
//! blocks multiplied in place: the last
//! position's log-softmax within 1e-3 and the same top-20 ids, for every
//! case in `logits_cases.json`, and Gemma 3 (gemma3_text) on the real
//! Gemma-3-270M GGUF the same way, prompts past its 512-token sliding
//! window included (`gemma3-270m-long`, see its README). (Greedy continuations through the KV cache
//! are checked end to end in kiln-engine's `pipeline` tests.)

mod common;
use common::*;

fn check_logits(model_dir: &str, file: &str) {
    check_logits_of(model_dir, "logits_cases.json", file);
}

fn check_logits_of(model_dir: &str, cases_file: &str, file: &str) {
    let model = load_gguf_model(file);
    let cases = goldens(model_dir, cases_file);
    for case in cases["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["ids"]);
        let mut cache = model.kv_cache_for_tokens(prompt.len(), 16).unwrap();
        let batch = kiln_tensor::ForwardBatch::single(&prompt, 0, &cache.spec, prompt.len() - 1);
        let logits = model.forward(&batch, &mut cache).unwrap();
        let logits = model.backend().to_host(&logits).unwrap();
        let got = log_softmax(&logits);
        let want = read_npy_f32(model_dir, case["logprobs_npy"].as_str().unwrap());
        assert_eq!(got.len(), want.len(), "{name}: vocab size");
        let max_diff = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - *w as f64).abs())
            .fold(0f64, f64::max);
        assert!(
            max_diff <= 1e-3,
            "{model_dir}/{name}: max |Δ logprob| = {max_diff}"
        );
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let top: Vec<u32> = order[..20].iter().map(|&i| i as u32).collect();
        let want_top: Vec<u32> = case["top20"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_u64().unwrap() as u32)
            .collect();
        assert_eq!(top, want_top, "{model_dir}/{name}: top-20 ids");
        eprintln!("{model_dir}/{name}: max |Δ logprob| = {max_diff:.2e}");
    }
}

#[test]
fn smollm2_logits_match_transformers() {
    check_logits("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf");
}

#[test]
fn qwen2_logits_match_transformers() {
    check_logits(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    );
}

#[test]
fn qwen2_1_5b_logits_match_transformers() {
    check_logits(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    );
}

#[test]
fn gemma3_logits_match_transformers() {
    check_logits("gemma3-270m", "gemma-3-270m-q4_k_m.gguf");
}

/// Prompts of 628 to 976 tokens: the sliding layers (window 512) drop the
/// oldest keys while the full-attention layers keep them.
#[test]
fn gemma3_logits_past_the_sliding_window_match_transformers() {
    check_logits_of("gemma3-270m-long", "cases.json", "gemma-3-270m-q4_k_m.gguf");
}
