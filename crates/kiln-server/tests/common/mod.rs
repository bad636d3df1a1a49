//! A test server on 127.0.0.1 (port 0) over the real SmolLM2, and a small
//! blocking HTTP/1.1 client written against a `TcpStream`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kiln_engine::{Engine, EngineConfig, LoadedModel};
use kiln_server::{Readiness, ServerConfig};
use kiln_tensor::cpu::CpuBackend;
use serde_json::Value;

pub const MODEL_NAME: &str = "smollm2";

/// Engine sizes for tests: 256 blocks of 16 tokens.
pub fn engine_config() -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_blocks: 256,
        max_num_seqs: 16,
        max_num_batched_tokens: 512,
        max_waiting: 64,
        context_length: None,
    }
}

/// The SmolLM2 test model, loaded on the CPU.
pub fn load_model() -> LoadedModel {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        path.display()
    );
    LoadedModel::load(&path, Arc::new(CpuBackend::new())).expect("loading SmolLM2")
}

/// Starts a server on its own thread and runtime; it runs until the test
/// process exits.
pub fn start(config: ServerConfig, engine_config: EngineConfig) -> SocketAddr {
    let engine = Engine::start(load_model(), engine_config).expect("starting the engine");
    let readiness = Readiness::new();
    readiness.ready(engine.handle());
    // The engine lives as long as the test process.
    std::mem::forget(engine);
    start_loading(config, readiness)
}

/// Starts a server whose model is ready when `readiness` says so.
pub fn start_loading(config: ServerConfig, readiness: Readiness) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding 127.0.0.1:0");
    let addr = listener.local_addr().expect("local address");
    listener
        .set_nonblocking(true)
        .expect("non-blocking listener");
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            let config = ServerConfig {
                model_name: MODEL_NAME.into(),
                ..config
            };
            kiln_server::serve_loading(listener, config, readiness, std::future::pending())
                .await
                .expect("server");
        });
    });
    addr
}

/// One response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `data:` payloads of an SSE body, in order (events named by an
    /// `event:` line too).
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(str::to_string)
            .collect()
    }
}

/// Writes a request with `Connection: close`.
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connecting to the test server");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())
        .expect("writing the request head");
    s.write_all(body).expect("writing the request body");
    s
}

/// Sends a request and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    let mut s = send(addr, method, path, headers, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("reading the response");
    parse_response(&raw)
}

pub fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    request(addr, "GET", path, &[], b"")
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

/// Status line, headers and body (de-chunked).
pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let split = find(raw, b"\r\n\r\n").expect("a complete response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = find(data, b"\r\n") {
        let size_text = String::from_utf8_lossy(&data[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .expect("a chunk size");
        data = &data[eol + 2..];
        if size == 0 || data.len() < size {
            break;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[(size + 2).min(data.len())..];
    }
    out
}

/// Reads from `s` into `buf` until `needle` appears; returns false at EOF.
pub fn read_until(s: &mut TcpStream, buf: &mut Vec<u8>, needle: &[u8]) -> bool {
    let mut chunk = [0u8; 4096];
    while find(buf, needle).is_none() {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

/// Polls `/stats` (at most ~20 s) until the engine holds no request and no
/// block; returns the last scheduler stats.
pub fn wait_idle(addr: SocketAddr) -> Value {
    let mut last = Value::Null;
    for _ in 0..400 {
        last = get(addr, "/stats").json()["scheduler"].clone();
        if last["num_running"] == 0 && last["num_waiting"] == 0 && last["num_blocks_used"] == 0 {
            return last;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    last
}

/// Asserts the OpenAI error shape and returns the error object.
pub fn assert_error(r: &HttpResponse, status: u16) -> Value {
    assert_eq!(r.status, status, "body: {}", r.text());
    let v = r.json();
    let e = v["error"].clone();
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    e
}
