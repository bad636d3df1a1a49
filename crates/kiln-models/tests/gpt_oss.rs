//! gpt-oss on random checkpoints against transformers (`tests/data/gpt_oss`,
//! made by `scripts/goldens/gpt_oss_random.py`; transformers' log-softmax
//! in float64): attention sinks, a 4-token sliding window on layer 0 and
//! full attention on layer 1 over a 20-token prompt, YaRN RoPE, the biased
//! top-k-softmax router, biased experts with the clamped SwiGLU over
//! interleaved gate/up columns. `plain` holds f32 experts as transformers
//! saves them; `mxfp4` the same model's experts in MXFP4 blocks and scales
//! as the released checkpoints do, its golden computed on the weights
//! transformers' own dequantizer reads from those bytes.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use kiln_formats::SafetensorsDir;
use kiln_models::{load_model, CausalLm, ModelConfig};
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::ForwardBatch;

fn case_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gpt_oss")
        .join(case)
}

fn load(case: &str) -> Box<dyn CausalLm> {
    common::load_safetensors_dir(&case_dir(case))
}

fn golden(case: &str) -> (Vec<u32>, Vec<Vec<f64>>) {
    common::logprob_golden(&case_dir(case).join("golden.json"))
}

use common::compare_logprobs as compare;

use common::host_logits as logits;

#[test]
fn gpt_oss_matches_transformers_in_prefill_and_token_by_token() {
    for case in ["plain", "mxfp4"] {
        let m = load(case);
        let (prompt, rows) = golden(case);
        let vocab = m.config().vocab_size;
        let mut cache = m.kv_cache_for_tokens(prompt.len(), 4).unwrap();
        let batch = ForwardBatch::single(&prompt, 0, &cache.spec, 0);
        let (worst, same) = compare(&logits(m.as_ref(), &batch, &mut cache), vocab, &rows);
        eprintln!("{case}: prefill max |Δ log-softmax| {worst:.2e}");
        assert!(
            worst <= 1e-3 && same,
            "{case}: prefill {worst}, argmax same {same}"
        );
        assert!(rows.iter().any(|r| r.iter().any(|&v| v > -2.0)), "{case}");
        // 6 tokens, then one a step past the window.
        let mut cache = m.kv_cache_for_tokens(prompt.len(), 4).unwrap();
        let (mut done, mut worst) = (0, 0f64);
        for chunk in [&prompt[..6]].into_iter().chain(prompt[6..].chunks(1)) {
            let batch = ForwardBatch::single(chunk, done, &cache.spec, chunk.len() - 1);
            let out = logits(m.as_ref(), &batch, &mut cache);
            let (w, same) = compare(&out, vocab, &rows[done + chunk.len() - 1..]);
            assert!(same, "{case}: argmax differs at {}", done + chunk.len() - 1);
            worst = worst.max(w);
            done += chunk.len();
        }
        eprintln!("{case}: decode max |Δ log-softmax| {worst:.2e}");
        assert!(worst <= 1e-3, "{case}: decode {worst}");
    }
}

#[test]
fn mxfp4_experts_stay_in_their_blocks() {
    // The same model: f32 experts, and MXFP4 experts kept as blocks (17
    // bytes a 32 stored; the CPU reads MXFP4 blocks, at most 18 bytes a 32
    // as it lays them out), not expanded to bf16's 64.
    let bytes = |case: &str| load(case).weight_bytes().unwrap().total();
    let (plain, mxfp4) = (bytes("plain"), bytes("mxfp4"));
    let cfg = load("plain").config().clone();
    let kiln_models::families::FamilyConfig::GptOss(g) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    let (h, i, layers) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers);
    let expert_values = (layers * g.num_experts * 3 * h * i) as u64;
    eprintln!("weights: plain {plain} bytes, mxfp4 {mxfp4}; expert values {expert_values}");
    let mxfp4_experts = mxfp4 - (plain - 4 * expert_values);
    assert!(
        mxfp4_experts * 32 <= 18 * expert_values,
        "{mxfp4_experts} bytes for {expert_values} expert values"
    );
}

#[test]
fn the_config_alternates_windows_and_reads_yarn() {
    let dir = SafetensorsDir::open(case_dir("plain")).unwrap();
    let cfg = ModelConfig::from_hf(dir.config()).unwrap();
    use kiln_models::config::LayerKind;
    assert_eq!(
        cfg.layer_kinds,
        [
            LayerKind::SlidingWindow { window: 4 },
            LayerKind::FullAttention
        ]
    );
    let kiln_models::families::FamilyConfig::GptOss(g) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    assert!(matches!(
        g.rope_scaling,
        kiln_models::RopeScaling::Yarn {
            factor: 32.0,
            truncate: false,
            ..
        }
    ));
    assert_eq!((g.num_experts, g.top_k), (4, 2));
}

#[test]
fn a_batch_gives_each_gpt_oss_sequence_its_bits_alone() {
    let m = load("mxfp4");
    let (prompt, _) = golden("mxfp4");
    let seqs: [&[u32]; 3] = [&prompt[..13], &prompt[4..], &prompt[9..12]];
    let vocab = m.config().vocab_size;
    let alone: Vec<Vec<f32>> = seqs
        .iter()
        .map(|s| {
            let mut cache = m.kv_cache_for_tokens(s.len(), 4).unwrap();
            let batch = ForwardBatch::single(s, 0, &cache.spec, 0);
            logits(m.as_ref(), &batch, &mut cache)
        })
        .collect();
    let (spec, _) = m.config().kv_layout(4);
    let groups = spec.groups.len();
    let per: Vec<u32> = seqs.iter().map(|s| s.len().div_ceil(4) as u32).collect();
    let total: u32 = per.iter().sum();
    let mut cache = m.new_kv_cache(groups * total as usize, 4).unwrap();
    let mut batch = ForwardBatch {
        block_size: 4,
        ..ForwardBatch::default()
    };
    let (mut next, mut starts) = (0u32, Vec::new());
    for (s, &n) in seqs.iter().zip(&per) {
        starts.push(batch.token_ids.len());
        let tables = (0..groups as u32)
            .map(|g| (g * total + next..g * total + next + n).collect())
            .collect();
        batch.push_seq_groups(s, 0, tables, false);
        next += n;
    }
    batch.logits_rows = (0..batch.token_ids.len() as u32).collect();
    let together = logits(m.as_ref(), &batch, &mut cache);
    for ((s, start), alone) in seqs.iter().zip(&starts).zip(&alone) {
        let rows = &together[start * vocab..(start + s.len()) * vocab];
        assert!(
            rows.iter()
                .zip(alone)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "a sequence of {} tokens differs in a batch",
            s.len()
        );
    }
}

/// The same model as a `gpt-oss` GGUF laid out as llama.cpp writes it
/// (`tests/data/gpt_oss/gguf`, `scripts/goldens/gpt_oss_gguf.py`): experts
/// split into gate/up/down in MXFP4, read an expert at a time and kept as
/// stored, against transformers on the same dequantized values.
#[test]
fn gpt_oss_gguf_matches_transformers() {
    use kiln_formats::{GgufWeights, WeightSource};
    let w = GgufWeights::open(case_dir("gguf").join("gpt-oss.gguf")).unwrap();
    let cfg = ModelConfig::from_hf(&w.hf_config().unwrap()).unwrap();
    assert_eq!(cfg.model_type, "gpt_oss");
    use kiln_models::config::LayerKind;
    assert_eq!(
        cfg.layer_kinds,
        [
            LayerKind::SlidingWindow { window: 4 },
            LayerKind::FullAttention
        ]
    );
    let experts: Vec<_> = w
        .tensors()
        .into_iter()
        .filter(|t| t.name.contains(".experts.") && t.name.ends_with("_proj.weight"))
        .collect();
    assert_eq!(experts.len(), 2 * 3 * 4);
    assert!(experts.iter().all(|t| t.dtype == "MXFP4"), "{experts:?}");
    let m = load_model(Arc::new(CpuBackend::new()), &w, cfg).unwrap();
    let (prompt, rows) = golden("gguf");
    let vocab = m.config().vocab_size;
    let mut cache = m.kv_cache_for_tokens(prompt.len(), 4).unwrap();
    let batch = ForwardBatch::single(&prompt, 0, &cache.spec, 0);
    let (worst, same) = compare(&logits(m.as_ref(), &batch, &mut cache), vocab, &rows);
    eprintln!("gguf: prefill max |Δ log-softmax| {worst:.2e}");
    assert!(worst <= 1e-3 && same, "gguf: {worst}, argmax same {same}");
}
