//! The real GGUF files in `models/` (fetched by `scripts/fetch-models.sh`):
//! configs match the facts in docs/models.md, every tensor maps to a Hugging
//! Face name with the shape that name implies, Q/K un-permutation matches
//! transformers' (through the fixtures), and a GGUF → safetensors directory →
//! reader round trip is bit-exact.

mod common;

use common::*;
use kiln_formats::{
    write_hf_dir_with, GgufWeights, HfDirOptions, SafetensorsDir, SafetensorsDtype, WeightSource,
};
use serde_json::{json, Value};

#[track_caller]
fn assert_config(c: &Value, expected: Value) {
    for (k, v) in expected.as_object().unwrap() {
        assert_eq!(&c[k], v, "config[{k}] in {c}");
    }
}

/// Every GGUF tensor has an HF name, once, with the shape the config implies.
fn check_tensor_names(w: &GgufWeights) {
    let c = w.hf_config().unwrap();
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    let (hidden, ffn, vocab) = (u("hidden_size"), u("intermediate_size"), u("vocab_size"));
    let (q, kv) = (
        u("num_attention_heads") * u("head_dim"),
        u("num_key_value_heads") * u("head_dim"),
    );
    let stored = w.tensors();
    assert_eq!(
        stored.len(),
        w.file.tensors.len(),
        "some GGUF tensors have no HF name"
    );
    let mut names: Vec<&str> = stored.iter().map(|t| t.name.as_str()).collect();
    names.sort();
    names.dedup();
    assert_eq!(
        names.len(),
        stored.len(),
        "two GGUF tensors map to one HF name"
    );
    for t in &stored {
        let layer_part = t
            .name
            .strip_prefix("model.layers.")
            .map(|r| r.split_once('.').unwrap().1);
        let want: Vec<usize> = match (t.name.as_str(), layer_part) {
            ("model.embed_tokens.weight" | "lm_head.weight", _) => vec![vocab, hidden],
            ("model.norm.weight", _) => vec![hidden],
            (_, Some("self_attn.q_proj.weight")) => vec![q, hidden],
            (_, Some("self_attn.k_proj.weight" | "self_attn.v_proj.weight")) => vec![kv, hidden],
            (_, Some("self_attn.o_proj.weight")) => vec![hidden, q],
            (_, Some("self_attn.q_proj.bias")) => vec![q],
            (_, Some("self_attn.k_proj.bias" | "self_attn.v_proj.bias")) => vec![kv],
            (_, Some("self_attn.q_norm.weight" | "self_attn.k_norm.weight")) => vec![u("head_dim")],
            (_, Some("mlp.gate_proj.weight" | "mlp.up_proj.weight")) => vec![ffn, hidden],
            (_, Some("mlp.down_proj.weight")) => vec![hidden, ffn],
            (_, Some(n)) if n.ends_with("layernorm.weight") => vec![hidden],
            _ => panic!("unexpected tensor {}", t.name),
        };
        assert_eq!(t.shape, want, "{}", t.name);
    }
    for i in 0..u("num_hidden_layers") {
        assert!(
            w.contains(&format!("model.layers.{i}.mlp.down_proj.weight")),
            "layer {i}"
        );
    }
}

#[test]
fn smollm2_config_and_names() {
    let w = GgufWeights::open(model_path(SMOLLM2)).unwrap();
    assert_eq!(w.arch(), "llama");
    assert_eq!(w.file.tensors.len(), 272);
    let c = w.hf_config().unwrap();
    assert_config(
        &c,
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
            "vocab_size": 49152, "tie_word_embeddings": true, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        }),
    );
    assert!(c.get("attention_bias").is_none());
    assert!(!w.contains("lm_head.weight"));
    check_tensor_names(&w);
    let t = w.tensors();
    let dtype = |n: &str| t.iter().find(|t| t.name == n).unwrap().dtype.clone();
    assert_eq!(dtype("model.embed_tokens.weight"), "Q8_0");
    assert_eq!(dtype("model.layers.0.self_attn.q_proj.weight"), "Q4_1");
    assert_eq!(dtype("model.norm.weight"), "F32");
}

#[test]
fn qwen_config_and_names() {
    let w = GgufWeights::open(model_path(QWEN)).unwrap();
    assert_eq!(w.arch(), "qwen2");
    assert_eq!(w.file.tensors.len(), 291);
    let c = w.hf_config().unwrap();
    assert_config(
        &c,
        json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
            "vocab_size": 151936, "tie_word_embeddings": false, "attention_bias": true,
            "bos_token_id": 151643, "eos_token_id": 151645,
        }),
    );
    assert!(w.contains("lm_head.weight"));
    assert!(w.contains("model.layers.23.self_attn.v_proj.bias"));
    check_tensor_names(&w);
    // Biases load as plain vectors.
    let b = w.load_f32("model.layers.0.self_attn.q_proj.bias").unwrap();
    assert_eq!(b.shape, [896]);
    assert!(b.data.iter().any(|&x| x != 0.0));
}

#[test]
fn gemma3_config_names_and_norm_offset() {
    let w = GgufWeights::open(model_path(GEMMA3)).unwrap();
    assert_eq!(w.arch(), "gemma3");
    let c = w.hf_config().unwrap();
    assert_config(
        &c,
        json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "sliding_window": 512, "query_pre_attn_scalar": 256, "vocab_size": 262144,
            "tie_word_embeddings": true, "hidden_activation": "gelu_pytorch_tanh",
            "bos_token_id": 2, "eos_token_id": 1,
        }),
    );
    check_tensor_names(&w);
    // GGUF stores 1 + w for every norm; the HF weight is w.
    for (hf, gguf) in [
        (
            "model.layers.0.input_layernorm.weight",
            "blk.0.attn_norm.weight",
        ),
        (
            "model.layers.0.pre_feedforward_layernorm.weight",
            "blk.0.ffn_norm.weight",
        ),
        (
            "model.layers.0.self_attn.q_norm.weight",
            "blk.0.attn_q_norm.weight",
        ),
        ("model.norm.weight", "output_norm.weight"),
    ] {
        let got = w.load_f32(hf).unwrap().data;
        let raw = w.file.tensor_f32(gguf).unwrap();
        let want: Vec<f32> = raw.iter().map(|x| x - 1.0).collect();
        assert_eq!(got, want, "{hf}");
    }
    // Projections are not touched.
    let q = w
        .load_f32("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q.data, w.file.tensor_f32("blk.0.attn_q.weight").unwrap());
}

/// Q/K come out in Hugging Face's layout: the fixtures hold transformers'
/// un-permutation of gguf-py's dequantization, sampled at a few columns.
#[test]
fn qk_layout_matches_transformers() {
    let manifest = read_json(&fixture("unpermute/manifest.json"));
    let cases = manifest["cases"].as_array().unwrap();
    assert!(
        cases.iter().any(|c| c["permuted_heads"].is_null()),
        "no un-permuted control case"
    );
    for c in cases {
        let file = c["file"].as_str().unwrap();
        let w = GgufWeights::open(model_path(file)).unwrap();
        let hf = c["hf_tensor"].as_str().unwrap();
        let t = w.load_f32(hf).unwrap();
        let (rows, cols) = (
            c["rows"].as_u64().unwrap() as usize,
            c["cols"].as_u64().unwrap() as usize,
        );
        assert_eq!(t.shape, [rows, cols], "{hf}");
        let columns: Vec<usize> = c["columns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let want = read_f32_le(&fixture(&format!(
            "unpermute/{}",
            c["values"].as_str().unwrap()
        )));
        assert_eq!(want.len(), rows * columns.len());
        for r in 0..rows {
            for (j, &col) in columns.iter().enumerate() {
                let (g, e) = (t.data[r * cols + col], want[r * columns.len() + j]);
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{file} {hf}: row {r} col {col}: {g} vs {e}"
                );
            }
        }
        // For permuted tensors the raw GGUF order differs, so the check has teeth.
        if !c["permuted_heads"].is_null() {
            let raw = w
                .file
                .tensor_f32(c["gguf_tensor"].as_str().unwrap())
                .unwrap();
            assert_ne!(raw, t.data, "{hf}: un-permutation changed nothing");
        }
    }
}

/// GGUF → `write_hf_dir` (F32, sharded) → `SafetensorsDir`: every tensor is
/// bit-identical, the config survives, and the tied head is not written.
#[test]
fn smollm2_round_trip_through_safetensors_is_bit_exact() {
    let w = GgufWeights::open(model_path(SMOLLM2)).unwrap();
    let config = w.hf_config().unwrap();
    let gen = json!({"bos_token_id": 1, "eos_token_id": 2});
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2");
    let opts = HfDirOptions {
        max_shard_bytes: 200 << 20,
        ..HfDirOptions::new(SafetensorsDtype::F32)
    };
    let files = write_hf_dir_with(&dir, &config, Some(&gen), &w, &opts).unwrap();
    assert_eq!(files.len(), 3, "about 540 MB in 200 MiB shards");

    let st = SafetensorsDir::open(&dir).unwrap();
    assert_eq!(st.config(), &config);
    assert_eq!(st.generation_config(), Some(&gen));
    assert!(!st.contains("lm_head.weight"));
    let ours = w.tensors();
    let theirs = st.tensors();
    assert_eq!(ours.len(), theirs.len());
    let mut total = 0;
    for t in &ours {
        let a = w.load_f32(&t.name).unwrap();
        let b = st.load_f32(&t.name).unwrap();
        assert_eq!(a.shape, b.shape, "{}", t.name);
        let same = a
            .data
            .iter()
            .zip(&b.data)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same && a.data.len() == b.data.len(),
            "{} differs after the round trip",
            t.name
        );
        total += b.data.len();
    }
    assert_eq!(total, 134_515_008, "SmolLM2-135M parameter count");
}
