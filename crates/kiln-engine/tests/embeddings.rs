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
    assert_eq!(
        e.head.dimension as u64,
        golden["dimension"].as_u64().unwrap()
    );
    assert_eq!(
        e.head.max_seq_length as u64,
        golden["max_seq_length"].as_u64().unwrap()
    );
    let mut inputs = Vec::new();
    let mut worst = (1.0f64, String::new());
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let input = e
            .tokenize(
                case["text"].as_str().unwrap(),
                case["prompt_name"].as_str(),
                true,
            )
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
    eprintln!(
        "{}: worst 1 - cosine {:.2e} ({})",
        golden["model"],
        1.0 - worst.0,
        worst.1
    );
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
    let err = e
        .tokenize("x", Some("no-such-task"), true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no-such-task") && err.contains("query"),
        "{err}"
    );
}

fn engine_of(model: LoadedModel, num_blocks: usize) -> kiln_engine::Engine {
    kiln_engine::Engine::start(
        model,
        kiln_engine::EngineConfig {
            block_size: 16,
            num_blocks,
            max_num_seqs: 16,
            max_num_batched_tokens: 256,
            max_waiting: 64,
            context_length: None,
        },
    )
    .unwrap()
}

#[test]
fn the_engine_embeds_concurrent_requests_as_the_embedder_does() {
    // Reference vectors from the Embedder (own cache), then the same inputs
    // through an engine from eight threads at once: passes batch jobs up to
    // the token budget over blocks the pool lends; every vector is the
    // Embedder's, bit for bit, and no block stays taken.
    let reference_model = load("all-MiniLM-L6-v2");
    let e = Embedder::new(&reference_model).unwrap();
    let g = golden("all-MiniLM-L6-v2.json");
    let inputs: Vec<EmbedInput> = g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| e.tokenize(c["text"].as_str().unwrap(), None, true).unwrap())
        .collect();
    let want: Vec<Vec<f32>> = inputs
        .iter()
        .map(|i| e.embed(std::slice::from_ref(i)).unwrap().remove(0))
        .collect();
    let engine = engine_of(load("all-MiniLM-L6-v2"), 64);
    let handle = engine.handle();
    let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let jobs: Vec<_> = inputs
            .chunks(4)
            .map(|chunk| {
                let h = handle.clone();
                s.spawn(move || h.embed(chunk.to_vec()).unwrap())
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let got: Vec<Vec<f32>> = got.into_iter().flatten().collect();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "input {i}"
        );
    }
    let stats = handle.stats().unwrap();
    assert!(stats.embed_passes >= 1 && stats.embed_inputs == inputs.len() as u64);
    assert_eq!(stats.scheduler.num_blocks_used, 0);
    // Inputs that could never fit the pool at once are refused with the numbers.
    let big: Vec<EmbedInput> = (0..5).map(|_| inputs[19].clone()).collect();
    let small = engine_of(load("all-MiniLM-L6-v2"), 40);
    let err = small.handle().embed(big).unwrap_err().to_string();
    assert!(err.contains("80") && err.contains("40"), "{err}");
}

#[test]
fn embedding_passes_leave_running_generations_unchanged() {
    // SmolLM2 (a decoder: last-token pooling) generates while another
    // thread embeds; its tokens are those it generates alone.
    use kiln_sampling::SamplingParams;
    let path = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let model = LoadedModel::load(&path, Arc::new(CpuBackend::new())).unwrap();
    let prompt = model
        .tokenizer
        .encode("Write a poem about the sea.", true)
        .unwrap();
    let request = || {
        kiln_engine::GenerationRequest::new(
            prompt.clone(),
            SamplingParams {
                max_tokens: Some(24),
                ..SamplingParams::greedy()
            },
        )
    };
    let engine = engine_of(model, 64);
    let h = engine.handle();
    let tokens = |stream: kiln_engine::RequestStream| -> Vec<u32> {
        stream
            .filter_map(|ev| match ev {
                kiln_engine::Event::Token { token_id, .. } => Some(token_id),
                kiln_engine::Event::Failed { message, .. } => panic!("{message}"),
                _ => None,
            })
            .collect()
    };
    let alone = tokens(h.submit(request()).unwrap());
    let head = h.embedding_head().unwrap();
    assert_eq!(head.pooling, Pooling::LastToken);
    let text = "The sea is wide and deep. ".repeat(20);
    let input = h.embed_input(&text, None, true).unwrap();
    let stream = h.submit(request()).unwrap();
    let vectors = std::thread::scope(|s| {
        let embedder = s.spawn(|| {
            (0..6)
                .map(|_| h.embed(vec![input.clone()]).unwrap())
                .collect::<Vec<_>>()
        });
        let with = tokens(stream);
        assert_eq!(with, alone, "generation changed by embedding passes");
        embedder.join().unwrap()
    });
    for v in &vectors {
        assert_eq!(v[0], vectors[0][0]);
        let norm: f32 = v[0].iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
    }
}
