//! A Mixture-of-Experts model behind the server (the random Qwen3-MoE
//! checkpoint of `kiln-models/tests/data/moe`, word-level tokens `t0`..):
//! completions are served and `/stats` shows each sparse layer's expert
//! load over the last steps.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{get, post};
use kiln_engine::{Engine, LoadedModel};
use kiln_server::{Readiness, ServerConfig};
use kiln_tensor::cpu::CpuBackend;
use serde_json::json;

#[test]
fn stats_show_the_expert_load_of_the_last_steps() {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kiln-models/tests/data/moe/qwen3_moe");
    let model = LoadedModel::load(&dir, Arc::new(CpuBackend::new())).unwrap();
    let engine = Engine::start(model, common::engine_config()).unwrap();
    let readiness = Readiness::new();
    readiness.ready(engine.handle());
    std::mem::forget(engine);
    let addr = common::start_loading(ServerConfig::default(), readiness);

    // Before any step the window is empty.
    let before = get(addr, "/stats").json();
    assert_eq!(before["experts"]["steps"], 0, "{before}");

    let body = json!({"prompt": "t5 t17 t33 t8 t61 t90 t12", "max_tokens": 6,
                      "ignore_eos": true, "temperature": 0});
    let r = post(addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let usage = &r.json()["usage"];
    let forwarded = usage["prompt_tokens"].as_u64().unwrap() + 6 - 1;

    let stats = get(addr, "/stats").json();
    let e = &stats["experts"];
    assert!(e["steps"].as_u64().unwrap() > 0, "{stats}");
    // Layers 0 and 2 are sparse (layer 1 is dense), 8 experts each, every
    // forwarded token routed to 4 of them.
    let layers = e["tokens_per_expert"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "{e}");
    for (layer, imbalance) in layers.iter().zip(e["max_over_mean"].as_array().unwrap()) {
        let counts: Vec<u64> = layer
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(counts.len(), 8);
        assert_eq!(counts.iter().sum::<u64>(), 4 * forwarded, "{e}");
        let imbalance = imbalance.as_f64().unwrap();
        assert!((1.0..=2.0).contains(&imbalance), "{e}");
    }
}
