//! `kiln serve` runs each model's engine in its own process: killing one
//! (SIGKILL) or crashing it (SIGABRT, as an abort or a panic that aborts
//! would) mid-stream ends that engine's requests in flight with a clear
//! error event, leaves the other model's stream running, and the next
//! request to the crashed model succeeds once its engine has restarted; a
//! hung engine (SIGSTOP) is found by the watchdog and treated the same; no
//! request is left hanging.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{http as whole, request, Server};
use serde_json::{json, Value};

fn serve(home: &std::path::Path) -> Server {
    let model = common::model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let args = [
        format!("--model=a={}", model.display()),
        format!("--model=b={}", model.display()),
        "--device=cpu".into(),
        "--throughput-log-secs=0".into(),
        // Short, for the hung-engine case below.
        "--engine-watchdog-secs=3".into(),
    ];
    Server::start(&args, home)
}

/// Reads until `text` has arrived (true) or the stream ended (false).
fn read_until(s: &mut TcpStream, got: &mut String, text: &str) -> bool {
    let mut buf = [0u8; 4096];
    while !got.contains(text) {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got.push_str(&String::from_utf8_lossy(&buf[..n])),
        }
    }
    true
}

fn stream(addr: &str, model: &str, max_tokens: usize) -> TcpStream {
    let body = json!({
        "model": model, "stream": true, "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0,
        "messages": [{"role": "user", "content": "Count to one thousand."}],
    });
    request(addr, "POST", "/v1/chat/completions", &body.to_string())
}

/// The engine processes the server started, by served name.
fn engines(server: u32) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The parent pid is the second field after the parenthesised name.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().nth(1));
        if ppid != Some(&server.to_string()) {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if let Some(i) = args.iter().position(|a| a == "--name") {
            if args.iter().any(|a| a == "engine-worker") {
                out.push((args[i + 1].clone(), pid));
            }
        }
    }
    out
}

fn engine_of(server: &Server, name: &str) -> u32 {
    engines(server.child.id())
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| {
            panic!(
                "no engine process for {name}: {:?}",
                engines(server.child.id())
            )
        })
        .1
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A stream that must end with an error event naming the engine's end.
fn assert_failed(s: &mut TcpStream, got: &mut String, how: &str) {
    let started = Instant::now();
    assert!(
        read_until(s, got, "\"error\""),
        "the stream ended without an error event: {got}"
    );
    let mut rest = String::new();
    let _ = s.read_to_string(&mut rest);
    got.push_str(&rest);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the stream hung"
    );
    let line = got.lines().find(|l| l.contains("\"error\"")).unwrap();
    let event: Value = serde_json::from_str(line.trim_start_matches("data: ")).unwrap();
    let message = event["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("restarting") && message.contains(how),
        "{message}"
    );
    assert_eq!(event["error"]["code"], "service_unavailable", "{event}");
}

/// Retries until the model answers again (each refusal meanwhile a 503).
fn answers_again(addr: &str, model: &str) {
    let body = json!({"model": model, "prompt": "Hello", "max_tokens": 3}).to_string();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (status, text) = whole(addr, "POST", "/v1/completions", &body);
        if status == 200 {
            return;
        }
        assert_eq!(status, 503, "{text}");
        assert!(text.contains("restart"), "{text}");
        assert!(Instant::now() < deadline, "{model} did not come back");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_crashed_engine_fails_only_its_own_requests_and_restarts() {
    let home = tempfile::tempdir().unwrap();
    let server = serve(home.path());
    let addr = server.addr.as_str();
    answers_again(addr, "b");
    assert_eq!(
        engines(server.child.id()).len(),
        2,
        "one engine process a model"
    );

    // Both models streaming; b's engine is killed.
    let (mut a, mut b) = (stream(addr, "a", 200), stream(addr, "b", 2000));
    let (mut got_a, mut got_b) = (String::new(), String::new());
    assert!(read_until(&mut a, &mut got_a, "\"content\""));
    assert!(read_until(&mut b, &mut got_b, "\"content\""));
    let killed = engine_of(&server, "b");
    signal(killed, "-KILL");
    assert_failed(&mut b, &mut got_b, "signal 9");
    // a's stream runs on to its end.
    assert!(read_until(&mut a, &mut got_a, "data: [DONE]"), "{got_a}");
    assert!(got_a.contains("\"finish_reason\":\"length\""), "{got_a}");
    assert!(!got_a.contains("\"error\""), "{got_a}");
    answers_again(addr, "b");
    assert_ne!(engine_of(&server, "b"), killed, "a fresh engine process");

    // An engine that aborts (as a panic that aborts, or a failed assertion
    // in native code, would): the same.
    let mut a = stream(addr, "a", 2000);
    let mut got = String::new();
    assert!(read_until(&mut a, &mut got, "\"content\""));
    signal(engine_of(&server, "a"), "-ABRT");
    assert_failed(&mut a, &mut got, "signal 6");
    answers_again(addr, "a");
    let (status, health) = whole(addr, "GET", "/health", "");
    assert_eq!(status, 200, "{health}");
    // A hung engine (stopped: it reads nothing and says nothing) is killed
    // by the watchdog, and its stream ends the same way.
    let mut b = stream(addr, "b", 2000);
    let mut got = String::new();
    assert!(read_until(&mut b, &mut got, "\"content\""));
    let stopped = engine_of(&server, "b");
    signal(stopped, "-STOP");
    assert_failed(&mut b, &mut got, "answered nothing");
    answers_again(addr, "b");
    assert_ne!(engine_of(&server, "b"), stopped);

    // `/stats` is read in the engine's process: its device and weights.
    let (_, stats) = whole(addr, "GET", "/stats?model=b", "");
    let stats: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["model"], "b", "{stats}");
    assert_eq!(stats["device"], "cpu", "{stats}");
    assert!(
        stats["weights"]["bytes"].as_u64().unwrap() > 50_000_000,
        "{stats}"
    );
}
