//! `kiln quantize` and `--quantize` on a real model: SmolLM2 exported to a
//! bf16 Hugging Face directory (`convert`), then quantized to a GGUF and at
//! load. The written file reads back as the same configuration, tokenizer
//! and blocks (so its logits equal the in-memory quantization's bit for
//! bit, which also proves llama's q/k rows were permuted the way the
//! reader undoes), and the quantized model stays close to the bf16 one.
//! (That llama.cpp reads the file the same way is measured by
//! `bench/quantize_vs_llamacpp.sh`, against the llama.cpp anchor.)

use std::path::PathBuf;
use std::sync::Arc;

use kiln_engine::LoadedModel;
use kiln_formats::{GgufFile, QuantMix, SafetensorsDtype};
use kiln_quant::QuantFormat;
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::ForwardBatch;

fn model_path(file: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    p
}

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const VOCAB: usize = 49152;

/// Logits of every position of `prompt`.
fn logits(m: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let mut cache = m.model.kv_cache_for_tokens(prompt.len(), 16).unwrap();
    let out = m
        .model
        .forward(&ForwardBatch::single(prompt, 0, &cache.spec, 0), &mut cache)
        .unwrap();
    m.model.backend().to_host(&out).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

fn argmaxes(l: &[f32]) -> Vec<usize> {
    l.chunks_exact(VOCAB)
        .map(|r| {
            r.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        })
        .collect()
}

#[test]
fn quantized_gguf_reads_back_as_the_quantized_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("smollm2-bf16");
    kiln_engine::convert::gguf_to_hf_dir(&model_path(SMOLLM2), &hf, SafetensorsDtype::BF16)
        .unwrap();
    let cpu = || Arc::new(CpuBackend::new());
    let bf16 = LoadedModel::load(&hf, cpu()).unwrap();
    let messages = serde_json::json!([{"role": "user", "content": "Name three colors of the rainbow, 1 2 3."}]);
    let rendered = bf16.render_chat(&messages, true).unwrap();
    let prompt = bf16.tokenizer.encode(&rendered, false).unwrap();
    // The weights the bf16 directory rounds: the original file's.
    let original = logits(
        &LoadedModel::load(&model_path(SMOLLM2), cpu()).unwrap(),
        &prompt,
    );
    let bf16_error = mean_abs_diff(&logits(&bf16, &prompt), &original);
    assert!(
        bf16_error > 0.0 && bf16_error < 0.05,
        "bf16 rounding moves logits by {bf16_error} on average"
    );

    // Q8_0 everywhere; Q4_K where rows are whole 256-blocks (the MLP's down
    // projection, 1536 wide), Q8_0 for the 576-wide rest. Bounds on the
    // mean and largest logit change against the original weights (measured
    // 0.238 / 1.64 and 0.346 / 2.32; bf16 rounding alone 0.034 / 0.28).
    let mut previous = bf16_error;
    for (format, mean_bound, max_bound, types) in [
        (
            QuantFormat::Q8_0,
            0.3f32,
            2.0f32,
            vec![("F32", 61), ("Q8_0", 211)],
        ),
        (
            QuantFormat::Q4K,
            0.45,
            3.0,
            vec![("F32", 61), ("Q4_K", 30), ("Q8_0", 181)],
        ),
    ] {
        let out = tmp.path().join(format!("smollm2-{format}.gguf"));
        let report =
            kiln_engine::quantize::quantize_to_gguf(&hf, &out, QuantMix::Uniform(format)).unwrap();
        assert_eq!(report.arch, "llama");
        let want: std::collections::BTreeMap<String, usize> =
            types.iter().map(|(t, n)| (t.to_string(), *n)).collect();
        assert_eq!(report.tensors_by_type, want, "{format}");

        // The file: llama.cpp's keys, the tokenizer as GGUF spells it.
        let file = GgufFile::open(&out).unwrap();
        let md = &file.metadata;
        assert_eq!(md.str("tokenizer.ggml.pre").unwrap(), Some("smollm"));
        assert_eq!(md.u64("llama.block_count").unwrap(), Some(30));
        assert_eq!(md.u64("llama.attention.head_count_kv").unwrap(), Some(3));
        assert!(
            file.tensor_info("output.weight").is_none(),
            "tied output is not written"
        );
        // The file's matrices (the F32 tensors are norms), by type.
        let mut file_bytes = std::collections::BTreeMap::<String, u64>::new();
        for t in file.tensors.iter().filter(|t| t.ggml_type.name() != "F32") {
            *file_bytes
                .entry(t.ggml_type.name().to_lowercase())
                .or_default() += file.tensor_bytes(t).len() as u64;
        }
        drop(file);

        let from_file = LoadedModel::load(&out, cpu()).unwrap();
        let at_load = LoadedModel::load_with(&hf, cpu(), None, Some(format)).unwrap();
        assert_eq!(at_load.quantized, Some(format));
        // The weights are counted as they are stored, the same either way,
        // each format about its bytes in the file (the CPU keeps its blocks
        // in 16-row groups).
        let stored = from_file.model.weight_bytes().unwrap();
        assert_eq!(Some(stored), at_load.model.weight_bytes(), "{format}");
        assert_eq!(
            stored.0.keys().collect::<Vec<_>>(),
            file_bytes.keys().collect::<Vec<_>>(),
            "{format}"
        );
        for (ty, &bytes) in &file_bytes {
            let held = stored.0[ty];
            assert!(
                held >= bytes && held as f64 <= bytes as f64 * 1.05,
                "{format}: {ty} holds {held} bytes for the file's {bytes}"
            );
        }
        // Same tokenizer, template and stop tokens.
        assert_eq!(from_file.render_chat(&messages, true).unwrap(), rendered);
        for text in [
            rendered.as_str(),
            "12345 hello  world\n\ttabs <|im_end|> ünïcödé 🙂",
        ] {
            assert_eq!(
                from_file.tokenizer.encode(text, false).unwrap(),
                bf16.tokenizer.encode(text, false).unwrap(),
                "{text:?}"
            );
        }
        assert_eq!(from_file.eos_token_ids, bf16.eos_token_ids);
        assert_eq!(from_file.model.config().vocab_size, VOCAB);

        let lf = logits(&from_file, &prompt);
        let la = logits(&at_load, &prompt);
        assert_eq!(
            lf, la,
            "{format}: the file holds the blocks --quantize makes"
        );
        let (mean, worst) = (mean_abs_diff(&lf, &original), max_abs_diff(&lf, &original));
        assert!(
            mean > previous && mean < mean_bound && worst < max_bound,
            "{format}: logits move by {mean} on average (fewer bits before: {previous}), at most {worst}"
        );
        previous = mean;
        // The last position's next token is the original's (a clear margin there).
        assert_eq!(argmaxes(&lf).last(), argmaxes(&original).last(), "{format}");
    }

    // llama.cpp's Q4_K_M mix: of the 256-wide-block matrices (the 30 down
    // projections) those of the first and last eighth of the layers and of
    // every third between are Q6_K, the rest Q4_K; the 576-wide rest Q8_0.
    let out = tmp.path().join("smollm2-q4_k_m.gguf");
    let report =
        kiln_engine::quantize::quantize_to_gguf(&hf, &out, QuantMix::parse("Q4_K_M").unwrap())
            .unwrap();
    let want: std::collections::BTreeMap<String, usize> =
        [("F32", 61), ("Q4_K", 16), ("Q6_K", 14), ("Q8_0", 181)]
            .iter()
            .map(|(t, n)| (t.to_string(), *n))
            .collect();
    assert_eq!(report.tensors_by_type, want);
    let file = GgufFile::open(&out).unwrap();
    assert_eq!(file.metadata.u64("general.file_type").unwrap(), Some(15));
    let q6: std::collections::BTreeSet<String> = file
        .tensors
        .iter()
        .filter(|t| t.ggml_type.name() == "Q6_K")
        .map(|t| t.name.clone())
        .collect();
    let more_bits = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29];
    assert_eq!(
        q6,
        more_bits
            .iter()
            .map(|i| format!("blk.{i}.ffn_down.weight"))
            .collect()
    );
    drop(file);
    let lm = logits(&LoadedModel::load(&out, cpu()).unwrap(), &prompt);
    let mean = mean_abs_diff(&lm, &original);
    assert!(
        mean > bf16_error && mean < 0.45,
        "q4_k_m: logits move by {mean} on average"
    );
    assert_eq!(argmaxes(&lm).last(), argmaxes(&original).last(), "q4_k_m");

    // FP8 (no GGUF type: at load only) where rows are whole runs of 128 (the
    // down projection), Q8_0 for the 576-wide rest: held as E4M3 bytes and
    // scales, and close to the original (bounds about 1.3× the measured
    // 0.299 mean / 3.25 largest: more than Q8_0 everywhere, E4M3's three
    // mantissa bits against Q8_0's seven).
    let fp8 = LoadedModel::load_with(&hf, cpu(), None, Some(QuantFormat::FP8)).unwrap();
    let held = fp8.model.weight_bytes().unwrap();
    assert_eq!(
        held.0.keys().map(|k| k.as_str()).collect::<Vec<_>>(),
        ["fp8", "q8_0"]
    );
    // 30 down projections of 576 × 1536, 132 bytes a 128.
    assert_eq!(held.0["fp8"], 30 * 576 * 1536 / 128 * 132);
    let l8 = logits(&fp8, &prompt);
    let (mean, worst) = (mean_abs_diff(&l8, &original), max_abs_diff(&l8, &original));
    assert!(
        mean > bf16_error && mean < 0.39 && worst < 4.3,
        "fp8: logits move by {mean} on average, at most {worst}"
    );
    assert_eq!(argmaxes(&l8).last(), argmaxes(&original).last(), "fp8");
}

#[test]
fn refusals_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    let e = kiln_engine::quantize::quantize_to_gguf(
        &tmp.path().join("nope"),
        &out,
        QuantMix::Uniform(QuantFormat::Q8_0),
    )
    .unwrap_err();
    assert!(e.to_string().contains("no such file"), "{e}");
    let e = kiln_engine::quantize::quantize_to_gguf(
        &model_path(SMOLLM2),
        &out,
        QuantMix::Uniform(QuantFormat::Q2K),
    )
    .unwrap_err();
    assert!(e.to_string().contains("Q4_K"), "{e}");
    // FP8 blocks have no GGUF type: they are made at load.
    let e = kiln_engine::quantize::quantize_to_gguf(
        &model_path(SMOLLM2),
        &out,
        QuantMix::Uniform(QuantFormat::FP8),
    )
    .unwrap_err();
    assert!(e.to_string().contains("--quantize fp8"), "{e}");
    assert!(!out.exists());
}

/// `--cpu-matmul fast` on the real SmolLM2: prefill logits stay close to
/// the exact path's (stated bound: mean |Δ| < 0.1, max < 1.0; measured on
/// AMX 0.054 / 0.55) and the next token at the prompt's end is the same;
/// without AMX the two are one computation.
#[test]
fn fast_cpu_matmul_stays_close_to_exact() {
    use kiln_tensor::cpu::quant::CpuMatmul;
    let exact = LoadedModel::load(&model_path(SMOLLM2), Arc::new(CpuBackend::new())).unwrap();
    let fast = LoadedModel::load(
        &model_path(SMOLLM2),
        Arc::new(CpuBackend::with_matmul(CpuMatmul::Fast)),
    )
    .unwrap();
    let messages = serde_json::json!([{"role": "user", "content": "Write a haiku about the sea and the sky, please."}]);
    let prompt = exact
        .tokenizer
        .encode(&exact.render_chat(&messages, true).unwrap(), false)
        .unwrap();
    let (le, lf) = (logits(&exact, &prompt), logits(&fast, &prompt));
    if !CpuMatmul::fast_available() {
        assert_eq!(le, lf);
        return;
    }
    let (mean, worst) = (mean_abs_diff(&lf, &le), max_abs_diff(&lf, &le));
    assert!(
        mean > 0.0 && mean < 0.1 && worst < 1.0,
        "fast moves logits by {mean} on average, at most {worst}"
    );
    assert_eq!(argmaxes(&lf).last(), argmaxes(&le).last());
}
