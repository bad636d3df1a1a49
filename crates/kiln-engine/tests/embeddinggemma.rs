//! EmbeddingGemma-300M, a sentence-transformers directory fetched by
//! `scripts/fetch-models.sh models embeddinggemma` (F32 safetensors named
//! as `Gemma3TextModel` names them, without `model.`; the real Gemma 3
//! `tokenizer.json`): it loads through the safetensors path with its
//! bidirectional attention read from `config.json`, and its tokenizer
//! encodes the golden tokenizer cases as the GGUF-built Gemma tokenizer
//! does. Its embeddings are not checked here (no pooling yet).

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::LoadedModel;
use kiln_models::config::LayerKind;
use kiln_models::families::FamilyConfig;
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::ForwardBatch;
use kiln_text::Tokenizer;

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")
}

fn embeddinggemma() -> PathBuf {
    let p = models().join("embeddinggemma-300m");
    assert!(
        p.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch-models.sh models embeddinggemma",
        p.display()
    );
    p
}

#[test]
fn embeddinggemma_loads_through_the_safetensors_path() {
    let m = LoadedModel::load(&embeddinggemma(), Arc::new(CpuBackend::new())).unwrap();
    let cfg = m.model.config();
    assert_eq!(cfg.model_type, "gemma3_text");
    assert_eq!(
        (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim),
        (24, 768, 3, 256)
    );
    // Gemma 3's config class ties the output to the embedding by default.
    assert!(cfg.tie_word_embeddings);
    let FamilyConfig::Gemma3(g) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    assert!(g.bidirectional);
    assert_eq!(g.sliding_window, 512);
    let full: Vec<usize> = (0..cfg.num_layers)
        .filter(|&i| !g.sliding_layers[i])
        .collect();
    assert_eq!(full, [5, 11, 17, 23]);
    // A window that looks ahead frees nothing: every layer keeps every block.
    assert!(cfg
        .layer_kinds
        .iter()
        .all(|k| *k == LayerKind::FullAttention));
    // Bidirectional: the first token's output depends on the tokens after it
    // (a causal model's would not).
    let first_row = |ids: &[u32]| {
        let mut cache = m.model.kv_cache_for_tokens(ids.len(), 16).unwrap();
        let batch = ForwardBatch::single(ids, 0, &cache.spec, 0);
        let out = m.model.forward(&batch, &mut cache).unwrap();
        let rows = m.model.backend().to_host(&out).unwrap();
        rows[..rows.len() / ids.len()].to_vec()
    };
    let (a, b) = (first_row(&[2, 9259, 603]), first_row(&[2, 9259, 1000]));
    assert!(a.iter().chain(&b).all(|x| x.is_finite()));
    assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-4));
}

#[test]
fn embeddinggemma_tokenizer_json_matches_the_gguf_tokenizer() {
    let hf = Tokenizer::from_hf_dir(embeddinggemma()).unwrap();
    let gguf = kiln_formats::GgufFile::open(models().join("gemma-3-270m-q4_k_m.gguf")).unwrap();
    let from_gguf = Tokenizer::from_gguf(&gguf.metadata).unwrap();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/goldens/gemma3-270m/tokenizer_cases.json");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut differ = Vec::new();
    let cases = cases["cases"].as_array().unwrap();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let (a, b) = (
            hf.encode(text, false).unwrap(),
            from_gguf.encode(text, false).unwrap(),
        );
        if a != b {
            differ.push(format!("{text:?}: tokenizer.json {a:?}, GGUF {b:?}"));
        }
    }
    assert!(
        differ.is_empty(),
        "{} of {} differ:\n{}",
        differ.len(),
        cases.len(),
        differ.join("\n")
    );
}
