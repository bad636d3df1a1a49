//! Mixture-of-Experts decoders on random checkpoints against transformers
//! (`tests/data/moe/*`, made by `scripts/goldens/moe_random.py`:
//! transformers' log-softmax in float64). `mixtral`: 8 experts, top 2,
//! renormalized, w1/w3/w2 names; `qwen2_moe`: top 3 not renormalized, a
//! gated shared expert, q/k/v biases; `qwen3_moe`: top 4 renormalized,
//! QK-norm, layer 1 dense (`mlp_only_layers`); `glm4_moe`
//! (`scripts/goldens/glm4_moe_random.py`): DeepSeek-style sigmoid routing
//! within the best 2 of 4 expert groups with a selection bias, scaled, an
//! ungated shared expert, layer 0 dense, q/k/v biases without an o bias,
//! QK-norm, RoPE over half of each head (its MTP layer: `tests/mtp.rs`);
//! `deepseek_v3` and `deepseek_v2` (`scripts/goldens/deepseek_random.py`):
//! multi-head latent attention (through `q_lora_rank` with YaRN's mscale,
//! or `q_proj`), interleaved RoPE, V3's grouped sigmoid routing and V2's
//! unnormalized softmax (`deepseek_v2_grouped`: within the best groups,
//! `group_limited_greedy`), shared experts; `glm4_moe_lite` (GLM-4.7-Flash):
//! V3's attention, one expert group, sparse layers from `mlp_layer_types`.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use kiln_formats::SafetensorsDir;
use kiln_models::families::FamilyConfig;
use kiln_models::{load_model, CausalLm, ModelConfig};
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::ForwardBatch;

const CASES: [&str; 8] = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v2",
    "deepseek_v2_grouped",
    "glm4_moe_lite",
];

fn case_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/moe")
        .join(case)
}

fn config(case: &str) -> ModelConfig {
    let dir = SafetensorsDir::open(case_dir(case)).unwrap();
    ModelConfig::from_hf(dir.config()).unwrap()
}

fn load(case: &str) -> Box<dyn CausalLm> {
    common::load_safetensors_dir(&case_dir(case))
}

/// The prompt and transformers' log-softmax at every position.
fn golden(case: &str) -> (Vec<u32>, Vec<Vec<f64>>) {
    common::logprob_golden(&case_dir(case).join("golden.json"))
}

use common::compare_logprobs as compare;

use common::host_logits as logits;

#[test]
fn configs_read_each_familys_routing_and_sparse_layers() {
    let moe = |case| match config(case).family {
        FamilyConfig::Moe(m) => m,
        other => panic!("{case}: {other:?}"),
    };
    let m = moe("mixtral");
    assert_eq!((m.num_experts, m.top_k, m.normalize), (8, 2, true));
    assert_eq!((m.expert_intermediate, m.shared_intermediate), (32, None));
    let m = moe("qwen2_moe");
    assert_eq!((m.num_experts, m.top_k, m.normalize), (8, 3, false));
    assert_eq!(
        (m.expert_intermediate, m.shared_intermediate),
        (24, Some(36))
    );
    assert!(m.attention.qkv_bias && !m.attention.qk_norm);
    let m = moe("qwen3_moe");
    assert_eq!((m.num_experts, m.top_k, m.normalize), (8, 4, true));
    assert_eq!(m.sparse_layers, [true, false, true]);
    assert!(m.attention.qk_norm);
    let m = moe("glm4_moe");
    assert_eq!(
        (m.num_experts, m.top_k, m.normalize, m.scale),
        (16, 4, true, 2.5)
    );
    assert_eq!(
        m.scoring,
        kiln_tensor::Scoring::SigmoidGroups { groups: 4, keep: 2 }
    );
    assert_eq!(
        (m.expert_intermediate, m.shared_intermediate),
        (24, Some(24))
    );
    assert_eq!(m.sparse_layers, [false, true, true]);
    let a = &m.attention;
    assert!(a.qkv_bias && !a.o_bias && a.qk_norm);
    assert_eq!((a.rotary_dim, a.nextn_layers), (Some(8), 1));
    // DeepSeek: latent attention keeps one KV head of rope + latent a
    // layer (8 + 16), not every head's keys and values (4 × (16 + 12)).
    for case in ["deepseek_v3", "deepseek_v2"] {
        let c = config(case);
        let FamilyConfig::Deepseek(d) = &c.family else {
            panic!("{case}: {:?}", c.family)
        };
        assert_eq!(c.kv_row(), 24, "{case}");
        assert_eq!(c.kv_bytes_per_token(4), 3 * 2 * 24 * 4, "{case}");
        assert_eq!(d.sparse_layers, [false, true, true], "{case}");
        assert_eq!(d.q_lora_rank.is_some(), case == "deepseek_v3");
        assert!(d.rope_interleave);
    }
    let routing = |case| match config(case).family {
        FamilyConfig::Deepseek(d) => (
            d.scoring,
            d.normalize,
            d.routed_scale,
            d.shared_intermediate,
            d.scale,
        ),
        other => panic!("{case}: {other:?}"),
    };
    let (scoring, normalize, scale, shared, softmax_scale) = routing("deepseek_v3");
    assert_eq!(
        (scoring, normalize, scale, shared),
        (
            kiln_tensor::Scoring::SigmoidGroups { groups: 4, keep: 2 },
            true,
            2.5,
            Some(24)
        )
    );
    // YaRN's mscale (0.1 ln 4 + 1) squared on 16^-0.5.
    let ms = 0.1 * 4f32.ln() + 1.0;
    assert!(
        (softmax_scale - ms * ms / 4.0).abs() < 1e-6,
        "{softmax_scale}"
    );
    // Kimi-K2 ships V3's architecture under `model_type: kimi_k2`.
    let dir = SafetensorsDir::open(case_dir("deepseek_v3")).unwrap();
    let mut kimi = dir.config().clone();
    kimi["model_type"] = serde_json::json!("kimi_k2");
    let k = ModelConfig::from_hf(&kimi).unwrap();
    assert_eq!(k.family, config("deepseek_v3").family);
    let (scoring, normalize, scale, shared, _) = routing("deepseek_v2");
    assert_eq!(
        (scoring, normalize, scale, shared),
        (kiln_tensor::Scoring::Softmax, false, 1.5, Some(48))
    );
    assert_eq!(
        routing("deepseek_v2_grouped").0,
        kiln_tensor::Scoring::SoftmaxGroups { groups: 4, keep: 2 }
    );
    // Every expert of every sparse layer is a weight the model has.
    let shapes = kiln_models::tensor_shapes(&config("qwen3_moe")).unwrap();
    let experts = shapes.iter().filter(|s| s.0.contains(".experts.")).count();
    assert_eq!(experts, 2 * 8 * 3);
    assert!(shapes
        .iter()
        .any(|s| s.0 == "model.layers.1.mlp.gate_proj.weight"));
}

#[test]
fn moe_checkpoints_match_transformers_in_prefill() {
    for case in CASES {
        let m = load(case);
        let (prompt, rows) = golden(case);
        let vocab = m.config().vocab_size;
        let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
        let batch = ForwardBatch::single(&prompt, 0, &cache.spec, 0);
        let out = logits(m.as_ref(), &batch, &mut cache);
        assert_eq!(out.len(), prompt.len() * vocab);
        let (worst, argmax_same) = compare(&out, vocab, &rows);
        eprintln!("{case}: max |Δ log-softmax| {worst:.2e}");
        assert!(worst <= 1e-3, "{case}: max |Δ log-softmax| {worst}");
        assert!(argmax_same, "{case}: an argmax differs");
        // The check can fail: the golden is not flat.
        assert!(rows.iter().any(|r| r.iter().any(|&v| v > -2.0)), "{case}");
    }
}

#[test]
fn moe_checkpoints_match_transformers_token_by_token() {
    for case in CASES {
        let m = load(case);
        let (prompt, rows) = golden(case);
        let vocab = m.config().vocab_size;
        let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
        let mut done = 0;
        let mut worst = 0f64;
        for chunk in [&prompt[..5]].into_iter().chain(prompt[5..].chunks(1)) {
            let batch = ForwardBatch::single(chunk, done, &cache.spec, chunk.len() - 1);
            let out = logits(m.as_ref(), &batch, &mut cache);
            let (w, same) = compare(&out, vocab, &rows[done + chunk.len() - 1..]);
            assert!(same, "{case}: argmax differs at {}", done + chunk.len() - 1);
            worst = worst.max(w);
            done += chunk.len();
        }
        assert!(
            worst <= 1e-3,
            "{case}: max |Δ log-softmax| {worst} decoding"
        );
    }
}

/// Three sequences in one step (different lengths, so tokens of different
/// sequences share experts) give each row the bits it gets alone.
#[test]
fn a_batch_gives_each_sequence_its_bits_alone() {
    for case in CASES {
        let m = load(case);
        let (prompt, _) = golden(case);
        let seqs: [&[u32]; 3] = [&prompt[..13], &prompt[4..], &prompt[9..12]];
        let vocab = m.config().vocab_size;
        let alone: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| {
                let mut cache = m.kv_cache_for_tokens(s.len(), 16).unwrap();
                let batch = ForwardBatch::single(s, 0, &cache.spec, 0);
                logits(m.as_ref(), &batch, &mut cache)
            })
            .collect();
        let blocks: usize = seqs.iter().map(|s| s.len().div_ceil(16)).sum();
        let mut cache = m.new_kv_cache(blocks, 16).unwrap();
        let mut batch = ForwardBatch {
            block_size: 16,
            ..ForwardBatch::default()
        };
        let mut next = 0u32;
        let mut starts = Vec::new();
        for s in seqs {
            let n = s.len().div_ceil(16) as u32;
            starts.push(batch.token_ids.len());
            batch.push_seq(s, 0, (next..next + n).collect(), false);
            next += n;
        }
        batch.logits_rows = (0..batch.token_ids.len() as u32).collect();
        let together = logits(m.as_ref(), &batch, &mut cache);
        for ((s, start), alone) in seqs.iter().zip(&starts).zip(&alone) {
            let rows = &together[start * vocab..(start + s.len()) * vocab];
            assert!(
                rows.iter()
                    .zip(alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{case}: a sequence of {} tokens differs in a batch",
                s.len()
            );
        }
    }
}

#[test]
fn a_router_that_does_not_fit_the_experts_is_refused_before_loading() {
    let dir = SafetensorsDir::open(case_dir("mixtral")).unwrap();
    let mut c = dir.config().clone();
    c["num_local_experts"] = serde_json::json!(6);
    let cfg = ModelConfig::from_hf(&c).unwrap();
    let err = match load_model(Arc::new(CpuBackend::new()), &dir, cfg) {
        Ok(_) => panic!("loaded 6 experts from a file of 8"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("num_experts") && err.contains('8'), "{err}");
    // More experts a token than the layer has.
    c["num_local_experts"] = serde_json::json!(8);
    c["num_experts_per_tok"] = serde_json::json!(9);
    let err = ModelConfig::from_hf(&c).unwrap_err().to_string();
    assert!(err.contains("num_experts_per_tok"), "{err}");
}

/// A DeepSeek config whose latent or value width does not fit the file is
/// refused before anything loads, naming the key; so is one declaring
/// fewer layers than the file has (its MTP layer aside).
#[test]
fn a_latent_attention_config_that_does_not_fit_is_refused_before_loading() {
    let dir = SafetensorsDir::open(case_dir("deepseek_v3")).unwrap();
    let refused = |key: &str, value: serde_json::Value| -> String {
        let mut c = dir.config().clone();
        c[key] = value;
        let cfg = ModelConfig::from_hf(&c).unwrap();
        match load_model(Arc::new(CpuBackend::new()), &dir, cfg) {
            Ok(_) => panic!("loaded with {key} changed"),
            Err(e) => e.to_string(),
        }
    };
    let err = refused("kv_lora_rank", serde_json::json!(12));
    assert!(err.contains("kv_lora_rank") && err.contains("24"), "{err}");
    let err = refused("v_head_dim", serde_json::json!(16));
    assert!(err.contains("v_head_dim"), "{err}");
    let err = refused("num_hidden_layers", serde_json::json!(2));
    assert!(err.contains("num_hidden_layers"), "{err}");
    // Without its MTP layer declared, layer 3 is one too many.
    let err = refused("num_nextn_predict_layers", serde_json::json!(0));
    assert!(err.contains("num_hidden_layers"), "{err}");
}

/// llama.cpp's `glm4moe` layout of the GLM-4.5 checkpoint (names from the
/// `gguf` package's own map, `scripts/goldens/glm4moe_gguf.py`): the config
/// rebuilt from its metadata is the checkpoint's (its MTP layer counted in
/// `block_count`, the rotated width, sigmoid gating, groups, the scale),
/// and every tensor reads back as the checkpoint's (its logits and MTP
/// head: `tests/mtp.rs`).
#[test]
fn glm4moe_gguf_reads_as_its_checkpoint() {
    use kiln_formats::{GgufWeights, WeightSource};
    let w = GgufWeights::open(case_dir("gguf").join("glm4moe.gguf")).unwrap();
    let from_gguf = ModelConfig::from_hf(&w.hf_config().unwrap()).unwrap();
    let st = config("glm4_moe");
    assert_eq!(from_gguf.family, st.family);
    assert_eq!(
        (
            from_gguf.num_layers,
            from_gguf.head_dim,
            from_gguf.num_kv_heads
        ),
        (st.num_layers, st.head_dim, st.num_kv_heads)
    );
    let dir = SafetensorsDir::open(case_dir("glm4_moe")).unwrap();
    let mut names: Vec<String> = dir.tensors().into_iter().map(|t| t.name).collect();
    let mut from: Vec<String> = w.tensors().into_iter().map(|t| t.name).collect();
    names.sort();
    from.sort();
    assert_eq!(from, names);
    for n in &names {
        assert_eq!(
            w.load_f32(n).unwrap().data,
            dir.load_f32(n).unwrap().data,
            "{n}"
        );
    }
}

/// llama.cpp's `deepseek2` layout of the DeepSeek checkpoints
/// (`scripts/goldens/deepseek2_gguf.py`: names from the `gguf` package's
/// own map, `kv_b_proj` split and transposed as llama.cpp's converter
/// writes it, the MTP layer left out): the config rebuilt from the metadata
/// is the checkpoint's (V3 told from V2 by its gating, groups, YaRN),
/// `kv_b_proj` joins back to the checkpoint's values, and the logits match
/// transformers' golden.
#[test]
fn deepseek2_gguf_files_read_as_their_checkpoints() {
    use kiln_formats::{GgufWeights, WeightSource};
    // (file, checkpoint): `deepseek_v2_legacy` is the layout converters
    // wrote before the absorbed one (`attn_kv_b` whole, the model's lengths).
    for (file, case) in [
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v2", "deepseek_v2"),
        ("deepseek_v2_grouped", "deepseek_v2_grouped"),
        ("deepseek_v2_legacy", "deepseek_v2"),
    ] {
        let w = GgufWeights::open(case_dir("gguf").join(format!("{file}.gguf"))).unwrap();
        let from_gguf = ModelConfig::from_hf(&w.hf_config().unwrap()).unwrap();
        let st = config(case);
        let (FamilyConfig::Deepseek(g), FamilyConfig::Deepseek(d)) =
            (&from_gguf.family, &st.family)
        else {
            panic!("{case}: {:?}", from_gguf.family)
        };
        // The file leaves the MTP layer out, as llama.cpp's converter does.
        let d = kiln_models::families::deepseek::DeepseekConfig {
            nextn_layers: 0,
            ..d.clone()
        };
        assert_eq!(*g, d, "{case}");
        assert_eq!(from_gguf.model_type, st.model_type, "{case}");
        let dir = SafetensorsDir::open(case_dir(case)).unwrap();
        for l in 0..st.num_layers {
            let n = format!("model.layers.{l}.self_attn.kv_b_proj.weight");
            assert_eq!(
                w.load_f32(&n).unwrap().data,
                dir.load_f32(&n).unwrap().data,
                "{case} {n}"
            );
        }
        let m = load_model(Arc::new(CpuBackend::new()), &w, from_gguf).unwrap();
        let (prompt, rows) = golden(case);
        let worst = prefill_against(m.as_ref(), &prompt, &rows);
        eprintln!("{file}.gguf: max |Δ log-softmax| {worst:.2e}");
        assert!(worst <= 1e-3, "{file}.gguf: {worst}");
    }
}

/// The prefill logits of `m` over `prompt`, compared with `rows`.
fn prefill_against(m: &dyn CausalLm, prompt: &[u32], rows: &[Vec<f64>]) -> f64 {
    let vocab = m.config().vocab_size;
    let mut cache = m.kv_cache_for_tokens(prompt.len(), 16).unwrap();
    let batch = ForwardBatch::single(prompt, 0, &cache.spec, 0);
    let out = logits(m, &batch, &mut cache);
    let (worst, argmax_same) = compare(&out, vocab, rows);
    assert!(argmax_same, "an argmax differs");
    worst
}

/// The experts as transformers holds them in memory (one `[n, 2i, h]`
/// gate/up stack and one `[n, h, i]` down stack a layer), written from the
/// per-expert checkpoint: the same logits as transformers.
#[test]
fn fused_expert_stacks_load_as_per_expert_tensors() {
    use kiln_formats::{write_safetensors, HostTensor, SafetensorsDtype, WeightSource};
    let case = "qwen3_moe";
    let src = SafetensorsDir::open(case_dir(case)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        case_dir(case).join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let mut out: Vec<(String, HostTensor)> = Vec::new();
    for t in src.tensors() {
        if t.name.contains(".experts.") {
            continue;
        }
        out.push((t.name.clone(), src.load_f32(&t.name).unwrap()));
    }
    for l in [0, 2] {
        let p = format!("model.layers.{l}.mlp.experts");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..8 {
            for proj in ["gate_proj", "up_proj"] {
                gate_up.extend(
                    src.load_f32(&format!("{p}.{e}.{proj}.weight"))
                        .unwrap()
                        .data,
                );
            }
            down.extend(
                src.load_f32(&format!("{p}.{e}.down_proj.weight"))
                    .unwrap()
                    .data,
            );
        }
        out.push((
            format!("{p}.gate_up_proj"),
            HostTensor::new(vec![8, 48, 48], gate_up),
        ));
        out.push((
            format!("{p}.down_proj"),
            HostTensor::new(vec![8, 48, 24], down),
        ));
    }
    let refs: Vec<(String, &HostTensor)> = out.iter().map(|(n, t)| (n.clone(), t)).collect();
    write_safetensors(
        dir.path().join("model.safetensors"),
        &refs,
        SafetensorsDtype::F32,
    )
    .unwrap();
    let fused = SafetensorsDir::open(dir.path()).unwrap();
    assert!(fused.contains("model.layers.0.mlp.experts.gate_up_proj"));
    let cfg = ModelConfig::from_hf(fused.config()).unwrap();
    let m = load_model(Arc::new(CpuBackend::new()), &fused, cfg).unwrap();
    let (prompt, rows) = golden(case);
    let worst = prefill_against(m.as_ref(), &prompt, &rows);
    assert!(worst <= 1e-3, "fused: max |Δ log-softmax| {worst}");
}

/// GGUF files laid out as llama.cpp writes them (`tests/data/moe/gguf`,
/// made by `scripts/goldens/moe_gguf.py`): stacked `ffn_*_exps` tensors in
/// Q8_0, read an expert at a time in place, against transformers on the
/// same dequantized weights.
#[test]
fn gguf_expert_stacks_match_transformers() {
    use kiln_formats::{GgufWeights, WeightSource};
    for (case, model_type) in [
        ("qwen3moe", "qwen3_moe"),
        ("qwen2moe", "qwen2_moe"),
        ("mixtral", "mixtral"),
    ] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/moe/gguf");
        let w = GgufWeights::open(dir.join(format!("{case}.gguf"))).unwrap();
        let cfg = ModelConfig::from_hf(&w.hf_config().unwrap()).unwrap();
        assert_eq!(cfg.model_type, model_type);
        // Each expert is its own tensor, a slice of the stack's bytes.
        let experts: Vec<_> = w
            .tensors()
            .into_iter()
            .filter(|t| t.name.contains(".experts."))
            .collect();
        let n = match &cfg.family {
            FamilyConfig::Moe(m) => m.num_experts,
            other => panic!("{other:?}"),
        };
        assert_eq!(experts.len(), 2 * 3 * n, "{case}");
        assert!(experts
            .iter()
            .all(|t| t.dtype == "Q8_0" && t.shape.len() == 2));
        let m = load_model(Arc::new(CpuBackend::new()), &w, cfg).unwrap();
        let (prompt, rows) = common::logprob_golden(&dir.join(format!("{case}.json")));
        let worst = prefill_against(m.as_ref(), &prompt, &rows);
        eprintln!("{case}.gguf: max |Δ log-softmax| {worst:.2e}");
        assert!(worst <= 1e-3, "{case}.gguf: max |Δ log-softmax| {worst}");
    }
}
