//! Gemma-3-270M's sliding-window layers through the engine: a 970-token
//! prompt (past the 512-token window) prefilled in chunks and decoded with
//! the sliding groups' out-of-window blocks freed gives transformers'
//! greedy tokens, and while it decodes the pool holds the global layers'
//! blocks for every token but the sliding layers' only for their window.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, Event, GenerationRequest, LoadedModel, RequestStream};
use kiln_sampling::SamplingParams;
use kiln_tensor::cpu::CpuBackend;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest::new(
        prompt,
        SamplingParams {
            max_tokens: Some(max_tokens),
            ..SamplingParams::greedy()
        },
    )
}

/// The ids of a stream's tokens and its cached prompt tokens; `on_first`
/// runs once the first token arrived.
fn collect(stream: RequestStream, mut on_first: impl FnMut()) -> (Vec<u32>, usize) {
    let mut ids = Vec::new();
    for ev in stream {
        match ev {
            Event::Token { token_id, .. } => {
                if ids.is_empty() {
                    on_first();
                }
                ids.push(token_id);
            }
            Event::Finished { usage, .. } => return (ids, usage.cached_tokens),
            Event::Failed { message, .. } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    panic!("stream ended without a Finished event");
}

#[test]
fn gemma3_long_prompt_decodes_like_transformers_holding_only_the_window() {
    let path = repo().join("models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        path.display()
    );
    let model = LoadedModel::load(&path, Arc::new(CpuBackend::new())).unwrap();
    let cfg = model.model.config();
    let (spec, _) = cfg.kv_layout(16);
    // 15 sliding layers of window 512 and 3 global ones: six groups of three.
    let sliding = spec
        .groups
        .iter()
        .filter(|g| g.kind == kiln_scheduler::LayerKind::SlidingWindow { window: 512 })
        .count();
    assert_eq!((spec.groups.len(), sliding), (6, 5));

    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("testdata/goldens/gemma3-270m-long/cases.json"))
            .unwrap(),
    )
    .unwrap();
    let case = &cases["cases"][1];
    assert_eq!(case["name"], "ledger_summary");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let prompt = ids(&case["ids"]);
    let want = ids(&case["generated_ids"]);
    assert_eq!(prompt.len(), 970);

    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 16,
            num_blocks: 1000,
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            max_waiting: 8,
            context_length: None,
        },
    )
    .unwrap();
    let handle = engine.handle();
    // Two chunks of prefill, then 24 decode steps past the window.
    let (got, _) = collect(
        handle.submit(greedy(prompt.clone(), want.len())).unwrap(),
        || {},
    );
    assert_eq!(got, want, "greedy tokens against transformers");

    // The same prompt again, decoding longer: its prefix is cached (the
    // sliding groups take only the hits inside their window), and while it
    // decodes every sliding group holds 32 or 33 blocks of 16 (512 keys),
    // the global group one block per 16 tokens.
    let mut used = None;
    let (again, cached) = collect(handle.submit(greedy(prompt.clone(), 100)).unwrap(), || {
        used = Some(handle.stats().unwrap().num_blocks_used);
    });
    assert_eq!(&again[..want.len()], &want[..]);
    assert_eq!(
        cached, 960,
        "every full block of the prompt but the last token's"
    );
    let used = used.unwrap();
    let (lo, hi) = (
        prompt.len().div_ceil(16) + sliding * 32,
        (prompt.len() + 100).div_ceil(16) + sliding * 33,
    );
    assert!(
        (lo..=hi).contains(&used),
        "{used} blocks in use, expected {lo}..={hi} (every group keeping every block: {})",
        6 * prompt.len().div_ceil(16)
    );
}
