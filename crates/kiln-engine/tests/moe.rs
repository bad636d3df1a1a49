//! Mixture-of-Experts random checkpoints (`kiln-models/tests/data/moe`,
//! `.../gpt_oss`) through the engine: four concurrent requests, prefilled in
//! chunks of 8 tokens and decoded together (tokens of different requests
//! sharing experts in one step), each give the tokens the model gives run
//! alone; gpt-oss's sliding layers free the blocks behind their window.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, Event, GenerationRequest, LoadedModel, RequestStream};
use kiln_sampling::SamplingParams;
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::ForwardBatch;

fn checkpoint(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kiln-models/tests/data")
        .join(rel)
}

fn collect(stream: RequestStream) -> Vec<u32> {
    let mut ids = Vec::new();
    for ev in stream {
        match ev {
            Event::Token { token_id, .. } => ids.push(token_id),
            Event::Finished { .. } => return ids,
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
    let mut done = 0;
    while seq.len() < prompt.len() + n {
        let batch = ForwardBatch::single(&seq[done..], done, &cache.spec, seq.len() - done - 1);
        let logits = m
            .backend()
            .to_host(&m.forward(&batch, &mut cache).unwrap())
            .unwrap();
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        done = seq.len();
        seq.push(best as u32);
    }
    seq[prompt.len()..].to_vec()
}

fn concurrent_requests_match_the_model_alone(rel: &str) {
    let model = LoadedModel::load(&checkpoint(rel), Arc::new(CpuBackend::new())).unwrap();
    let vocab = model.model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|r| {
            (0..11 + 5 * r)
                .map(|i| (i * 37 + 11 * r + 3) % vocab)
                .collect()
        })
        .collect();
    let n = 12;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&model, p, n)).collect();
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 4,
            num_blocks: 400,
            max_num_seqs: 4,
            max_num_batched_tokens: 8,
            max_waiting: 4,
            context_length: None,
        },
    )
    .unwrap();
    let handle = engine.handle();
    let streams: Vec<RequestStream> = prompts
        .iter()
        .map(|p| {
            let params = SamplingParams {
                max_tokens: Some(n),
                ignore_eos: true,
                ..SamplingParams::greedy()
            };
            handle
                .submit(GenerationRequest::new(p.clone(), params))
                .unwrap()
        })
        .collect();
    for (i, (stream, want)) in streams.into_iter().zip(&want).enumerate() {
        assert_eq!(&collect(stream), want, "{rel}: request {i}");
    }
    // The load balance over the window: every token forwarded went to
    // top_k experts of every sparse layer (the last token of a request is
    // never forwarded).
    let stats = handle.stats().unwrap();
    let forwarded: u64 = prompts.iter().map(|p| (p.len() + n - 1) as u64).sum();
    let top_k = match &handle.model().model.config().family {
        kiln_models::families::FamilyConfig::Moe(m) => m.top_k,
        kiln_models::families::FamilyConfig::GptOss(g) => g.top_k,
        other => panic!("{other:?}"),
    } as u64;
    assert!(!stats.expert_tokens.is_empty(), "{rel}: no expert load");
    eprintln!("{rel}: expert load over {} steps", stats.expert_steps);
    if (stats.expert_steps as usize) < kiln_engine::EXPERT_WINDOW_STEPS {
        for layer in &stats.expert_tokens {
            assert_eq!(
                layer.iter().sum::<u64>(),
                top_k * forwarded,
                "{rel}: {layer:?}"
            );
        }
    }
}

#[test]
fn qwen3_moe_requests_batched_in_the_engine_match_each_alone() {
    concurrent_requests_match_the_model_alone("moe/qwen3_moe");
}

#[test]
fn qwen2_moe_requests_batched_in_the_engine_match_each_alone() {
    concurrent_requests_match_the_model_alone("moe/qwen2_moe");
}

#[test]
fn gpt_oss_requests_batched_in_the_engine_match_each_alone() {
    concurrent_requests_match_the_model_alone("gpt_oss/mxfp4");
}
