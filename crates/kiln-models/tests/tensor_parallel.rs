//! Tensor parallelism's CPU twin: a model split over 2 and 4 ranks of an
//! in-process group gives the logits of the whole model. Column-parallel
//! products and attention give each rank the whole model's bits for its
//! heads; the row-parallel products' all-reduce adds the ranks' partial
//! sums in another order than one product does, so the logits agree
//! within a stated bound (max |Δ log-softmax| ≤ 1e-4, every argmax
//! equal) rather than bit for bit. The Mixture-of-Experts checkpoints are
//! also held to transformers' log-softmax (`tests/data/moe`, the bound of
//! `tests/moe.rs`), and ranks of one degree are run twice to show a split
//! model's own bits repeat.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use kiln_formats::{SafetensorsDir, WeightSource};
use kiln_models::random::{merge, preset, RandomWeights};
use kiln_models::{load_model, load_tensor_parallel, CausalLm, ModelConfig};
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::{Backend, ForwardBatch, HostGroup};
use serde_json::json;

/// `n` CPU ranks of one in-process group, one thread each.
fn ranks(n: usize) -> Vec<Arc<dyn Backend>> {
    let g = HostGroup::new(n);
    (0..n)
        .map(|r| Arc::new(CpuBackend::new().in_group(g.clone(), r, 1).unwrap()) as Arc<dyn Backend>)
        .collect()
}

fn load(source: &dyn WeightSource, cfg: &ModelConfig, tp: usize) -> Box<dyn CausalLm> {
    match tp {
        1 => load_model(Arc::new(CpuBackend::new()), source, cfg.clone()).unwrap(),
        n => load_tensor_parallel(ranks(n), source, cfg.clone(), None).unwrap(),
    }
}

/// Logits of every position: a prefill of the first 9 tokens (all rows),
/// then the rest one token a step (paged KV across 16-token blocks).
fn run(m: &dyn CausalLm, prompt: &[u32]) -> Vec<f32> {
    let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
    let first = 9.min(prompt.len());
    let mut batch = ForwardBatch::single(&prompt[..first], 0, &cache.spec, 0);
    batch.logits_rows = (0..first as u32).collect();
    let mut out = common::host_logits(m, &batch, &mut cache);
    for (i, t) in prompt[first..].iter().enumerate() {
        let batch = ForwardBatch::single(std::slice::from_ref(t), first + i, &cache.spec, 0);
        out.extend(common::host_logits(m, &batch, &mut cache));
    }
    out
}

/// Max |Δ log-softmax| between two runs' rows, and whether every row's
/// argmax agrees.
fn diff(a: &[f32], b: &[f32], vocab: usize) -> (f64, bool) {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f64;
    let mut same = true;
    for (x, y) in a.chunks(vocab).zip(b.chunks(vocab)) {
        for (p, q) in common::log_softmax(x).iter().zip(common::log_softmax(y)) {
            worst = worst.max((p - q).abs());
        }
        same &= common::argmax(x) == common::argmax(y);
    }
    (worst, same)
}

const BOUND: f64 = 1e-4;

fn prompt(vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// Llama-shaped random checkpoints: 8 heads over 2 KV heads (replicated
/// at 4 ranks), a vocabulary the ranks split unevenly (250 = 63·3 + 61),
/// biases on q/k/v and o (o's held by rank 0 alone), an untied head; and
/// a Qwen2 one with a tied head.
#[test]
fn llama_shaped_splits_give_the_whole_models_logits() {
    for (model_type, tied, bias) in [("llama", false, true), ("qwen2", true, true)] {
        let c = merge(
            preset("tiny").unwrap(),
            &json!({"model_type": model_type, "hidden_size": 64, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 96,
                "num_hidden_layers": 2, "vocab_size": 250, "tie_word_embeddings": tied,
                "attention_bias": bias}),
        );
        let cfg = ModelConfig::from_hf(&c).unwrap();
        let w = RandomWeights::new(&cfg, 7).unwrap();
        let p = prompt(250, 40);
        let whole = run(load(&w, &cfg, 1).as_ref(), &p);
        for tp in [2, 4] {
            let split = load(&w, &cfg, tp);
            assert_eq!(split.config().vocab_size, 250);
            let got = run(split.as_ref(), &p);
            let (worst, same) = diff(&got, &whole, 250);
            assert!(
                worst <= BOUND && same,
                "{model_type} tp={tp}: max |Δ log-softmax| {worst}, argmax equal {same}"
            );
            // A split model's bits repeat run to run (the sum's order is
            // fixed: rank order).
            assert_eq!(
                run(split.as_ref(), &p)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{model_type} tp={tp}: two runs differ"
            );
        }
    }
}

fn moe_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/moe")
        .join(case)
}

/// Mixtral (w1/w3/w2 experts), Qwen2-MoE (a gated shared expert, q/k/v
/// biases) and Qwen3-MoE (QK-norm, a dense layer) split over 2 and 4
/// ranks: every expert split like a dense MLP, or (expert parallel) each
/// rank holding a run of whole experts and adding only theirs; the router
/// replicated either way.
#[test]
fn moe_splits_give_the_whole_models_logits_and_match_transformers() {
    for case in ["mixtral", "qwen2_moe", "qwen3_moe"] {
        let dir = SafetensorsDir::open(moe_dir(case)).unwrap();
        let cfg = ModelConfig::from_hf(dir.config()).unwrap();
        let (p, golden) = common::logprob_golden(&moe_dir(case).join("golden.json"));
        let vocab = cfg.vocab_size;
        let whole = run(load(&dir, &cfg, 1).as_ref(), &p);
        for (tp, ep) in [(2, false), (4, false), (2, true), (4, true)] {
            let m: Box<dyn CausalLm> = match ep {
                false => load(&dir, &cfg, tp),
                true => Box::new(
                    kiln_models::tp::load_ranks(ranks(tp), &dir, cfg.clone(), None, true).unwrap(),
                ),
            };
            let got = run(m.as_ref(), &p);
            let (worst, same) = diff(&got, &whole, vocab);
            assert!(
                worst <= BOUND && same,
                "{case} tp={tp} ep={ep}: max |Δ log-softmax| {worst} against tp=1, argmax equal {same}"
            );
            let (hf, same) = common::compare_logprobs(&got, vocab, &golden);
            assert!(
                hf <= 1e-3 && same,
                "{case} tp={tp}: max |Δ log-softmax| {hf} against transformers"
            );
        }
    }
}

/// A degree the heads or sizes do not split over is refused before a
/// weight loads, naming the key; so is a family without a split.
#[test]
fn degrees_that_do_not_split_are_refused_by_key() {
    let c = merge(
        preset("tiny").unwrap(),
        &json!({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
            "hidden_size": 48, "intermediate_size": 96, "vocab_size": 100}),
    );
    let cfg = ModelConfig::from_hf(&c).unwrap();
    let w = RandomWeights::new(&cfg, 1).unwrap();
    let err = |tp: usize| match load_tensor_parallel(ranks(tp), &w, cfg.clone(), None) {
        Ok(_) => panic!("tp={tp} loaded"),
        Err(e) => e.to_string(),
    };
    assert!(err(4).contains("num_attention_heads"), "{}", err(4));
    // 6 heads split over 2, but 3 KV heads neither split nor replicate evenly.
    assert!(err(2).contains("num_key_value_heads"), "{}", err(2));
    assert!(load_tensor_parallel(ranks(3), &w, cfg.clone(), None).is_ok());
    let i = merge(c.clone(), &json!({"intermediate_size": 100}));
    let cfg = ModelConfig::from_hf(&i).unwrap();
    let w = RandomWeights::new(&cfg, 1).unwrap();
    match load_tensor_parallel(ranks(3), &w, cfg, None) {
        Ok(_) => panic!("an intermediate size of 100 split over 3"),
        Err(e) => assert!(e.to_string().contains("intermediate_size"), "{e}"),
    }
    let gemma = ModelConfig::from_hf(&json!({"model_type": "gemma3_text", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100}))
    .unwrap();
    let e = kiln_models::tp::check_degree(&gemma, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("gemma3"), "{e}");
    // Expert parallelism needs experts, and as many a rank.
    let e = match kiln_models::tp::load_ranks(ranks(3), &w, cfg_dense(), None, true) {
        Ok(_) => panic!("a dense model expert-parallel"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("dense"), "{e}");
    let dir = SafetensorsDir::open(moe_dir("qwen3_moe")).unwrap();
    let six = merge(dir.config().clone(), &json!({"num_experts": 6}));
    let moe = ModelConfig::from_hf(&six).unwrap();
    assert!(kiln_models::tp::shard_config(&moe, 0, 2, true).is_ok());
    let e = kiln_models::tp::shard_config(&moe, 0, 4, true).unwrap_err();
    assert!(e.to_string().contains("num_experts"), "{e}");
}

fn cfg_dense() -> ModelConfig {
    let c = merge(
        preset("tiny").unwrap(),
        &json!({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
            "hidden_size": 48, "intermediate_size": 96, "vocab_size": 100}),
    );
    ModelConfig::from_hf(&c).unwrap()
}

/// A source of one Q8_0 matrix, `[rows, cols]`, by a name the Llama
/// split gives `role`.
struct Blocks(Vec<f32>, usize, usize, &'static str);

impl WeightSource for Blocks {
    fn path(&self) -> &std::path::Path {
        std::path::Path::new("<blocks>")
    }
    fn tensors(&self) -> Vec<kiln_formats::StoredTensor> {
        Vec::new()
    }
    fn contains(&self, name: &str) -> bool {
        name == self.3
    }
    fn load_f32(&self, _: &str) -> kiln_formats::Result<kiln_formats::HostTensor> {
        Ok(kiln_formats::HostTensor::new(
            vec![self.1, self.2],
            self.0.clone(),
        ))
    }
    fn load_blocks(&self, _: &str) -> kiln_formats::Result<Option<kiln_tensor::QuantMatrix>> {
        let q = kiln_tensor::QuantFormat::Q8_0;
        let bytes = kiln_quant::quantize(q, &self.0).unwrap();
        Ok(Some(
            kiln_tensor::QuantMatrix::new(
                q,
                self.1,
                self.2,
                kiln_tensor::SharedBytes::from_vec(bytes),
            )
            .unwrap(),
        ))
    }
}

/// Quantized matrices stay blocks when a rank's cut falls on whole blocks
/// — rows always, columns at multiples of the block — holding exactly the
/// whole matrix's blocks of its part; a column cut inside a block leaves
/// the matrix to load dense (`None`), where its f32 values are cut.
#[test]
fn block_matrices_are_cut_on_whole_blocks() {
    let (rows, cols) = (8, 128);
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let llama = kiln_models::registry::find("llama")
        .unwrap()
        .tensor_parallel
        .unwrap();
    let shard = |rank, world| kiln_models::TpShard {
        rank,
        world,
        vocab_size: 100,
        experts: None,
    };
    let whole = Blocks(data.clone(), rows, cols, "")
        .load_blocks("")
        .unwrap()
        .unwrap();
    let whole = whole.dequantize();
    // Columns (o_proj is row-parallel): 128 over 2 ranks, 64 each, two Q8_0 blocks.
    let src = Blocks(
        data.clone(),
        rows,
        cols,
        "model.layers.0.self_attn.o_proj.weight",
    );
    for rank in 0..2 {
        let s = kiln_models::tp::ShardSource::new(&src, llama, shard(rank, 2), 2);
        let m = s
            .load_blocks(src.3)
            .unwrap()
            .expect("a cut on whole blocks");
        assert_eq!((m.rows(), m.cols()), (rows, 64));
        let want: Vec<f32> = (0..rows)
            .flat_map(|r| whole[r * cols + rank * 64..r * cols + rank * 64 + 64].to_vec())
            .collect();
        assert_eq!(m.dequantize(), want);
    }
    // Over 8 ranks a rank's 16 columns are half a block: loaded dense.
    let s = kiln_models::tp::ShardSource::new(&src, llama, shard(3, 8), 8);
    assert!(s.load_blocks(src.3).unwrap().is_none());
    let dense = s.load_f32(src.3).unwrap();
    assert_eq!(dense.shape, vec![rows, 16]);
    assert_eq!(dense.data[..16], data[48..64]);
    // Rows (q_proj is column-parallel): any cut.
    let src = Blocks(
        data.clone(),
        rows,
        cols,
        "model.layers.0.self_attn.q_proj.weight",
    );
    let s = kiln_models::tp::ShardSource::new(&src, llama, shard(1, 4), 4);
    let m = s.load_blocks(src.3).unwrap().unwrap();
    assert_eq!((m.rows(), m.cols()), (2, cols));
    assert_eq!(m.dequantize(), whole[2 * cols..4 * cols].to_vec());
}
