//! The Anthropic Messages API end to end on the real SmolLM2, through the
//! raw HTTP client: plain and streamed answers, stop reasons, token
//! counting, a tool round trip, and Anthropic-shaped errors.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::{request, HttpResponse, MODEL_NAME};
use kiln_server::ServerConfig;
use serde_json::{json, Value};

const KEY: &str = "anthropic-test-key";
const PARIS: &str = "The capital of France is Paris.";

/// A server with an API key, sent as `x-api-key`.
fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let config = ServerConfig {
            api_key: Some(KEY.into()),
            ..ServerConfig::default()
        };
        common::start(config, common::engine_config())
    })
}

fn post_raw(path: &str, body: &[u8], key: &str) -> HttpResponse {
    let headers = [("x-api-key", key), ("anthropic-version", "2023-06-01")];
    request(server(), "POST", path, &headers, body)
}

fn post(path: &str, body: &Value) -> HttpResponse {
    post_raw(path, body.to_string().as_bytes(), KEY)
}

fn france(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_NAME,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

/// The text of a response's text blocks.
fn text_of(v: &Value) -> String {
    v["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect()
}

/// `(event name, data)` for each event of an SSE body.
fn events(r: &HttpResponse) -> Vec<(String, Value)> {
    r.text()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "));
            let data = e.lines().find_map(|l| l.strip_prefix("data: "));
            let (Some(name), Some(data)) = (name, data) else {
                panic!("an event without a name or data: {e:?}");
            };
            let data: Value = serde_json::from_str(data).expect("event data is JSON");
            assert_eq!(data["type"], name, "{data}");
            (name.to_string(), data)
        })
        .collect()
}

/// Asserts Anthropic's error shape and returns the error object.
fn assert_anthropic_error(r: &HttpResponse, status: u16, kind: &str) -> Value {
    assert_eq!(r.status, status, "body: {}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    v["error"].clone()
}

#[test]
fn greedy_answer_with_usage() {
    let r = post("/v1/messages", &france(json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], MODEL_NAME);
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(text_of(&v), PARIS);
    assert_eq!(v["stop_reason"], "end_turn");
    assert!(v["stop_sequence"].is_null());
    let u = &v["usage"];
    assert!(u["input_tokens"].as_u64().is_some_and(|n| n > 5), "{u}");
    assert!(u["output_tokens"].as_u64().is_some_and(|n| n >= 7), "{u}");
    assert!(u["cache_read_input_tokens"].is_u64(), "{u}");
    assert_eq!(u["cache_creation_input_tokens"], 0);
}

#[test]
fn stream_is_well_formed_and_matches() {
    let r = post("/v1/messages", &france(json!({"stream": true})));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    let evs = events(&r);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[1], "ping");
    assert_eq!(names[2], "content_block_start");
    assert_eq!(names[names.len() - 3], "content_block_stop");
    assert_eq!(names[names.len() - 2], "message_delta");
    assert_eq!(names[names.len() - 1], "message_stop");
    assert!(names[3..names.len() - 3]
        .iter()
        .all(|n| *n == "content_block_delta"));
    let start = &evs[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert!(start["usage"]["input_tokens"]
        .as_u64()
        .is_some_and(|n| n > 5));
    assert_eq!(
        evs[2].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = evs
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap_or_default().to_string()
        })
        .collect();
    assert_eq!(text, PARIS);
    let delta = &evs[names.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert!(delta["usage"]["output_tokens"]
        .as_u64()
        .is_some_and(|n| n >= 7));
    assert!(!r.text().contains("[DONE]"));
}

#[test]
fn stop_sequence_and_max_tokens_are_stop_reasons() {
    let v = post(
        "/v1/messages",
        &france(json!({"stop_sequences": ["France"]})),
    )
    .json();
    assert_eq!(v["stop_reason"], "stop_sequence", "{v}");
    assert_eq!(v["stop_sequence"], "France");
    assert_eq!(text_of(&v), "The capital of ");
    let v = post("/v1/messages", &france(json!({"max_tokens": 3}))).json();
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    assert_eq!(v["usage"]["output_tokens"], 3);
}

#[test]
fn count_tokens_matches_the_usage() {
    let mut body = france(json!({}));
    let usage = post("/v1/messages", &body).json()["usage"].clone();
    body.as_object_mut().map(|o| o.remove("max_tokens"));
    let r = post("/v1/messages/count_tokens", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["input_tokens"], usage["input_tokens"]);
}

fn tool_conversation(is_error: bool) -> Value {
    json!({
        "model": MODEL_NAME,
        "max_tokens": 16,
        "temperature": 0,
        "system": [{"type": "text", "text": "You are a helpful assistant."}],
        "tools": [{
            "name": "get_weather",
            "description": "Current weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "unavailable"}], "is_error": is_error},
            ]},
        ],
    })
}

#[test]
fn tool_round_trip_with_an_error_result() {
    let r = post("/v1/messages", &tool_conversation(true));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(!v["content"].as_array().is_some_and(Vec::is_empty), "{v}");
    assert!(
        ["end_turn", "max_tokens", "tool_use"].contains(&v["stop_reason"].as_str().unwrap_or(""))
    );
    // The error marker is rendered into the prompt.
    let count = |is_error| {
        let r = post("/v1/messages/count_tokens", &tool_conversation(is_error));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["input_tokens"].as_u64().unwrap_or(0)
    };
    assert!(count(true) > count(false));
    assert_eq!(v["usage"]["input_tokens"].as_u64(), Some(count(true)));
}

#[test]
fn errors_have_anthropic_shape() {
    let r = post_raw("/v1/messages", b"{nope", KEY);
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let mut body = france(json!({}));
    body.as_object_mut().map(|o| o.remove("max_tokens"));
    let e = assert_anthropic_error(&post("/v1/messages", &body), 400, "invalid_request_error");
    assert!(e["message"]
        .as_str()
        .is_some_and(|m| m.contains("max_tokens")));
    let r = post("/v1/messages", &france(json!({"max_tokens": 0})));
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let r = post_raw(
        "/v1/messages",
        france(json!({})).to_string().as_bytes(),
        "wrong",
    );
    assert_anthropic_error(&r, 401, "authentication_error");
    let r = post(
        "/v1/messages",
        &france(json!({"tool_choice": {"type": "any"}})),
    );
    let e = assert_anthropic_error(&r, 400, "invalid_request_error");
    assert!(e["message"]
        .as_str()
        .is_some_and(|m| m.contains("at least one tool")));
    let r = post("/v1/messages", &france(json!({"model": "nope"})));
    assert_anthropic_error(&r, 404, "not_found_error");
    // Unknown fields are ignored and named in a header (`--strict-params`
    // refuses them; tested through the SDK suite).
    let r = post(
        "/v1/messages",
        &france(json!({"frobnicate": 1, "max_tokens": 2})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kiln-ignored-params"), Some("frobnicate"));
    // The OpenAI routes keep their shape, and also take `x-api-key`.
    let r = post("/v1/chat/completions", &json!({"messages": []}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "messages");
}
