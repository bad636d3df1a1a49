//! The OpenAI API end to end on the real SmolLM2, through a raw HTTP client:
//! chat (plain and streamed), completions, prefix caching, stop strings,
//! seeds, logprobs, tokenization, and operations routes.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::{assert_error, get, post, MODEL_NAME};
use kiln_server::ServerConfig;
use serde_json::{json, Value};

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| common::start(ServerConfig::default(), common::engine_config()))
}

fn france(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 24,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

const PARIS: &str = "The capital of France is Paris.";

#[test]
fn chat_answers_with_usage() {
    let r = post(server(), "/v1/chat/completions", &france(json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    assert_eq!(v["model"], MODEL_NAME);
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], PARIS);
    assert_eq!(choice["finish_reason"], "stop");
    assert!(choice.get("logprobs").is_some_and(Value::is_null));
    let u = &v["usage"];
    let (p, c) = (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
    );
    assert!(p > 5 && c >= 7, "{u}");
    assert_eq!(u["total_tokens"].as_u64(), Some(p + c));
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
}

#[test]
fn chat_streams_the_same_text() {
    let body = france(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let r = post(server(), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, PARIS);
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert!(usage_chunk["usage"]["completion_tokens"].as_u64().unwrap() >= 7);
    let last = rest.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    for c in rest {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["usage"].is_null(), "{c}");
    }
}

#[test]
fn completions_take_token_ids_and_echo() {
    let t = post(
        server(),
        "/tokenize",
        &json!({"prompt": "The capital of France is"}),
    )
    .json();
    let tokens = t["tokens"].clone();
    let body = json!({"prompt": tokens, "echo": true, "max_tokens": 3, "temperature": 0});
    let v = post(server(), "/v1/completions", &body).json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with("The capital of France is") && text.len() > 24,
        "{text:?}"
    );
    assert_eq!(v["usage"]["prompt_tokens"], t["count"]);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[test]
fn a_repeated_prefix_is_served_from_the_cache() {
    let prompt = "Kiln test of the prefix cache. ".repeat(8);
    let body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
    let first = post(server(), "/v1/completions", &body).json();
    let second = post(server(), "/v1/completions", &body).json();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 16, "{second}");
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);
}

#[test]
fn stop_strings_end_the_text_unemitted() {
    let v = post(
        server(),
        "/v1/chat/completions",
        &france(json!({"stop": ["Paris"]})),
    )
    .json();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "The capital of France is "
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn a_seed_reproduces_sampling() {
    let body =
        json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 1234});
    let a = post(server(), "/v1/completions", &body).json();
    let b = post(server(), "/v1/completions", &body).json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(a["usage"]["completion_tokens"], 8);
}

#[test]
fn logprobs_have_the_openai_shape() {
    let body = france(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 4}));
    let v = post(server(), "/v1/chat/completions", &body).json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 4);
    let mut bytes = Vec::new();
    for e in &content {
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], e["token"]);
        bytes.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );

    let body = json!({"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2});
    let lp = post(server(), "/v1/completions", &body).json()["choices"][0]["logprobs"].clone();
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().map(Vec::len), Some(3), "{key}: {lp}");
    }
    assert_eq!(lp["top_logprobs"][0].as_object().map(|m| m.len()), Some(2));
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let text = "Kiln tokenizes: héllo, wörld! 123";
    let t = post(server(), "/tokenize", &json!({"prompt": text})).json();
    assert_eq!(
        t["count"].as_u64(),
        Some(t["tokens"].as_array().unwrap().len() as u64)
    );
    let d = post(server(), "/detokenize", &json!({"tokens": t["tokens"]})).json();
    assert_eq!(d["prompt"], text);
    let m = post(
        server(),
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": text}]}),
    )
    .json();
    assert!(
        m["count"].as_u64() > t["count"].as_u64(),
        "the template adds tokens: {m}"
    );
}

#[test]
fn operations_routes() {
    let addr = server();
    assert_eq!(get(addr, "/health").status, 200);
    let models = get(addr, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], MODEL_NAME);
    assert_eq!(models["data"][0]["max_model_len"], 8192);
    let stats = get(addr, "/stats").json();
    assert_eq!(stats["device"], "cpu");
    assert_eq!(stats["scheduler"]["num_blocks_total"], 256);
    let metrics = get(addr, "/metrics");
    assert_eq!(metrics.status, 200);
    let text = metrics.text();
    for name in [
        "kiln_num_requests_running",
        "kiln_kv_blocks_total{model=\"smollm2\"} 256",
        "kiln_http_requests_total{endpoint=\"/v1/models\",status=\"200\"}",
        "kiln_generation_tokens_total",
        "kiln_preemptions_total",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
}

#[test]
fn a_prompt_over_the_context_is_refused_with_the_numbers() {
    let addr = server();
    let ids = vec![1u32; 8300];
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1}),
    );
    let e = assert_error(&r, 400);
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("8300") && msg.contains("8192"), "{msg}");
    assert_eq!(e["code"], "context_length_exceeded");

    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 9000}),
    );
    let e = assert_error(&r, 400);
    assert!(e["message"].as_str().unwrap().contains("9000"), "{e}");

    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": "gpt-4", "prompt": "hi"}),
    );
    assert_eq!(assert_error(&r, 404)["code"], "model_not_found");
    assert_error(&get(addr, "/v2/nothing"), 404);
}

#[test]
fn predicted_outputs_keep_the_answer_and_report_accepted_tokens() {
    let plain = post(server(), "/v1/chat/completions", &france(json!({})));
    assert_eq!(plain.status, 200, "{}", plain.text());
    let answer = plain.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(plain.json()["usage"]
        .get("completion_tokens_details")
        .is_none());
    // The answer itself as the prediction, as text parts, and an edited one.
    let edited = answer.replace("Paris", "Lyon");
    for prediction in [
        json!({"type": "content", "content": answer}),
        json!({"type": "content", "content": [{"type": "text", "text": answer}]}),
        json!({"type": "content", "content": edited}),
    ] {
        let r = post(
            server(),
            "/v1/chat/completions",
            &france(json!({"prediction": prediction})),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["choices"][0]["message"]["content"], answer.as_str());
        let d = &v["usage"]["completion_tokens_details"];
        let accepted = d["accepted_prediction_tokens"].as_u64().unwrap();
        assert!(accepted > 0, "{v}");
        assert!(d["rejected_prediction_tokens"].as_u64().is_some(), "{v}");
    }
    // Streamed: the same text.
    let r = post(
        server(),
        "/v1/chat/completions",
        &france(json!({"stream": true, "prediction": {"type": "content", "content": answer}})),
    );
    let text: String = r
        .sse_data()
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).ok()?;
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, answer);
    // Metrics count the verified drafts.
    let m = get(server(), "/metrics").text();
    let accepted = m
        .lines()
        .find(|l| l.starts_with("kiln_spec_decode_num_accepted_tokens_total"))
        .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .unwrap();
    assert!(accepted > 0.0, "{m}");
    // A malformed prediction is a 400 naming the parameter.
    for bad in [
        json!("Paris"),
        json!({"type": "text", "content": "x"}),
        json!({"type": "content", "content": 5}),
    ] {
        let r = post(
            server(),
            "/v1/chat/completions",
            &france(json!({"prediction": bad})),
        );
        let e = assert_error(&r, 400);
        assert_eq!(e["param"], "prediction", "{e}");
    }
}
