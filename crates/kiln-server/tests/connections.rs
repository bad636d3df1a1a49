//! No client can hold the server: idle connections and a slowloris client
//! (a request head sent a byte at a time) are closed after their timeouts
//! while normal requests are served, a body that does not arrive is a 408,
//! and connections past the cap get a 503 with a JSON body.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{parse_response, post};
use serde_json::json;

use kiln_server::ServerConfig;

/// A server with short timeouts.
fn server(max_connections: usize) -> SocketAddr {
    let config = ServerConfig {
        header_read_timeout: Duration::from_millis(500),
        body_read_timeout: Duration::from_millis(500),
        idle_timeout: Duration::from_secs(2),
        max_connections,
        ..ServerConfig::default()
    };
    common::start(config, common::engine_config())
}

fn completion() -> serde_json::Value {
    json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0})
}

/// Whether the server has closed `s` (end of stream or reset), waiting at
/// most `wait` for it.
fn closed_within(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).expect("read timeout");
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            // Bytes (an error response) before the close.
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// Sends a request head a byte at a time (every 20 ms, for at most 20 s)
/// and says whether the server closed the connection before it was done.
fn slowloris(addr: SocketAddr) -> bool {
    let mut s = TcpStream::connect(addr).expect("connecting");
    s.set_nonblocking(true).expect("non-blocking");
    let mut head = format!("POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nX-Pad: ");
    head.push_str(&"a".repeat(1000));
    head.push_str("\r\n\r\n");
    let started = Instant::now();
    for byte in head.bytes() {
        if started.elapsed() > Duration::from_secs(20) {
            return false;
        }
        if s.write_all(&[byte]).is_err() {
            return true;
        }
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(0) => return true,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            _ => return true,
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn idle_connections_and_a_slowloris_are_closed_while_requests_are_served() {
    let addr = server(512);
    let mut idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).expect("an idle connection"))
        .collect();
    let loris = std::thread::spawn(move || slowloris(addr));
    let r = post(addr, "/v1/completions", &completion());
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        loris.join().expect("the slowloris thread"),
        "the slow head was never cut off"
    );
    // Each idle connection is closed by the server (the first wait covers
    // the idle timeout; the rest are closed by then).
    for (i, s) in idle.iter_mut().enumerate() {
        assert!(
            closed_within(s, Duration::from_secs(15)),
            "idle connection {i} is still open"
        );
    }
    let r = post(addr, "/v1/completions", &completion());
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_body_that_does_not_arrive_is_408_in_the_routes_shape() {
    let addr = server(512);
    for (path, anthropic) in [("/v1/chat/completions", false), ("/v1/messages", true)] {
        let mut s = TcpStream::connect(addr).expect("connecting");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: 100\r\nConnection: close\r\n\r\n{{\"model\""
        );
        s.write_all(head.as_bytes()).expect("writing");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("read timeout");
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        assert!(!raw.is_empty(), "{path}: no answer");
        let r = parse_response(&raw);
        assert_eq!(r.status, 408, "{path}: {}", r.text());
        if anthropic {
            assert_eq!(r.json()["type"], "error", "{}", r.text());
        } else {
            assert_eq!(r.json()["error"]["code"], "request_timeout", "{}", r.text());
        }
    }
}

#[test]
fn connections_past_the_cap_get_a_503_with_a_json_body() {
    let addr = server(4);
    let held: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(addr).expect("a held connection"))
        .collect();
    // The server accepts in order: these four hold every slot.
    let r = post(addr, "/v1/completions", &completion());
    let e = common::assert_error(&r, 503);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("too many open connections"),
        "{e}"
    );
    drop(held);
    // Once they are gone, requests are served again.
    let mut last = None;
    for _ in 0..100 {
        let r = post(addr, "/v1/completions", &completion());
        if r.status == 200 {
            return;
        }
        last = Some(r.status);
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("still refused after the held connections closed: {last:?}");
}
