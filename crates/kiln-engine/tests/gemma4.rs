//! A Gemma 4 random checkpoint (`kiln-models/tests/data/gemma4/shared_kv`:
//! sliding window 4, the last three layers reading earlier layers' caches)
//! through the engine: chunked prefill, the sliding groups freeing blocks
//! behind their window and a cached prefix give the tokens the model gives
//! run alone, step by step, and the pool holds blocks only for the layers
//! that keep a cache.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, Event, GenerationRequest, LoadedModel, RequestStream};
use kiln_sampling::SamplingParams;
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::ForwardBatch;

fn checkpoint() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kiln-models/tests/data/gemma4/shared_kv")
}

fn collect(stream: RequestStream, mut on_token: impl FnMut()) -> (Vec<u32>, usize) {
    let mut ids = Vec::new();
    for ev in stream {
        match ev {
            Event::Token { token_id, .. } => {
                on_token();
                ids.push(token_id);
            }
            Event::Finished { usage, .. } => return (ids, usage.cached_tokens),
            Event::Failed { message, .. } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    panic!("stream ended without a Finished event");
}

/// Greedy tokens of the model run alone, one step a token.
fn alone(model: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let m = &model.model;
    let mut cache = m.kv_cache_for_tokens(prompt.len() + n, 4).unwrap();
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    let mut done = 0;
    while out.len() < n {
        let batch = ForwardBatch::single(&seq[done..], done, &cache.spec, seq.len() - done - 1);
        let logits = m
            .backend()
            .to_host(&m.forward(&batch, &mut cache).unwrap())
            .unwrap();
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        done = seq.len();
        seq.push(best as u32);
        out.push(best as u32);
    }
    out
}

#[test]
fn gemma4_shared_kv_through_the_engine_matches_the_model_alone() {
    let model = LoadedModel::load(&checkpoint(), Arc::new(CpuBackend::new())).unwrap();
    let cfg = model.model.config();
    let (spec, _) = cfg.kv_layout(4);
    // Three layers keep a cache (two sliding, one full): three groups.
    assert_eq!(spec.groups.len(), 3);
    let prompt: Vec<u32> = (0..30).map(|i| (i * 37 + 11) % 128).collect();
    let n = 24;
    let want = alone(&model, &prompt, n);

    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 4,
            num_blocks: 200,
            max_num_seqs: 4,
            // Prefill in chunks of 8 tokens.
            max_num_batched_tokens: 8,
            max_waiting: 4,
            context_length: None,
        },
    )
    .unwrap();
    let handle = engine.handle();
    let request = || {
        GenerationRequest::new(
            prompt.clone(),
            SamplingParams {
                max_tokens: Some(n),
                ..SamplingParams::greedy()
            },
        )
    };
    let mut most = 0;
    let (got, _) = collect(handle.submit(request()).unwrap(), || {
        most = most.max(handle.stats().unwrap().num_blocks_used);
    });
    assert_eq!(got, want, "engine against the model alone");
    // Keeping every block in every group would take 3 * 54 / 4 = 42 blocks;
    // the full group keeps 14, each sliding group at most three (a window
    // of 4 keys spans two blocks, and a step may open the next).
    let full = (prompt.len() + n).div_ceil(4);
    eprintln!("at most {most} blocks in use; full group {full}");
    assert!(
        most <= full + 2 * 3,
        "{most} blocks in use at most; the full-attention group alone needs {full}"
    );
    // The prompt again: its prefix is cached, the tokens are the same.
    let (again, cached) = collect(handle.submit(request()).unwrap(), || {});
    assert_eq!(again, want);
    assert!(cached > 0, "the second request found its prefix cached");
}
