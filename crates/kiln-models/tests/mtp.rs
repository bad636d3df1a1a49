//! Multi-token-prediction heads against transformers, in float64: a random
//! Qwen3.5 checkpoint's (`tests/data/hybrid/qwen3_5_mtp`, made by
//! `scripts/goldens/mtp_random.py`; the head composed from transformers' own
//! Qwen3.5 modules) and a random GLM-4.5's DeepSeek-style MTP layer
//! (`tests/data/moe/glm4_moe`, `scripts/goldens/glm4_moe_random.py`) and
//! DeepSeek-V3's (`tests/data/moe/deepseek_v3`, `deepseek_random.py`; both
//! transformers' own `MtpModel`): at every prompt position from the model's
//! final hidden states, in one pass and in two (the second reading the
//! first's keys and values), then a second depth fed with the head's own
//! output.

mod common;

use std::path::PathBuf;

use kiln_models::CausalLm;
use kiln_tensor::ForwardBatch;

use common::compare_logprobs as compare;

fn dir() -> PathBuf {
    data("hybrid/qwen3_5_mtp")
}

fn data(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(case)
}

/// Every checkpoint with a head, and the directory of its golden: the
/// GLM-4.5 GGUF file holds the safetensors checkpoint's values.
const HEADS: [(&str, &str); 4] = [
    ("hybrid/qwen3_5_mtp", "hybrid/qwen3_5_mtp"),
    ("moe/glm4_moe", "moe/glm4_moe"),
    ("moe/deepseek_v3", "moe/deepseek_v3"),
    ("moe/gguf/glm4moe.gguf", "moe/glm4_moe"),
];

/// A checkpoint directory or GGUF file, on the CPU.
fn load(case: &str) -> Box<dyn CausalLm> {
    let path = data(case);
    match case.ends_with(".gguf") {
        true => {
            use std::sync::Arc;
            let w = kiln_formats::GgufWeights::open(&path).unwrap();
            let cfg = kiln_models::ModelConfig::from_hf(&w.hf_config().unwrap()).unwrap();
            kiln_models::load_model(Arc::new(kiln_tensor::cpu::CpuBackend::new()), &w, cfg).unwrap()
        }
        false => common::load_safetensors_dir(&path),
    }
}

struct Golden {
    prompt: Vec<u32>,
    logprobs: Vec<Vec<f64>>,
    mtp: Vec<Vec<f64>>,
    depth2_token: u32,
    depth2: Vec<f64>,
}

fn golden(case: &str) -> Golden {
    let text = std::fs::read_to_string(data(case).join("golden.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let row = |r: &serde_json::Value| -> Vec<f64> {
        r.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let rows = |k: &str| -> Vec<Vec<f64>> { v[k].as_array().unwrap().iter().map(row).collect() };
    Golden {
        prompt: common::ids(&v["prompt"]),
        logprobs: rows("logprobs"),
        mtp: rows("mtp_logprobs"),
        depth2_token: v["depth2_token"].as_u64().unwrap() as u32,
        depth2: row(&v["depth2_logprobs"]),
    }
}

/// The model's logits of every prompt row and its final hidden states.
fn trunk(m: &dyn CausalLm, prompt: &[u32]) -> (Vec<f32>, kiln_tensor::Tensor) {
    let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
    let pool = cache.spec;
    let batch = ForwardBatch::single(prompt, 0, &pool, 0);
    let (logits, hidden) = m.forward_with_hidden(&batch, &mut cache).unwrap();
    (m.backend().to_host(&logits).unwrap(), hidden)
}

#[test]
fn the_checkpoint_declares_and_ships_one_head() {
    let m = common::load_safetensors_dir(&dir());
    assert_eq!(m.mtp_heads(), 1);
    // `fit` counts the head's tensors (every one the checkpoint holds),
    // the decode roofline none of them (plain decoding never reads it).
    let shapes = kiln_models::tensor_shapes(m.config()).unwrap();
    let d = kiln_formats::SafetensorsDir::open(dir()).unwrap();
    let stored: std::collections::BTreeSet<String> = kiln_formats::WeightSource::tensors(&d)
        .into_iter()
        .map(|t| t.name)
        .collect();
    let listed: std::collections::BTreeSet<String> = shapes.iter().map(|s| s.0.clone()).collect();
    assert_eq!(listed, stored);
    let head: Vec<&String> = listed.iter().filter(|n| n.starts_with("mtp.")).collect();
    assert_eq!(head.len(), 15, "{head:?}");
    for n in head {
        assert_eq!(kiln_models::decode_share(m.config(), n), 0.0, "{n}");
    }
    // GLM-4.5's and DeepSeek-V3's MTP layer is `model.layers.{num_layers}.*`:
    // listed, every tensor the file has, none read by plain decoding. Its
    // own tensors (enorm, hnorm, eh_proj, shared_head.norm), the block's two
    // norms and attention (GLM: q/k/v/o, q/k/v biases, QK-norm; DeepSeek:
    // q_a, its norm, q_b, kv_a, its norm, kv_b, o), the router and its
    // bias, 16 experts' 3 and the shared expert's 3.
    for (case, attention) in [("moe/glm4_moe", 9), ("moe/deepseek_v3", 7)] {
        let m = common::load_safetensors_dir(&data(case));
        assert_eq!(m.mtp_heads(), 1, "{case}");
        let shapes = kiln_models::tensor_shapes(m.config()).unwrap();
        let d = kiln_formats::SafetensorsDir::open(data(case)).unwrap();
        let stored: std::collections::BTreeSet<String> = kiln_formats::WeightSource::tensors(&d)
            .into_iter()
            .map(|t| t.name)
            .collect();
        let listed: std::collections::BTreeSet<String> =
            shapes.iter().map(|s| s.0.clone()).collect();
        assert_eq!(listed, stored, "{case}");
        let layer: Vec<&String> = listed
            .iter()
            .filter(|n| n.starts_with("model.layers.3."))
            .collect();
        assert_eq!(
            layer.len(),
            4 + 2 + attention + 2 + 48 + 3,
            "{case}: {layer:?}"
        );
        for n in layer {
            assert_eq!(kiln_models::decode_share(m.config(), n), 0.0, "{n}");
        }
        let q = match case {
            "moe/glm4_moe" => "model.layers.2.self_attn.q_proj.weight",
            _ => "model.layers.2.self_attn.q_b_proj.weight",
        };
        assert!(kiln_models::decode_share(m.config(), q) > 0.0);
    }
    // The hybrid checkpoint without `mtp.*` has none, and says so.
    let plain = common::load_safetensors_dir(&dir().with_file_name("qwen3_5"));
    assert_eq!(plain.mtp_heads(), 0);
    let err = plain
        .new_mtp_cache(4, 16)
        .err()
        .expect("no head")
        .to_string();
    assert!(err.contains("multi-token-prediction"), "{err}");
}

#[test]
fn the_head_matches_transformers_at_every_position_and_depth() {
    for (case, golden_dir) in HEADS {
        head_matches_transformers(case, golden_dir);
    }
}

fn head_matches_transformers(case: &str, golden_dir: &str) {
    let g = golden(golden_dir);
    let m = load(case);
    let b = m.backend().clone();
    let vocab = m.config().vocab_size;
    let n = g.prompt.len();
    // The same logits as the plain forward pass, and transformers'.
    let (logits, hidden) = trunk(m.as_ref(), &g.prompt);
    let (worst, same) = compare(&logits, vocab, &g.logprobs);
    assert!(worst < 1e-3 && same, "{case} model: {worst}");
    let mut cache = m.kv_cache_for_tokens(n, 16).unwrap();
    let pool = cache.spec;
    let plain = b
        .to_host(
            &m.forward(&ForwardBatch::single(&g.prompt, 0, &pool, 0), &mut cache)
                .unwrap(),
        )
        .unwrap();
    assert_eq!(
        plain, logits,
        "{case}: forward_with_hidden changed the logits"
    );

    // Depth 1 at positions 0..n-2 (the token after each), in one pass and
    // in two passes over one cache.
    let rows: Vec<u32> = (0..n as u32 - 1).collect();
    let h = b.gather_rows(&hidden, &rows).unwrap();
    for split in [n - 1, 7] {
        let mut kv = m.new_mtp_cache(n.div_ceil(16) + 1, 16).unwrap();
        let pool = kv.spec;
        let mut got = Vec::new();
        let mut last = None;
        for (start, end) in [(0, split), (split, n - 1)] {
            if start == end {
                continue;
            }
            let batch = ForwardBatch::single(&g.prompt[start + 1..end + 1], start, &pool, 0);
            let part: Vec<u32> = (start as u32..end as u32).collect();
            let hp = b.gather_rows(&h, &part).unwrap();
            let (l, out) = m.mtp_forward(&batch, &hp, &mut kv).unwrap();
            got.extend(b.to_host(&l).unwrap());
            last = Some(out);
        }
        let (worst, same) = compare(&got, vocab, &g.mtp);
        eprintln!("{case}: depth 1 (split {split}) max |Δ log-softmax| {worst:.2e}");
        assert!(
            worst < 1e-3 && same,
            "{case} depth 1 (split {split}): {worst}"
        );

        // Depth 2 at position n-1: the next guess with the head's own
        // output at n-2.
        let out = last.unwrap();
        let rows_out = b.to_host(&out).unwrap().len() / m.config().hidden_size;
        let prev = b.gather_rows(&out, &[rows_out as u32 - 1]).unwrap();
        let batch = ForwardBatch::single(&[g.depth2_token], n - 1, &pool, 0);
        let (l, _) = m.mtp_forward(&batch, &prev, &mut kv).unwrap();
        let (worst, same) = compare(&b.to_host(&l).unwrap(), vocab, &[g.depth2.clone()]);
        assert!(
            worst < 1e-3 && same,
            "{case} depth 2 (split {split}): {worst}"
        );
    }
}
