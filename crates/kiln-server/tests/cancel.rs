//! Load safety: a client that disconnects mid-stream frees its request's
//! blocks, and a full queue answers 429 with `Retry-After`.

mod common;

use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};

use common::{assert_error, read_until, send, wait_idle};
use kiln_engine::EngineConfig;
use kiln_server::ServerConfig;
use serde_json::json;

/// One request runs at a time and one may wait, so the queue fills with three.
fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let engine = EngineConfig {
            max_num_seqs: 1,
            max_waiting: 1,
            ..common::engine_config()
        };
        common::start(ServerConfig::default(), engine)
    })
}

/// The tests here read the engine's global state; they take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn long_stream() -> Vec<u8> {
    json!({
        "messages": [{"role": "user", "content": "Tell me a long story about a kiln."}],
        "max_tokens": 400,
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
    })
    .to_string()
    .into_bytes()
}

#[test]
fn a_disconnect_mid_stream_frees_the_blocks() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let addr = server();
    let mut s = send(addr, "POST", "/v1/chat/completions", &[], &long_stream());
    let mut buf = Vec::new();
    // Wait for generated text, then hang up.
    assert!(
        read_until(&mut s, &mut buf, b"\"content\":\"") && read_until(&mut s, &mut buf, b"\n\n")
    );
    let running = common::get(addr, "/stats").json()["scheduler"].clone();
    assert!(running["num_blocks_used"].as_u64() > Some(0), "{running}");
    drop(s);
    let idle = wait_idle(addr);
    assert_eq!(idle["num_running"], 0, "{idle}");
    assert_eq!(idle["num_blocks_used"], 0, "{idle}");
    assert!(idle["num_cancelled"].as_u64() >= Some(1), "{idle}");
}

#[test]
fn a_full_queue_is_429_with_retry_after() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let addr = server();
    let mut running = send(addr, "POST", "/v1/chat/completions", &[], &long_stream());
    let mut buf = Vec::new();
    assert!(read_until(&mut running, &mut buf, b"\"content\":\""));
    // Admitted (headers sent) but waiting behind the running one.
    let mut waiting = send(addr, "POST", "/v1/chat/completions", &[], &long_stream());
    let mut buf2 = Vec::new();
    assert!(read_until(&mut waiting, &mut buf2, b"\r\n\r\n"));
    assert!(
        buf2.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf2)
    );
    let r = common::request(addr, "POST", "/v1/chat/completions", &[], &long_stream());
    let e = assert_error(&r, 429);
    assert_eq!(e["type"], "rate_limit_error");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(running);
    drop(waiting);
    let idle = wait_idle(addr);
    assert_eq!(idle["num_blocks_used"], 0, "{idle}");
    assert_eq!(idle["num_waiting"], 0, "{idle}");
}
