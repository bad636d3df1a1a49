//! Helpers shared by the golden tests: paths, the real models, .npy reading.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use kiln_formats::GgufWeights;
use kiln_models::{load_model, CausalLm, ModelConfig};
use kiln_tensor::cpu::CpuBackend;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A real model fetched by `scripts/fetch-models.sh`.
pub fn model_path(file: &str) -> PathBuf {
    let p = repo_root().join("models").join(file);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    p
}

pub fn goldens(model: &str, file: &str) -> serde_json::Value {
    let p = repo_root().join("testdata/goldens").join(model).join(file);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

/// Read a little-endian float32 1-D `.npy` file.
pub fn read_npy_f32(model: &str, rel: &str) -> Vec<f32> {
    let p = repo_root().join("testdata/goldens").join(model).join(rel);
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("'<f4'"), "{header}");
    bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn load_gguf_model(file: &str) -> Box<dyn CausalLm> {
    let w = GgufWeights::open(model_path(file)).unwrap();
    let cfg = ModelConfig::from_hf(&w.hf_config().unwrap()).unwrap();
    load_model(Arc::new(CpuBackend::new()), &w, cfg).unwrap()
}

/// Log-softmax in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&x| x as f64 - lse).collect()
}

pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A random-checkpoint golden (a JSON file written by a script in
/// `scripts/goldens/`): the prompt and transformers' log-softmax at every
/// position. Where the golden records the routing margin of a sparse model,
/// it must be wide enough that f32 rounding cannot flip a choice.
pub fn logprob_golden(path: &std::path::Path) -> (Vec<u32>, Vec<Vec<f64>>) {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let g: serde_json::Value = serde_json::from_str(&text).unwrap();
    // One margin, or several (a grouped router's group scores and keys).
    for key in ["min_routing_margin", "min_routing_margin_mtp"] {
        let margins = match g.get(key) {
            Some(serde_json::Value::Object(m)) => m.values().cloned().collect(),
            Some(v) => vec![v.clone()],
            None => Vec::new(),
        };
        for margin in margins {
            assert!(margin.as_f64().unwrap() > 1e-3, "{} {key}", path.display());
        }
    }
    let rows = g["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect();
    (ids(&g["prompt"]), rows)
}

/// The largest |Δ log-softmax| of `logits` (rows of `vocab`) against golden
/// `rows`, and whether every row's argmax matches.
pub fn compare_logprobs(logits: &[f32], vocab: usize, rows: &[Vec<f64>]) -> (f64, bool) {
    let mut worst = 0f64;
    let mut argmax_same = true;
    for (got, want) in logits.chunks(vocab).zip(rows) {
        for (a, b) in log_softmax(got).iter().zip(want) {
            worst = worst.max((a - b).abs());
        }
        let best = want
            .iter()
            .enumerate()
            .fold(0, |m, (i, &v)| if v > want[m] { i } else { m });
        argmax_same &= argmax(got) == best;
    }
    (worst, argmax_same)
}

/// A safetensors checkpoint directory loaded on the CPU.
pub fn load_safetensors_dir(dir: &std::path::Path) -> Box<dyn CausalLm> {
    let w = kiln_formats::SafetensorsDir::open(dir).unwrap();
    let cfg = ModelConfig::from_hf(w.config()).unwrap();
    load_model(Arc::new(CpuBackend::new()), &w, cfg).unwrap()
}

/// One forward step's logits, on the host.
pub fn host_logits(
    m: &dyn CausalLm,
    batch: &kiln_tensor::ForwardBatch,
    cache: &mut kiln_tensor::KvCache,
) -> Vec<f32> {
    m.backend()
        .to_host(&m.forward(batch, cache).unwrap())
        .unwrap()
}
