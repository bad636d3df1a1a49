//! `kiln serve`'s logs on SmolLM2: one line per request with its token
//! counts and timings, as text and as JSON; what a shutdown waits for; and
//! a second interrupt that stops a busy server at once (exit status 0).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Long enough for a debug build to load the model and answer.
const WAIT: Duration = Duration::from_secs(300);

fn smollm2() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    p
}

/// A `kiln serve` on a free loopback port, its stderr read line by line.
struct Server {
    child: Child,
    port: u16,
    lines: mpsc::Receiver<String>,
    /// Every stderr line read so far.
    seen: Vec<String>,
}

impl Server {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["--threads", "2", "serve", "--port", "0", "--device", "cpu"])
            .args(["--served-model-name", "smol"])
            .args(args)
            .arg(smollm2())
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut server = Server {
            child,
            port: 0,
            lines,
            seen: Vec::new(),
        };
        let listening =
            server.wait_line("the listening line", |l| l.contains("on http://127.0.0.1:"));
        let rest = listening.split("on http://127.0.0.1:").nth(1).unwrap();
        server.port = rest
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap();
        server.wait_line("the model to load", |l| l.contains("ready"));
        server
    }

    /// The next stderr line `want` accepts (earlier ones are kept in `seen`).
    fn wait_line(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if want(&line) {
                        return line;
                    }
                }
                Err(_) => panic!("no line with {what}; stderr:\n{}", self.seen.join("\n")),
            }
        }
    }

    fn interrupt(&self) {
        let status = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to end; its exit status.
    fn wait_for_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the server did not stop; stderr:\n{}",
                self.seen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends a JSON POST and returns the connection, the request written.
fn post(port: u16, path: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// A whole non-streamed answer's JSON body.
fn chat(port: u16) -> Value {
    let mut s = post(
        port,
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }),
    );
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let body = response.split("\r\n\r\n").nth(1).unwrap();
    serde_json::from_str(body).unwrap()
}

#[test]
fn each_request_gets_a_json_log_line_with_its_tokens_and_timings() {
    let mut server = Server::start(&["--log-format", "json"]);
    let answer = chat(server.port);
    let usage = &answer["usage"];
    let line = server.wait_line("the request's log line", |l| {
        l.contains("kiln::access") && l.contains("/v1/chat/completions")
    });
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(v["level"], "INFO", "{line}");
    assert!(
        v["timestamp"].as_str().is_some_and(|t| t.starts_with("20")),
        "{line}"
    );
    let f = &v["fields"];
    assert_eq!(f["message"], "request", "{line}");
    assert_eq!(f["method"], "POST", "{line}");
    assert_eq!(f["model"], "smol", "{line}");
    assert_eq!(f["status"], 200, "{line}");
    assert_eq!(f["prompt_tokens"], usage["prompt_tokens"], "{line}");
    assert_eq!(f["generated_tokens"], usage["completion_tokens"], "{line}");
    assert!(f["cached_tokens"].as_u64().is_some(), "{line}");
    assert!(f["ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{line}");
    assert!(f["tok_s"].as_f64().is_some_and(|t| t > 0.0), "{line}");
    assert!(f["finish"].is_string(), "{line}");
    // A route that generates nothing has no token fields.
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    write!(
        s,
        "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let _ = s.read_to_end(&mut Vec::new());
    let line = server.wait_line("the models log line", |l| l.contains("/v1/models"));
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["fields"]["status"], 200, "{line}");
    assert!(v["fields"].get("generated_tokens").is_none(), "{line}");
    server.interrupt();
    server.wait_line("the shutdown line", |l| l.contains("no requests in flight"));
    assert!(server.wait_for_exit().success());
}

#[test]
fn the_text_log_line_has_a_timestamp_and_the_same_fields() {
    let mut server = Server::start(&[]);
    let answer = chat(server.port);
    let usage = &answer["usage"];
    let line = server.wait_line("the request's log line", |l| {
        l.contains("kiln::access") && l.contains("/v1/chat/completions")
    });
    // `2026-12-01T15:46:36.123456Z  INFO kiln::access: request method=POST ...`
    let timestamp = line.split_whitespace().next().unwrap();
    assert!(
        timestamp.len() > 20 && timestamp.as_bytes()[10] == b'T' && timestamp.ends_with('Z'),
        "{line}"
    );
    for field in [
        "INFO".to_string(),
        "method=POST".into(),
        "route=/v1/chat/completions".into(),
        "model=smol".into(),
        "status=200".into(),
        format!("prompt_tokens={}", usage["prompt_tokens"]),
        format!("generated_tokens={}", usage["completion_tokens"]),
        "cached_tokens=".into(),
        "ttft_ms=".into(),
        "tok_s=".into(),
    ] {
        assert!(line.contains(&field), "{field} missing: {line}");
    }
}

#[test]
fn a_second_interrupt_stops_a_busy_server_at_once() {
    // A grace far longer than the test may take: only the second interrupt
    // can end it in time.
    let mut server = Server::start(&["--shutdown-grace-secs", "3600"]);
    let mut stream = post(
        server.port,
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 4000,
            "ignore_eos": true,
            "stream": true,
        }),
    );
    // Wait for the first streamed token, then read on in the background.
    let mut head = [0u8; 512];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data:") {
        let n = stream.read(&mut head).unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&head[..n]);
    }
    let reader = std::thread::spawn(move || {
        let _ = stream.read_to_end(&mut Vec::new());
    });
    server.interrupt();
    let waiting = server.wait_line("what the shutdown waits for", |l| {
        l.contains("shutting down")
    });
    assert!(
        waiting.contains("1 request(s) in flight") && waiting.contains("3600s"),
        "{waiting}"
    );
    server.interrupt();
    server.wait_line("the second interrupt's line", |l| {
        l.contains("interrupted again")
    });
    assert!(
        server.wait_for_exit().success(),
        "{}",
        server.seen.join("\n")
    );
    // The client's connection ends with the process.
    reader.join().unwrap();
}
