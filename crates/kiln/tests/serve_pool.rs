//! `kiln serve` with three real models (SmolLM2-135M, Qwen2.5-Coder-0.5B,
//! Gemma-3-270M, from a `--models` TOML file) under a memory budget that
//! holds two: requests alternating between all three succeed, the pool
//! loads and unloads as the budget says, `/v1/models` and `/api/ps` tell
//! the truth throughout, an unknown model is a 404 listing the three, and
//! `/models/unload` and `/models/load` do what they say.

mod common;

use std::path::Path;
use std::time::Duration;

use common::Server;
use serde_json::{json, Value};

fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let (status, body) = common::http(addr, method, path, body);
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// `kiln serve --models FILE` plus `extra`, once its default model is ready.
fn serve(file: &Path, extra: &[&str], home: &Path) -> Server {
    let mut args = vec!["--models".to_string(), file.display().to_string()];
    args.extend(["--device", "cpu", "--throughput-log-secs", "0"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    Server::start(&args, home)
}

/// `/v1/models` by name: (status, memory_bytes).
fn listed(addr: &str) -> Vec<(String, String, u64)> {
    let (status, v) = http(addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{v}");
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["status"].as_str().unwrap().to_string(),
                m["memory_bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn loaded(addr: &str) -> Vec<String> {
    listed(addr)
        .into_iter()
        .filter(|m| m.1 == "loaded")
        .map(|m| m.0)
        .collect()
}

#[test]
fn three_models_under_a_budget_for_two() {
    let files = [
        ("smol", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("qwen", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        ("gemma", "gemma-3-270m-q4_k_m.gguf"),
    ];
    let home = tempfile::tempdir().unwrap();
    let toml_path = home.path().join("models.toml");
    let mut toml = String::new();
    for (name, f) in files {
        toml += &format!(
            "[[model]]\nname = \"{name}\"\npath = \"{}\"\ncontext = 512\nkv_mib = 48\n\n",
            common::model(f).display()
        );
    }
    std::fs::write(&toml_path, toml).unwrap();

    // What each model holds loaded, as the pool plans it (no budget: all
    // would fit).
    let sizes: Vec<(String, u64)> = {
        let server = serve(&toml_path, &[], home.path());
        let models = listed(&server.addr);
        let names: Vec<&str> = models.iter().map(|m| m.0.as_str()).collect();
        assert_eq!(names, ["smol", "qwen", "gemma"]);
        assert_eq!(models[0].1, "loaded", "the default model loads at start");
        assert_eq!(
            (models[1].1.as_str(), models[2].1.as_str()),
            ("unloaded", "unloaded")
        );
        models.into_iter().map(|m| (m.0, m.2)).collect()
    };
    let size = |n: &str| sizes.iter().find(|s| s.0 == n).unwrap().1;
    let mut pairs: Vec<u64> = vec![
        size("smol") + size("qwen"),
        size("smol") + size("gemma"),
        size("qwen") + size("gemma"),
    ];
    pairs.sort();
    let all = size("smol") + size("qwen") + size("gemma");
    // Every pair fits, all three do not.
    let budget_mib = pairs[2].div_ceil(1 << 20) + 1;
    assert!(budget_mib << 20 < all, "{sizes:?}");
    let budget = budget_mib.to_string();
    let server = serve(&toml_path, &["--memory-budget-mib", &budget], home.path());
    let addr = server.addr.as_str();
    assert_eq!(loaded(addr), ["smol"]);

    let mut loads = 0;
    let mut before = loaded(addr);
    // Most recent last.
    let mut recency = vec!["smol".to_string()];
    for name in ["qwen", "gemma", "smol", "qwen", "smol", "gemma", "qwen"] {
        let body = json!({"model": name, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
        let (status, v) = http(addr, "POST", "/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{name}: {v}");
        assert_eq!(v["model"], name, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
        let now = loaded(addr);
        assert!(
            now.contains(&name.to_string()),
            "{name} answered but is not listed loaded: {now:?}"
        );
        assert!(
            now.len() <= 2,
            "three models loaded under a budget for two: {now:?}"
        );
        let used: u64 = now.iter().map(|n| size(n)).sum();
        assert!(used <= budget_mib << 20, "{now:?} hold {used} bytes");
        if !before.contains(&name.to_string()) {
            loads += 1;
            assert_eq!(
                now.len(),
                (before.len() + 1).min(2),
                "{before:?} -> {now:?}"
            );
            if before.len() == 2 {
                // The model that made room is the one used least recently.
                let lru = recency.iter().find(|n| before.contains(n)).unwrap();
                assert!(
                    !now.contains(lru),
                    "{before:?} -> {now:?}, {lru} was used least recently"
                );
            }
        }
        recency.retain(|n| n != name);
        recency.push(name.to_string());
        before = now;
    }
    assert!(
        loads >= 5,
        "alternating three models over two slots reloads ({loads})"
    );

    // Ollama's view agrees.
    let (status, ps) = http(addr, "GET", "/api/ps", "");
    assert_eq!(status, 200);
    let mut running: Vec<String> = ps["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_string())
        .collect();
    running.sort();
    let mut expect = loaded(addr);
    expect.sort();
    assert_eq!(running, expect);
    let (_, tags) = http(addr, "GET", "/api/tags", "");
    assert_eq!(tags["models"].as_array().unwrap().len(), 3, "{tags}");

    // An unknown model: 404 in the API's shape, listing what exists.
    let (status, v) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
    );
    assert_eq!(status, 404, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    for (name, _) in files {
        assert!(message.contains(name), "{message}");
    }
    assert_eq!(v["error"]["code"], "model_not_found");

    // Ollama's ways: an empty generate loads, with `keep_alive: 0` it
    // unloads; `keep_alive` on a request sets how long the model stays.
    let gen = |body: Value| http(addr, "POST", "/api/generate", &body.to_string());
    let (status, v) = gen(json!({"model": "qwen", "keep_alive": 0}));
    assert_eq!(
        (status, v["done_reason"].as_str()),
        (200, Some("unload")),
        "{v}"
    );
    assert!(!loaded(addr).contains(&"qwen".to_string()));
    let (status, v) = gen(json!({"model": "qwen"}));
    assert_eq!(
        (status, v["done_reason"].as_str()),
        (200, Some("load")),
        "{v}"
    );
    assert!(loaded(addr).contains(&"qwen".to_string()));
    let (status, v) = gen(
        json!({"model": "qwen", "prompt": "Hi", "stream": false, "keep_alive": 0,
                                 "options": {"num_predict": 2}}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["eval_count"], 2, "{v}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while loaded(addr).contains(&"qwen".to_string()) {
        assert!(
            std::time::Instant::now() < deadline,
            "keep_alive 0 did not unload qwen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, _) = gen(
        json!({"model": "gemma", "prompt": "Hi", "stream": false, "keep_alive": "10m",
                                 "options": {"num_predict": 1}}),
    );
    assert_eq!(status, 200);
    let (_, ps) = http(addr, "GET", "/api/ps", "");
    let gemma = ps["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "gemma")
        .cloned()
        .unwrap();
    assert!(
        !gemma["expires_at"].as_str().unwrap().starts_with("9999"),
        "{gemma}"
    );
    let (status, v) = gen(json!({"model": "gemma", "keep_alive": "5 minutes"}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("keep_alive"), "{v}");

    // Unload and load on request.
    let victim = loaded(addr)[0].clone();
    let (status, v) = http(
        addr,
        "POST",
        "/models/unload",
        &json!({"model": victim}).to_string(),
    );
    assert_eq!(
        (status, v["was_loaded"].as_bool()),
        (200, Some(true)),
        "{v}"
    );
    assert!(!loaded(addr).contains(&victim));
    let (status, v) = http(
        addr,
        "POST",
        "/models/load",
        &json!({"model": "gemma"}).to_string(),
    );
    assert_eq!(status, 200, "{v}");
    assert!(loaded(addr).contains(&"gemma".to_string()));
    let (status, _) = http(
        addr,
        "POST",
        "/models/load",
        &json!({"model": "nope"}).to_string(),
    );
    assert_eq!(status, 404);
}
