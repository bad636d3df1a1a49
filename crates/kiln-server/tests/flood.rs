//! A flood of long requests against a small KV pool on the real SmolLM2:
//! every request is answered — completed, or refused at once in the API's
//! error format (429 with `Retry-After` when the queue is full, 400 naming
//! the limit when a request could never fit) — none hangs, the engine's
//! queue, running set and pool stay within their bounds throughout, and the
//! server is healthy and idle afterwards.

mod common;

use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{assert_error, get, parse_response, post, send, wait_idle, HttpResponse, MODEL_NAME};
use kiln_engine::EngineConfig;
use kiln_server::ServerConfig;
use serde_json::{json, Value};

/// 32 blocks of 16 tokens: one 400-token request fills most of the pool.
const ENGINE: EngineConfig = EngineConfig {
    block_size: 16,
    num_blocks: 32,
    max_num_seqs: 4,
    max_num_batched_tokens: 256,
    max_waiting: 4,
    context_length: None,
};

/// However slow the machine, nothing takes this long unless it hangs.
const DEADLINE: Duration = Duration::from_secs(900);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// About 390 prompt tokens: fits the pool alone, not two at once.
    Long,
    /// The same, streamed.
    LongStream,
    /// About 600 tokens: more blocks than the whole pool.
    OverPool,
    /// About 9000 tokens: beyond the model's 8192-token context.
    OverContext,
}

fn prompt(i: usize, sentences: usize) -> String {
    // A distinct lead per request, so no two share a cached prefix block.
    let mut p = format!("Request number {i} asks about this text. ");
    for s in 0..sentences {
        p.push_str(&format!(
            "Line {s}: the quick brown fox jumps over the lazy dog. "
        ));
    }
    p
}

fn body(i: usize, kind: Kind) -> Value {
    let sentences = match kind {
        Kind::Long | Kind::LongStream => 26,
        Kind::OverPool => 40,
        Kind::OverContext => 600,
    };
    json!({
        "model": MODEL_NAME,
        "prompt": prompt(i, sentences),
        "max_tokens": 16,
        "temperature": 0,
        "stream": kind == Kind::LongStream,
    })
}

/// One request with a read timeout past the deadline (the common client's
/// 120 s could end a request that is only waiting its turn).
fn completion(addr: SocketAddr, body: &Value) -> HttpResponse {
    let mut s = send(
        addr,
        "POST",
        "/v1/completions",
        &[],
        body.to_string().as_bytes(),
    );
    s.set_read_timeout(Some(DEADLINE)).expect("timeout");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("reading the response");
    parse_response(&raw)
}

#[derive(Default, Debug)]
struct Peaks {
    running: u64,
    waiting: u64,
    blocks: u64,
    samples: u64,
}

#[test]
fn a_flood_of_long_requests_is_served_or_refused_never_lost() {
    let addr = common::start(ServerConfig::default(), ENGINE);
    let total_blocks = get(addr, "/stats").json()["scheduler"]["num_blocks_total"].clone();
    assert_eq!(total_blocks, ENGINE.num_blocks as u64);
    let kinds: Vec<Kind> = (0..48)
        .map(|i| match i % 12 {
            0 => Kind::OverPool,
            6 => Kind::OverContext,
            3 | 9 => Kind::LongStream,
            _ => Kind::Long,
        })
        .collect();

    // The engine's counters, sampled while the flood runs.
    let peaks = Arc::new(Mutex::new(Peaks::default()));
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (peaks, done) = (peaks.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let s = get(addr, "/stats").json()["scheduler"].clone();
                let n = |k: &str| s[k].as_u64().unwrap_or(0);
                let mut p = peaks.lock().unwrap();
                p.running = p.running.max(n("num_running"));
                p.waiting = p.waiting.max(n("num_waiting"));
                p.blocks = p.blocks.max(n("num_blocks_used"));
                p.samples += 1;
                drop(p);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let (tx, rx) = mpsc::channel();
    for (i, &kind) in kinds.iter().enumerate() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let r = completion(addr, &body(i, kind));
            let _ = tx.send((i, r));
        });
    }
    drop(tx);
    let start = Instant::now();
    let mut answers: Vec<Option<HttpResponse>> = (0..kinds.len()).map(|_| None).collect();
    for _ in 0..kinds.len() {
        let left = DEADLINE.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok((i, r)) => answers[i] = Some(r),
            Err(e) => {
                let missing: Vec<usize> =
                    (0..kinds.len()).filter(|&i| answers[i].is_none()).collect();
                panic!(
                    "requests {missing:?} got no answer ({e}); /stats: {}",
                    get(addr, "/stats").text()
                );
            }
        }
    }
    done.store(true, Ordering::Relaxed);
    watcher.join().unwrap();

    let (mut completed, mut busy, mut refused) = (0, 0, 0);
    for (i, (kind, r)) in kinds.iter().zip(answers).enumerate() {
        let r = r.unwrap();
        match (kind, r.status) {
            (Kind::Long, 200) => {
                let v = r.json();
                assert!(v["choices"][0]["text"].is_string(), "request {i}: {v}");
                assert_eq!(v["usage"]["completion_tokens"], 16, "request {i}: {v}");
                assert!(
                    v["usage"]["prompt_tokens"].as_u64() > Some(350),
                    "request {i}: {v}"
                );
                completed += 1;
            }
            (Kind::LongStream, 200) => {
                let data = r.sse_data();
                assert_eq!(
                    data.last().map(String::as_str),
                    Some("[DONE]"),
                    "request {i}"
                );
                completed += 1;
            }
            (Kind::Long | Kind::LongStream, 429) => {
                let e = assert_error(&r, 429);
                assert_eq!(r.header("retry-after"), Some("1"), "request {i}");
                assert!(e["message"].as_str().unwrap().contains("busy"), "{e}");
                busy += 1;
            }
            (Kind::OverPool, _) => {
                let e = assert_error(&r, 400);
                let m = e["message"].as_str().unwrap();
                assert!(m.contains("KV blocks") && m.contains("32"), "{e}");
                refused += 1;
            }
            (Kind::OverContext, _) => {
                let e = assert_error(&r, 400);
                assert!(
                    e["message"].as_str().unwrap().contains("8192"),
                    "request {i}: {e}"
                );
                refused += 1;
            }
            (kind, status) => panic!("request {i} ({kind:?}): {status} {}", r.text()),
        }
    }
    eprintln!(
        "flood: {completed} completed, {busy} refused as busy, {refused} refused as impossible; peaks {:?}",
        peaks.lock().unwrap()
    );
    assert!(completed >= 1, "nothing completed");
    assert_eq!(refused, 8);
    assert_eq!(completed + busy + refused, kinds.len());

    // The bounds held while the flood ran.
    let p = peaks.lock().unwrap();
    assert!(p.samples > 0);
    assert!(p.running <= ENGINE.max_num_seqs as u64, "{p:?}");
    assert!(p.waiting <= ENGINE.max_waiting as u64, "{p:?}");
    assert!(p.blocks <= ENGINE.num_blocks as u64, "{p:?}");
    drop(p);

    // Afterwards: idle, every block back, healthy, and still serving.
    let idle = wait_idle(addr);
    assert_eq!(idle["num_running"], 0, "{idle}");
    assert_eq!(idle["num_waiting"], 0, "{idle}");
    assert_eq!(idle["num_blocks_used"], 0, "{idle}");
    assert_eq!(
        idle["num_finished"].as_u64(),
        Some(completed as u64),
        "{idle}"
    );
    let h = get(addr, "/health");
    assert_eq!(h.status, 200, "{}", h.text());
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}
