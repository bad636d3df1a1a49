//! Loading: the `tokenizer_config.json` forms transformers accepts, the extra files of
//! a Hugging Face directory, and errors that name the file and key.

mod common;

use std::fs;

use common::{gguf_tokenizer, model_path, temp_dir, Model};
use kiln_formats::{GgufMetadata, MetaValue};
use kiln_text::{TextError, Tokenizer};
use serde_json::{json, Value};

/// A SmolLM2 directory written by `save_hf`, with its config replaced by `config`.
fn smollm2_dir(name: &str, config: Value) -> std::path::PathBuf {
    let dir = temp_dir(name);
    gguf_tokenizer(Model::SmolLm2)
        .save_hf(&dir)
        .expect("save_hf");
    let text = serde_json::to_string_pretty(&config).expect("json");
    fs::write(dir.join("tokenizer_config.json"), text).expect("write config");
    dir
}

#[test]
fn config_forms_and_extra_files() {
    let dir = smollm2_dir(
        "kiln-text-config-forms",
        json!({
            "bos_token": {"content": "<|im_start|>", "lstrip": false, "special": true},
            "eos_token": "<|im_end|>",
            "pad_token": null,
            "add_bos_token": true,
            "chat_template": [
                {"name": "default", "template": "from-config"},
                {"name": "tool_use", "template": "tools: {{ tools | length }}"}
            ]
        }),
    );
    fs::write(dir.join("chat_template.jinja"), "from-jinja-file").expect("write");
    fs::create_dir_all(dir.join("additional_chat_templates")).expect("mkdir");
    fs::write(dir.join("additional_chat_templates/rag.jinja"), "rag").expect("write");
    fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [2, 7]}"#,
    )
    .expect("write");

    let tok = Tokenizer::from_hf_dir(&dir).expect("loads");
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.pad_id(), None);
    // An explicit add_bos_token replaces the post-processor, as in transformers.
    assert!(tok.add_bos());
    let plain = gguf_tokenizer(Model::SmolLm2)
        .encode("Hi", false)
        .expect("encode");
    assert_eq!(tok.encode("Hi", false).expect("encode"), plain);
    assert_eq!(
        tok.encode("Hi", true).expect("encode"),
        [vec![1], plain].concat()
    );
    assert_eq!(tok.chat_template(), Some("from-jinja-file"));
    let templates = tok.chat_templates();
    assert_eq!(
        templates.get("tool_use"),
        Some("tools: {{ tools | length }}")
    );
    assert_eq!(templates.get("rag"), Some("rag"));
    assert_eq!(tok.stop_ids(), &[2, 0, 7]);
}

#[test]
fn special_tokens_map_is_the_fallback() {
    let dir = smollm2_dir("kiln-text-special-map", json!({"eos_token": null}));
    let map = json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": {"content": "<|endoftext|>"}});
    fs::write(dir.join("special_tokens_map.json"), map.to_string()).expect("write");
    let tok = Tokenizer::from_hf_dir(&dir).expect("loads");
    assert_eq!((tok.bos_id(), tok.unk_id()), (Some(1), Some(0)));
    // An explicit null in tokenizer_config.json is kept.
    assert_eq!(tok.eos_id(), None);
}

#[test]
fn hf_dir_errors_name_the_file_and_key() {
    let missing = temp_dir("kiln-text-empty-dir");
    match Tokenizer::from_hf_dir(&missing) {
        Err(TextError::Io { path, .. }) => assert!(path.ends_with("tokenizer.json")),
        other => panic!("expected Io, got {other:?}"),
    }

    let dir = smollm2_dir("kiln-text-bad-token", json!({"bos_token": 1}));
    match Tokenizer::from_hf_dir(&dir) {
        Err(TextError::Config { path, key, .. }) => {
            assert!(path.ends_with("tokenizer_config.json"));
            assert_eq!(key, "bos_token");
        }
        other => panic!("expected Config, got {other:?}"),
    }

    let dir = smollm2_dir(
        "kiln-text-bad-template",
        json!({"chat_template": [{"name": 1}]}),
    );
    let err = Tokenizer::from_hf_dir(&dir).expect_err("bad chat_template");
    assert!(
        matches!(err, TextError::Config { ref key, .. } if key == "chat_template"),
        "{err}"
    );

    let dir = smollm2_dir("kiln-text-bad-json", json!({}));
    fs::write(dir.join("tokenizer_config.json"), "{ not json").expect("write");
    let err = Tokenizer::from_hf_dir(&dir).expect_err("bad JSON");
    assert!(matches!(err, TextError::Json { .. }), "{err}");

    let dir = smollm2_dir("kiln-text-bad-tokenizer", json!({}));
    fs::write(dir.join("tokenizer.json"), r#"{"model": 3}"#).expect("write");
    let err = Tokenizer::from_hf_dir(&dir).expect_err("bad tokenizer.json");
    assert!(matches!(err, TextError::Build { .. }), "{err}");
}

#[test]
fn gguf_errors_name_the_key() {
    let base = GgufMetadata {
        path: model_path(Model::SmolLm2),
        ..GgufMetadata::default()
    };
    match Tokenizer::from_gguf(&base) {
        Err(TextError::GgufTokenizer { key, .. }) => assert_eq!(key, "tokenizer.ggml.model"),
        other => panic!("expected GgufTokenizer, got {other:?}"),
    }

    let mut meta = base.clone();
    let string = |s: &str| MetaValue::String(s.to_string());
    meta.entries
        .insert("tokenizer.ggml.model".into(), string("bert"));
    let tokens = MetaValue::Array(vec![string("a"), string("b")]);
    meta.entries.insert("tokenizer.ggml.tokens".into(), tokens);
    match Tokenizer::from_gguf(&meta) {
        Err(TextError::GgufTokenizer { key, what, .. }) => {
            assert_eq!(key, "tokenizer.ggml.model");
            assert!(what.contains("bert"), "{what}");
        }
        other => panic!("expected GgufTokenizer, got {other:?}"),
    }

    meta.entries
        .insert("tokenizer.ggml.model".into(), string("gpt2"));
    let err = Tokenizer::from_gguf(&meta).expect_err("no merges");
    assert!(
        matches!(err, TextError::GgufTokenizer { ref key, .. } if key == "tokenizer.ggml.merges")
    );

    meta.entries
        .insert("tokenizer.ggml.merges".into(), MetaValue::Array(vec![]));
    meta.entries
        .insert("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(9));
    let err = Tokenizer::from_gguf(&meta).expect_err("bos outside vocabulary");
    assert!(
        matches!(err, TextError::GgufTokenizer { ref key, .. } if key == "tokenizer.ggml.bos_token_id")
    );

    meta.entries
        .insert("tokenizer.ggml.bos_token_id".into(), string("one"));
    let err = Tokenizer::from_gguf(&meta).expect_err("bos of the wrong type");
    assert!(matches!(err, TextError::Gguf(_)), "{err}");
}

#[test]
fn unknown_pre_falls_back_to_gpt2_split() {
    let gguf = kiln_formats::GgufFile::open(model_path(Model::Qwen)).expect("open");
    let mut meta = gguf.metadata.clone();
    let pre = MetaValue::String("some-future-pre".to_string());
    meta.entries.insert("tokenizer.ggml.pre".into(), pre);
    let tok = Tokenizer::from_gguf(&meta).expect("builds");
    // Qwen2's regex lets one punctuation character lead a word (`(self`); GPT-2's
    // only a space.
    let text = "def f(self):\n    return self.x";
    let gpt2 = tok.encode(text, false).expect("encode");
    let qwen2 = gguf_tokenizer(Model::Qwen)
        .encode(text, false)
        .expect("encode");
    assert_eq!(tok.decode(&gpt2, false).expect("decode"), text);
    assert_ne!(gpt2, qwen2);
}
