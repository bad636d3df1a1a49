//! Constrained decoding through the engine on the real SmolLM2: a JSON
//! schema request and a free request in the same steps; the constrained
//! output parses and validates, the free one is what it is alone; a format
//! that does not compile is refused at submit.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{Engine, EngineConfig, EngineError, Event, GenerationRequest, LoadedModel};
use kiln_sampling::{FinishReason, SamplingParams};
use kiln_structured::Format;
use kiln_tensor::cpu::CpuBackend;
use serde_json::{json, Value};

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

fn prompt(m: &LoadedModel, text: &str) -> Vec<u32> {
    let rendered = m
        .render_chat(&json!([{"role": "user", "content": text}]), true)
        .unwrap();
    m.tokenizer.encode(&rendered, false).unwrap()
}

fn run(stream: kiln_engine::RequestStream) -> (String, FinishReason) {
    let mut text = String::new();
    for ev in stream {
        match ev {
            Event::Token { text: t, .. } => text.push_str(&t),
            Event::Finished { finish_reason, .. } => return (text, finish_reason),
            Event::Failed { message, .. } => panic!("request failed: {message}"),
            Event::Progress => {}
        }
    }
    panic!("no Finished event")
}

fn request(p: Vec<u32>, format: Option<Format>) -> GenerationRequest {
    GenerationRequest {
        format,
        ..GenerationRequest::new(
            p,
            SamplingParams {
                max_tokens: Some(80),
                ..SamplingParams::greedy()
            },
        )
    }
}

#[test]
fn schema_and_free_requests_share_steps_and_each_gets_its_own_output() {
    let model = load();
    let p_json = prompt(&model, "Describe a cat as JSON with its name and age.");
    let p_free = prompt(&model, "What is the capital of France?");
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "indoor": {"type": "boolean"}
        },
        "required": ["name", "age", "indoor"],
        "additionalProperties": false
    });
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 16,
            num_blocks: 256,
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            max_waiting: 16,
            context_length: None,
        },
    )
    .unwrap();
    let h = engine.handle();
    // The free request alone first, then both at once.
    let (alone, _) = run(h.submit(request(p_free.clone(), None)).unwrap());
    let s_json = h
        .submit(request(p_json, Some(Format::JsonSchema(schema.clone()))))
        .unwrap();
    let s_free = h.submit(request(p_free, None)).unwrap();
    let (json_text, finish) = run(s_json);
    let (free_text, _) = run(s_free);
    assert_eq!(free_text, alone, "a constrained neighbour changes nothing");
    assert_eq!(
        finish,
        FinishReason::Stop,
        "the grammar ended the output: {json_text:?}"
    );
    let v: Value =
        serde_json::from_str(&json_text).unwrap_or_else(|e| panic!("{e}: {json_text:?}"));
    let obj = v.as_object().unwrap();
    assert_eq!(obj.len(), 3, "{v}");
    assert!(
        obj["name"]
            .as_str()
            .is_some_and(|s| s.chars().count() <= 20),
        "{v}"
    );
    assert!(
        obj["age"].as_i64().is_some_and(|a| (0..=30).contains(&a)),
        "{v}"
    );
    assert!(obj["indoor"].is_boolean(), "{v}");
}

#[test]
fn regex_and_choice_constrain_generate_too() {
    let model = load();
    let p = prompt(&model, "Is the sky blue? Answer yes or no.");
    let choice = Format::Choice(vec!["yes".into(), "no".into()]);
    let g = model
        .generate(&request(p.clone(), Some(choice)), &mut |_| {
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
    assert!(g.text == "yes" || g.text == "no", "{:?}", g.text);
    let g = model
        .generate(
            &request(p, Some(Format::Regex("[A-Z][a-z]{2,6}, [0-9]{4}".into()))),
            &mut |_| std::ops::ControlFlow::Continue(()),
        )
        .unwrap();
    let (word, year) = g
        .text
        .split_once(", ")
        .unwrap_or_else(|| panic!("{:?}", g.text));
    assert!(
        word.chars().next().unwrap().is_ascii_uppercase() && (3..=7).contains(&word.len()),
        "{:?}",
        g.text
    );
    assert!(
        year.len() == 4 && year.bytes().all(|b| b.is_ascii_digit()),
        "{:?}",
        g.text
    );
}

#[test]
fn a_format_that_does_not_compile_is_refused_at_submit() {
    let engine = Engine::start(
        load(),
        EngineConfig {
            block_size: 16,
            num_blocks: 64,
            max_num_seqs: 4,
            max_num_batched_tokens: 256,
            max_waiting: 4,
            context_length: None,
        },
    )
    .unwrap();
    let h = engine.handle();
    let p = h.model().tokenizer.encode("Hello", false).unwrap();
    let err = h
        .submit(request(p, Some(Format::Regex("(unclosed".into()))))
        .err()
        .expect("refused");
    assert!(matches!(err, EngineError::Structured(_)), "{err}");
    assert!(err.to_string().contains("regex"), "{err}");
}

#[test]
fn jump_forward_is_lossless_and_saves_steps() {
    // Keys, quotes and separators the schema forces are taken without a
    // forward pass each: the same text and token count, fewer steps.
    let model = load();
    let p = prompt(&model, "Describe a cat as JSON.");
    let schema = json!({
        "type": "object",
        "properties": {
            "name_of_the_cat": {"type": "string", "maxLength": 12},
            "age_in_whole_years": {"type": "integer", "minimum": 0, "maximum": 30},
            "is_an_indoor_cat": {"type": "boolean"}
        },
        "required": ["name_of_the_cat", "age_in_whole_years", "is_an_indoor_cat"],
        "additionalProperties": false
    });
    let engine = Engine::start(
        model,
        EngineConfig {
            block_size: 16,
            num_blocks: 128,
            max_num_seqs: 4,
            max_num_batched_tokens: 512,
            max_waiting: 8,
            context_length: None,
        },
    )
    .unwrap();
    let h = engine.handle();
    let mut outs = Vec::new();
    for jump in [false, true] {
        let before = h.stats().unwrap();
        let mut r = request(p.clone(), Some(Format::JsonSchema(schema.clone())));
        r.jump_forward = jump;
        let mut text = String::new();
        let mut tokens = 0;
        for ev in h.submit(r).unwrap() {
            match ev {
                Event::Token { text: t, .. } => {
                    text.push_str(&t);
                    tokens += 1;
                }
                Event::Finished { usage, .. } => assert_eq!(usage.completion_tokens, tokens),
                Event::Failed { message, .. } => panic!("{message}"),
                Event::Progress => {}
            }
        }
        let steps = h.stats().unwrap().num_steps - before.num_steps;
        outs.push((text, tokens, steps));
    }
    let (plain, jumped) = (&outs[0], &outs[1]);
    eprintln!(
        "jump-forward: {} tokens in {} steps, without: {} steps",
        jumped.1, jumped.2, plain.2
    );
    assert_eq!(jumped.0, plain.0, "the same output");
    assert_eq!(jumped.1, plain.1, "the same tokens");
    let v: Value = serde_json::from_str(&plain.0).unwrap();
    assert!(v["name_of_the_cat"].is_string(), "{v}");
    // Each long key is several forced tokens.
    assert!(
        jumped.2 + 6 <= plain.2,
        "steps with jump-forward {} against {}",
        jumped.2,
        plain.2
    );
}
