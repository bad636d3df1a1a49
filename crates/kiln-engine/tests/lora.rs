//! LoRA in the engine loop on the real SmolLM2: the prefix cache keys
//! blocks by adapter (a prompt computed for the base is no hit for an
//! adapter, nor one adapter's for another; the same adapter hits its own),
//! and a request's answer is the same whether its blocks were hit or not.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, Event, GenerationRequest, LoadedModel};
use kiln_sampling::SamplingParams;
use kiln_tensor::cpu::CpuBackend;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn prefix_hits_never_cross_adapters() {
    let model = LoadedModel::load(
        &root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        Arc::new(CpuBackend::new()),
    )
    .unwrap();
    let prompt = model
        .tokenizer
        .encode(
            &format!(
                "{}The three primary colors are",
                "A long shared preamble about the sea and its tides. ".repeat(6)
            ),
            true,
        )
        .unwrap();
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 16,
            num_blocks: 128,
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            max_waiting: 16,
            context_length: None,
        },
    )
    .unwrap();
    let h = engine.handle();
    let dir = root().join("testdata/lora/smollm2-lora");
    h.adapters().add("a", &dir).unwrap();
    h.adapters().add("b", &dir).unwrap();
    // Each generated token with its log-probability: an adapter moves the
    // log-probabilities even where greedy picks the same tokens.
    let run = |adapter: Option<&str>| -> (Vec<(u32, f32)>, usize) {
        let req = GenerationRequest {
            adapter: adapter.map(|n| h.adapters().get(n).unwrap().unwrap()),
            ..GenerationRequest::new(
                prompt.clone(),
                SamplingParams {
                    max_tokens: Some(16),
                    logprobs: Some(1),
                    ..SamplingParams::greedy()
                },
            )
        };
        let (mut ids, mut cached) = (Vec::new(), usize::MAX);
        for ev in h.submit(req).unwrap() {
            match ev {
                Event::Token {
                    token_id, logprobs, ..
                } => ids.push((token_id, logprobs.expect("asked for logprobs").logprob)),
                Event::Finished { usage, .. } => cached = usage.cached_tokens,
                Event::Failed { message, .. } => panic!("{message}"),
                _ => {}
            }
        }
        (ids, cached)
    };
    let (base, _) = run(None);
    let (base_again, hit) = run(None);
    assert!(
        hit > 0 && base_again == base,
        "the base hits its own blocks"
    );
    let (a, cached) = run(Some("a"));
    assert_eq!(cached, 0, "no hit on the base's blocks");
    let (a_again, hit) = run(Some("a"));
    assert!(hit > 0 && a_again == a, "adapter a hits its own blocks");
    // Adapter b holds the same weights, but is another adapter: no hit.
    let (b, cached) = run(Some("b"));
    assert_eq!(cached, 0, "no hit on adapter a's blocks");
    assert_eq!(b, a);
    assert_ne!(a, base, "the adapter changes the answer");
}
