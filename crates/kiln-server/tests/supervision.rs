//! The engine loop's supervision through the server: a panic on the engine
//! thread (injected through the `fault-injection` test hook) fails the
//! running and the queued request in their APIs' error shapes, `/health`
//! says 503 while the engine restarts, and the next request succeeds.

mod common;

use std::time::Duration;

use common::{get, post, read_until, send};
use kiln_engine::{Engine, EngineConfig};
use kiln_server::{Readiness, ServerConfig};
use serde_json::json;

#[test]
fn an_engine_panic_fails_its_requests_and_the_engine_restarts() {
    // One request runs at a time, so the second one waits in the queue.
    let config = EngineConfig {
        max_num_seqs: 1,
        ..common::engine_config()
    };
    let engine = Engine::start(common::load_model(), config).expect("starting the engine");
    let handle = engine.handle();
    let readiness = Readiness::new();
    readiness.ready(engine.handle());
    let addr = common::start_loading(ServerConfig::default(), readiness);

    // Running: a whole OpenAI completion that cannot end early.
    let running = std::thread::spawn(move || {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 400,
                          "ignore_eos": true, "temperature": 0});
        post(addr, "/v1/completions", &body)
    });
    wait_for(addr, |s| s["num_running"] == 1);
    // Queued behind it: an Anthropic stream (admitted, so its head is sent).
    let body = json!({"max_tokens": 50, "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]});
    let mut queued = send(
        addr,
        "POST",
        "/v1/messages",
        &[],
        body.to_string().as_bytes(),
    );
    let mut head = Vec::new();
    assert!(read_until(&mut queued, &mut head, b"\r\n\r\n"));
    wait_for(addr, |s| s["num_waiting"] == 1);

    let gate = handle.inject_panic().expect("the engine takes commands");

    // The running request fails with OpenAI's error body: 503, the engine
    // restarts and the request may be sent again.
    let r = running.join().expect("the running request's thread");
    let e = common::assert_error(&r, 503);
    assert!(e["message"].as_str().unwrap().contains("restarting"), "{e}");
    // The queued stream ends with Anthropic's error event.
    let mut rest = Vec::new();
    assert!(read_until(&mut queued, &mut rest, b"event: error"));
    assert!(read_until(&mut queued, &mut rest, b"\n\n"));
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains(r#""type":"error""#), "{text}");
    assert!(text.contains("restarting"), "{text}");

    // Until the engine is back, health and generation are 503.
    let h = get(addr, "/health");
    assert_eq!(h.status, 503, "{}", h.text());
    assert_eq!(h.json()["status"], "restarting");
    let chat = json!({"messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2, "temperature": 0});
    common::assert_error(&post(addr, "/v1/chat/completions", &chat), 503);

    gate.release();
    let mut healthy = None;
    for _ in 0..400 {
        let h = get(addr, "/health");
        if h.status == 200 {
            healthy = Some(h.json());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let healthy = healthy.expect("the engine came back");
    assert_eq!(healthy, json!({"status": "ok", "restarts": 1}));
    let r = post(addr, "/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.text());
    // The fresh pool holds nothing of the failed requests.
    let idle = common::wait_idle(addr);
    assert_eq!(idle["num_blocks_used"], 0, "{idle}");
    drop(engine);
}

/// Polls `/stats` (at most ~20 s) until `ready` holds for the scheduler's
/// counters.
fn wait_for(addr: std::net::SocketAddr, ready: impl Fn(&serde_json::Value) -> bool) {
    for _ in 0..400 {
        let stats = get(addr, "/stats").json()["scheduler"].clone();
        if ready(&stats) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the engine never reached the expected state");
}
