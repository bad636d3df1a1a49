//! A request whose client leaves while it waits in the queue is dropped
//! from the queue at once: it is never scheduled, so its prompt is never
//! prefilled.

mod common;

use std::time::Duration;

use common::{get, read_until, send};
use kiln_engine::EngineConfig;
use kiln_server::ServerConfig;
use serde_json::{json, Value};

fn scheduler_stats(addr: std::net::SocketAddr) -> Value {
    get(addr, "/stats").json()["scheduler"].clone()
}

#[test]
fn a_client_that_leaves_while_queued_is_never_prefilled() {
    // One request runs at a time; streams send keep-alives often, so a
    // closed connection is noticed soon.
    let engine = EngineConfig {
        max_num_seqs: 1,
        ..common::engine_config()
    };
    let config = ServerConfig {
        sse_keepalive: Duration::from_millis(100),
        ..ServerConfig::default()
    };
    let addr = common::start(config, engine);
    let long = json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true,
                      "temperature": 0, "stream": true});
    let mut running = send(
        addr,
        "POST",
        "/v1/completions",
        &[],
        long.to_string().as_bytes(),
    );
    let mut buf = Vec::new();
    assert!(read_until(&mut running, &mut buf, b"data: {"));
    let before = scheduler_stats(addr);
    assert_eq!(before["num_running"], 1, "{before}");

    let queued = json!({"messages": [{"role": "user", "content": "A question that waits."}],
                        "max_tokens": 20, "stream": true});
    let mut waiting = send(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        queued.to_string().as_bytes(),
    );
    let mut head = Vec::new();
    assert!(read_until(&mut waiting, &mut head, b"\r\n\r\n"));
    assert_eq!(scheduler_stats(addr)["num_waiting"], 1);
    drop(waiting);

    // The queued request is cancelled while the first one still runs.
    let mut after = Value::Null;
    for _ in 0..400 {
        after = scheduler_stats(addr);
        if after["num_waiting"] == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(after["num_waiting"], 0, "{after}");
    assert_eq!(after["num_cancelled"], 1, "{after}");
    assert_eq!(
        after["num_finished"], 0,
        "the first request is still running: {after}"
    );
    assert_eq!(after["num_running"], 1, "{after}");
    // Its prompt was never admitted for computation.
    assert_eq!(
        after["num_prompt_tokens"], before["num_prompt_tokens"],
        "{after}"
    );
    drop(running);
}
