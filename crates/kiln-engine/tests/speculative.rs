//! Speculative decoding on the real SmolLM2 (CPU): n-gram drafts and
//! predicted outputs change nothing a request receives — greedy and seeded
//! sampling give the same tokens, text, logprobs and finish as without
//! speculation, alone and in a batch of 16 mixed requests — while drafts are
//! really verified and accepted; the first sampled tokens' distribution over
//! many seeds is the same with and without (chi-square).

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{
    Engine, EngineConfig, Event, GenerationRequest, LoadedModel, RequestStream, SpeculativeConfig,
    SpeculativeMethod, Usage,
};
use kiln_sampling::{FinishReason, Sampled, SamplingParams};
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

fn engine(method: SpeculativeMethod) -> Engine {
    Engine::start_with(
        load(),
        EngineConfig {
            block_size: 16,
            num_blocks: 512,
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            max_waiting: 64,
            context_length: None,
        },
        SpeculativeConfig {
            method,
            ..SpeculativeConfig::default()
        },
    )
    .unwrap()
}

#[derive(Debug, Clone, PartialEq)]
struct Done {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<Option<Sampled>>,
    finish: FinishReason,
    usage: Usage,
}

fn collect(stream: RequestStream) -> Done {
    let (mut ids, mut text, mut logprobs) = (Vec::new(), String::new(), Vec::new());
    for ev in stream {
        match ev {
            Event::Token {
                token_id,
                text: t,
                logprobs: l,
            } => {
                if token_id != u32::MAX {
                    ids.push(token_id);
                    logprobs.push(l);
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
                    logprobs,
                    finish: finish_reason,
                    usage,
                }
            }
            Event::Failed { message, .. } => panic!("request failed: {message}"),
        }
    }
    panic!("stream ended without a Finished event");
}

/// Prompts whose answers repeat the prompt (lists to copy, code to
/// rewrite), so n-gram lookup finds drafts.
fn prompt(model: &LoadedModel, i: usize) -> Vec<u32> {
    let items = [
        "apples", "pears", "plums", "figs", "dates", "limes", "kiwis",
    ];
    let list: Vec<String> = (0..5 + i % 3)
        .map(|k| format!("{}. {}", k + 1, items[(i + k) % items.len()]))
        .collect();
    let q = match i % 3 {
        0 => format!("Repeat this list exactly:\n{}", list.join("\n")),
        1 => format!(
            "Rewrite this code with the variable renamed to total:\n\
             def f(xs):\n    s = 0\n    for x in xs:\n        s += x * {i}\n    return s"
        ),
        _ => format!("Copy the text: {}", list.join(", ")),
    };
    let r = model
        .render_chat(&json!([{"role": "user", "content": q}]), true)
        .unwrap();
    model.tokenizer.encode(&r, false).unwrap()
}

/// Request `i` of the mix: greedy, seeded sampling, logprobs, stop strings.
fn request(model: &LoadedModel, i: usize) -> GenerationRequest {
    let mut params = SamplingParams {
        max_tokens: Some(24 + 8 * (i % 4)),
        ..SamplingParams::greedy()
    };
    match i % 4 {
        1 => {
            params.temperature = 0.8;
            params.top_p = 0.95;
            params.seed = Some(1000 + i as u64);
        }
        2 => params.logprobs = Some(3),
        3 => params.stop = vec!["3.".to_string(), "return".to_string()],
        _ => {}
    }
    GenerationRequest::new(prompt(model, i), params)
}

#[test]
fn ngram_speculation_gives_the_plain_outputs_alone_and_batched() {
    let plain = engine(SpeculativeMethod::Off);
    let spec = engine(SpeculativeMethod::Ngram);
    let (hp, hs) = (plain.handle(), spec.handle());
    let n = 16;
    let want: Vec<Done> = (0..n)
        .map(|i| collect(hp.submit(request(hp.model(), i)).unwrap()))
        .collect();
    assert_eq!(hp.stats().unwrap().num_draft_tokens, 0);
    // Alone, one request at a time.
    for (i, w) in want.iter().enumerate().take(6) {
        let got = collect(hs.submit(request(hs.model(), i)).unwrap());
        assert_eq!(got.ids, w.ids, "request {i} alone");
        assert_eq!(
            (&got.text, &got.logprobs, got.finish),
            (&w.text, &w.logprobs, w.finish)
        );
    }
    // All 16 at once.
    let streams: Vec<RequestStream> = (0..n)
        .map(|i| hs.submit(request(hs.model(), i)).unwrap())
        .collect();
    let mut drafts = 0;
    for (i, s) in streams.into_iter().enumerate() {
        let got = collect(s);
        assert_eq!(got.ids, want[i].ids, "request {i} batched");
        assert_eq!(got.text, want[i].text, "request {i} batched");
        assert_eq!(got.logprobs, want[i].logprobs, "request {i} batched");
        assert_eq!(got.finish, want[i].finish, "request {i} batched");
        assert!(got.usage.accepted_draft_tokens <= got.usage.draft_tokens);
        drafts += got.usage.draft_tokens;
    }
    let st = hs.stats().unwrap();
    eprintln!(
        "n-gram: {} drafts verified in {} speculative decodes, {} accepted",
        st.num_draft_tokens, st.num_speculative_decodes, st.num_accepted_draft_tokens
    );
    assert!(drafts > 0 && st.num_accepted_draft_tokens > 0, "{st:?}");
    assert!(st.num_accepted_draft_tokens < st.num_draft_tokens);
    assert_eq!(st.num_blocks_used, 0, "every block is back");
}

#[test]
fn predicted_outputs_change_nothing_and_a_close_prediction_is_accepted() {
    let e = engine(SpeculativeMethod::Off);
    let h = e.handle();
    let model = h.model();
    for i in [0, 1, 3] {
        let want = collect(h.submit(request(model, i)).unwrap());
        assert_eq!(want.usage.draft_tokens, 0);
        // The exact output as the prediction: nearly every token accepted.
        let mut r = request(model, i);
        r.prediction = Some(want.ids.clone());
        let got = collect(h.submit(r).unwrap());
        assert_eq!(
            (&got.ids, &got.text, got.finish),
            (&want.ids, &want.text, want.finish)
        );
        let u = got.usage;
        eprintln!(
            "request {i}: exact prediction, {} of {} drafts accepted",
            u.accepted_draft_tokens, u.draft_tokens
        );
        assert!(
            u.accepted_draft_tokens + 2 >= want.ids.len().min(u.draft_tokens + 1),
            "{u:?}"
        );
        // An edited prediction (tokens replaced and dropped): the same
        // output, some drafts rejected.
        let mut edited = want.ids.clone();
        let third = edited.len() / 3;
        edited[third] = edited[third].wrapping_add(7) % 49_000;
        edited.remove(2 * third);
        let mut r = request(model, i);
        r.prediction = Some(edited);
        let got = collect(h.submit(r).unwrap());
        assert_eq!(
            (&got.ids, &got.text, got.finish),
            (&want.ids, &want.text, want.finish)
        );
        assert!(got.usage.accepted_draft_tokens > 0);
        // A prediction unrelated to the answer still changes nothing.
        let mut r = request(model, i);
        r.prediction = Some((100..180).collect());
        let got = collect(h.submit(r).unwrap());
        assert_eq!(got.ids, want.ids);
    }
}

#[test]
fn sampled_tokens_are_distributed_as_without_speculation() {
    // 200 seeds of one prompt whose answer repeats it, temperature 1: the
    // first four sampled tokens, plain against a prediction of the greedy
    // answer (drafts on every step), binned by token; chi-square of the two
    // samples over the bins with at least 5 expected counts.
    let e = engine(SpeculativeMethod::Off);
    let h = e.handle();
    let model = h.model();
    let p = prompt(model, 0);
    let greedy = collect(
        h.submit(GenerationRequest::new(
            p.clone(),
            SamplingParams {
                max_tokens: Some(8),
                ..SamplingParams::greedy()
            },
        ))
        .unwrap(),
    );
    let run = |seed: u64, predict: bool| {
        let mut r = GenerationRequest::new(
            p.clone(),
            SamplingParams {
                max_tokens: Some(4),
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::greedy()
            },
        );
        if predict {
            r.prediction = Some(greedy.ids.clone());
        }
        h.submit(r).unwrap()
    };
    let mut counts: std::collections::BTreeMap<(usize, u32), [u64; 2]> = Default::default();
    let (mut same, mut drafts) = (0, 0);
    for seed in 0..200 {
        let a = collect(run(seed, false));
        // A different seed for the speculative side: two independent samples.
        let b = collect(run(10_000 + seed, true));
        let c = collect(run(seed, true));
        same += usize::from(a.ids == c.ids);
        drafts += c.usage.draft_tokens;
        for (side, d) in [(0, &a), (1, &b)] {
            for (pos, &t) in d.ids.iter().enumerate() {
                counts.entry((pos, t)).or_default()[side] += 1;
            }
        }
    }
    // With a seed, speculation takes the same draws: the very same tokens.
    assert_eq!(same, 200, "seeded outputs differ with speculation");
    assert!(drafts > 0);
    let (mut chi2, mut bins) = (0.0, 0usize);
    for c in counts.values() {
        let total = (c[0] + c[1]) as f64;
        if total < 10.0 {
            continue;
        }
        for &k in c {
            let expected = total / 2.0;
            chi2 += (k as f64 - expected).powi(2) / expected;
        }
        bins += 1;
    }
    // Degrees of freedom ~ bins (minus the per-position constraints);
    // reject at about p < 0.001: mean + 4.5 standard deviations.
    let limit = bins as f64 + 4.5 * (2.0 * bins as f64).sqrt();
    eprintln!("chi-square {chi2:.1} over {bins} bins (limit {limit:.1})");
    assert!(bins >= 4, "too few bins: {counts:?}");
    assert!(chi2 < limit, "chi-square {chi2:.1} over {bins} bins");
}

#[test]
fn a_draft_model_gives_the_plain_outputs_and_a_foreign_tokenizer_is_refused() {
    let plain = engine(SpeculativeMethod::Off);
    let hp = plain.handle();
    let n = 8;
    let want: Vec<Done> = (0..n)
        .map(|i| collect(hp.submit(request(hp.model(), i)).unwrap()))
        .collect();
    // The model drafts for itself: greedy requests accept nearly every
    // guess, sampled ones reject many; every output is the plain one.
    let config = EngineConfig {
        block_size: 16,
        num_blocks: 512,
        max_num_seqs: 32,
        max_num_batched_tokens: 512,
        max_waiting: 64,
        context_length: None,
    };
    let spec = SpeculativeConfig {
        method: SpeculativeMethod::Draft,
        num_tokens: 4,
        ..SpeculativeConfig::default()
    };
    // The draft's KV comes out of the planned pool: the same model halves it.
    let (target, draft) = (load(), load());
    let shared = config.with_draft(&target, &draft, spec.max_batch);
    assert_eq!(shared.num_blocks, config.num_blocks / 2);
    let e = Engine::start_with_draft(target, config, spec, Some(draft)).unwrap();
    let h = e.handle();
    for round in 0..2 {
        let streams: Vec<RequestStream> = (0..n)
            .map(|i| h.submit(request(h.model(), i)).unwrap())
            .collect();
        for (i, s) in streams.into_iter().enumerate() {
            let got = collect(s);
            assert_eq!(got.ids, want[i].ids, "request {i}, round {round}");
            assert_eq!(
                (&got.text, &got.logprobs, got.finish),
                (&want[i].text, &want[i].logprobs, want[i].finish)
            );
        }
    }
    let st = h.stats().unwrap();
    eprintln!(
        "draft: {} drafts in {} speculative decodes, {} accepted",
        st.num_draft_tokens, st.num_speculative_decodes, st.num_accepted_draft_tokens
    );
    assert!(st.num_accepted_draft_tokens > 0);
    assert!(st.num_accepted_draft_tokens < st.num_draft_tokens);
    assert_eq!(st.num_blocks_used, 0);
    // A draft whose tokenizer differs, or none at all, is refused at start.
    let qwen = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let other = LoadedModel::load(&qwen, Arc::new(CpuBackend::new())).unwrap();
    let err = Engine::start_with_draft(load(), config, spec, Some(other))
        .err()
        .expect("a foreign draft is refused")
        .to_string();
    assert!(err.contains("tokenizer"), "{err}");
    let err = Engine::start_with_draft(load(), config, spec, None)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("--draft-model"), "{err}");
}

#[test]
fn drafts_a_format_forbids_are_never_verified() {
    let e = engine(SpeculativeMethod::Off);
    let h = e.handle();
    let model = h.model();
    let schema = kiln_structured::Format::JsonSchema(json!({
        "type": "object",
        "properties": {"fruit": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["fruit", "count"],
        "additionalProperties": false
    }));
    let constrained = |prediction: Option<Vec<u32>>| {
        let mut r = request(model, 0);
        r.format = Some(schema.clone());
        r.params.max_tokens = Some(40);
        r.prediction = prediction;
        collect(h.submit(r).unwrap())
    };
    let want = constrained(None);
    assert!(want.text.starts_with('{'), "{}", want.text);
    // The answer as the prediction: verified and accepted.
    let got = constrained(Some(want.ids.clone()));
    assert_eq!((&got.ids, &got.text), (&want.ids, &want.text));
    assert!(got.usage.accepted_draft_tokens > 0, "{:?}", got.usage);
    // Plain prose as the prediction: the grammar refuses its first token,
    // so nothing is ever scheduled for verification.
    let prose = model
        .tokenizer
        .encode("hello there, no JSON here", false)
        .unwrap();
    let got = constrained(Some(prose));
    assert_eq!(got.ids, want.ids);
    assert_eq!(got.usage.draft_tokens, 0, "{:?}", got.usage);
}
