//! The tokenizers of the real embedding models (`scripts/fetch-models.sh
//! models minilm embeddinggemma`) against the ids sentence-transformers fed
//! its model in `testdata/goldens/embeddings` (special tokens included), for
//! every case the model's limit did not truncate. all-MiniLM-L6-v2's
//! `tokenizer.json` saves padding to 128 ids and truncation: neither may
//! apply (transformers treats both as per-call options).

use std::path::PathBuf;

use kiln_text::Tokenizer;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn check(model_dir: &str, golden: &str) {
    let dir = root().join("models").join(model_dir);
    assert!(
        dir.join("tokenizer.json").exists(),
        "{} is missing: run scripts/fetch-models.sh",
        dir.display()
    );
    let tok = Tokenizer::from_hf_dir(&dir).expect("tokenizer");
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("testdata/goldens/embeddings").join(golden)).unwrap(),
    )
    .unwrap();
    let limit = g["max_seq_length"].as_u64().unwrap() as usize;
    let mut checked = 0;
    for case in g["cases"].as_array().unwrap() {
        let want: Vec<u32> = case["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        if want.len() >= limit {
            continue;
        }
        let prompt = case["prompt_name"]
            .as_str()
            .and_then(|p| g["prompts"][p].as_str())
            .unwrap_or("");
        let text = format!("{prompt}{}", case["text"].as_str().unwrap());
        let got = tok.encode(&text, true).unwrap();
        assert_eq!(got, want, "{model_dir} {}: {text:?}", case["name"]);
        checked += 1;
    }
    assert!(checked >= 28, "{model_dir}: only {checked} cases checked");
}

#[test]
fn minilm_ids_are_sentence_transformers_ids() {
    check("all-MiniLM-L6-v2", "all-MiniLM-L6-v2.json");
}

#[test]
fn embeddinggemma_ids_are_sentence_transformers_ids() {
    check("embeddinggemma-300m", "embeddinggemma-300m.json");
}
