//! Hybrid (recurrent + attention) decoders on random checkpoints against
//! transformers (`tests/data/hybrid/*`, made by
//! `scripts/goldens/hybrid_random.py`; transformers' log-softmax in float64,
//! and the logits of decoding the last 5 prompt tokens one at a time after a
//! cached prefill). `qwen3_5`: three gated-DeltaNet layers then a gated
//! full-attention layer with partial RoPE; `qwen3_5_moe`: the same with
//! sparse feed-forwards (8 experts, top 2, a gated shared expert);
//! `qwen3_next`: the same with its projections grouped by key head and layer
//! 1 dense; `lfm2`:
//! gated short convolutions and GQA attention layers interleaved;
//! `lfm2_moe`: the same with sparse feed-forwards past the first (a sigmoid
//! router with a selection bias, scaled weights).

mod common;

use std::path::PathBuf;

use kiln_formats::SafetensorsDir;
use kiln_models::families::FamilyConfig;
use kiln_models::{CausalLm, ModelConfig};
use kiln_scheduler::LayerKind;
use kiln_tensor::ForwardBatch;

use common::{compare_logprobs as compare, host_logits as logits};

const CASES: [&str; 5] = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe"];

fn case_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hybrid")
        .join(case)
}

fn dir() -> PathBuf {
    case_dir("qwen3_5")
}

fn load(case: &str) -> Box<dyn CausalLm> {
    common::load_safetensors_dir(&case_dir(case))
}

fn golden(case: &str) -> (Vec<u32>, Vec<Vec<f64>>, usize, Vec<Vec<f64>>) {
    let text = std::fs::read_to_string(case_dir(case).join("golden.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = |k: &str| -> Vec<Vec<f64>> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            })
            .collect()
    };
    (
        common::ids(&v["prompt"]),
        rows("logprobs"),
        v["decode_from"].as_u64().unwrap() as usize,
        rows("decode_logprobs"),
    )
}

#[test]
fn config_reads_layer_types_and_the_delta_net_shape() {
    let d = SafetensorsDir::open(dir()).unwrap();
    let cfg = ModelConfig::from_hf(d.config()).unwrap();
    let FamilyConfig::Qwen35(q) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    assert_eq!(q.linear_layers, [true, true, true, false]);
    assert_eq!(
        cfg.layer_kinds,
        [
            LayerKind::Recurrent,
            LayerKind::Recurrent,
            LayerKind::Recurrent,
            LayerKind::FullAttention
        ]
    );
    assert_eq!((q.rotary_dim, q.rope_theta), (4, 10000.0));
    assert_eq!(
        (
            q.linear_k_heads,
            q.linear_v_heads,
            q.linear_k_dim,
            q.linear_v_dim,
            q.conv_kernel
        ),
        (2, 4, 8, 12, 4)
    );
    // Without layer_types, every fourth layer is full attention.
    let mut c = d.config().clone();
    c.as_object_mut().unwrap().remove("layer_types");
    c["num_hidden_layers"] = serde_json::json!(8);
    let FamilyConfig::Qwen35(q) = ModelConfig::from_hf(&c).unwrap().family else {
        panic!()
    };
    assert_eq!(
        q.linear_layers,
        [true, true, true, false, true, true, true, false]
    );
    c["linear_num_value_heads"] = serde_json::json!(3);
    assert!(
        ModelConfig::from_hf(&c).is_err(),
        "3 value heads over 2 key heads"
    );
}

#[test]
fn qwen3_5_moe_config_reads_the_sparse_feed_forward() {
    let cfg = ModelConfig::from_hf(
        SafetensorsDir::open(case_dir("qwen3_5_moe"))
            .unwrap()
            .config(),
    )
    .unwrap();
    let FamilyConfig::Qwen35(q) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    let m = q.moe.unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.top_k,
            m.expert_intermediate,
            m.shared_intermediate
        ),
        (8, 2, 24, 36)
    );
    // A decode token reads 2 of 8 experts.
    assert_eq!(
        kiln_models::decode_share(&cfg, "model.layers.0.mlp.experts.3.up_proj.weight"),
        0.25
    );
    let experts = kiln_models::tensor_shapes(&cfg)
        .unwrap()
        .iter()
        .filter(|s| s.0.contains(".experts."))
        .count();
    assert_eq!(experts, 4 * 8 * 3);
}

#[test]
fn qwen3_next_config_reads_its_sparse_layers_and_projections() {
    let cfg = ModelConfig::from_hf(
        SafetensorsDir::open(case_dir("qwen3_next"))
            .unwrap()
            .config(),
    )
    .unwrap();
    let FamilyConfig::Qwen35(q) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    assert!(q.next);
    assert_eq!(q.sparse_layers, [true, false, true, true]);
    let names: Vec<String> = kiln_models::tensor_shapes(&cfg)
        .unwrap()
        .into_iter()
        .map(|s| s.0)
        .collect();
    assert!(names.contains(&"model.layers.0.linear_attn.in_proj_qkvz.weight".to_string()));
    assert!(names.contains(&"model.layers.1.mlp.gate_proj.weight".to_string()));
    assert!(!names
        .iter()
        .any(|n| n.starts_with("model.layers.1.mlp.experts")));
}

#[test]
fn lfm2_moe_config_reads_the_sparse_layers_and_router() {
    let cfg =
        ModelConfig::from_hf(SafetensorsDir::open(case_dir("lfm2_moe")).unwrap().config()).unwrap();
    let FamilyConfig::Lfm2(f) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    let m = f.moe.unwrap();
    assert_eq!(
        (
            m.num_experts,
            m.top_k,
            m.expert_intermediate,
            m.num_dense_layers
        ),
        (8, 2, 24, 1)
    );
    assert!(m.expert_bias && m.normalize && m.scale == 1.5);
    // The dense layer's feed-forward is intermediate_size wide, not adjusted.
    assert_eq!(f.ff_dim, 64);
    assert!(!m.sparse(0) && m.sparse(1));
    let shapes = kiln_models::tensor_shapes(&cfg).unwrap();
    assert_eq!(
        shapes
            .iter()
            .filter(|s| s.0.ends_with("expert_bias"))
            .count(),
        4
    );
}

#[test]
fn lfm2_config_reads_conv_layers_and_the_feed_forward_size() {
    let d = SafetensorsDir::open(case_dir("lfm2")).unwrap();
    let cfg = ModelConfig::from_hf(d.config()).unwrap();
    let FamilyConfig::Lfm2(f) = &cfg.family else {
        panic!("{:?}", cfg.family)
    };
    assert_eq!(f.conv_layers, [true, true, false, true, false]);
    // 2/3 of 96, times 1.0, rounded up to 16.
    assert_eq!((f.ff_dim, f.conv_kernel, f.norm_eps), (64, 3, 1e-5));
    assert!(cfg.tie_word_embeddings);
    // full_attn_idxs instead of layer_types.
    let mut c = d.config().clone();
    c.as_object_mut().unwrap().remove("layer_types");
    c["full_attn_idxs"] = serde_json::json!([1, 4]);
    let FamilyConfig::Lfm2(f) = ModelConfig::from_hf(&c).unwrap().family else {
        panic!()
    };
    assert_eq!(f.conv_layers, [true, false, true, true, false]);
    c["conv_bias"] = serde_json::json!(true);
    assert!(
        ModelConfig::from_hf(&c).is_err(),
        "biased convolutions are refused"
    );
}

/// The state a sequence holds, as the config prices it (`kiln fit`) and as
/// the model allocates it: Qwen3.5's three DeltaNet layers each keep 3 past
/// inputs of 80 channels and 4 value heads of 8 × 12; LFM2's three
/// convolutions 2 past inputs of 48 channels.
#[test]
fn the_state_a_sequence_holds_is_priced_as_allocated() {
    for (case, values) in [
        ("qwen3_5", 3 * (3 * 80 + 4 * 8 * 12)),
        ("qwen3_5_moe", 3 * (3 * 80 + 4 * 8 * 12)),
        ("qwen3_next", 3 * (3 * 80 + 4 * 8 * 12)),
        ("lfm2", 3 * 2 * 48),
        ("lfm2_moe", 3 * 2 * 48),
    ] {
        let m = load(case);
        assert_eq!(
            m.config().state_bytes_per_seq(),
            4 * values as u64,
            "{case}"
        );
        assert_eq!(m.state_bytes_per_seq(), 4 * values as u64, "{case}");
        let cache = m.new_cache(4, 16, 5).unwrap();
        assert_eq!(
            cache.state_shape().unwrap().bytes(),
            5 * 4 * values as u64,
            "{case}"
        );
    }
}

#[test]
fn prefill_matches_transformers() {
    for case in CASES {
        let m = load(case);
        let (prompt, rows, _, _) = golden(case);
        let vocab = m.config().vocab_size;
        let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
        let batch = ForwardBatch::single(&prompt, 0, &cache.spec, 0);
        let out = logits(m.as_ref(), &batch, &mut cache);
        let (worst, same) = compare(&out, vocab, &rows);
        eprintln!("{case} prefill: max |Δ log-softmax| {worst:.2e}");
        assert!(worst <= 1e-3, "{case}: max |Δ log-softmax| {worst}");
        assert!(same, "{case}: an argmax differs");
        assert!(
            rows.iter().any(|r| r.iter().any(|&v| v > -2.0)),
            "{case}: the golden is flat"
        );
    }
}

/// The state carried across steps: prefill in chunks of 7 and token by
/// token reach the same logits bit for bit (each sequence's recurrence runs
/// token by token whatever the chunk), and the decode steps match
/// transformers' cached decode.
#[test]
fn chunks_and_single_tokens_carry_the_state() {
    for case in CASES {
        let m = load(case);
        let (prompt, rows, from, decode_rows) = golden(case);
        let vocab = m.config().vocab_size;
        let whole = {
            let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
            let batch = ForwardBatch::single(&prompt, 0, &cache.spec, 0);
            logits(m.as_ref(), &batch, &mut cache)
        };
        for chunk in [7, 1] {
            let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
            let mut got = Vec::new();
            for (i, c) in prompt.chunks(chunk).enumerate() {
                let batch = ForwardBatch::single(c, i * chunk, &cache.spec, 0);
                got.extend(logits(m.as_ref(), &batch, &mut cache));
            }
            assert!(
                got.iter()
                    .zip(&whole)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{case}: chunks of {chunk} differ from one prefill"
            );
        }
        // transformers' cached decode of the last tokens.
        let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
        let batch = ForwardBatch::single(&prompt[..from], 0, &cache.spec, from - 1);
        logits(m.as_ref(), &batch, &mut cache);
        let mut worst = 0f64;
        for (i, &t) in prompt[from..].iter().enumerate() {
            let batch = ForwardBatch::single(&[t], from + i, &cache.spec, 0);
            let out = logits(m.as_ref(), &batch, &mut cache);
            let (w, same) = compare(&out, vocab, &decode_rows[i..i + 1]);
            assert!(same, "{case}: decode step {i}: argmax differs");
            worst = worst.max(w);
        }
        assert!(worst <= 1e-3, "{case}: decode: max |Δ log-softmax| {worst}");
        let _ = rows;
    }
}

/// Three sequences in one step, each on its own state slot, give each row
/// the bits it gets alone; a slot reused by a new sequence starts from zero.
#[test]
fn a_batch_gives_each_sequence_its_bits_alone() {
    for case in CASES {
        let m = load(case);
        let (prompt, _, _, _) = golden(case);
        let vocab = m.config().vocab_size;
        let seqs: [&[u32]; 3] = [&prompt[..13], &prompt[4..], &prompt[9..12]];
        let alone: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| {
                let mut cache = m.kv_cache_for_tokens(s.len(), 16).unwrap();
                let batch = ForwardBatch::single(s, 0, &cache.spec, 0);
                logits(m.as_ref(), &batch, &mut cache)
            })
            .collect();
        let (spec, _) = m.config().kv_layout(16);
        // Attention layers' groups only: recurrent layers keep no KV.
        let groups = spec.groups.len();
        assert_eq!(groups, 1, "{case}");
        let mut cache = m.new_cache(groups * 6, 16, 3).unwrap();
        assert_eq!(cache.state_shape().unwrap().num_slots, 3);
        let run = |cache: &mut kiln_tensor::KvCache, slots: Vec<u32>| {
            let mut batch = ForwardBatch {
                block_size: 16,
                ..ForwardBatch::default()
            };
            let mut next = 0u32;
            for s in seqs {
                let tables = (0..groups)
                    .map(|_| {
                        next += 1;
                        vec![next - 1]
                    })
                    .collect();
                batch.push_seq_groups(s, 0, tables, false);
            }
            batch.logits_rows = (0..batch.token_ids.len() as u32).collect();
            batch.states = slots
                .into_iter()
                .map(|slot| kiln_tensor::SeqState {
                    slot,
                    ..Default::default()
                })
                .collect();
            logits(m.as_ref(), &batch, cache)
        };
        // Slots in another order the second time: the first run's states are
        // overwritten by fresh sequences, not continued.
        for slots in [vec![0, 1, 2], vec![2, 0, 1]] {
            let together = run(&mut cache, slots);
            let mut start = 0;
            for (s, alone) in seqs.iter().zip(&alone) {
                let rows = &together[start * vocab..(start + s.len()) * vocab];
                assert!(
                    rows.iter()
                        .zip(alone)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{case}: a sequence of {} tokens differs in a batch",
                    s.len()
                );
                start += s.len();
            }
        }
    }
}
