//! Sentence embeddings of the real all-MiniLM-L6-v2 (BERT) and
//! EmbeddingGemma-300M (bidirectional Gemma 3 with two Dense layers)
//! directories against sentence-transformers on CPU
//! (`testdata/goldens/embeddings`, made by
//! `scripts/goldens/embeddings/gen_embeddings.py`): the same token ids
//! (prompts and truncation at the model's limit included) and cosine ≥
//! 0.9999 for each of the 30 inputs; a batch gives each input what it
//! gives alone, bit for bit.

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::{EmbedInput, Embedder, LoadedModel, Pooling};
use kiln_tensor::cpu::CpuBackend;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn load(dir: &str) -> LoadedModel {
    let path = root().join("models").join(dir);
    assert!(
        path.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch-models.sh",
        path.display()
    );
    LoadedModel::load(&path, Arc::new(CpuBackend::new())).expect("load")
}

fn golden(name: &str) -> Value {
    let path = root().join("testdata/goldens/embeddings").join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * y).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// Every golden case: ids, then the embedding; the inputs for the batch
/// check come back.
fn check(model: &LoadedModel, golden: &Value) -> Vec<EmbedInput> {
    let e = Embedder::new(model).unwrap();
    assert_eq!(e.head.dimension as u64, golden["dimension"].as_u64().unwrap());
    assert_eq!(e.head.max_seq_length as u64, golden["max_seq_length"].as_u64().unwrap());
    let mut inputs = Vec::new();
    let mut worst = (1.0f64, String::new());
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let input = e
            .tokenize(case["text"].as_str().unwrap(), case["prompt_name"].as_str(), true)
            .unwrap();
        let want_ids: Vec<u32> = case["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(input.ids, want_ids, "{name}: token ids");
        let got = e.embed(std::slice::from_ref(&input)).unwrap().remove(0);
        let want: Vec<f64> = case["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len(), "{name}: dimension");
        let c = cosine(&got, &want);
        assert!(c >= 0.9999, "{name}: cosine {c}");
        if c < worst.0 {
            worst = (c, name.to_string());
        }
        if input.ids.len() < 300 {
            inputs.push(input);
        }
    }
    eprintln!("{}: worst 1 - cosine {:.2e} ({})", golden["model"], 1.0 - worst.0, worst.1);
    // Batched = alone, bit for bit.
    let batched = e.embed(&inputs).unwrap();
    for (input, b) in inputs.iter().zip(&batched) {
        let alone = e.embed(std::slice::from_ref(input)).unwrap().remove(0);
        assert!(
            alone.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{:?}: batched differs from alone",
            input.ids
        );
    }
    inputs
}

#[test]
fn minilm_matches_sentence_transformers() {
    let model = load("all-MiniLM-L6-v2");
    assert!(!model.model.generates());
    let e = Embedder::new(&model).unwrap();
    assert_eq!(e.head.pooling, Pooling::Mean);
    check(&model, &golden("all-MiniLM-L6-v2.json"));
    // Past the limit without truncation: an error naming the limit.
    let long = "word ".repeat(400);
    let err = e.tokenize(&long, None, false).unwrap_err().to_string();
    assert!(err.contains("256"), "{err}");
}

#[test]
fn embeddinggemma_matches_sentence_transformers() {
    let model = load("embeddinggemma-300m");
    let e = Embedder::new(&model).unwrap();
    assert_eq!(e.head.pooling, Pooling::Mean);
    assert_eq!(e.head.dense.len(), 2);
    check(&model, &golden("embeddinggemma-300m.json"));
    let err = e.tokenize("x", Some("no-such-task"), true).unwrap_err().to_string();
    assert!(err.contains("no-such-task") && err.contains("query"), "{err}");
}
