//! Serving behaviour around generation on the real SmolLM2: 503 while the
//! model loads (and after a failed load), several choices per request (`n`),
//! SSE keep-alives while a stream waits in the queue, and the latency
//! histograms of `/metrics` and `/stats`.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use common::{assert_error, get, post, MODEL_NAME};
use kiln_engine::{Engine, EngineConfig};
use kiln_server::{Readiness, ServerConfig};
use serde_json::{json, Value};

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| common::start(ServerConfig::default(), common::engine_config()))
}

fn story(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 12,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

fn chat_body() -> Value {
    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0})
}

#[test]
fn answers_503_while_loading_then_serves() {
    let readiness = Readiness::new();
    let addr = common::start_loading(ServerConfig::default(), readiness.clone());

    let h = get(addr, "/health");
    assert_eq!(h.status, 503, "{}", h.text());
    assert_eq!(h.json(), json!({"status": "loading"}));
    assert_eq!(h.header("retry-after"), Some("1"));
    let r = post(addr, "/v1/chat/completions", &chat_body());
    let e = assert_error(&r, 503);
    assert!(e["message"].as_str().unwrap().contains("loading"), "{e}");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_error(&get(addr, "/v1/models"), 503);
    let r = post(
        addr,
        "/v1/messages",
        &json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "overloaded_error");
    assert_eq!(r.header("retry-after"), Some("1"));

    // The load finishes: the same server now answers.
    let engine =
        Engine::start(common::load_model(), common::engine_config()).expect("starting the engine");
    readiness.ready(engine.handle());
    let h = get(addr, "/health");
    assert_eq!(h.status, 200, "{}", h.text());
    assert_eq!(h.json()["status"], "ok");
    let r = post(addr, "/v1/chat/completions", &chat_body());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(get(addr, "/v1/models").status, 200);
}

#[test]
fn a_failed_load_is_reported() {
    let readiness = Readiness::new();
    let addr = common::start_loading(ServerConfig::default(), readiness.clone());
    readiness.failed("no such file: model.gguf");
    let h = get(addr, "/health");
    assert_eq!(h.status, 503);
    assert_eq!(
        h.json(),
        json!({"status": "failed", "error": "no such file: model.gguf"})
    );
    let r = post(addr, "/v1/completions", &json!({"prompt": "hi"}));
    let e = assert_error(&r, 503);
    assert!(
        e["message"].as_str().unwrap().contains("no such file"),
        "{e}"
    );
    assert_eq!(r.header("retry-after"), None);
}

#[test]
fn several_chat_choices_are_seeded_and_counted() {
    let addr = server();
    let many = post(
        addr,
        "/v1/chat/completions",
        &story(json!({"n": 3, "logprobs": true})),
    );
    assert_eq!(many.status, 200, "{}", many.text());
    let many = many.json();
    let choices = many["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut tokens = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{many}");
        assert!(c["finish_reason"].is_string(), "{many}");
        tokens += c["logprobs"]["content"].as_array().unwrap().len() as u64;
    }
    let one = post(addr, "/v1/chat/completions", &story(json!({}))).json();
    assert_eq!(
        one["choices"][0]["message"]["content"],
        choices[0]["message"]["content"]
    );
    // Choice i is seeded with seed + i.
    let second = post(addr, "/v1/chat/completions", &story(json!({"seed": 12}))).json();
    assert_eq!(
        second["choices"][0]["message"]["content"],
        choices[1]["message"]["content"]
    );
    let u = &many["usage"];
    assert_eq!(u["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(u["completion_tokens"].as_u64(), Some(tokens), "{u}");
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(tokens + u["prompt_tokens"].as_u64().unwrap())
    );

    for bad in [0, 9] {
        let r = post(addr, "/v1/chat/completions", &story(json!({"n": bad})));
        assert_eq!(assert_error(&r, 400)["param"], "n");
    }
    let r = post(addr, "/v1/completions", &json!({"prompt": "hi", "n": 20}));
    assert_eq!(assert_error(&r, 400)["param"], "n");
}

#[test]
fn several_streamed_choices_interleave_by_index() {
    let addr = server();
    let body = |stream: bool| {
        json!({"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0,
               "seed": 5, "n": 2, "stream": stream,
               "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }})
    };
    let whole = post(addr, "/v1/completions", &body(false)).json();
    assert_eq!(whole["choices"].as_array().unwrap().len(), 2, "{whole}");
    let r = post(addr, "/v1/completions", &body(true));
    assert_eq!(r.status, 200, "{}", r.text());
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut texts = [String::new(), String::new()];
    let mut finished = [0, 0];
    let mut usage = Vec::new();
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        if !v["usage"].is_null() {
            usage.push(v["usage"].clone());
        }
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            texts[i].push_str(c["text"].as_str().unwrap());
            if c["finish_reason"].is_string() {
                finished[i] += 1;
            }
        }
    }
    assert_eq!(finished, [1, 1], "{data:?}");
    for i in 0..2 {
        assert_eq!(texts[i], whole["choices"][i]["text"], "choice {i}");
    }
    assert_eq!(
        usage,
        vec![whole["usage"].clone()],
        "one usage chunk, summed"
    );
}

/// A server whose engine runs one request at a time, so a second waits in
/// the queue while the first generates; streams ping every 20 ms.
fn one_at_a_time() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let config = ServerConfig {
            sse_keepalive: Duration::from_millis(20),
            ..ServerConfig::default()
        };
        let engine = EngineConfig {
            max_num_seqs: 1,
            ..common::engine_config()
        };
        common::start(config, engine)
    })
}

/// Runs `f` while a 120-token request occupies the engine's one slot.
fn while_busy<T>(addr: SocketAddr, f: impl FnOnce() -> T) -> T {
    let blocker = std::thread::spawn(move || {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 120,
                          "ignore_eos": true, "temperature": 0});
        post(addr, "/v1/completions", &body)
    });
    // Wait (generously) until the blocker runs.
    for _ in 0..400 {
        if get(addr, "/stats").json()["scheduler"]["num_running"] == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let out = f();
    assert_eq!(blocker.join().unwrap().status, 200);
    out
}

#[test]
fn queued_streams_send_keepalives() {
    let addr = one_at_a_time();
    let r = while_busy(addr, || {
        post(
            addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "temperature": 0, "stream": true}),
        )
    });
    let text = r.text();
    let first_data = text.find("data: ").unwrap();
    let first_ping = text.find(": ping\n\n").expect("a keep-alive comment");
    // The role chunk goes first; pings follow while the request waits.
    assert!(first_data < first_ping, "{text}");
    assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));
    for d in &r.sse_data()[..r.sse_data().len() - 1] {
        serde_json::from_str::<Value>(d).unwrap_or_else(|e| panic!("{e}: {d}"));
    }

    let r = while_busy(addr, || {
        post(
            addr,
            "/v1/messages",
            &json!({"max_tokens": 3, "stream": true,
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
    });
    let text = r.text();
    let pings = text
        .matches("event: ping\ndata: {\"type\":\"ping\"}\n\n")
        .count();
    // One after message_start, then keep-alives.
    assert!(pings >= 2, "{text}");
    assert!(!text.lines().any(|l| l == ": ping"), "{text}");
    assert!(text.contains("event: message_stop"), "{text}");
}

#[test]
fn latency_histograms_in_metrics_and_stats() {
    let addr = server();
    let r = post(
        addr,
        "/v1/chat/completions",
        &story(json!({"max_tokens": 4})),
    );
    assert_eq!(r.status, 200);
    let text = get(addr, "/metrics").text();
    for name in [
        "kiln_time_to_first_token_seconds",
        "kiln_inter_token_latency_seconds",
        "kiln_e2e_request_latency_seconds",
        "kiln_request_queue_time_seconds",
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} histogram")),
            "{name}:\n{text}"
        );
        let inf = format!("{name}_bucket{{model=\"{MODEL_NAME}\",le=\"+Inf\"}} ");
        let count = format!("{name}_count{{model=\"{MODEL_NAME}\"}} ");
        let value = |prefix: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{prefix} missing:\n{text}"))
        };
        assert!(value(&count) >= 1, "{name}");
        assert_eq!(value(&inf), value(&count), "{name}");
        assert!(text.contains(&format!("{name}_sum{{model=\"{MODEL_NAME}\"}} ")));
    }
    assert!(text.contains("kiln_prefix_cache_hit_rate{"), "{text}");

    let stats = get(addr, "/stats").json();
    // The weight matrices as stored: SmolLM2's Q4_1 blocks at their size.
    let w = &stats["weights"];
    let by = w["by_storage"].as_object().unwrap();
    assert!(by["q4_1"].as_u64() > Some(30_000_000), "{w}");
    assert_eq!(
        by.values().map(|v| v.as_u64().unwrap()).sum::<u64>(),
        w["bytes"].as_u64().unwrap(),
        "{w}"
    );
    let l = &stats["latency"];
    for name in [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ] {
        let h = &l[name];
        assert!(h["count"].as_u64() >= Some(1), "{name}: {l}");
        let (mean, p50, p90, p99) = (
            h["mean"].as_f64().unwrap(),
            h["p50"].as_f64().unwrap(),
            h["p90"].as_f64().unwrap(),
            h["p99"].as_f64().unwrap(),
        );
        assert!(mean >= 0.0 && p50 <= p90 && p90 <= p99, "{name}: {h}");
    }
    let ttft = l["time_to_first_token_seconds"]["p99"].as_f64().unwrap();
    let e2e = l["e2e_request_latency_seconds"]["mean"].as_f64().unwrap();
    assert!(ttft > 0.0 && e2e > 0.0, "{l}");
}
