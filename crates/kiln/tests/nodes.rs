//! A model split over two nodes — two `kiln serve` processes on loopback,
//! one rank each, meeting at `--master-port` (the CPU twin of a two-node
//! GPU run): node 0 serves and its answers are the whole model's; node 1
//! serves nothing and stops when node 0 does.

mod common;

use std::process::{Command, Stdio};

use common::{http, Server};

/// A port whose next one is free too (the meeting and the CPU's
/// collectives).
fn two_free_ports() -> u16 {
    loop {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

fn complete(addr: &str, prompt: &str) -> String {
    let body = format!(
        r#"{{"model": "tiny", "prompt": "{prompt}", "max_tokens": 12, "temperature": 0, "ignore_eos": true}}"#
    );
    let (status, body) = http(addr, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn two_nodes_serve_the_whole_models_answers() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = common::random_checkpoint(dir.path(), "f32");
    let ckpt_arg = ckpt.to_str().unwrap();
    let whole = Server::start(&[ckpt_arg, "--device", "cpu"], dir.path());
    let prompts = ["Hello", "The capital of France is", "1, 2, 3,"];
    let want: Vec<String> = prompts.iter().map(|p| complete(&whole.addr, p)).collect();
    drop(whole);

    let port = two_free_ports().to_string();
    let node = |rank: &str| -> Vec<String> {
        [
            ckpt_arg,
            "--device",
            "cpu",
            "--tensor-parallel",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            rank,
            "--master-port",
            &port,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let mut follower = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("serve")
        .args(node("1"))
        .env("KILN_HOME", dir.path())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let leader = Server::start(&node("0"), dir.path());
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(&complete(&leader.addr, p), w, "{p}");
    }
    // Requests at once share steps across both nodes too.
    let together: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| complete(&leader.addr, p)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, want);
    // Node 1 goes when node 0 does, and says it ended well.
    drop(leader);
    let status = follower.wait().unwrap();
    assert!(status.success(), "node 1 ended with {status}");
}
