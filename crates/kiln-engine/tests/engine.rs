//! The engine loop on the real SmolLM2 (its Q4_1 and Q8_0 blocks multiplied
//! in place): continuous batching of 64 requests gives exactly the outputs
//! of requests run alone; prefix reuse reports cached tokens and
//! changes nothing; preemption completes everything; cancels free every
//! block; impossible requests are refused with their numbers; chat sessions
//! prefill only each new turn.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{
    ChatSession, Engine, EngineConfig, EngineError, Event, GenerationRequest, LoadedModel,
    RequestStream, Usage,
};
use kiln_sampling::{FinishReason, SamplingParams};
use kiln_tensor::cpu::CpuBackend;
use serde_json::json;

fn load() -> LoadedModel {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    LoadedModel::load(&p, Arc::new(CpuBackend::new())).unwrap()
}

fn engine(num_blocks: usize) -> Engine {
    Engine::start(
        load(),
        EngineConfig {
            block_size: 16,
            num_blocks,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            max_waiting: 256,
            context_length: None,
        },
    )
    .unwrap()
}

#[derive(Debug, Clone, PartialEq)]
struct Done {
    ids: Vec<u32>,
    text: String,
    finish: FinishReason,
    usage: Usage,
}

fn collect(stream: RequestStream) -> Done {
    let (mut ids, mut text) = (Vec::new(), String::new());
    for ev in stream {
        match ev {
            Event::Token {
                token_id, text: t, ..
            } => {
                if token_id != u32::MAX {
                    ids.push(token_id);
                }
                text.push_str(&t);
            }
            Event::Progress => {}
            Event::Finished {
                finish_reason,
                usage,
                ..
            } => {
                return Done {
                    ids,
                    text,
                    finish: finish_reason,
                    usage,
                }
            }
            Event::Failed { message, .. } => panic!("request failed: {message}"),
        }
    }
    panic!("stream ended without a Finished event");
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

/// Chat prompts of varied lengths.
fn prompts(model: &LoadedModel, n: usize) -> Vec<Vec<u32>> {
    let topics = [
        "the sea",
        "a red fox",
        "prime numbers",
        "the moon",
        "bread",
        "rivers",
        "clocks",
        "music",
    ];
    (0..n)
        .map(|i| {
            let q = format!(
                "{} Tell me one fact about {}.",
                "Please be brief. ".repeat(i % 5),
                topics[i % topics.len()]
            );
            let r = model
                .render_chat(&json!([{"role": "user", "content": q}]), true)
                .unwrap();
            model.tokenizer.encode(&r, false).unwrap()
        })
        .collect()
}

#[test]
fn batched_preempted_and_cancelled_requests_match_requests_run_alone() {
    let big = engine(512);
    let h = big.handle();
    let ps = prompts(h.model(), 64);
    let max = |i: usize| 4 + i % 9;
    // Alone: one request at a time.
    let alone: Vec<Done> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| collect(h.submit(greedy(p.clone(), max(i))).unwrap()))
        .collect();
    // 64 at once, continuous batching: steps of every batch size, so both
    // the decode-sized products (fused in registers) and the panel products
    // for larger batches run.
    let streams: Vec<RequestStream> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| h.submit(greedy(p.clone(), max(i))).unwrap())
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let d = collect(s);
        assert_eq!(
            d.ids, alone[i].ids,
            "request {i}: batched output differs from alone"
        );
        assert_eq!(d.text, alone[i].text);
    }
    // Cancel half of them mid-stream: the pool returns to all blocks free.
    let total = h.stats().unwrap().num_blocks_total;
    let mut streams: Vec<Option<RequestStream>> = ps[..32]
        .iter()
        .enumerate()
        .map(|(i, p)| Some(h.submit(greedy(p.clone(), max(i))).unwrap()))
        .collect();
    for s in streams.iter_mut().step_by(2) {
        let first = s.as_ref().unwrap().next_event();
        assert!(matches!(
            first,
            Some(Event::Token { .. }) | Some(Event::Progress)
        ));
        *s = None; // dropped: cancelled
    }
    for (i, s) in streams.into_iter().enumerate() {
        if let Some(s) = s {
            assert_eq!(
                collect(s).ids,
                alone[i].ids,
                "request {i} beside cancelled ones"
            );
        }
    }
    let st = h.stats().unwrap();
    assert_eq!((st.num_running, st.num_waiting), (0, 0));
    assert_eq!(st.num_blocks_used, 0, "every block is free again");
    assert_eq!(st.num_blocks_total, total);

    // A pool for about 4 requests and 32 submitted: preemption, then everything completes.
    // Each request has its own cache salt (no shared blocks) and may generate 40
    // tokens, so running requests must outgrow the pool; greedy outputs are
    // prefixes of each other, so each must start with (or equal) its alone run.
    drop(big);
    let small = engine(16);
    let h = small.handle();
    let streams: Vec<RequestStream> = ps[..32]
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = greedy(p.clone(), 40);
            r.cache_salt = Some(format!("req-{i}"));
            h.submit(r).unwrap()
        })
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let d = collect(s);
        if alone[i].finish == FinishReason::Length {
            assert_eq!(
                d.ids[..alone[i].ids.len()],
                alone[i].ids[..],
                "request {i} under preemption"
            );
        } else {
            assert_eq!(d.ids, alone[i].ids, "request {i} under preemption");
        }
    }
    let st = h.stats().unwrap();
    assert!(
        st.num_preemptions > 0,
        "the small pool forced preemptions: {st:?}"
    );
    assert_eq!(st.num_blocks_used, 0);
    // A request that can never fit is refused at once, with its numbers.
    let err = h.submit(greedy(vec![1; 300], 10)).err().unwrap();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::Refused(_)), "{err:?}");
    assert!(msg.contains("16") && msg.contains("20"), "{msg}");
}

#[test]
fn shared_prefix_is_served_from_the_cache_and_changes_nothing() {
    let e = engine(256);
    let h = e.handle();
    let text = "The history of the printing press begins in the fifteenth century, when movable type made books \
                cheaper to produce. Knowledge spread quickly across Europe. ";
    let unit = h.model().tokenizer.encode(text, false).unwrap();
    let mut prefix = Vec::new();
    while prefix.len() < 1000 {
        prefix.extend_from_slice(&unit);
    }
    prefix.truncate(1000);
    let ask = |q: &str| {
        let mut p = prefix.clone();
        p.extend(h.model().tokenizer.encode(q, false).unwrap());
        p
    };
    let a = ask(" Question: who printed the first book?");
    let b = ask(" Question: why did prices fall?");
    let first = collect(h.submit(greedy(a, 8)).unwrap());
    assert_eq!(first.usage.cached_tokens, 0);
    let cached = collect(h.submit(greedy(b.clone(), 8)).unwrap());
    assert_eq!(
        cached.usage.cached_tokens,
        1000 / 16 * 16,
        "every full block of the shared prefix"
    );
    // The same request on a fresh engine (nothing cached) gives the same tokens.
    drop(e);
    let fresh = engine(256);
    let uncached = collect(fresh.handle().submit(greedy(b, 8)).unwrap());
    assert_eq!(uncached.usage.cached_tokens, 0);
    assert_eq!(cached.ids, uncached.ids);
}

#[test]
fn chat_session_prefills_only_new_turns_and_matches_a_fresh_render() {
    let e = engine(256);
    let params = SamplingParams {
        max_tokens: Some(24),
        ..SamplingParams::greedy()
    };
    let mut s = ChatSession::new(
        e.handle(),
        vec![json!({"role": "system", "content": "You are a helpful assistant."})],
        params.clone(),
    );
    let mut turns = Vec::new();
    let mut prev_prompt_len = 0;
    let inputs = [
        "What is 2 plus 2?",
        "And 3 plus 3?",
        "TOOL",
        "Thanks. Name a color.",
        "One more color?",
    ];
    for (t, input) in inputs.iter().enumerate() {
        let turn = if *input == "TOOL" {
            s.continue_tool("call_1", "division by zero", true)
        } else {
            s.continue_user(input)
        }
        .unwrap();
        if t > 0 {
            assert!(
                turn.usage.cached_tokens >= prev_prompt_len / 16 * 16,
                "turn {t}: {} cached of a previous prompt of {prev_prompt_len}",
                turn.usage.cached_tokens
            );
            assert!(
                turn.usage.prompt_tokens - turn.usage.cached_tokens < 64,
                "turn {t} prefilled only its new tokens: {:?}",
                turn.usage
            );
        }
        prev_prompt_len = turn.usage.prompt_tokens;
        turns.push(turn);
    }
    let rendered = e
        .handle()
        .model()
        .render_chat(&serde_json::Value::Array(s.messages().to_vec()), false)
        .unwrap();
    assert!(
        rendered.contains(kiln_engine::TOOL_ERROR_MARKER),
        "the tool error is marked in the render"
    );
    // The last turn from scratch: its conversation rendered whole, on a fresh engine.
    let mut history = s.messages().to_vec();
    history.pop(); // the last assistant reply
    drop(e);
    let fresh = engine(256);
    let h = fresh.handle();
    let r = h
        .model()
        .render_chat(&serde_json::Value::Array(history), true)
        .unwrap();
    let prompt = h.model().tokenizer.encode(&r, false).unwrap();
    assert_eq!(prompt.len(), turns[4].usage.prompt_tokens);
    let scratch = collect(h.submit(GenerationRequest::new(prompt, params)).unwrap());
    assert_eq!(scratch.usage.cached_tokens, 0);
    assert_eq!(scratch.text, turns[4].text);
    assert_eq!(scratch.ids, turns[4].token_ids);
}
