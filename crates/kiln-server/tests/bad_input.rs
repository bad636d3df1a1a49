//! Each class of bad input gets its status and the OpenAI error body.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::{assert_error, get, post, request};
use kiln_server::ServerConfig;
use serde_json::json;

const KEY: &str = "test-key";
const AUTH: (&str, &str) = ("Authorization", "Bearer test-key");

/// A server with an API key and a 4 KiB body limit.
fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let config = ServerConfig {
            api_key: Some(KEY.into()),
            max_body_bytes: 4096,
            ..ServerConfig::default()
        };
        common::start(config, common::engine_config())
    })
}

fn chat(body: &str) -> common::HttpResponse {
    request(
        server(),
        "POST",
        "/v1/chat/completions",
        &[AUTH],
        body.as_bytes(),
    )
}

#[test]
fn api_key_is_required() {
    let addr = server();
    let e = assert_error(&get(addr, "/v1/models"), 401);
    assert_eq!(e["code"], "invalid_api_key");
    let wrong = request(
        addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer nope")],
        b"",
    );
    assert_error(&wrong, 401);
    assert_error(&post(addr, "/v1/chat/completions", &json!({})), 401);
    assert_eq!(request(addr, "GET", "/v1/models", &[AUTH], b"").status, 200);
    assert_eq!(get(addr, "/health").status, 200);
}

#[test]
fn a_body_over_the_limit_is_413() {
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(8192)}]});
    let r = chat(&big.to_string());
    let e = assert_error(&r, 413);
    assert!(e["message"].as_str().unwrap().contains("4096"), "{e}");
}

#[test]
fn malformed_requests_are_400() {
    let e = assert_error(&chat("{\"messages\": ["), 400);
    assert_eq!(e["code"], "invalid_json");

    let e = assert_error(
        &chat(r#"{"messages": [{"role": "robot", "content": "hi"}]}"#),
        400,
    );
    assert_eq!(e["param"], "messages[0].role");

    let e = assert_error(&chat(r#"{"messages": "hi"}"#), 400);
    assert_eq!(e["param"], "messages");

    let e = assert_error(&chat(r#"{"messages": []}"#), 400);
    assert_eq!(e["param"], "messages");

    let e = assert_error(
        &chat(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}"#),
        400,
    );
    assert_eq!(e["param"], "max_tokens");

    let e = assert_error(
        &chat(r#"{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}"#),
        400,
    );
    assert_eq!(e["param"], "temperature");

    let e = assert_error(
        &chat(r#"{"messages": [{"role": "user", "content": "hi"}], "top_p": "high"}"#),
        400,
    );
    assert_eq!(e["param"], "top_p");

    let e = assert_error(
        &chat(
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
        ),
        400,
    );
    assert_eq!(e["param"], "messages[0].content[0].type");
}

#[test]
fn what_kiln_cannot_honour_is_named_and_unknown_fields_are_ignored() {
    for (param, value) in [
        ("modalities", json!(["audio"])),
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("best_of", json!(2)),
        ("functions", json!([])),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        body[param] = value;
        let e = assert_error(&chat(&body.to_string()), 400);
        assert_eq!(e["param"], param, "{e}");
        assert_eq!(e["code"], "unsupported_parameter", "{e}");
    }
    // Unknown fields (top level and nested) are ignored and listed (a
    // `prediction` is honoured: verified as draft tokens).
    let body = json!({
        "messages": [{"role": "user", "content": "hi", "frob": 2}],
        "max_tokens": 1,
        "frobnicate": 1,
        "prediction": {"type": "content", "content": "x"},
        "cache_prompt": true,
        "modalities": ["text"],
    });
    let r = chat(&body.to_string());
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.header("x-kiln-ignored-params"),
        Some("frobnicate, messages[0].frob")
    );
}
