//! Shared helpers of the integration tests: the real models, their goldens, and one
//! tokenizer per model built once per test binary.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kiln_formats::GgufFile;
use kiln_text::Tokenizer;
use serde_json::Value;

/// The models with goldens in `testdata/goldens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    SmolLm2,
    Qwen,
    Gemma,
}

impl Model {
    pub fn gguf_file(self) -> &'static str {
        match self {
            Model::SmolLm2 => "SmolLM2-135M-Instruct.Q4_1.gguf",
            Model::Qwen => "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            Model::Gemma => "gemma-3-270m-q4_k_m.gguf",
        }
    }

    pub fn golden_dir(self) -> &'static str {
        match self {
            Model::SmolLm2 => "smollm2",
            Model::Qwen => "qwen2.5-coder-0.5b",
            Model::Gemma => "gemma3-270m",
        }
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The path of a model file; panics with the fix when the file is missing.
pub fn model_path(model: Model) -> PathBuf {
    let path = repo_root().join("models").join(model.gguf_file());
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-models.sh (from the repository root) to fetch the test models",
        path.display()
    );
    path
}

/// A golden JSON file of a model.
pub fn golden(model: Model, file: &str) -> Value {
    let path = repo_root()
        .join("testdata/goldens")
        .join(model.golden_dir())
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read golden {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON fixture of this crate's `tests/data`.
pub fn test_data(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The tokenizer built from a model's GGUF metadata, shared by the tests of one binary.
pub fn gguf_tokenizer(model: Model) -> &'static Tokenizer {
    static SMOLLM2: OnceLock<Tokenizer> = OnceLock::new();
    static QWEN: OnceLock<Tokenizer> = OnceLock::new();
    static GEMMA: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match model {
        Model::SmolLm2 => &SMOLLM2,
        Model::Qwen => &QWEN,
        Model::Gemma => &GEMMA,
    };
    cell.get_or_init(|| {
        let path = model_path(model);
        let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
        Tokenizer::from_gguf(&gguf.metadata).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// The tokenizer cases of a model's goldens.
pub fn tokenizer_cases(model: Model) -> Vec<Value> {
    let cases = golden(model, "tokenizer_cases.json");
    cases["cases"].as_array().expect("cases is a list").clone()
}

/// A golden's id list.
pub fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("ids are a list")
        .iter()
        .map(|v| v.as_u64().expect("an id") as u32)
        .collect()
}

/// A golden's string.
pub fn text(value: &Value) -> &str {
    value.as_str().expect("a string")
}

/// A fresh directory under Cargo's per-target temporary directory.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}
