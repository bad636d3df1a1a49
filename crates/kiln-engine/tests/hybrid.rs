//! Hybrids (the random Qwen3.5 and LFM2 checkpoints of
//! `kiln-models/tests/data/hybrid`) through the engine: concurrent requests,
//! prefilled in chunks and decoded together, each on its own recurrent-state
//! slot, give the tokens the model gives run alone; slots pass from finished
//! requests to new ones, and a request sharing another's prompt recomputes it
//! (no block holds recurrent state) with the same output.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, Event, GenerationRequest, LoadedModel, RequestStream};
use kiln_sampling::SamplingParams;
use kiln_tensor::cpu::CpuBackend;

fn checkpoint(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kiln-models/tests/data/hybrid")
        .join(case)
}

fn collect(stream: RequestStream) -> (Vec<u32>, usize) {
    let mut ids = Vec::new();
    for ev in stream {
        match ev {
            Event::Token { token_id, .. } => ids.push(token_id),
            Event::Finished { usage, .. } => return (ids, usage.cached_tokens),
            Event::Failed { message } => panic!("request failed: {message}"),
            _ => {}
        }
    }
    panic!("stream ended without a Finished event");
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(n),
        ignore_eos: true,
        ..SamplingParams::greedy()
    }
}

#[test]
fn qwen3_5_requests_batched_in_the_engine_match_each_alone() {
    requests_batched_in_the_engine_match_each_alone("qwen3_5");
}

#[test]
fn lfm2_requests_batched_in_the_engine_match_each_alone() {
    requests_batched_in_the_engine_match_each_alone("lfm2");
}

fn requests_batched_in_the_engine_match_each_alone(case: &str) {
    let model = LoadedModel::load(&checkpoint(case), Arc::new(CpuBackend::new())).unwrap();
    let vocab = model.model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|r| {
            (0..9 + 7 * (r % 3))
                .map(|i| (i * 37 + 11 * r + 3) % vocab)
                .collect()
        })
        .chain(std::iter::once(
            (0..23).map(|i| (i * 37 + 3) % vocab).collect(),
        ))
        .collect();
    let n = 10;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let req = GenerationRequest::new(p.clone(), greedy(n));
            model
                .generate(&req, &mut |_| std::ops::ControlFlow::Continue(()))
                .unwrap()
                .token_ids
        })
        .collect();
    // Three slots for seven requests: they take turns.
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 4,
            num_blocks: 400,
            max_num_seqs: 3,
            max_num_batched_tokens: 8,
            max_waiting: 8,
            context_length: None,
        },
    )
    .unwrap();
    let handle = engine.handle();
    let streams: Vec<RequestStream> = prompts
        .iter()
        .map(|p| {
            handle
                .submit(GenerationRequest::new(p.clone(), greedy(n)))
                .unwrap()
        })
        .collect();
    for (i, (stream, want)) in streams.into_iter().zip(&want).enumerate() {
        let (got, cached) = collect(stream);
        assert_eq!(&got, want, "{case}: request {i}");
        // (The last prompt starts with the first's 9 tokens and more.)
        assert_eq!(
            cached, 0,
            "{case}: request {i}: no prefix of a hybrid is cached"
        );
    }
}
