//! Scratch (not committed): dumps ids for /tmp/ref/corpus.json.
mod common;
use common::{gguf_tokenizer, Model};
#[test]
fn dump_corpus_ids() {
    let corpus: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string("/tmp/ref/corpus.json").unwrap()).unwrap();
    for (model, name) in [
        (Model::SmolLm2, "smollm2"),
        (Model::Qwen, "qwen"),
        (Model::Gemma, "gemma"),
    ] {
        let tok = gguf_tokenizer(model);
        let t = std::time::Instant::now();
        let ids: Vec<Vec<u32>> = corpus
            .iter()
            .map(|s| tok.encode(s, true).unwrap())
            .collect();
        let dec: Vec<String> = ids.iter().map(|i| tok.decode(i, false).unwrap()).collect();
        let decs: Vec<String> = ids.iter().map(|i| tok.decode(i, true).unwrap()).collect();
        // streaming check
        for i in &ids {
            for skip in [false, true] {
                let mut d = kiln_text::IncrementalDetokenizer::new(tok, skip);
                let mut s = String::new();
                for &id in i {
                    s.push_str(&d.push(id).unwrap());
                }
                s.push_str(&d.finish().unwrap());
                assert_eq!(s, tok.decode(i, skip).unwrap());
            }
        }
        eprintln!("{name}: {:?}", t.elapsed());
        std::fs::write(
            format!("/tmp/ref/rust_{name}.json"),
            serde_json::to_string(&serde_json::json!({"ids": ids, "dec": dec, "decs": decs}))
                .unwrap(),
        )
        .unwrap();
    }
}
#[test]
fn hf_dirs_from_transformers() {
    let corpus: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string("/tmp/ref/corpus.json").unwrap()).unwrap();
    for (model, name) in [
        (Model::Qwen, "qwen"),
        (Model::Gemma, "gemma"),
        (Model::SmolLm2, "smollm2"),
    ] {
        let hf = kiln_text::Tokenizer::from_hf_dir(format!("/tmp/ref/{name}_hf")).unwrap();
        let tok = gguf_tokenizer(model);
        let mut bad = 0;
        for s in &corpus {
            for sp in [false, true] {
                if hf.encode(s, sp).unwrap() != tok.encode(s, sp).unwrap() {
                    bad += 1;
                }
            }
        }
        eprintln!("{name}: hf-dir vs gguf mismatches {bad}; bos {:?} eos {:?} eot {:?} stops {:?} add_bos {} tmpl {} vocab {} {}", hf.bos_id(), hf.eos_id(), hf.eot_id(), hf.stop_ids(), hf.add_bos(), hf.chat_template().map(|t| t.len()).unwrap_or(0), hf.vocab_size(), tok.vocab_size());
    }
    let b = kiln_text::Tokenizer::from_hf_dir("/work/shared/bench/smollm2-tokenizer").unwrap();
    let tok = gguf_tokenizer(Model::SmolLm2);
    let mut bad = 0;
    for s in &corpus {
        if b.encode(s, true).unwrap() != tok.encode(s, true).unwrap() {
            bad += 1;
        }
    }
    eprintln!(
        "bench smollm2 dir vs gguf: {bad}; stops {:?} tmpl {}",
        b.stop_ids(),
        b.chat_template().is_some()
    );
}
