//! The request guard and the key check: only loopback `Host` names on a
//! loopback server (unless allowed), 415 for bodies that are not JSON,
//! JSON bodies for 404/405/414/431 in each API's shape, and API keys with
//! the `Bearer` scheme in any case.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use common::{assert_error, parse_response, HttpResponse};
use kiln_server::ServerConfig;
use serde_json::json;

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| common::start(ServerConfig::default(), common::engine_config()))
}

/// Sends `head` (request line and headers, without the blank line) and
/// `body` as they are.
fn raw(addr: SocketAddr, head: &str, body: &str) -> HttpResponse {
    let mut s = TcpStream::connect(addr).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let text = format!(
        "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(text.as_bytes()).expect("writing");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("reading");
    parse_response(&out)
}

fn get_with_host(addr: SocketAddr, path: &str, host: &str) -> HttpResponse {
    raw(addr, &format!("GET {path} HTTP/1.1\r\nHost: {host}"), "")
}

fn chat() -> String {
    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0})
        .to_string()
}

fn anthropic() -> String {
    json!({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).to_string()
}

fn assert_anthropic_error(r: &HttpResponse, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
}

#[test]
fn only_loopback_host_names_reach_a_loopback_server() {
    let addr = server();
    let port = addr.port();
    for host in [
        format!("localhost:{port}"),
        "localhost".into(),
        format!("127.0.0.1:{port}"),
        "[::1]:8080".into(),
        "LOCALHOST".into(),
    ] {
        let r = get_with_host(addr, "/health", &host);
        assert_eq!(r.status, 200, "{host}: {}", r.text());
    }
    for host in [
        "evil.example",
        "evil.example:8080",
        "localhost.evil.example",
        "10.0.0.1",
    ] {
        let r = get_with_host(addr, "/v1/models", host);
        let e = assert_error(&r, 403);
        assert_eq!(e["code"], "host_not_allowed", "{e}");
        assert!(
            e["message"].as_str().unwrap().contains("--allowed-hosts"),
            "{e}"
        );
        let r = raw(
            addr,
            &format!(
                "POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            ),
            &anthropic(),
        );
        assert_anthropic_error(&r, 403, "permission_error");
    }
}

#[test]
fn allowed_hosts_widen_the_list() {
    let config = ServerConfig {
        allowed_hosts: vec!["kiln.lan".into()],
        ..ServerConfig::default()
    };
    let addr = common::start_loading(config, kiln_server::Readiness::new());
    // The model is "loading": 503 means the host was let through.
    assert_eq!(get_with_host(addr, "/health", "kiln.lan:8080").status, 503);
    assert_eq!(get_with_host(addr, "/health", "localhost").status, 503);
    assert_eq!(get_with_host(addr, "/health", "other.lan").status, 403);
    let config = ServerConfig {
        allowed_hosts: vec!["*".into()],
        ..ServerConfig::default()
    };
    let addr = common::start_loading(config, kiln_server::Readiness::new());
    assert_eq!(
        get_with_host(addr, "/health", "anything.example").status,
        503
    );
}

#[test]
fn posts_that_are_not_json_are_415_in_each_shape() {
    let addr = server();
    let host = format!("Host: {addr}");
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ] {
        let head = format!("POST /v1/chat/completions HTTP/1.1\r\n{host}\r\nContent-Type: {ct}");
        let e = assert_error(&raw(addr, &head, &chat()), 415);
        assert_eq!(e["code"], "unsupported_media_type", "{e}");
        let head = format!("POST /v1/messages HTTP/1.1\r\n{host}\r\nContent-Type: {ct}");
        assert_anthropic_error(
            &raw(addr, &head, &anthropic()),
            415,
            "invalid_request_error",
        );
    }
    // No Content-Type at all, as a browser sends for some bodies.
    let head = format!("POST /v1/completions HTTP/1.1\r\n{host}");
    assert_error(
        &raw(addr, &head, r#"{"prompt": "hi", "max_tokens": 1}"#),
        415,
    );
    // JSON with parameters is JSON.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\n{host}\r\nContent-Type: Application/JSON; charset=utf-8"
    );
    let r = raw(addr, &head, &chat());
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn not_found_and_method_not_allowed_under_messages_are_anthropic_shaped() {
    let addr = server();
    let host = format!("Host: {addr}");
    let r = raw(addr, &format!("GET /v1/messages HTTP/1.1\r\n{host}"), "");
    assert_anthropic_error(&r, 405, "invalid_request_error");
    let r = raw(
        addr,
        &format!("GET /v1/messages/nope HTTP/1.1\r\n{host}"),
        "",
    );
    assert_anthropic_error(&r, 404, "not_found_error");
    // Elsewhere they stay OpenAI's.
    assert_error(
        &raw(addr, &format!("GET /v1/nope HTTP/1.1\r\n{host}"), ""),
        404,
    );
    assert_error(
        &raw(
            addr,
            &format!("GET /v1/chat/completions HTTP/1.1\r\n{host}"),
            "",
        ),
        405,
    );
}

#[test]
fn long_targets_and_large_headers_get_json_bodies() {
    let addr = server();
    let host = format!("Host: {addr}");
    let long = "a".repeat(9 << 10);
    let r = raw(
        addr,
        &format!("GET /health?q={long} HTTP/1.1\r\n{host}"),
        "",
    );
    let e = assert_error(&r, 414);
    assert_eq!(e["code"], "uri_too_long", "{e}");
    let r = raw(
        addr,
        &format!("GET /v1/messages?q={long} HTTP/1.1\r\n{host}"),
        "",
    );
    assert_anthropic_error(&r, 414, "request_too_large");
    let big = "b".repeat(70 << 10);
    let r = raw(
        addr,
        &format!("GET /health HTTP/1.1\r\n{host}\r\nX-Big: {big}"),
        "",
    );
    let e = assert_error(&r, 431);
    assert_eq!(e["code"], "headers_too_large", "{e}");
    let many: String = (0..150).map(|i| format!("\r\nX-H{i}: v")).collect();
    let r = raw(addr, &format!("GET /health HTTP/1.1\r\n{host}{many}"), "");
    assert_error(&r, 431);
}

#[test]
fn api_keys_take_the_bearer_scheme_in_any_case() {
    let config = ServerConfig {
        api_key: Some("s3cret-key".into()),
        ..ServerConfig::default()
    };
    let addr = common::start(config, common::engine_config());
    let host = format!("Host: {addr}");
    for auth in [
        "Bearer s3cret-key",
        "bearer s3cret-key",
        "BEARER s3cret-key",
    ] {
        let r = raw(
            addr,
            &format!("GET /v1/models HTTP/1.1\r\n{host}\r\nAuthorization: {auth}"),
            "",
        );
        assert_eq!(r.status, 200, "{auth}: {}", r.text());
    }
    for auth in [
        "Bearer s3cret",
        "Bearer s3cret-key2",
        "Basic s3cret-key",
        "s3cret-key",
    ] {
        let r = raw(
            addr,
            &format!("GET /v1/models HTTP/1.1\r\n{host}\r\nAuthorization: {auth}"),
            "",
        );
        assert_error(&r, 401);
    }
}

#[test]
fn an_empty_api_key_is_refused_at_start() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let e = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding");
        let config = ServerConfig {
            api_key: Some("  ".into()),
            ..ServerConfig::default()
        };
        kiln_server::serve_loading(
            listener,
            config,
            kiln_server::Readiness::new(),
            std::future::ready(()),
        )
        .await
    });
    let e = e.expect_err("an empty key must be refused").to_string();
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn oversized_requests_are_400s_naming_the_field() {
    let addr = server();
    // 800k stop strings fit the body limit: the bound refuses them.
    let stops: Vec<&str> = vec!["a"; 800_000];
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "stop": stops});
    let bytes = body.to_string();
    assert!(bytes.len() < 8 << 20);
    let r = common::request(addr, "POST", "/v1/chat/completions", &[], bytes.as_bytes());
    assert_eq!(assert_error(&r, 400)["param"], "stop");
    let stops: Vec<String> = (0..2000).map(|i| format!("s{i}")).collect();
    let body = json!({"prompt": "hi", "max_tokens": 1, "stop": stops});
    let r = common::post(addr, "/v1/completions", &body);
    assert_eq!(assert_error(&r, 400)["param"], "stop");
    let body = json!({"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                      "stop_sequences": stops});
    let r = common::post(addr, "/v1/messages", &body);
    assert_anthropic_error(&r, 400, "invalid_request_error");
    let bias: serde_json::Map<String, serde_json::Value> =
        (0..5000).map(|i| (i.to_string(), json!(1))).collect();
    let body = json!({"prompt": "hi", "max_tokens": 1, "logit_bias": bias});
    let r = common::post(addr, "/v1/completions", &body);
    assert_eq!(assert_error(&r, 400)["param"], "logit_bias");
}

#[test]
fn hypers_own_refusals_get_json_bodies() {
    let addr = server();
    let host = format!("Host: {addr}");
    // Past hyper's own limits: a 70 KiB target, 500 headers.
    let long = "a".repeat(70 << 10);
    let r = raw(
        addr,
        &format!("GET /health?q={long} HTTP/1.1\r\n{host}"),
        "",
    );
    assert_eq!(assert_error(&r, 414)["code"], "uri_too_long");
    let many: String = (0..500).map(|i| format!("\r\nX-H{i}: v")).collect();
    let r = raw(addr, &format!("GET /health HTTP/1.1\r\n{host}{many}"), "");
    assert_eq!(assert_error(&r, 431)["code"], "headers_too_large");
}
