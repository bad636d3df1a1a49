//! LoRA adapters from PEFT directories against PEFT itself
//! (`testdata/lora`, made by `scripts/goldens/lora/gen_lora.py` with peft
//! and transformers on CPU in f32): a tiny random Qwen2 with three random
//! adapters over every projection (one rsLoRA) within 1e-4 of PEFT's
//! log-softmax, the real SmolLM2 (Q4_1, blocks in place) with a bf16
//! q/v adapter within 1e-3 (the golden tests' bound); a batch mixing the
//! three adapters and the base gives every row the bits it gets alone; and
//! what Kiln cannot run is refused by name.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{load_gguf_model, log_softmax, repo_root};
use kiln_formats::SafetensorsDir;
use kiln_models::lora::load_peft;
use kiln_models::{load_model, CausalLm, ModelConfig};
use kiln_tensor::cpu::CpuBackend;
use kiln_tensor::{ForwardBatch, LoraAdapter, LoraBatch, LoraGroup};
use serde_json::Value;

fn lora_dir() -> PathBuf {
    repo_root().join("testdata/lora")
}

fn goldens() -> Value {
    serde_json::from_str(&std::fs::read_to_string(lora_dir().join("goldens.json")).unwrap())
        .unwrap()
}

fn logprobs_file(name: &str) -> Vec<f32> {
    std::fs::read(lora_dir().join("logprobs").join(name))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn qwen_tiny() -> Box<dyn CausalLm> {
    let w = SafetensorsDir::open(lora_dir().join("qwen2-tiny")).unwrap();
    let cfg = ModelConfig::from_hf(w.config()).unwrap();
    load_model(Arc::new(CpuBackend::new()), &w, cfg).unwrap()
}

/// Logits of the last row of each sequence of `seqs` run in one batch,
/// each with its adapter (`None`: the base).
fn run(model: &dyn CausalLm, seqs: &[(Vec<u32>, Option<Arc<LoraAdapter>>)]) -> Vec<Vec<f32>> {
    let blocks: usize = seqs.iter().map(|(s, _)| s.len().div_ceil(16)).sum();
    let mut cache = model.new_kv_cache(blocks, 16).unwrap();
    let mut batch = ForwardBatch {
        block_size: 16,
        ..ForwardBatch::default()
    };
    let mut next = 0u32;
    let mut lora = LoraBatch::default();
    for (ids, adapter) in seqs {
        let blocks = ids.len().div_ceil(16) as u32;
        let start = batch.token_ids.len();
        batch.push_seq(ids, 0, (next..next + blocks).collect(), true);
        next += blocks;
        if let Some(a) = adapter {
            match lora.groups.iter_mut().find(|g| g.adapter.id == a.id) {
                Some(g) => g.rows.push(start..start + ids.len()),
                None => lora.groups.push(LoraGroup {
                    adapter: a.clone(),
                    rows: vec![start..start + ids.len()],
                }),
            }
        }
    }
    batch.lora = lora;
    let logits = model.forward(&batch, &mut cache).unwrap();
    let v = model.backend().to_host(&logits).unwrap();
    let vocab = v.len() / seqs.len();
    v.chunks_exact(vocab).map(|c| c.to_vec()).collect()
}

fn check(
    model: &dyn CausalLm,
    g: &Value,
    key: &str,
    adapter: Option<Arc<LoraAdapter>>,
    bound: f64,
) {
    for case in g[key].as_array().unwrap() {
        let ids = common::ids(&case["ids"]);
        let got = log_softmax(&run(model, &[(ids, adapter.clone())])[0]);
        let want = logprobs_file(case["logprobs"].as_str().unwrap());
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - *b as f64).abs())
            .fold(0f64, f64::max);
        eprintln!("{key}: max |Δ log-softmax| {diff:.2e}");
        assert!(diff <= bound, "{key}: max |Δ log-softmax| {diff}");
    }
}

#[test]
fn qwen_tiny_adapters_match_peft_and_mix_in_one_batch() {
    let model = qwen_tiny();
    let g = &goldens()["qwen2-tiny"];
    check(model.as_ref(), g, "base", None, 1e-4);
    let adapters: Vec<Arc<LoraAdapter>> = (1..=3)
        .map(|k| {
            let name = format!("qwen2-tiny-lora-{k}");
            let a = Arc::new(load_peft(&lora_dir().join(&name), &name, model.as_ref()).unwrap());
            // Every projection of both layers.
            assert_eq!(a.projs.len(), 14);
            check(model.as_ref(), g, &name, Some(a.clone()), 1e-4);
            a
        })
        .collect();
    // rsLoRA scales by alpha / √r, the others by alpha / r.
    let scale = |a: &LoraAdapter| a.projs.values().next().unwrap().scale;
    assert_eq!(scale(&adapters[0]), 2.0);
    assert!((scale(&adapters[2]) - 16.0 / 8f32.sqrt()).abs() < 1e-6);
    // Three adapters and the base in one batch, interleaved: each row as alone.
    let p = common::ids(&g["base"][0]["ids"]);
    let q = common::ids(&g["base"][1]["ids"]);
    let mix: Vec<(Vec<u32>, Option<Arc<LoraAdapter>>)> = vec![
        (p.clone(), Some(adapters[1].clone())),
        (q.clone(), None),
        (q.clone(), Some(adapters[0].clone())),
        (p.clone(), Some(adapters[2].clone())),
        (p.clone(), Some(adapters[1].clone())),
        (p.clone(), None),
    ];
    let batched = run(model.as_ref(), &mix);
    for (i, seq) in mix.iter().enumerate() {
        let alone = &run(model.as_ref(), std::slice::from_ref(seq))[0];
        assert!(
            alone
                .iter()
                .zip(&batched[i])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {i} differs batched"
        );
    }
}

#[test]
fn smollm2_with_a_bf16_adapter_matches_peft() {
    let model = load_gguf_model("SmolLM2-135M-Instruct.Q4_1.gguf");
    let g = &goldens()["smollm2"];
    check(model.as_ref(), g, "base", None, 1e-3);
    let a = Arc::new(load_peft(&lora_dir().join("smollm2-lora"), "smol", model.as_ref()).unwrap());
    assert_eq!(a.projs.len(), 60);
    check(model.as_ref(), g, "smollm2-lora", Some(a), 1e-3);
}

/// A copy of adapter `name` in a temporary directory, its config changed
/// by `edit`.
fn edited(name: &str, edit: impl Fn(&mut Value)) -> PathBuf {
    let src = lora_dir().join(name);
    let dst = std::env::temp_dir().join(format!("kiln-lora-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dst.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    edit(&mut c);
    std::fs::write(dst.join("adapter_config.json"), c.to_string()).unwrap();
    dst
}

fn refused(model: &dyn CausalLm, dir: &Path) -> String {
    load_peft(dir, "x", model).unwrap_err().to_string()
}

#[test]
fn what_kiln_cannot_run_is_refused_by_name() {
    let model = qwen_tiny();
    let m = model.as_ref();
    let base = "qwen2-tiny-lora-1";
    assert!(refused(m, &edited(base, |c| c["use_dora"] = true.into())).contains("use_dora"));
    assert!(refused(
        m,
        &edited(base, |c| c["modules_to_save"] =
            serde_json::json!(["lm_head"]))
    )
    .contains("modules_to_save"));
    assert!(refused(m, &edited(base, |c| c["bias"] = "all".into())).contains("bias"));
    assert!(refused(
        m,
        &edited(base, |c| c["rank_pattern"] =
            serde_json::json!({"q_proj": 4}))
    )
    .contains("rank_pattern"));
    // A rank the weights do not have.
    assert!(refused(m, &edited(base, |c| c["r"] = 4.into())).contains("rank 4"));
    // Weights for another model's shapes: SmolLM2's adapter on the tiny Qwen.
    let e = refused(m, &lora_dir().join("smollm2-lora"));
    assert!(
        e.contains("lora_A") || e.contains("not a projection"),
        "{e}"
    );
    // A directory without weights.
    let empty = std::env::temp_dir().join(format!("kiln-lora-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(
        empty.join("adapter_config.json"),
        r#"{"r": 8, "lora_alpha": 16}"#,
    )
    .unwrap();
    assert!(refused(m, &empty).contains("safetensors"));
}
