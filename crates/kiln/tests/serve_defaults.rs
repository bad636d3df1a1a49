//! `kiln serve` with default flags on a real 1.5B model on the CPU: the
//! context is what memory allows (here the trained 32,768 tokens), the KV
//! pool is sized from free RAM, and a request without `max_tokens` or
//! sampling fields is answered.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn qwen_1_5b() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
}

/// One HTTP/1.1 request on loopback; the response body.
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |x| x.1).to_string();
    (status, body)
}

#[test]
fn a_1_5b_model_serves_on_the_cpu_with_default_flags() {
    let model = qwen_1_5b();
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models.sh models qwen2.5-coder-1.5b",
        model.display()
    );
    let home = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve"])
        .arg(&model)
        .args(["--device", "cpu", "--port", "0"])
        .env("KILN_HOME", home.path())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut addr = None;
    let mut context_line = None;
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.split_once(" on http://") {
            addr = rest.1.split_whitespace().next().map(str::to_string);
        }
        // The context and defaults line comes when the load returns; the
        // server answers for the model once the `ready` line is out.
        if line.contains("kiln serve: context ") {
            context_line = Some(line.clone());
        }
        let done = line.ends_with("; ready");
        seen.push(line);
        if done || seen.len() > 50 {
            break;
        }
    }
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let (Some(addr), Some(context_line)) = (addr, context_line) else {
        let _ = child.kill();
        panic!("kiln serve did not get ready: {seen:#?}");
    };
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
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert!(!text.trim().is_empty(), "{v}");
    eprintln!(
        "answered in {:.1}s: {text:?}",
        start.elapsed().as_secs_f64()
    );
}
