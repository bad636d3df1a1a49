//! `kiln serve` with default flags on a real 1.5B model on the CPU: the
//! context is what memory allows (here the trained 32,768 tokens), the KV
//! pool is sized from free RAM, and a request without `max_tokens` or
//! sampling fields is answered.

mod common;

use std::time::Instant;

use common::{http, Server};
use serde_json::Value;

#[test]
fn a_1_5b_model_serves_on_the_cpu_with_default_flags() {
    let model = common::model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let home = tempfile::tempdir().unwrap();
    let server = Server::start(
        &[model.as_os_str(), "--device".as_ref(), "cpu".as_ref()],
        home.path(),
    );
    let addr = server.addr.clone();
    // The context line comes when the plan is made, before the load.
    let context_line = server
        .startup
        .iter()
        .find(|l| l.contains("kiln serve: context "))
        .cloned()
        .unwrap_or_else(|| panic!("no context line: {:#?}", server.startup));
    assert!(
        context_line.contains("context 32768 tokens (the model's trained length)"),
        "{context_line}"
    );
    let (status, models) = http(&addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{models}");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 32768, "{models}");
    let start = Instant::now();
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": "Write the word hello."}], "seed": 1}"#,
    );
    drop(server);
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert!(!text.trim().is_empty(), "{v}");
    eprintln!(
        "answered in {:.1}s: {text:?}",
        start.elapsed().as_secs_f64()
    );
}
