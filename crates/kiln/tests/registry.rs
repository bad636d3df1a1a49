//! The model registry and the memory equation end to end: `kiln scan` and
//! `kiln ls` over ./models, a random checkpoint and a mock-hub download;
//! query resolution (ambiguity lists candidates); `kiln fit` verdicts;
//! `kiln serve` refusing a model that does not fit; and `kiln fit`
//! predicting `kiln generate`'s peak RSS on SmolLM2 within 5 %.

#[path = "../../kiln-hub/tests/mock_hub/mod.rs"]
mod mock_hub;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use mock_hub::{MockFile, MockHub, MockRepo, MockRevision, MAIN_COMMIT};
use serde_json::Value;

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")
}

fn smollm2() -> PathBuf {
    models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// `kiln` with its own registry (`home/kiln`), hub cache (`home/hf`) and
/// the repository's models folder.
fn kiln(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.arg("--threads")
        .arg("2")
        .env("KILN_HOME", home.join("kiln"))
        .env("HF_HOME", home.join("hf"))
        .env("KILN_MODELS_DIR", models_dir())
        .env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .env_remove("HF_TOKEN");
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: Output) -> String {
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    text(&out.stdout)
}

fn failed(out: Output) -> String {
    assert_eq!(out.status.code(), Some(1), "stdout: {}", text(&out.stdout));
    text(&out.stderr)
}

fn random_checkpoint(home: &Path, dir: &Path) {
    ok(kiln(home)
        .args([
            "dev",
            "random-checkpoint",
            "--preset",
            "tiny",
            "--tokenizer",
        ])
        .arg(smollm2())
        .arg("-o")
        .arg(dir)
        .output()
        .unwrap());
}

fn ls(home: &Path) -> Vec<Value> {
    ok(kiln(home).args(["ls", "--json"]).output().unwrap())
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn by_name<'a>(rows: &'a [Value], name: &str) -> &'a Value {
    rows.iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in {rows:?}"))
}

#[test]
fn scan_lists_ggufs_and_a_random_checkpoint_with_their_headers() {
    let home = tempfile::tempdir().unwrap();
    let ckpt = home.path().join("tiny-ckpt");
    random_checkpoint(home.path(), &ckpt);
    let table = ok(kiln(home.path()).arg("scan").arg(&ckpt).output().unwrap());
    assert!(table.starts_with("NAME"), "{table}");
    let rows = ls(home.path());
    let smol = by_name(&rows, "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(smol["model_type"], "llama");
    assert_eq!(smol["architecture"], "LlamaForCausalLM");
    assert_eq!(smol["num_params"], 134_515_008);
    assert_eq!(smol["quant"], "Q4_1");
    assert_eq!(smol["context_length"], 8192);
    assert_eq!(smol["size_bytes"], 98_362_432);
    assert_eq!(smol["tier"], "llama");
    let gemma = by_name(&rows, "gemma-3-270m-q4_k_m");
    assert_eq!(gemma["model_type"], "gemma3_text");
    assert_eq!(gemma["num_params"], 268_098_176);
    assert_eq!(gemma["quant"], "Q4_K_M");
    assert_eq!(gemma["context_length"], 32768);
    assert_eq!(gemma["tier"], "gemma3");
    let tiny = by_name(&rows, "tiny-ckpt");
    assert_eq!(tiny["format"], "safetensors");
    assert_eq!(tiny["model_type"], "llama");
    // Tied embedding 49152 x 64 plus two layers and the final norm.
    assert_eq!(tiny["num_params"], 49152 * 64 + 2 * 36992 + 64);
    assert_eq!(tiny["quant"], "BF16");
    assert_eq!(tiny["context_length"], 2048);
    // A query resolves for every model-taking command.
    let out = ok(kiln(home.path())
        .args([
            "generate",
            "-p",
            "Hi",
            "--max-tokens",
            "2",
            "--device",
            "cpu",
            "-m",
            "tiny-ck",
        ])
        .output()
        .unwrap());
    assert!(!out.is_empty());
    // Forgetting an entry; a rescan of its registered path is gone too.
    ok(kiln(home.path())
        .args(["rm", "tiny-ckpt"])
        .output()
        .unwrap());
    ok(kiln(home.path()).arg("scan").output().unwrap());
    assert!(ls(home.path()).iter().all(|r| r["name"] != "tiny-ckpt"));
    // Local files are never deleted.
    let e = failed(
        kiln(home.path())
            .args(["rm", "gemma-3-270m", "--delete-files"])
            .output()
            .unwrap(),
    );
    assert!(e.contains("not in the hub cache"), "{e}");
    assert!(models_dir().join("gemma-3-270m-q4_k_m.gguf").is_file());
}

#[test]
fn ambiguous_and_unknown_queries_say_what_to_do() {
    let home = tempfile::tempdir().unwrap();
    ok(kiln(home.path()).arg("scan").output().unwrap());
    let e = failed(
        kiln(home.path())
            .args(["generate", "-p", "Hi", "-m", "q4_k_m"])
            .output()
            .unwrap(),
    );
    // Every Q4_K_M file of ./models (the test models: Gemma 3 and both
    // Qwen2.5-Coder sizes) is a candidate, listed by name.
    let q4km: Vec<String> = std::fs::read_dir(models_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with("q4_k_m.gguf"))
        .collect();
    assert!(q4km.len() >= 2, "{q4km:?}");
    assert!(e.contains(&format!("matches {} models", q4km.len())), "{e}");
    for name in &q4km {
        assert!(e.contains(name.trim_end_matches(".gguf")), "{name}: {e}");
    }
    let e = failed(
        kiln(home.path())
            .args(["fit", "llama-70b"])
            .output()
            .unwrap(),
    );
    assert!(e.contains("kiln get") && e.contains("kiln scan"), "{e}");
}

/// A mock hub serving a random tiny checkpoint as `kiln-test/tiny-llama`.
fn tiny_llama_hub(home: &Path) -> MockHub {
    let ckpt = home.join("ckpt");
    random_checkpoint(home, &ckpt);
    let files = [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ]
    .iter()
    .map(|f| {
        let bytes = std::fs::read(ckpt.join(f)).unwrap();
        if f.ends_with(".safetensors") {
            MockFile::lfs(f, bytes)
        } else {
            MockFile::git(f, &bytes)
        }
    })
    .collect();
    MockHub::start(vec![MockRepo {
        id: "kiln-test/tiny-llama".into(),
        token: None,
        revisions: vec![MockRevision {
            commit: MAIN_COMMIT.into(),
            branches: vec!["main".into()],
            files,
        }],
    }])
}

#[test]
fn kiln_run_fetches_registers_and_chats_then_runs_by_name_offline() {
    let home = tempfile::tempdir().unwrap();
    let hub = tiny_llama_hub(home.path());
    let run = |name: &str, endpoint: &str| {
        kiln(home.path())
            .env("HF_ENDPOINT", endpoint)
            .env("KILN_TEST_FREE_BYTES", "10000000000")
            .args(["run", name, "--device", "cpu"])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let out = run("kiln-test/tiny-llama", &hub.url);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("is not here yet; fetching it"), "{stderr}");
    assert!(
        stderr.contains("kiln: registered kiln-test/tiny-llama"),
        "{stderr}"
    );
    assert!(stderr.contains("kiln chat"), "the chat started: {stderr}");
    // Registered without a scan; by name, with the hub gone.
    let rows = ls(home.path());
    assert_eq!(by_name(&rows, "kiln-test/tiny-llama")["tier"], "llama");
    let out = run("tiny-llama", "http://127.0.0.1:9");
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn a_mock_hub_download_shows_up_after_scan_and_rm_deletes_its_files() {
    let home = tempfile::tempdir().unwrap();
    let hub = tiny_llama_hub(home.path());
    ok(kiln(home.path())
        .env("HF_ENDPOINT", &hub.url)
        .env("KILN_TEST_FREE_BYTES", "10000000000")
        .args(["get", "kiln-test/tiny-llama"])
        .output()
        .unwrap());
    ok(kiln(home.path()).arg("scan").output().unwrap());
    let rows = ls(home.path());
    let r = by_name(&rows, "kiln-test/tiny-llama");
    assert_eq!(r["revision"], MAIN_COMMIT);
    assert_eq!(r["refs"], serde_json::json!(["main"]));
    assert_eq!(r["source"], "hub-cache");
    assert_eq!(r["num_params"], 49152 * 64 + 2 * 36992 + 64);
    assert_eq!(r["tier"], "llama");
    let cached = home.path().join("hf/hub/models--kiln-test--tiny-llama");
    assert!(cached.is_dir());
    ok(kiln(home.path())
        .args(["rm", "tiny-llama", "--delete-files"])
        .output()
        .unwrap());
    assert!(!cached.exists());
    assert!(ls(home.path())
        .iter()
        .all(|r| r["name"] != "kiln-test/tiny-llama"));
}

/// `kiln fit --json` on SmolLM2 (CPU); its exit status is the verdict.
fn fit_json(home: &Path, args: &[&str]) -> Value {
    let out = kiln(home)
        .arg("fit")
        .arg(smollm2())
        .args(["--device", "cpu", "--json"])
        .args(args)
        .output()
        .unwrap();
    let v: Value = serde_json::from_str(&text(&out.stdout))
        .unwrap_or_else(|e| panic!("{e}: {}", text(&out.stderr)));
    let fits = v["fits"].as_bool().unwrap();
    assert_eq!(out.status.success(), fits, "exit status vs verdict: {v}");
    v
}

#[test]
fn fit_verdicts_and_serve_refuses_with_the_breakdown() {
    let home = tempfile::tempdir().unwrap();
    let fits = fit_json(
        home.path(),
        &["--context", "4096", "--memory-bytes", "4000000000"],
    );
    assert_eq!(fits["fits"], true);
    // The Q4_1/Q8_0 blocks are held repacked (as many bytes as the file's,
    // its pages let go); the 61 norm vectors of 576 are f32 copies.
    let in_place = fits["weights_in_place_bytes"].as_u64().unwrap();
    assert_eq!(
        fits["weights_bytes"].as_u64().unwrap(),
        in_place + 61 * 576 * 4
    );
    let file = std::fs::metadata(smollm2()).unwrap().len();
    assert!(
        in_place < file && in_place > file / 100 * 95,
        "{in_place} of {file}"
    );
    assert_eq!(fits["kv_bytes_per_token"], 2 * 30 * 3 * 64 * 4);
    assert_eq!(fits["max_context"], 8192);
    assert_eq!(fits["context_source"], "requested");
    let max_batch = fits["max_batch"].as_u64().unwrap();
    assert!(max_batch > 1, "{fits}");
    // One more sequence than the largest batch does not fit.
    let over = fit_json(
        home.path(),
        &[
            "--context",
            "4096",
            "--memory-bytes",
            "4000000000",
            "--batch",
            &(max_batch + 1).to_string(),
        ],
    );
    assert_eq!(over["fits"], false);
    let tight = fit_json(
        home.path(),
        &["--context", "8192", "--memory-bytes", "100000000"],
    );
    assert_eq!(tight["fits"], false);
    assert_eq!(tight["max_context"], 0);
    let e = failed(
        kiln(home.path())
            .arg("serve")
            .arg(smollm2())
            .args([
                "--device",
                "cpu",
                "--port",
                "0",
                "--memory-bytes",
                "100000000",
            ])
            .output()
            .unwrap(),
    );
    assert!(
        e.contains("does not fit one sequence of 8192 tokens"),
        "{e}"
    );
    assert!(
        e.contains("KV cache")
            && e.contains("weights (as stored)")
            && e.contains("verdict: does not fit"),
        "{e}"
    );
}

/// The context `kiln serve` announces at start (`--port 0`, stopped as
/// soon as it is printed).
fn serve_context(home: &Path, args: &[&str]) -> usize {
    use std::io::{BufRead, BufReader};
    let mut child = kiln(home)
        .arg("serve")
        .arg(smollm2())
        .args(["--device", "cpu", "--port", "0"])
        .args(args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut seen = Vec::new();
    let mut context = None;
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("kiln serve: context ") {
            context = rest.split(' ').next().and_then(|n| n.parse().ok());
            break;
        }
        seen.push(line);
    }
    let _ = child.kill();
    let _ = child.wait();
    context.unwrap_or_else(|| panic!("no context line in {seen:?}"))
}

#[test]
fn fit_and_serve_agree_on_the_default_context() {
    let home = tempfile::tempdir().unwrap();
    // SmolLM2 on the CPU: 92 MiB of blocks in the mapped file, 46,080 B of
    // KV a token. Three budgets: two where the pool holds less than the
    // trained context, one roomy.
    let mut contexts = Vec::new();
    for budget in ["450000000", "550000000", "8000000000"] {
        let plan = fit_json(home.path(), &["--memory-bytes", budget]);
        let served = serve_context(home.path(), &["--memory-bytes", budget]);
        assert_eq!(plan["context"].as_u64().unwrap() as usize, served, "{plan}");
        assert_eq!(plan["fits"], true, "{plan}");
        contexts.push(served);
    }
    assert!(
        contexts[0] < contexts[1] && contexts[1] < 8192,
        "{contexts:?}"
    );
    assert_eq!(contexts[2], 8192, "capped at the trained length");
    // A fixed pool gives the same answer through both too.
    let plan = fit_json(
        home.path(),
        &["--kv-mib", "100", "--memory-bytes", "8000000000"],
    );
    // Whole 16-token blocks of 46,080 B a token.
    assert_eq!(plan["context"], 100 * 1024 * 1024 / (46_080 * 16) * 16);
    assert_eq!(plan["context_source"], "memory");
    let served = serve_context(
        home.path(),
        &["--kv-mib", "100", "--memory-bytes", "8000000000"],
    );
    assert_eq!(plan["context"].as_u64().unwrap() as usize, served);
}

#[test]
fn fit_predicts_generate_peak_rss_on_smollm2_within_5_percent() {
    let home = tempfile::tempdir().unwrap();
    // A 2000-token prompt: running (KV + activations) outweighs loading.
    let prompt = vec!["The quick brown fox jumps over the lazy dog."; 200].join(" ");
    let out = kiln(home.path())
        .arg("generate")
        .arg("-m")
        .arg(smollm2())
        .args([
            "--device",
            "cpu",
            "--json",
            "--ignore-eos",
            "--max-tokens",
            "2",
            "--report-peak-rss",
            "-p",
        ])
        .arg(&prompt)
        .output()
        .unwrap();
    let v: Value = serde_json::from_str(&ok(out.clone())).unwrap();
    let context = v["timings"]["prompt_tokens"].as_u64().unwrap() + 2;
    assert!(context > 1900, "{v}");
    let stderr = text(&out.stderr);
    let peak: f64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix("kiln: peak RSS "))
        .and_then(|l| l.trim_end_matches(" bytes").parse().ok())
        .unwrap_or_else(|| panic!("no peak RSS in {stderr}"));
    let fit = fit_json(home.path(), &["--context", &context.to_string()]);
    let predicted = fit["total_bytes"].as_f64().unwrap();
    let err = (predicted - peak) / peak;
    eprintln!(
        "context {context}: peak RSS {peak} bytes, fit {predicted} bytes ({:+.1} %)",
        err * 100.0
    );
    assert!(
        err.abs() < 0.05,
        "fit {predicted} vs peak RSS {peak}: {:+.1} %",
        err * 100.0
    );
}

#[test]
fn a_missing_model_file_says_so_and_how_to_fetch_models() {
    let home = tempfile::tempdir().unwrap();
    for query in ["./models/nope.gguf", "missing-7b.Q4_K_M.gguf"] {
        let e = failed(
            kiln(home.path())
                .args(["generate", "-m", query, "-p", "hi"])
                .output()
                .unwrap(),
        );
        assert!(
            e.contains(&format!("{query}: no such file or directory"))
                && e.contains("scripts/fetch-models.sh"),
            "{e}"
        );
    }
}
