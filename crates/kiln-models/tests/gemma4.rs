//! Gemma 4 text models on random checkpoints against transformers
//! (`tests/data/gemma4/*`, made by `scripts/goldens/gemma4_random.py`:
//! transformers' log-softmax in float64 over a prompt five times the
//! sliding window). `shared_kv` has K = V full layers, the last three layers
//! reading earlier layers' caches, double-wide MLPs and per-layer input
//! embeddings; `plain` the E-model attention without them.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use kiln_formats::SafetensorsDir;
use kiln_models::{load_model, CausalLm, ModelConfig};
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::ForwardBatch;

fn case_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gemma4")
        .join(case)
}

fn load(case: &str) -> Box<dyn CausalLm> {
    common::load_safetensors_dir(&case_dir(case))
}

/// The prompt and transformers' log-softmax at every position.
fn golden(case: &str) -> (Vec<u32>, Vec<Vec<f64>>) {
    common::logprob_golden(&case_dir(case).join("golden.json"))
}

use common::compare_logprobs as compare;

/// The whole prompt in one step, logits at every position.
fn prefill_matches(case: &str) {
    let m = load(case);
    let (prompt, rows) = golden(case);
    let vocab = m.config().vocab_size;
    let mut cache = m.kv_cache_for_tokens(prompt.len(), 4).unwrap();
    let batch = ForwardBatch::single(&prompt, 0, &cache.spec, 0);
    let out = m
        .backend()
        .to_host(&m.forward(&batch, &mut cache).unwrap())
        .unwrap();
    assert_eq!(out.len(), prompt.len() * vocab);
    let (worst, argmax_same) = compare(&out, vocab, &rows);
    assert!(worst <= 1e-3, "{case}: max |Δ log-softmax| {worst}");
    assert!(argmax_same, "{case}: an argmax differs");
    // The check can fail: the golden is not flat.
    assert!(rows.iter().any(|r| r.iter().any(|&v| v > -2.0)), "{case}");
}

/// A chunk of 7 tokens, then one token a step: the shared layers read what
/// their producers wrote in earlier steps and in this one.
fn decode_matches(case: &str) {
    let m = load(case);
    let (prompt, rows) = golden(case);
    let vocab = m.config().vocab_size;
    let mut cache = m.kv_cache_for_tokens(prompt.len(), 4).unwrap();
    let mut done = 0;
    let mut worst = 0f64;
    for chunk in [&prompt[..7]].into_iter().chain(prompt[7..].chunks(1)) {
        let batch = ForwardBatch::single(chunk, done, &cache.spec, chunk.len() - 1);
        let out = m
            .backend()
            .to_host(&m.forward(&batch, &mut cache).unwrap())
            .unwrap();
        let (w, same) = compare(&out, vocab, &rows[done + chunk.len() - 1..]);
        assert!(
            same,
            "{case}: argmax differs at position {}",
            done + chunk.len() - 1
        );
        worst = worst.max(w);
        done += chunk.len();
    }
    assert!(
        worst <= 1e-3,
        "{case}: max |Δ log-softmax| {worst} decoding"
    );
}

#[test]
fn shared_kv_checkpoint_matches_transformers_in_prefill() {
    prefill_matches("shared_kv");
}

#[test]
fn shared_kv_checkpoint_matches_transformers_token_by_token() {
    decode_matches("shared_kv");
}

#[test]
fn plain_checkpoint_matches_transformers_in_prefill_and_decode() {
    prefill_matches("plain");
    decode_matches("plain");
}

#[test]
fn shared_layers_keep_no_cache_and_read_their_producers() {
    let dir = SafetensorsDir::open(case_dir("shared_kv")).unwrap();
    let cfg = ModelConfig::from_hf(dir.config()).unwrap();
    // Layers s s f | s s f: the last three read layers 1 (sliding) and 2 (full).
    let from: Vec<_> = cfg.layer_kv.iter().map(|l| l.shared_from).collect();
    assert_eq!(from, [None, None, None, Some(1), Some(1), Some(2)]);
    let shapes: Vec<_> = cfg
        .layer_kv
        .iter()
        .map(|l| (l.num_kv_heads, l.head_dim))
        .collect();
    assert_eq!(
        shapes,
        [(2, 16), (2, 16), (1, 32), (2, 16), (2, 16), (1, 32)]
    );
    let (spec, slots) = cfg.kv_layout(4);
    // Owners: 2 sliding layers and 1 full one; groups of one layer.
    assert_eq!(spec.groups.len(), 3);
    assert_eq!(slots[3], slots[1]);
    assert_eq!(slots[4], slots[1]);
    assert_eq!(slots[5], slots[2]);
    // A token's KV bytes (f32): three owners, 32 elements each for K and V.
    assert_eq!(cfg.kv_bytes_per_token(4), 3 * 2 * 32 * 4);
    assert_eq!(cfg.kv_row(), 32);
}

#[test]
fn random_checkpoints_of_every_shape_load_and_run() {
    use kiln_models::random::RandomWeights;
    let dir = SafetensorsDir::open(case_dir("shared_kv")).unwrap();
    // The registry's tensor list is what the loader reads: a random
    // checkpoint built from it loads, and runs finite.
    for ple in [8, 0] {
        let mut v = dir.config().clone();
        v["hidden_size_per_layer_input"] = serde_json::json!(ple);
        let cfg = ModelConfig::from_hf(&v).unwrap();
        let w = RandomWeights::new(&cfg, 3).unwrap();
        let m = load_model(Arc::new(CpuBackend::new()), &w, cfg).unwrap();
        let mut cache = m.kv_cache_for_tokens(9, 4).unwrap();
        let batch = ForwardBatch::single(&[1, 5, 9, 2, 7, 3, 8, 4, 6], 0, &cache.spec, 0);
        let out = m
            .backend()
            .to_host(&m.forward(&batch, &mut cache).unwrap())
            .unwrap();
        assert!(out.iter().all(|x| x.is_finite()));
        assert!(out.iter().any(|&x| x.abs() > 1e-3));
    }
}

#[test]
fn a_multimodal_wrapper_loads_as_its_text_decoder() {
    use kiln_formats::{write_safetensors, SafetensorsDtype, WeightSource};
    // Gemma4ForConditionalGeneration's layout: the text config under
    // `text_config`, the decoder's tensors under `model.language_model.`,
    // towers beside it.
    let plain = SafetensorsDir::open(case_dir("shared_kv")).unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-gemma4-wrapper-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = serde_json::json!({
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": plain.config(), "vision_config": null, "audio_config": null,
        "tie_word_embeddings": true});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut tensors: Vec<(String, kiln_formats::HostTensor)> = plain
        .tensors()
        .iter()
        .map(|t| {
            let name = t.name.replacen("model.", "model.language_model.", 1);
            (name, plain.load_f32(&t.name).unwrap())
        })
        .collect();
    tensors.push((
        "model.vision_tower.patch_embed.weight".into(),
        kiln_formats::HostTensor::new(vec![2, 3], vec![0.5; 6]),
    ));
    let refs: Vec<(String, &kiln_formats::HostTensor)> =
        tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    write_safetensors(dir.join("model.safetensors"), &refs, SafetensorsDtype::F32).unwrap();

    let wrapped = SafetensorsDir::open(&dir).unwrap();
    assert_eq!(wrapped.config()["model_type"], "gemma4_text");
    assert_eq!(wrapped.tensors().len(), plain.tensors().len());
    let run = |d: &SafetensorsDir| {
        let cfg = ModelConfig::from_hf(d.config()).unwrap();
        let m = load_model(Arc::new(CpuBackend::new()), d, cfg).unwrap();
        let mut cache = m.kv_cache_for_tokens(6, 4).unwrap();
        let batch = ForwardBatch::single(&[2, 17, 93, 5, 64, 101], 0, &cache.spec, 0);
        m.backend()
            .to_host(&m.forward(&batch, &mut cache).unwrap())
            .unwrap()
    };
    assert_eq!(run(&wrapped), run(&plain));
    std::fs::remove_dir_all(&dir).unwrap();
}
