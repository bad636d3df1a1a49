//! A mock Hugging Face hub on loopback: model info with blobs, `resolve`
//! answering files kept in git itself and redirecting LFS files (302) to a
//! `/cdn/` path, `Range` requests, a token-protected repository, and faults
//! to inject (a connection cut part-way, wrong bytes). Every request is
//! logged so tests can check what the client sent.
//!
//! Used by `kiln-hub`'s tests and, through `#[path]`, by the `kiln` binary's.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use sha1::Digest;

pub struct MockFile {
    pub path: String,
    pub bytes: Vec<u8>,
    pub lfs: bool,
}

impl MockFile {
    pub fn git(path: &str, bytes: &[u8]) -> MockFile {
        MockFile {
            path: path.to_string(),
            bytes: bytes.to_vec(),
            lfs: false,
        }
    }

    pub fn lfs(path: &str, bytes: Vec<u8>) -> MockFile {
        MockFile {
            path: path.to_string(),
            bytes,
            lfs: true,
        }
    }

    /// The blob name: sha256 for LFS files, the git blob sha1 for the rest.
    pub fn etag(&self) -> String {
        if self.lfs {
            sha256_hex(&self.bytes)
        } else {
            git_sha1_hex(&self.bytes)
        }
    }
}

pub struct MockRevision {
    pub commit: String,
    /// Branch names that point at this commit.
    pub branches: Vec<String>,
    pub files: Vec<MockFile>,
}

pub struct MockRepo {
    pub id: String,
    /// When set, every request must carry `Authorization: Bearer {token}`.
    pub token: Option<String>,
    pub revisions: Vec<MockRevision>,
}

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Request {
    pub target: String,
    pub headers: Vec<(String, String)>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct Faults {
    /// etag → bytes to send before closing the connection, once.
    cut_once: HashMap<String, usize>,
    /// etags served with one byte changed.
    corrupt: HashSet<String>,
}

pub struct MockHub {
    pub url: String,
    repos: Arc<Vec<MockRepo>>,
    faults: Arc<Mutex<Faults>>,
    log: Arc<Mutex<Vec<Request>>>,
}

impl MockHub {
    /// Start the hub and its CDN, each on its own loopback port (so the CDN is
    /// another origin, as on the real hub).
    pub fn start(repos: Vec<MockRepo>) -> MockHub {
        let hub_listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let cdn_listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let url = format!("http://{}", hub_listener.local_addr().expect("local addr"));
        let cdn_url = format!("http://{}", cdn_listener.local_addr().expect("local addr"));
        let hub = MockHub {
            url,
            repos: Arc::new(repos),
            faults: Arc::default(),
            log: Arc::default(),
        };
        for listener in [hub_listener, cdn_listener] {
            let (repos, faults, log, cdn_url) = (
                hub.repos.clone(),
                hub.faults.clone(),
                hub.log.clone(),
                cdn_url.clone(),
            );
            std::thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    let (repos, faults, log, cdn_url) =
                        (repos.clone(), faults.clone(), log.clone(), cdn_url.clone());
                    std::thread::spawn(move || {
                        let _ = serve(stream, &repos, &faults, &log, &cdn_url);
                    });
                }
            });
        }
        hub
    }

    pub fn requests(&self) -> Vec<Request> {
        self.log.lock().unwrap().clone()
    }

    pub fn clear_log(&self) {
        self.log.lock().unwrap().clear();
    }

    /// The next download of `etag` stops after `num_bytes` bytes.
    pub fn cut_once(&self, etag: &str, num_bytes: usize) {
        self.faults
            .lock()
            .unwrap()
            .cut_once
            .insert(etag.to_string(), num_bytes);
    }

    /// Downloads of `etag` get one byte changed, until `heal`.
    pub fn corrupt(&self, etag: &str) {
        self.faults.lock().unwrap().corrupt.insert(etag.to_string());
    }

    pub fn heal(&self) {
        self.faults.lock().unwrap().corrupt.clear();
    }
}

struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Close the connection after this many body bytes.
    cut_at: Option<usize>,
}

impl Answer {
    fn new(status: u16, body: Vec<u8>) -> Answer {
        Answer {
            status,
            headers: Vec::new(),
            body,
            cut_at: None,
        }
    }

    fn with(mut self, k: &str, v: impl Into<String>) -> Answer {
        self.headers.push((k.to_string(), v.into()));
        self
    }
}

fn serve(
    stream: TcpStream,
    repos: &[MockRepo],
    faults: &Mutex<Faults>,
    log: &Mutex<Vec<Request>>,
    base: &str,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.trim_end().split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let req = Request { target, headers };
    log.lock().unwrap().push(req.clone());
    let answer = route(&req, repos, faults, base);
    write_answer(stream, answer)
}

fn write_answer(mut stream: TcpStream, a: Answer) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {} X\r\n", a.status);
    for (k, v) in &a.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        a.body.len()
    ));
    stream.write_all(head.as_bytes())?;
    let n = a.cut_at.unwrap_or(a.body.len()).min(a.body.len());
    stream.write_all(&a.body[..n])?;
    stream.flush()?;
    stream.shutdown(std::net::Shutdown::Both)
}

fn route(req: &Request, repos: &[MockRepo], faults: &Mutex<Faults>, base: &str) -> Answer {
    let path = req.target.split('?').next().unwrap_or("");
    if let Some(etag) = path.strip_prefix("/cdn/") {
        return match repos
            .iter()
            .flat_map(|r| &r.revisions)
            .flat_map(|v| &v.files)
            .find(|f| f.etag() == etag)
        {
            Some(f) => serve_bytes(req, f, faults),
            None => Answer::new(404, b"no such blob".to_vec()),
        };
    }
    let (api, rest) = match path.strip_prefix("/api/models/") {
        Some(rest) => (true, rest),
        None => (false, path.trim_start_matches('/')),
    };
    let sep = if api { "/revision/" } else { "/resolve/" };
    let Some((repo_id, after)) = rest.split_once(sep) else {
        return Answer::new(404, b"unknown route".to_vec());
    };
    let Some(repo) = repos.iter().find(|r| r.id == repo_id) else {
        return Answer::new(404, b"Repository not found".to_vec())
            .with("X-Error-Code", "RepoNotFound")
            .with("X-Error-Message", "Repository not found");
    };
    if let Some(token) = &repo.token {
        if req.header("authorization") != Some(&format!("Bearer {token}")) {
            return Answer::new(401, b"gated".to_vec())
                .with("X-Error-Code", "GatedRepo")
                .with(
                    "X-Error-Message",
                    format!("Access to model {} is restricted.", repo.id),
                );
        }
    }
    let (rev, file_path) = if api {
        (decode(after), String::new())
    } else {
        let (r, p) = after.split_once('/').unwrap_or((after, ""));
        (decode(r), decode(p))
    };
    let Some(revision) = repo
        .revisions
        .iter()
        .find(|v| v.commit == rev || v.branches.contains(&rev))
    else {
        return Answer::new(404, b"Invalid rev id".to_vec())
            .with("X-Error-Code", "RevisionNotFound")
            .with("X-Error-Message", "Invalid rev id");
    };
    if api {
        return Answer::new(200, model_info(repo, revision).into_bytes())
            .with("Content-Type", "application/json");
    }
    let Some(file) = revision.files.iter().find(|f| f.path == file_path) else {
        return Answer::new(404, b"Entry not found".to_vec())
            .with("X-Error-Code", "EntryNotFound")
            .with("X-Repo-Commit", revision.commit.clone());
    };
    if file.lfs {
        let etag = file.etag();
        return Answer::new(302, Vec::new())
            .with("Location", format!("{base}/cdn/{etag}?X-Amz-Signature=x"))
            .with("X-Linked-Etag", format!("\"{etag}\""))
            .with("X-Linked-Size", file.bytes.len().to_string())
            .with("X-Repo-Commit", revision.commit.clone());
    }
    serve_bytes(req, file, faults)
        .with("ETag", format!("\"{}\"", file.etag()))
        .with("X-Repo-Commit", revision.commit.clone())
}

/// The file's bytes, honouring `Range: bytes=N-` and the injected faults.
fn serve_bytes(req: &Request, file: &MockFile, faults: &Mutex<Faults>) -> Answer {
    let etag = file.etag();
    let mut bytes = file.bytes.clone();
    let mut faults = faults.lock().unwrap();
    if faults.corrupt.contains(&etag) && !bytes.is_empty() {
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
    }
    let len = bytes.len();
    let start = req
        .header("range")
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse::<usize>().ok());
    let mut answer = match start {
        Some(s) if s >= len => {
            return Answer::new(416, Vec::new()).with("Content-Range", format!("bytes */{len}"))
        }
        Some(s) => Answer::new(206, bytes[s..].to_vec())
            .with("Content-Range", format!("bytes {s}-{}/{len}", len - 1)),
        None => Answer::new(200, bytes),
    };
    answer.cut_at = faults.cut_once.remove(&etag);
    answer.with("Accept-Ranges", "bytes")
}

fn model_info(repo: &MockRepo, rev: &MockRevision) -> String {
    let siblings: Vec<String> = rev
        .files
        .iter()
        .map(|f| {
            let lfs = if f.lfs {
                format!(
                    r#","lfs":{{"sha256":"{}","size":{},"pointerSize":134}}"#,
                    f.etag(),
                    f.bytes.len()
                )
            } else {
                String::new()
            };
            format!(
                r#"{{"rfilename":"{}","size":{},"blobId":"{}"{lfs}}}"#,
                f.path,
                f.bytes.len(),
                git_sha1_hex(if f.lfs { b"pointer" } else { &f.bytes })
            )
        })
        .collect();
    format!(
        r#"{{"_id":"x","id":"{}","private":false,"sha":"{}","siblings":[{}]}}"#,
        repo.id,
        rev.commit,
        siblings.join(",")
    )
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let digits = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(digits, 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&sha2::Sha256::digest(bytes))
}

pub fn git_sha1_hex(bytes: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex(&h.finalize())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Deterministic pseudo-random bytes (xorshift).
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub const MAIN_COMMIT: &str = "1111111111111111111111111111111111111111";
pub const PINNED_COMMIT: &str = "2222222222222222222222222222222222222222";
pub const PUBLIC_REPO: &str = "kiln-test/tiny-model";
pub const PRIVATE_REPO: &str = "kiln-test/gated-model";
pub const TOKEN: &str = "hf_test_token";

/// The fixture: a public repository with a small git file and two LFS files
/// (one in a sub-folder) on `main`, an older pinned commit (also branch `v1`),
/// and a gated repository.
pub fn fixture() -> Vec<MockRepo> {
    let main = MockRevision {
        commit: MAIN_COMMIT.to_string(),
        branches: vec!["main".to_string()],
        files: vec![
            MockFile::git(
                "config.json",
                br#"{"model_type": "llama", "hidden_size": 64}"#,
            ),
            MockFile::lfs("model-00001-of-00002.safetensors", random_bytes(1, 300_000)),
            MockFile::lfs(
                "weights/model-00002-of-00002.safetensors",
                random_bytes(2, 200_000),
            ),
        ],
    };
    let pinned = MockRevision {
        commit: PINNED_COMMIT.to_string(),
        branches: vec!["v1".to_string()],
        files: vec![
            MockFile::git(
                "config.json",
                br#"{"model_type": "llama", "hidden_size": 32}"#,
            ),
            MockFile::lfs("model-00001-of-00002.safetensors", random_bytes(3, 250_000)),
        ],
    };
    let gated = MockRevision {
        commit: MAIN_COMMIT.to_string(),
        branches: vec!["main".to_string()],
        files: vec![
            MockFile::git("README.md", b"# gated\n"),
            MockFile::lfs("model.safetensors", random_bytes(4, 100_000)),
        ],
    };
    vec![
        MockRepo {
            id: PUBLIC_REPO.to_string(),
            token: None,
            revisions: vec![main, pinned],
        },
        MockRepo {
            id: PRIVATE_REPO.to_string(),
            token: Some(TOKEN.to_string()),
            revisions: vec![gated],
        },
    ]
}
