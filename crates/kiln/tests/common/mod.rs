//! What the tests that run `kiln serve` share: starting it and waiting for
//! it to be ready, and one-shot HTTP requests on loopback.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A model under the repository's `models/` (fetched by scripts/fetch-models.sh).
pub fn model(file: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        path.display()
    );
    path
}

/// A tiny random checkpoint in `dtype` (`f32`, `bf16`) with SmolLM2's
/// tokenizer, under `dir`.
pub fn random_checkpoint(dir: &Path, dtype: &str) -> PathBuf {
    let ckpt = dir.join("tiny");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "dev",
            "random-checkpoint",
            "--preset",
            "tiny",
            "--dtype",
            dtype,
        ])
        .arg("--tokenizer")
        .arg(model("SmolLM2-135M-Instruct.Q4_1.gguf"))
        .arg("-o")
        .arg(&ckpt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ckpt
}

/// A running `kiln serve`, killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
    /// Its stderr lines up to the `ready` one.
    pub startup: Vec<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `kiln serve ARGS --port 0` with `$KILN_HOME` at `home`, once its
    /// default model is ready (its later stderr lines are echoed).
    pub fn start<S: AsRef<OsStr>>(args: &[S], home: &Path) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .args(args)
            .args(["--port", "0"])
            .env("KILN_HOME", home)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut addr = None;
        let mut startup = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(rest) = line.split_once(" on http://") {
                addr = rest.1.split_whitespace().next().map(str::to_string);
            }
            let done = line.ends_with("; ready");
            startup.push(line);
            if done || startup.len() > 60 {
                break;
            }
        }
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                eprintln!("server: {l}");
            }
        });
        let ready = startup.last().is_some_and(|l| l.ends_with("; ready"));
        let Some(addr) = addr.filter(|_| ready) else {
            let _ = child.kill();
            panic!("kiln serve did not get ready: {startup:#?}");
        };
        Server {
            child,
            addr,
            startup,
        }
    }
}

/// Sends one HTTP/1.1 request (the connection closes after it).
pub fn request(addr: &str, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// One request and its whole answer: status and body.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = request(addr, method, path, body);
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    (
        status,
        out.split_once("\r\n\r\n").map_or("", |x| x.1).to_string(),
    )
}
