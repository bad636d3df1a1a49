//! Tensor parallelism's CPU twin through the engine, on the real
//! Qwen2.5-Coder-0.5B (Q4_K_M): split over two ranks (7 heads and one KV
//! head each, half of every expert-free MLP, half the vocabulary — its
//! quantized matrices cut by rows, or loaded dense where a cut would split
//! a block), a batch of mixed greedy requests gives the tokens the whole
//! model gives, and a device's KV pool holds twice the blocks. A model
//! whose heads do not split is refused at load.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, Event, GenerationRequest, LoadedModel};
use kiln_sampling::SamplingParams;
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::{Backend, HostGroup};
use serde_json::json;

fn model_path(file: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    p
}

fn ranks(n: usize) -> Vec<Arc<dyn Backend>> {
    let g = HostGroup::new(n);
    (0..n)
        .map(|r| Arc::new(CpuBackend::new().in_group(g.clone(), r, 1).unwrap()) as Arc<dyn Backend>)
        .collect()
}

/// Each request's generated ids, the four submitted at once.
fn outputs(model: LoadedModel) -> Vec<Vec<u32>> {
    let questions = [
        "Write a Python function that reverses a string.",
        "What is a hash map?",
        "Sort [3, 1, 2] in Rust.",
        "Explain recursion in one sentence.",
    ];
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            let r = model
                .render_chat(&json!([{"role": "user", "content": q}]), true)
                .unwrap();
            model.tokenizer.encode(&r, false).unwrap()
        })
        .collect();
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 16,
            num_blocks: 64,
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
            max_waiting: 16,
            context_length: None,
        },
    )
    .unwrap();
    let h = engine.handle();
    let streams: Vec<_> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                max_tokens: Some(16 + 4 * i),
                ..SamplingParams::greedy()
            };
            h.submit(GenerationRequest::new(p, params)).unwrap()
        })
        .collect();
    streams
        .into_iter()
        .map(|s| {
            let mut ids = Vec::new();
            for ev in s {
                match ev {
                    Event::Token { token_id, .. } if token_id != u32::MAX => ids.push(token_id),
                    Event::Finished { .. } => return ids,
                    Event::Failed { message, .. } => panic!("request failed: {message}"),
                    _ => {}
                }
            }
            panic!("no Finished event")
        })
        .collect()
}

#[test]
fn a_split_real_model_generates_the_whole_models_tokens() {
    let path = model_path("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let whole = LoadedModel::load(&path, Arc::new(CpuBackend::new())).unwrap();
    let split = LoadedModel::load_split(&path, ranks(2), None, None).unwrap();
    assert_eq!(
        split.model.config().num_heads,
        14,
        "the engine sees the whole model"
    );
    // A rank's pool holds a token in one KV head of two: the same bytes a
    // device hold twice the blocks.
    let blocks = |m: &LoadedModel| EngineConfig::for_memory(m, 64 << 20).num_blocks;
    let (s, w) = (blocks(&split), blocks(&whole));
    assert!(s.abs_diff(2 * w) <= 1, "{s} blocks split, {w} whole");
    let whole = outputs(whole);
    let got = outputs(split);
    assert!(whole.iter().all(|ids| ids.len() >= 16));
    assert_eq!(got, whole);
}

#[test]
fn a_degree_the_heads_do_not_split_over_is_refused() {
    // SmolLM2-135M has 9 attention heads.
    let path = model_path("SmolLM2-135M-Instruct.Q4_1.gguf");
    let err = match LoadedModel::load_split(&path, ranks(2), None, None) {
        Ok(_) => panic!("9 heads split over 2 ranks"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("num_attention_heads"), "{err}");
}
