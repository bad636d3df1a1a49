//! LoRA adapters through the server on the real SmolLM2: an adapter given
//! at start is listed by `/v1/models` with its parent and named by `model`;
//! its greedy completion is the library's with the same adapter (whose
//! logits match PEFT: kiln-models' lora test) and differs from the base;
//! base and adapter requests run at once and each gives what it gives
//! alone; adapters load and unload at run time while requests stream,
//! none dropped; unknown names are 404, and the runtime routes are absent
//! unless enabled.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{engine_config, get, load_model, post, start_loading, MODEL_NAME};
use kiln_engine::{Engine, GenerationRequest};
use kiln_sampling::SamplingParams;
use kiln_server::{Readiness, ServerConfig};
use serde_json::json;

fn adapter_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/lora/smollm2-lora")
}

const PROMPT: &str = "The three primary colors are";

/// The greedy completion the library gives with `adapter` (or none).
fn library_text(adapter: Option<&str>) -> String {
    let model = load_model();
    let adapter = adapter.map(|a| {
        Arc::new(kiln_models::lora::load_peft(&adapter_dir(), a, model.model.as_ref()).unwrap())
    });
    let prompt = model.tokenizer.encode(PROMPT, true).unwrap();
    let req = GenerationRequest {
        adapter,
        ..GenerationRequest::new(
            prompt,
            SamplingParams {
                max_tokens: Some(16),
                ..SamplingParams::greedy()
            },
        )
    };
    model
        .generate(&req, &mut |_| std::ops::ControlFlow::Continue(()))
        .unwrap()
        .text
}

fn server(runtime: bool) -> std::net::SocketAddr {
    let engine = Engine::start(load_model(), engine_config()).unwrap();
    engine
        .handle()
        .adapters()
        .add("smol-a", &adapter_dir())
        .unwrap();
    let readiness = Readiness::new();
    readiness.ready(engine.handle());
    std::mem::forget(engine);
    start_loading(
        ServerConfig {
            enable_lora_runtime: runtime,
            ..ServerConfig::default()
        },
        readiness,
    )
}

fn complete(addr: std::net::SocketAddr, model: &str) -> String {
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn adapters_are_listed_named_by_model_and_run_beside_the_base() {
    let addr = server(false);
    let models = get(addr, "/v1/models").json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL_NAME, "smol-a"]);
    assert_eq!(models["data"][1]["parent"], MODEL_NAME);
    let (base, adapted) = (library_text(None), library_text(Some("smol-a")));
    assert_ne!(base, adapted, "the adapter changes the greedy answer");
    assert_eq!(complete(addr, "smol-a"), adapted);
    assert_eq!(complete(addr, MODEL_NAME), base);
    // Both at once, several times over: each as alone.
    let outs: Vec<(String, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..6)
            .map(|i| {
                let m = if i % 2 == 0 { "smol-a" } else { MODEL_NAME };
                s.spawn(move || (m.to_string(), complete(addr, m)))
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (m, text) in outs {
        assert_eq!(&text, if m == "smol-a" { &adapted } else { &base }, "{m}");
    }
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    // Runtime loading is off: its routes are not there.
    let r = post(
        addr,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "b", "lora_path": "x"}),
    );
    assert_eq!(r.status, 404);
}

#[test]
fn adapters_load_and_unload_while_requests_stream() {
    let addr = server(true);
    let adapted = library_text(Some("smol-a"));
    let r = post(
        addr,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "smol-b", "lora_path": adapter_dir()}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // A bad directory is refused with the reason; a taken name too.
    let r = post(
        addr,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "c", "lora_path": "/nonexistent"}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = post(
        addr,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "smol-b", "lora_path": adapter_dir()}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    // Requests stream on smol-b while it is unloaded and loaded again:
    // every one completes with the adapter's answer or is refused as
    // unknown (never dropped half-way).
    let results: Vec<Result<String, u16>> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..6)
            .map(|_| {
                s.spawn(move || {
                    let r = post(
                        addr,
                        "/v1/completions",
                        &json!({"model": "smol-b", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}),
                    );
                    if r.status == 200 {
                        Ok(r.json()["choices"][0]["text"].as_str().unwrap().to_string())
                    } else {
                        Err(r.status)
                    }
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let r = post(
            addr,
            "/v1/unload_lora_adapter",
            &json!({"lora_name": "smol-b"}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for r in &results {
        match r {
            Ok(text) => assert_eq!(text, &adapted),
            Err(status) => assert_eq!(*status, 404),
        }
    }
    let r = post(
        addr,
        "/v1/unload_lora_adapter",
        &json!({"lora_name": "smol-b"}),
    );
    assert_eq!(r.status, 400, "unloading twice: {}", r.text());
    let r = post(
        addr,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "smol-b", "lora_path": adapter_dir()}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(complete(addr, "smol-b"), adapted);
}
