//! Hybrids (the random Qwen3.5, Qwen3.5-MoE, Qwen3-Next, LFM2 and LFM2-MoE checkpoints of
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
            Event::Failed { message, .. } => panic!("request failed: {message}"),
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

/// The `n` greedy tokens `model` gives `prompt` run alone (no engine).
fn alone(model: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let req = GenerationRequest::new(prompt.to_vec(), greedy(n));
    model
        .generate(&req, &mut |_| std::ops::ControlFlow::Continue(()))
        .unwrap()
        .token_ids
}

#[test]
fn qwen3_5_requests_batched_in_the_engine_match_each_alone() {
    requests_batched_in_the_engine_match_each_alone("qwen3_5");
}

#[test]
fn qwen3_5_moe_requests_batched_in_the_engine_match_each_alone() {
    requests_batched_in_the_engine_match_each_alone("qwen3_5_moe");
}

#[test]
fn qwen3_next_requests_batched_in_the_engine_match_each_alone() {
    requests_batched_in_the_engine_match_each_alone("qwen3_next");
}

#[test]
fn lfm2_moe_requests_batched_in_the_engine_match_each_alone() {
    requests_batched_in_the_engine_match_each_alone("lfm2_moe");
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
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&model, p, n)).collect();
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

/// Prefix reuse through state snapshots: a request sharing a 300-token prefix
/// with a finished one resumes from the snapshot at that prompt's end
/// (`cached_tokens` ≥ 256) and gives the tokens of an uncached run; the next
/// turn of a chat (prompt, answer, new message) resumes after the previous
/// answer (the first request's tail snapshot); a prompt whose prefix no
/// snapshot covers computes all.
fn prefixes_resume_from_state_snapshots(case: &str) {
    let model = LoadedModel::load(&checkpoint(case), Arc::new(CpuBackend::new())).unwrap();
    let vocab = model.model.config().vocab_size as u32;
    let shared: Vec<u32> = (0..300).map(|i| (i * 7 + 5) % vocab).collect();
    let first: Vec<u32> = shared.iter().copied().chain([3, 9, 27]).collect();
    let second: Vec<u32> = shared
        .iter()
        .copied()
        .chain((0..40).map(|i| (i * 13 + 1) % vocab))
        .collect();
    let n = 8;
    let alone = |p: &[u32]| alone(&model, p, n);
    let (want_first, want_second) = (alone(&first), alone(&second));
    let turn2: Vec<u32> = first
        .iter()
        .chain(&want_first)
        .copied()
        .chain([11, 12, 13, 14, 15])
        .collect();
    let want_turn2 = alone(&turn2);
    let other: Vec<u32> = (0..200).map(|i| (i * 5 + 2) % vocab).collect();
    let want_other = alone(&other);
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 4,
            num_blocks: 2000,
            max_num_seqs: 2,
            max_num_batched_tokens: 64,
            max_waiting: 8,
            context_length: None,
        },
    )
    .unwrap();
    let h = engine.handle();
    let run = |p: &[u32]| {
        collect(
            h.submit(GenerationRequest::new(p.to_vec(), greedy(n)))
                .unwrap(),
        )
    };
    let (got, cached) = run(&first);
    assert_eq!(
        (got, cached),
        (want_first.clone(), 0),
        "{case}: first request"
    );
    let (got, cached) = run(&second);
    assert_eq!(got, want_second, "{case}: second request");
    assert!(
        cached >= 256,
        "{case}: second request reused {cached} tokens"
    );
    let (got, cached) = run(&turn2);
    assert_eq!(got, want_turn2, "{case}: next turn");
    eprintln!(
        "{case}: the next turn ({} tokens) resumed after {cached}",
        turn2.len()
    );
    // Past the previous answer: the last block boundary the first request
    // passed (its prompt and all but its last token computed).
    assert!(
        cached >= (first.len() + n - 1) / 4 * 4,
        "{case}: next turn reused {cached} tokens"
    );
    let (got, cached) = run(&other);
    assert_eq!((got, cached), (want_other, 0), "{case}: unrelated prompt");
}

#[test]
fn qwen3_5_prefixes_resume_from_state_snapshots() {
    prefixes_resume_from_state_snapshots("qwen3_5");
}

#[test]
fn lfm2_prefixes_resume_from_state_snapshots() {
    prefixes_resume_from_state_snapshots("lfm2");
}

/// Speculative decodes on a hybrid (Predicted Outputs as the proposer): the
/// state of a step that verifies drafts goes to a spare slot, kept when
/// every draft is accepted, else the accepted tokens are computed again
/// from the state before the step. Exact, edited and unrelated predictions,
/// each request alone and four at once on three spare slots, give the plain
/// greedy tokens; drafts are accepted and rejected along the way, and every
/// block comes back.
fn predictions_give_the_plain_tokens(case: &str) {
    let model = LoadedModel::load(&checkpoint(case), Arc::new(CpuBackend::new())).unwrap();
    let vocab = model.model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|r| {
            (0..11 + 5 * r)
                .map(|i| (i * 29 + 7 * r + 1) % vocab)
                .collect()
        })
        .collect();
    let n = 24;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&model, p, n)).collect();
    // Request r's prediction: exact (0), two edits (1, 3: a replaced and a
    // dropped token), unrelated (2).
    let prediction = |r: usize| -> Vec<u32> {
        let mut p = want[r].clone();
        match r {
            0 => {}
            2 => p = (0..n as u32).map(|i| (i * 3 + 1) % vocab).collect(),
            _ => {
                p[n / 3] = (p[n / 3] + 1) % vocab;
                p.remove(2 * n / 3);
            }
        }
        p
    };
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 4,
            num_blocks: 600,
            max_num_seqs: 4,
            max_num_batched_tokens: 64,
            max_waiting: 8,
            context_length: None,
        },
    )
    .unwrap();
    let h = engine.handle();
    let request = |r: usize| {
        let mut req = GenerationRequest::new(prompts[r].clone(), greedy(n));
        req.prediction = Some(prediction(r));
        req
    };
    for r in 0..4 {
        let (got, _) = collect(h.submit(request(r)).unwrap());
        assert_eq!(got, want[r], "{case}: request {r} alone");
    }
    let alone = h.stats().unwrap();
    let streams: Vec<RequestStream> = (0..4).map(|r| h.submit(request(r)).unwrap()).collect();
    for (r, s) in streams.into_iter().enumerate() {
        let (got, _) = collect(s);
        assert_eq!(got, want[r], "{case}: request {r} batched");
    }
    let st = h.stats().unwrap();
    eprintln!(
        "{case}: {} drafts verified in {} speculative decodes, {} accepted (alone: {} of {})",
        st.num_draft_tokens,
        st.num_speculative_decodes,
        st.num_accepted_draft_tokens,
        alone.num_accepted_draft_tokens,
        alone.num_draft_tokens
    );
    assert!(alone.num_accepted_draft_tokens > 0, "{alone:?}");
    assert!(alone.num_accepted_draft_tokens < alone.num_draft_tokens);
    assert!(st.num_accepted_draft_tokens > alone.num_accepted_draft_tokens);
    assert!(st.num_draft_tokens > alone.num_draft_tokens);
    assert_eq!(st.num_blocks_used, 0, "{case}: every block is back");
}

#[test]
fn qwen3_5_predictions_give_the_plain_tokens() {
    predictions_give_the_plain_tokens("qwen3_5");
}

#[test]
fn lfm2_predictions_give_the_plain_tokens() {
    predictions_give_the_plain_tokens("lfm2");
}

/// `--speculative mtp` on the random Qwen3.5 with a multi-token-prediction
/// head (`qwen3_5_mtp`): its guesses are verified in the decode steps and
/// every request, alone and four at once (prompts prefilled in chunks),
/// gets the plain greedy tokens; every block comes back. A model without a
/// head is refused with the reason.
#[test]
fn mtp_speculation_gives_the_plain_tokens() {
    mtp_gives_the_plain_tokens(&checkpoint("qwen3_5_mtp"), 300, 256);
}

/// The same with GLM-4.5's and DeepSeek-V3's MTP layers (sparse models
/// without recurrent state: the shared prefix comes from the prefix cache).
#[test]
fn deepseek_style_mtp_speculation_gives_the_plain_tokens() {
    mtp_gives_the_plain_tokens(&checkpoint("../moe/glm4_moe"), 150, 148);
    // DeepSeek-V3's, with latent attention in the model and the head.
    mtp_gives_the_plain_tokens(&checkpoint("../moe/deepseek_v3"), 150, 148);
}

fn mtp_gives_the_plain_tokens(dir: &std::path::Path, shared_len: u32, min_cached: usize) {
    use kiln_engine::{SpeculativeConfig, SpeculativeMethod};
    let model = LoadedModel::load(dir, Arc::new(CpuBackend::new())).unwrap();
    let vocab = model.model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|r| {
            (0..11 + 9 * r)
                .map(|i| (i * 31 + 5 * r + 3) % vocab)
                .collect()
        })
        .collect();
    let n = 20;
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&model, p, n)).collect();
    // Two prompts sharing a prefix: the second resumes from a snapshot or
    // cached blocks, and the head's keys begin where its computation does.
    let shared: Vec<u32> = (0..shared_len).map(|i| (i * 7 + 5) % vocab).collect();
    let pair: Vec<Vec<u32>> = [
        vec![3, 9, 27],
        (0..40).map(|i| (i * 13 + 1) % vocab).collect(),
    ]
    .into_iter()
    .map(|tail| shared.iter().copied().chain(tail).collect())
    .collect();
    let want_pair: Vec<Vec<u32>> = pair.iter().map(|p| alone(&model, p, n)).collect();
    let config = EngineConfig {
        block_size: 4,
        num_blocks: 600,
        max_num_seqs: 4,
        max_num_batched_tokens: 16,
        max_waiting: 8,
        context_length: None,
    };
    let spec = SpeculativeConfig {
        method: SpeculativeMethod::Mtp,
        num_tokens: 3,
        ..SpeculativeConfig::default()
    };
    let engine = Engine::start_with(model, config, spec).unwrap();
    let h = engine.handle();
    for (r, p) in prompts.iter().enumerate() {
        let (got, _) = collect(
            h.submit(GenerationRequest::new(p.clone(), greedy(n)))
                .unwrap(),
        );
        assert_eq!(got, want[r], "request {r} alone");
    }
    let alone_stats = h.stats().unwrap();
    let streams: Vec<RequestStream> = prompts
        .iter()
        .map(|p| {
            h.submit(GenerationRequest::new(p.clone(), greedy(n)))
                .unwrap()
        })
        .collect();
    for (r, s) in streams.into_iter().enumerate() {
        let (got, _) = collect(s);
        assert_eq!(got, want[r], "request {r} batched");
    }
    for (r, p) in pair.iter().enumerate() {
        let (got, cached) = collect(
            h.submit(GenerationRequest::new(p.clone(), greedy(n)))
                .unwrap(),
        );
        assert_eq!(got, want_pair[r], "shared-prefix request {r}");
        assert!(
            r == 0 || cached >= min_cached,
            "the second reused {cached} tokens"
        );
    }
    let st = h.stats().unwrap();
    eprintln!(
        "mtp: {} guesses verified in {} speculative decodes, {} accepted",
        st.num_draft_tokens, st.num_speculative_decodes, st.num_accepted_draft_tokens
    );
    assert!(alone_stats.num_speculative_decodes > 0, "{alone_stats:?}");
    assert!(st.num_draft_tokens > alone_stats.num_draft_tokens);
    assert_eq!(st.num_blocks_used, 0, "every block is back");

    let plain = LoadedModel::load(&checkpoint("qwen3_5"), Arc::new(CpuBackend::new())).unwrap();
    let err = Engine::start_with(plain, config, spec)
        .err()
        .expect("no head")
        .to_string();
    assert!(err.contains("multi-token-prediction head"), "{err}");
}
