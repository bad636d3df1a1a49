//! Ollama's API on the real SmolLM2: the listing routes, `/api/chat` and
//! `/api/generate` (one object, and newline-delimited JSON streams giving
//! the same text), `/api/embed` as `/v1/embeddings`, and errors in Ollama's
//! shape. The answers are checked against the OpenAI route's for the same
//! greedy request.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::{get, post, MODEL_NAME};
use kiln_server::ServerConfig;
use serde_json::{json, Value};

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| common::start(ServerConfig::default(), common::engine_config()))
}

const QUESTION: &str = "What is the capital of France? Answer in one sentence.";

/// The lines of an NDJSON body.
fn lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

#[test]
fn listing_routes_name_the_served_model() {
    let addr = server();
    let v = get(addr, "/api/version");
    assert_eq!(v.status, 200);
    assert!(v.json()["version"].as_str().is_some_and(|s| !s.is_empty()));
    let tags = get(addr, "/api/tags").json();
    assert_eq!(tags["models"][0]["name"], MODEL_NAME, "{tags}");
    assert_eq!(tags["models"][0]["details"]["format"], "gguf");
    assert!(tags["models"][0]["size"].as_u64().unwrap() > 1_000_000);
    let ps = get(addr, "/api/ps").json();
    assert_eq!(ps["models"][0]["name"], MODEL_NAME, "{ps}");
    let show = post(
        addr,
        "/api/show",
        &json!({"model": format!("{MODEL_NAME}:latest")}),
    );
    assert_eq!(show.status, 200, "{}", show.text());
    let show = show.json();
    assert!(
        show["template"].as_str().unwrap().contains("im_start"),
        "{show}"
    );
    assert!(show["capabilities"]
        .as_array()
        .unwrap()
        .contains(&json!("completion")));
}

#[test]
fn chat_answers_as_the_openai_route_whole_and_streamed() {
    let addr = server();
    let openai = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 12, "temperature": 0}),
    )
    .json();
    let want = openai["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!want.is_empty());
    let req = |stream: bool| {
        json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTION}],
               "stream": stream, "options": {"num_predict": 12, "temperature": 0}})
    };
    let whole = post(addr, "/api/chat", &req(false));
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole = whole.json();
    assert_eq!(whole["message"]["role"], "assistant");
    assert_eq!(whole["message"]["content"], want.as_str(), "{whole}");
    assert_eq!(whole["done"], true);
    let reason = match openai["choices"][0]["finish_reason"].as_str() {
        Some("length") => "length",
        _ => "stop",
    };
    assert_eq!(whole["done_reason"], reason, "{whole}");
    assert_eq!(whole["eval_count"], openai["usage"]["completion_tokens"]);
    assert_eq!(
        whole["prompt_eval_count"], openai["usage"]["prompt_tokens"],
        "{whole}"
    );
    let streamed = post(addr, "/api/chat", &req(true));
    assert_eq!(streamed.status, 200);
    assert_eq!(
        streamed.header("content-type"),
        Some("application/x-ndjson")
    );
    let parts = lines(&streamed.text());
    assert!(parts.len() > 2, "{parts:?}");
    let (last, body) = parts.split_last().unwrap();
    assert!(body.iter().all(|p| p["done"] == false));
    assert_eq!(last["done"], true);
    assert_eq!(last["eval_count"], whole["eval_count"]);
    assert_eq!(last["done_reason"], whole["done_reason"]);
    let text: String = parts
        .iter()
        .map(|p| p["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, want);
}

#[test]
fn generate_templates_the_prompt_and_raw_skips_it() {
    let addr = server();
    let chat = post(
        addr,
        "/api/chat",
        &json!({"messages": [{"role": "user", "content": QUESTION}], "stream": false,
                "options": {"num_predict": 10, "temperature": 0}}),
    )
    .json();
    let gen = |extra: Value| {
        let mut body = json!({"model": MODEL_NAME, "prompt": QUESTION, "stream": false,
                              "options": {"num_predict": 10, "temperature": 0}});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = post(addr, "/api/generate", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let templated = gen(json!({}));
    assert_eq!(
        templated["response"], chat["message"]["content"],
        "{templated}"
    );
    let raw = gen(json!({"raw": true}));
    assert_ne!(raw["prompt_eval_count"], templated["prompt_eval_count"]);
    // Streamed: the same text in lines.
    let streamed = post(
        addr,
        "/api/generate",
        &json!({"prompt": QUESTION, "options": {"num_predict": 10, "temperature": 0}}),
    );
    let text: String = lines(&streamed.text())
        .iter()
        .map(|p| p["response"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, templated["response"].as_str().unwrap());
    // An empty prompt only loads the model.
    let load = post(addr, "/api/generate", &json!({"model": MODEL_NAME}));
    assert_eq!(load.json()["done_reason"], "load");
}

#[test]
fn embed_is_the_openai_embedding() {
    let addr = server();
    let ollama = post(
        addr,
        "/api/embed",
        &json!({"model": MODEL_NAME, "input": ["a cat", "Paris"]}),
    );
    let openai = post(
        addr,
        "/v1/embeddings",
        &json!({"input": ["a cat", "Paris"]}),
    );
    assert_eq!(
        ollama.status,
        openai.status,
        "{} / {}",
        ollama.text(),
        openai.text()
    );
    if openai.status == 200 {
        let (o, a) = (ollama.json(), openai.json());
        for i in 0..2 {
            assert_eq!(o["embeddings"][i], a["data"][i]["embedding"]);
        }
    } else {
        assert!(ollama.json()["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()));
    }
}

#[test]
fn errors_are_in_ollamas_shape() {
    let addr = server();
    let check = |path: &str, body: &Value, status: u16, needle: &str| {
        let r = post(addr, path, body);
        assert_eq!(r.status, status, "{path}: {}", r.text());
        let e = r.json();
        let msg = e["error"].as_str().unwrap_or_else(|| panic!("{e}"));
        assert!(msg.contains(needle), "{path}: {msg}");
        assert_eq!(e.as_object().unwrap().len(), 1, "{e}");
    };
    let msg = json!([{"role": "user", "content": "hi"}]);
    check(
        "/api/chat",
        &json!({"model": "llama9:70b", "messages": msg}),
        404,
        "llama9:70b",
    );
    check(
        "/api/chat",
        &json!({"messages": msg, "tools": [{"type": "function"}]}),
        400,
        "tools[0]",
    );
    check(
        "/api/chat",
        &json!({"messages": msg, "format": 3}),
        400,
        "format",
    );
    let with_image = json!([{"role": "user", "content": "hi", "images": ["aGk="]}]);
    check("/api/chat", &json!({"messages": with_image}), 400, "images");
    check("/api/chat", &json!({"messages": "hi"}), 400, "messages");
    check("/api/generate", &json!({"prompt": 3}), 400, "prompt");
    let bad = post(addr, "/api/nothing", &json!({}));
    assert_eq!(bad.status, 404);
    assert!(bad.json()["error"].is_string());
}

/// Tools on Qwen2.5-Coder (a model that calls them): `/api/chat` gives the
/// call the OpenAI route gives for the same greedy request, its arguments
/// as an object, whole and streamed.
#[test]
fn tool_calls_come_back_with_object_arguments() {
    use std::path::PathBuf;
    use std::sync::Arc;
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let model =
        kiln_engine::LoadedModel::load(&path, Arc::new(kiln_tensor::cpu::CpuBackend::new()))
            .expect("loading Qwen2.5-Coder-0.5B");
    let engine = kiln_engine::Engine::start(model, common::engine_config()).unwrap();
    let readiness = kiln_server::Readiness::new();
    readiness.ready(engine.handle());
    std::mem::forget(engine);
    let addr = common::start_loading(ServerConfig::default(), readiness);
    let tool = json!({"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}});
    let messages = json!([{"role": "user", "content": "What is the weather in Paris right now?"}]);
    let openai = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "tools": [tool], "max_tokens": 60, "temperature": 0}),
    )
    .json();
    let want = &openai["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(want["name"], "get_weather", "{openai}");
    let want_args: Value = serde_json::from_str(want["arguments"].as_str().unwrap()).unwrap();
    let req = |stream: bool| {
        json!({"messages": messages, "tools": [tool], "stream": stream,
               "options": {"num_predict": 60, "temperature": 0}})
    };
    let whole = post(addr, "/api/chat", &req(false)).json();
    let call = &whole["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{whole}");
    assert_eq!(call["arguments"], want_args, "{whole}");
    let streamed = post(addr, "/api/chat", &req(true));
    let calls: Vec<Value> = lines(&streamed.text())
        .iter()
        .filter_map(|l| l["message"]["tool_calls"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["function"], *call);
}

/// `format`: a JSON schema (the answer is JSON holding its required keys)
/// and `"json"` (a JSON object), on chat and generate.
#[test]
fn format_constrains_the_answer() {
    let addr = server();
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"},
                        "country": {"type": "string"}}, "required": ["city", "country"],
                        "additionalProperties": false});
    let r = post(
        addr,
        "/api/chat",
        &json!({"messages": [{"role": "user", "content": "Describe Paris as JSON."}],
                "stream": false, "format": schema, "options": {"num_predict": 120, "temperature": 0}}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let answer = r.json();
    let content = answer["message"]["content"].as_str().unwrap();
    let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
    assert!(v["city"].is_string() && v["country"].is_string(), "{v}");
    let r = post(
        addr,
        "/api/generate",
        &json!({"prompt": "List three colours.", "stream": false, "format": "json",
                "options": {"num_predict": 200, "temperature": 0}}),
    );
    let text = r.json()["response"].as_str().unwrap().to_string();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v.is_object(), "{v}");
}
