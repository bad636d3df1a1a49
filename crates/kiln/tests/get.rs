//! `kiln get` end to end against the mock hub: the environment variables
//! the binary reads (HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_TOKEN and the
//! token file, KILN_TEST_FREE_BYTES, HF_HUB_OFFLINE), what it prints, its
//! exit codes, `:QUANT` selection, registration and offline use.

#[path = "../../kiln-hub/tests/mock_hub/mod.rs"]
mod mock_hub;

use std::path::Path;
use std::process::{Command, Output};

use mock_hub::{
    fixture, random_bytes, MockFile, MockHub, MockRepo, MockRevision, MAIN_COMMIT, PRIVATE_REPO,
    PUBLIC_REPO, TOKEN,
};

/// `kiln get` with a clean hub environment pointing at `hub` and `home`.
fn kiln_get(hub: &MockHub, home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.arg("get")
        .env("HF_ENDPOINT", &hub.url)
        .env("HF_HOME", home)
        // Local paths get registered: keep the registry inside the test's home.
        .env("KILN_HOME", home.join("kiln"))
        .env("KILN_TEST_FREE_BYTES", "10000000000")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN");
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: Output) -> (String, String) {
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    (text(&out.stdout), text(&out.stderr))
}

fn failed(out: Output) -> String {
    assert_eq!(out.status.code(), Some(1), "stdout: {}", text(&out.stdout));
    text(&out.stderr)
}

#[test]
fn get_fills_the_hub_cache_under_hf_home_and_prints_the_snapshot() {
    let hub = MockHub::start(fixture());
    let home = tempfile::tempdir().unwrap();
    let (stdout, stderr) = ok(kiln_get(&hub, home.path())
        .arg(PUBLIC_REPO)
        .output()
        .unwrap());
    let snap = home
        .path()
        .join("hub/models--kiln-test--tiny-model/snapshots")
        .join(MAIN_COMMIT);
    assert_eq!(stdout.trim(), snap.display().to_string());
    assert!(snap
        .join("weights/model-00002-of-00002.safetensors")
        .is_file());
    assert!(
        stderr.contains("3 files, 500.0 kB, 500.0 kB to download"),
        "{stderr}"
    );
    assert!(stderr.contains("downloaded config.json (42 B)"), "{stderr}");

    // HF_HUB_CACHE wins over HF_HOME; --include narrows the files.
    let cache = tempfile::tempdir().unwrap();
    let (stdout, _) = ok(kiln_get(&hub, home.path())
        .env("HF_HUB_CACHE", cache.path())
        .args([PUBLIC_REPO, "--include", "*.json"])
        .output()
        .unwrap());
    assert!(
        stdout.starts_with(&cache.path().display().to_string()),
        "{stdout}"
    );
    let n = std::fs::read_dir(Path::new(stdout.trim())).unwrap().count();
    assert_eq!(n, 1);
}

#[test]
fn get_takes_the_token_from_hf_token_or_the_token_file() {
    let hub = MockHub::start(fixture());
    let home = tempfile::tempdir().unwrap();
    let stderr = failed(
        kiln_get(&hub, home.path())
            .arg(PRIVATE_REPO)
            .output()
            .unwrap(),
    );
    assert!(
        stderr.contains("error: access to kiln-test/gated-model was refused"),
        "{stderr}"
    );
    assert!(stderr.contains("set HF_TOKEN"), "{stderr}");

    ok(kiln_get(&hub, home.path())
        .env("HF_TOKEN", TOKEN)
        .arg(PRIVATE_REPO)
        .output()
        .unwrap());

    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("token"), format!("{TOKEN}\n")).unwrap();
    ok(kiln_get(&hub, other.path())
        .arg(PRIVATE_REPO)
        .output()
        .unwrap());
}

#[test]
fn get_refuses_when_the_disk_is_too_full() {
    let hub = MockHub::start(fixture());
    let home = tempfile::tempdir().unwrap();
    let stderr = failed(
        kiln_get(&hub, home.path())
            .env("KILN_TEST_FREE_BYTES", "300000")
            .arg(PUBLIC_REPO)
            .output()
            .unwrap(),
    );
    assert!(stderr.contains("not enough disk space"), "{stderr}");
    assert!(stderr.contains("300.0 kB available"), "{stderr}");
    assert!(!home
        .path()
        .join("hub/models--kiln-test--tiny-model/blobs")
        .read_dir()
        .unwrap()
        .any(|_| true));
}

#[test]
fn get_on_a_local_path_only_checks_it() {
    let hub = MockHub::start(fixture());
    let home = tempfile::tempdir().unwrap();
    let file = home.path().join("model.gguf");
    std::fs::write(&file, b"GGUF").unwrap();
    let (stdout, stderr) = ok(kiln_get(&hub, home.path()).arg(&file).output().unwrap());
    assert_eq!(
        stdout.trim(),
        file.canonicalize().unwrap().display().to_string()
    );
    assert!(stderr.contains("is a local file (4 B)"), "{stderr}");
    let (_, stderr) = ok(kiln_get(&hub, home.path())
        .arg(home.path())
        .output()
        .unwrap());
    assert!(stderr.contains("local model directory"), "{stderr}");

    let stderr = failed(
        kiln_get(&hub, home.path())
            .arg("./no/such/model.gguf")
            .output()
            .unwrap(),
    );
    assert!(
        stderr.contains("./no/such/model.gguf is not a file or directory"),
        "{stderr}"
    );
    let stderr = failed(
        kiln_get(&hub, home.path())
            .arg("just-a-name")
            .output()
            .unwrap(),
    );
    assert!(stderr.contains("expected ORG/NAME"), "{stderr}");
    assert!(hub.requests().is_empty());
}

#[test]
fn get_picks_one_quantization_registers_it_and_uses_the_cache_offline() {
    let repo = "kiln-test/tiny-gguf";
    let files = vec![
        MockFile::git("README.md", b"# three quantizations"),
        MockFile::lfs("tiny-q4_k_m.gguf", random_bytes(1, 2000)),
        MockFile::lfs("tiny-IQ4_K_M.gguf", random_bytes(2, 1000)),
        MockFile::lfs("tiny.Q8_0.gguf", random_bytes(3, 3000)),
    ];
    let hub = MockHub::start(vec![MockRepo {
        id: repo.into(),
        token: None,
        revisions: vec![MockRevision {
            commit: MAIN_COMMIT.into(),
            branches: vec!["main".into()],
            files,
        }],
    }]);
    let home = tempfile::tempdir().unwrap();
    let (stdout, stderr) = ok(kiln_get(&hub, home.path())
        .arg(format!("{repo}:Q4_K_M"))
        .output()
        .unwrap());
    let snap = home
        .path()
        .join("hub/models--kiln-test--tiny-gguf/snapshots")
        .join(MAIN_COMMIT);
    // Only that quantization came (not IQ4_K_M), and the file is printed.
    let got: Vec<String> = std::fs::read_dir(&snap)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(got, vec!["tiny-q4_k_m.gguf"], "{stderr}");
    assert_eq!(
        stdout.trim(),
        snap.join("tiny-q4_k_m.gguf").display().to_string()
    );
    assert!(
        stderr.contains("kiln: registered kiln-test/tiny-gguf"),
        "{stderr}"
    );
    // `kiln ls` knows it without a scan.
    let ls = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["ls", "--json"])
        .env("KILN_HOME", home.path().join("kiln"))
        .output()
        .unwrap();
    assert!(
        text(&ls.stdout).contains("tiny-q4_k_m.gguf"),
        "{}",
        text(&ls.stdout)
    );

    // The hub unreachable: the complete cached snapshot is used.
    let (again, stderr) = ok(kiln_get(&hub, home.path())
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .arg(format!("{repo}:q4_k_m"))
        .output()
        .unwrap());
    assert_eq!(again, stdout);
    assert!(
        stderr.contains("using the complete cached snapshot"),
        "{stderr}"
    );
    // HF_HUB_OFFLINE never asks the hub; a quantization not cached is an error.
    hub.clear_log();
    let (offline, _) = ok(kiln_get(&hub, home.path())
        .env("HF_HUB_OFFLINE", "1")
        .arg(format!("{repo}:Q4_K_M"))
        .output()
        .unwrap());
    assert_eq!(offline, stdout);
    let e = failed(
        kiln_get(&hub, home.path())
            .env("HF_HUB_OFFLINE", "1")
            .arg(format!("{repo}:Q8_0"))
            .output()
            .unwrap(),
    );
    assert!(e.contains("HF_HUB_OFFLINE is set"), "{e}");
    assert!(hub.requests().is_empty());
    // A quantization the repository does not have.
    let e = failed(
        kiln_get(&hub, home.path())
            .arg(format!("{repo}:Q5_K_M"))
            .output()
            .unwrap(),
    );
    assert!(
        e.contains("no `Q5_K_M` GGUF file in kiln-test/tiny-gguf"),
        "{e}"
    );
}
