//! Tokenizers built from the real GGUF files against transformers' goldens: ids with
//! and without special tokens, decoded text, special ids, streaming detokenization, and
//! a save_hf -> from_hf_dir round trip.

mod common;

use common::{gguf_tokenizer, golden, ids, temp_dir, text, tokenizer_cases, Model};
use kiln_text::{IncrementalDetokenizer, Tokenizer};

/// Checks every tokenizer case of `model` on `tok` and reports all mismatches at once.
fn check_cases(model: Model, tok: &Tokenizer) {
    let mut failures = Vec::new();
    for case in tokenizer_cases(model) {
        let input = text(&case["text"]);
        let want = ids(&case["ids"]);
        let got = tok.encode(input, false).expect("encode");
        if got != want {
            failures.push(format!("{input:?}: ids {got:?}, want {want:?}"));
        }
        let want = ids(&case["ids_add_special_tokens"]);
        let got = tok.encode(input, true).expect("encode");
        if got != want {
            failures.push(format!(
                "{input:?}: ids with specials {got:?}, want {want:?}"
            ));
        }
        let case_ids = ids(&case["ids"]);
        for (skip, key) in [(false, "decoded"), (true, "decoded_skip_special")] {
            let got = tok.decode(&case_ids, skip).expect("decode");
            if got != text(&case[key]) {
                failures.push(format!("{input:?}: {key} {got:?}, want {:?}", case[key]));
            }
        }
    }
    assert!(failures.is_empty(), "{model:?}:\n{}", failures.join("\n"));
}

/// Checks the special ids against `model_meta.json`.
fn check_special_ids(model: Model, tok: &Tokenizer) {
    let meta = golden(model, "model_meta.json");
    let id = |key: &str| meta[key].as_u64().map(|v| v as u32);
    assert_eq!(tok.bos_id(), id("bos_token_id"), "{model:?} bos");
    assert_eq!(tok.eos_id(), id("eos_token_id"), "{model:?} eos");
    assert_eq!(tok.pad_id(), id("pad_token_id"), "{model:?} pad");
    assert_eq!(tok.unk_id(), id("unk_token_id"), "{model:?} unk");
    assert_eq!(tok.bos_token(), meta["bos_token"].as_str(), "{model:?}");
    assert_eq!(tok.eos_token(), meta["eos_token"].as_str(), "{model:?}");
    let vocab_size = meta["vocab_size_tokenizer"].as_u64().expect("vocab size") as usize;
    assert_eq!(tok.vocab_size(), vocab_size, "{model:?} vocab size");
}

/// Streams every case one id at a time and compares with the full decode.
fn check_detokenizer(model: Model, tok: &Tokenizer) {
    for case in tokenizer_cases(model) {
        let case_ids = ids(&case["ids_add_special_tokens"]);
        for skip in [false, true] {
            let mut detok = IncrementalDetokenizer::new(tok, skip);
            let mut streamed = String::new();
            for &id in &case_ids {
                let piece = detok.push(id).expect("push");
                assert!(
                    !piece.contains('\u{fffd}'),
                    "{model:?}: partial char in {piece:?}"
                );
                streamed.push_str(&piece);
            }
            streamed.push_str(&detok.finish().expect("finish"));
            let want = tok.decode(&case_ids, skip).expect("decode");
            assert_eq!(
                streamed, want,
                "{model:?} skip_special={skip} {:?}",
                case["text"]
            );
        }
    }
}

/// Saves as a Hugging Face directory, loads it back and compares behaviour.
fn check_round_trip(model: Model, tok: &Tokenizer) {
    let dir = temp_dir(&format!("kiln-text-roundtrip-{model:?}"));
    tok.save_hf(&dir).expect("save_hf");
    let back = Tokenizer::from_hf_dir(&dir).expect("from_hf_dir");
    for case in tokenizer_cases(model) {
        let input = text(&case["text"]);
        for add_special in [false, true] {
            let want = tok.encode(input, add_special).expect("encode");
            assert_eq!(
                back.encode(input, add_special).expect("encode"),
                want,
                "{input:?}"
            );
            for skip in [false, true] {
                let want = tok.decode(&want, skip).expect("decode");
                let got = back.decode(&back.encode(input, add_special).expect("encode"), skip);
                assert_eq!(got.expect("decode"), want, "{input:?}");
            }
        }
    }
    assert_eq!(
        (
            back.bos_id(),
            back.eos_id(),
            back.eot_id(),
            back.pad_id(),
            back.unk_id()
        ),
        (
            tok.bos_id(),
            tok.eos_id(),
            tok.eot_id(),
            tok.pad_id(),
            tok.unk_id()
        )
    );
    assert_eq!(back.stop_ids(), tok.stop_ids());
    assert_eq!(back.add_bos(), tok.add_bos());
    assert_eq!(back.vocab_size(), tok.vocab_size());
    assert_eq!(back.chat_templates(), tok.chat_templates());
    for id in 0..tok.vocab_size() as u32 {
        assert_eq!(back.is_special(id), tok.is_special(id), "is_special({id})");
    }
}

#[test]
fn smollm2_tokenizer_matches_goldens() {
    let tok = gguf_tokenizer(Model::SmolLm2);
    check_cases(Model::SmolLm2, tok);
    check_special_ids(Model::SmolLm2, tok);
    assert!(!tok.add_bos());
    assert_eq!(tok.eot_id(), Some(2));
    assert_eq!(tok.stop_ids(), &[2, 0]);
}

#[test]
fn qwen_tokenizer_matches_goldens() {
    let tok = gguf_tokenizer(Model::Qwen);
    check_cases(Model::Qwen, tok);
    check_special_ids(Model::Qwen, tok);
    assert!(!tok.add_bos());
    assert_eq!(tok.eot_id(), Some(151645));
    assert_eq!(tok.stop_ids(), &[151645, 151643]);
    // USER_DEFINED tokens are matched whole but are not special.
    assert_eq!(tok.encode("<tool_call>", false).expect("encode"), [151657]);
    assert!(!tok.is_special(151657));
    assert!(tok.is_special(151644));
}

#[test]
fn gemma_tokenizer_matches_goldens() {
    let tok = gguf_tokenizer(Model::Gemma);
    check_cases(Model::Gemma, tok);
    check_special_ids(Model::Gemma, tok);
    assert!(tok.add_bos());
    assert_eq!(tok.eot_id(), tok.token_to_id("<end_of_turn>"));
    assert_eq!(tok.chat_template(), None);
}

#[test]
fn detokenizer_streams_every_case() {
    for model in [Model::SmolLm2, Model::Qwen, Model::Gemma] {
        check_detokenizer(model, gguf_tokenizer(model));
    }
}

#[test]
fn save_hf_round_trip_keeps_behaviour() {
    for model in [Model::SmolLm2, Model::Qwen, Model::Gemma] {
        check_round_trip(model, gguf_tokenizer(model));
    }
}

#[test]
fn detokenizer_holds_back_partial_characters() {
    // Gemma spells U+2028 as three byte-fallback tokens.
    let tok = gguf_tokenizer(Model::Gemma);
    let bytes: Vec<u32> = ["<0xE2>", "<0x80>", "<0xA8>"]
        .iter()
        .map(|t| tok.token_to_id(t).expect("byte token"))
        .collect();
    let mut detok = IncrementalDetokenizer::new(tok, false);
    assert_eq!(detok.push(bytes[0]).expect("push"), "");
    assert_eq!(detok.push(bytes[1]).expect("push"), "");
    assert_eq!(detok.push(bytes[2]).expect("push"), "\u{2028}");
    // An incomplete character at the end comes out as U+FFFD from finish(). The full
    // decode differs here by design: ByteFallback turns the whole invalid run of four
    // byte tokens into four U+FFFD, while the stream already showed U+2028.
    assert_eq!(detok.push(bytes[0]).expect("push"), "");
    assert_eq!(detok.finish().expect("finish"), "\u{fffd}");
    let all = [bytes.as_slice(), &bytes[..1]].concat();
    assert_eq!(
        tok.decode(&all, false).expect("decode"),
        "\u{fffd}".repeat(4)
    );
}

#[test]
fn detokenizer_with_context_continues_the_prompt() {
    for model in [Model::SmolLm2, Model::Qwen, Model::Gemma] {
        let tok = gguf_tokenizer(model);
        let prompt = tok
            .encode("The capital of France is", false)
            .expect("encode");
        let generated = tok.encode(" Paris, of course.", false).expect("encode");
        let context = &prompt[prompt.len().saturating_sub(5)..];
        let mut detok = IncrementalDetokenizer::with_context(tok, true, context);
        let mut streamed = String::new();
        for &id in &generated {
            streamed.push_str(&detok.push(id).expect("push"));
        }
        streamed.push_str(&detok.finish().expect("finish"));
        let all = [prompt.as_slice(), &generated].concat();
        let full = tok.decode(&all, true).expect("decode");
        let prompt_text = tok.decode(&prompt, true).expect("decode");
        assert_eq!(streamed, full[prompt_text.len()..], "{model:?}");
    }
}

#[test]
fn llama_style_sentencepiece_keeps_the_first_space_with_context() {
    // Gemma's vocabulary read as a plain `llama` architecture: transformers'
    // LlamaTokenizer shape (prefix space on the first word, stripped when decoding).
    let gguf = kiln_formats::GgufFile::open(common::model_path(Model::Gemma)).expect("open");
    let mut meta = gguf.metadata.clone();
    let arch = kiln_formats::MetaValue::String("llama".to_string());
    meta.entries
        .insert("general.architecture".to_string(), arch);
    let tok = Tokenizer::from_gguf(&meta).expect("builds");
    let ids = tok.encode("Hello world", false).expect("encode");
    assert_eq!(tok.id_to_token(ids[0]).as_deref(), Some("▁Hello"));
    assert_eq!(tok.decode(&ids, false).expect("decode"), "Hello world");

    let paris = tok.encode("Paris", false).expect("encode");
    let mut alone = IncrementalDetokenizer::new(&tok, false);
    let mut continued = IncrementalDetokenizer::with_context(&tok, false, &ids);
    let (mut a, mut c) = (String::new(), String::new());
    for &id in &paris {
        a.push_str(&alone.push(id).expect("push"));
        c.push_str(&continued.push(id).expect("push"));
    }
    assert_eq!(a, "Paris");
    assert_eq!(c, " Paris");
}

/// The tokenizer written as GGUF metadata (`kiln quantize`) reads back as
/// the same tokenizer (every golden case), and what is written is what
/// llama.cpp's converter wrote into the original file: tokens, types,
/// merges, split name and special ids.
#[test]
fn gguf_metadata_round_trip_matches_the_original_file() {
    use kiln_formats::{GgufFile, GgufMetadata};
    for model in [Model::SmolLm2, Model::Qwen] {
        let original = GgufFile::open(common::model_path(model)).unwrap().metadata;
        let tok = gguf_tokenizer(model);
        let vocab = original
            .str_array("tokenizer.ggml.tokens")
            .unwrap()
            .unwrap()
            .len();
        let written = GgufMetadata {
            path: "written.gguf".into(),
            entries: tok.gguf_metadata(vocab).unwrap().into_iter().collect(),
        };
        for key in [
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.chat_template",
        ] {
            assert_eq!(
                written.get(key),
                original.get(key),
                "{model:?}: {key} differs from the original file"
            );
        }
        let (w, o) = (
            written
                .i64_array("tokenizer.ggml.token_type")
                .unwrap()
                .unwrap(),
            original
                .i64_array("tokenizer.ggml.token_type")
                .unwrap()
                .unwrap(),
        );
        let differ: Vec<(usize, i64, i64)> = (0..w.len().max(o.len()))
            .filter(|&i| w.get(i) != o.get(i))
            .map(|i| {
                (
                    i,
                    w.get(i).copied().unwrap_or(-1),
                    o.get(i).copied().unwrap_or(-1),
                )
            })
            .take(20)
            .collect();
        assert!(
            differ.is_empty(),
            "{model:?}: token types (id, written, original): {differ:?}"
        );
        let back = Tokenizer::from_gguf(&written).unwrap();
        check_cases(model, &back);
        check_special_ids(model, &back);
        assert_eq!(back.add_bos(), tok.add_bos());
    }
    // A SentencePiece vocabulary (Gemma) is refused by name.
    let e = gguf_tokenizer(Model::Gemma)
        .gguf_metadata(262144)
        .unwrap_err();
    assert!(e.to_string().contains("SentencePiece"), "{e}");
}
