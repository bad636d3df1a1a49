//! Quantized Hugging Face checkpoints against transformers
//! (`tests/data/quantized/*`, made by `scripts/goldens/quantized_st.py`):
//! one random Llama with every projection stored as AWQ (GEMM order,
//! asymmetric 4-bit groups of 32 and of 128), GPTQ (4-bit symmetric, with
//! an act-order `g_idx` and without; asymmetric groups of 128),
//! compressed-tensors pack-quantized int4 and FP8 per channel, and FP8
//! with block scales; the golden is transformers' float64 log-softmax of
//! the model whose projections are the dequantized weights (the layouts
//! packed by AutoAWQ's and compressed-tensors' own code; transformers
//! loads the compressed-tensors ones itself to the same logits).

mod common;

use std::path::PathBuf;

use kiln_formats::{SafetensorsDir, WeightSource};
use kiln_tensor::ForwardBatch;

const CASES: [&str; 8] = [
    "awq",
    "gptq",
    "gptq_noact",
    "ct_int4",
    "ct_fp8",
    "fp8_block",
    "awq_g128",
    "gptq_asym",
];

fn case_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/quantized")
        .join(case)
}

#[test]
fn quantized_checkpoints_match_transformers() {
    for case in CASES {
        let m = common::load_safetensors_dir(&case_dir(case));
        let (prompt, rows) = common::logprob_golden(&case_dir(case).join("golden.json"));
        let vocab = m.config().vocab_size;
        let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
        let batch = ForwardBatch::single(&prompt, 0, &cache.spec, 0);
        let out = common::host_logits(m.as_ref(), &batch, &mut cache);
        let (worst, argmax_same) = common::compare_logprobs(&out, vocab, &rows);
        eprintln!("{case}: max |Δ log-softmax| {worst:.2e}");
        assert!(worst <= 1e-3, "{case}: max |Δ log-softmax| {worst}");
        assert!(argmax_same, "{case}: an argmax differs");
    }
}

/// The stored parts are hidden behind the matrices they make; the
/// unquantized tensors stay as they are.
#[test]
fn the_tensor_list_names_the_matrices_not_their_parts() {
    for case in CASES {
        let dir = SafetensorsDir::open(case_dir(case)).unwrap();
        let names: Vec<String> = dir.tensors().into_iter().map(|t| t.name).collect();
        let q = "model.layers.1.self_attn.k_proj.weight";
        assert!(names.iter().any(|n| n == q) && dir.contains(q), "{case}");
        for part in [
            "qweight",
            "qzeros",
            "scales",
            "g_idx",
            "weight_packed",
            "weight_scale",
            "weight_scale_inv",
        ] {
            assert!(
                !names.iter().any(|n| n.ends_with(&format!(".{part}"))),
                "{case}: {part} listed"
            );
        }
        let t = dir.load_f32(q).unwrap();
        assert_eq!(t.shape, [64, 128], "{case}");
        assert!(dir.contains("lm_head.weight") && dir.contains("model.norm.weight"));
    }
}

/// Int4 groups in input order load as blocks the backends multiply in
/// place (the logits test above runs through them): symmetric ones (GPTQ
/// without act-order, compressed-tensors int4) are exactly GGUF Q4_0 (4.5
/// bits a weight), ones with zero points in groups of 128 (AWQ, GPTQ
/// asymmetric) Kiln's Q4_Z (4.25 bits), in groups of 32 Q4_Z32 (5 bits);
/// FP8 whose scales are constant over runs of 128 (per channel here)
/// Kiln's FP8 blocks (8.25 bits); the others (act-order GPTQ, FP8 in
/// 32×32 blocks) are read dense.
#[test]
fn int4_groups_in_order_and_fp8_runs_load_as_blocks() {
    use kiln_tensor::QuantFormat;
    let q = "model.layers.0.mlp.down_proj.weight";
    for case in CASES {
        let dir = SafetensorsDir::open(case_dir(case)).unwrap();
        let blocks = dir.load_blocks(q).unwrap();
        let want = match case {
            "gptq_noact" | "ct_int4" => Some(QuantFormat::Q4_0),
            "awq_g128" | "gptq_asym" => Some(QuantFormat::Q4Z),
            "awq" => Some(QuantFormat::Q4Z32),
            "ct_fp8" => Some(QuantFormat::FP8),
            _ => None,
        };
        match want {
            Some(f) => {
                let m = blocks.unwrap_or_else(|| panic!("{case}: not blocks"));
                assert_eq!(m.format(), f, "{case}");
                // The tensor list names the format it loads as (the memory
                // plan counts its bytes).
                let listed = dir.tensors().into_iter().find(|t| t.name == q).unwrap();
                assert_eq!(listed.dtype, f.name(), "{case}");
                assert_eq!((m.rows(), m.cols()), (128, 256), "{case}");
                // The blocks are the dense reading, value for value.
                let dense = dir.load_f32(q).unwrap().data;
                let got = m.dequantize();
                assert_eq!(got.len(), dense.len());
                for (i, (a, b)) in got.iter().zip(&dense).enumerate() {
                    assert!(a == b, "{case}: element {i}: {a} vs {b}");
                }
            }
            None => assert!(blocks.is_none(), "{case}: blocks"),
        }
    }
}

/// A layout Kiln does not read is refused at open, by name.
#[test]
fn an_unknown_quantization_is_refused_clearly() {
    let tmp = std::env::temp_dir().join(format!("kiln-bnb-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(case_dir("awq").join(f), tmp.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(case_dir("awq").join("config.json")).unwrap())
            .unwrap();
    cfg["quantization_config"] =
        serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true});
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let err = SafetensorsDir::open(&tmp)
        .err()
        .expect("refused")
        .to_string();
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(
        err.contains("bitsandbytes") && err.contains("quantization_config"),
        "{err}"
    );
}
