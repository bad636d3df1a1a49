//! Structured output through the OpenAI routes on the real SmolLM2:
//! `response_format` json_schema / json_object, vLLM's `guided_*` fields,
//! streamed and not, and the 400s for formats that cannot be used.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::{assert_error, post, MODEL_NAME};
use kiln_server::ServerConfig;
use serde_json::{json, Value};

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| common::start(ServerConfig::default(), common::engine_config()))
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 96,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "string", "maxLength": 24},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": false
    })
}

fn check(v: &Value) {
    let o = v.as_object().unwrap_or_else(|| panic!("an object: {v}"));
    assert_eq!(o.len(), 3, "{v}");
    assert!(
        o["city"].as_str().is_some_and(|s| s.chars().count() <= 24),
        "{v}"
    );
    assert!(
        o["country"]
            .as_str()
            .is_some_and(|s| s.chars().count() <= 24),
        "{v}"
    );
    assert!(
        o["population_millions"]
            .as_i64()
            .is_some_and(|n| (0..=100).contains(&n)),
        "{v}"
    );
}

#[test]
fn json_schema_answers_parse_and_validate_streamed_or_not() {
    let body = chat(
        "Give the capital of France as JSON.",
        json!({"response_format": {"type": "json_schema",
               "json_schema": {"name": "capital", "schema": schema(), "strict": true}}}),
    );
    let r = post(server(), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    check(&serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {content:?}")));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(server(), "/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.text());
    let text: String = r
        .sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, content, "streamed and whole outputs agree");
    // The masks were computed (alongside the forward passes) and counted.
    let stats = common::get(server(), "/stats").json();
    let masks = stats["engine"]["masks"].as_u64().unwrap_or(0);
    assert!(masks >= 2 * content.len().min(4) as u64, "{stats}");
    assert!(
        stats["engine"]["mask_seconds_total"]
            .as_f64()
            .unwrap_or(0.0)
            > 0.0,
        "{stats}"
    );
}

#[test]
fn json_object_and_guided_fields_constrain_chat_and_completions() {
    let r = post(
        server(),
        "/v1/chat/completions",
        &chat(
            "Describe a dog.",
            json!({"response_format": {"type": "json_object"}}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let content = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        serde_json::from_str::<Value>(&content).is_ok_and(|v| v.is_object()),
        "{content:?}"
    );

    let r = post(
        server(),
        "/v1/chat/completions",
        &chat("Is water wet?", json!({"guided_choice": ["yes", "no"]})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let c = r.json()["choices"][0]["message"]["content"].clone();
    assert!(c == "yes" || c == "no", "{c}");

    let r = post(
        server(),
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": "The year the Eiffel Tower opened:", "max_tokens": 8,
                "temperature": 0, "guided_regex": " [0-9]{4}"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let t = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(
        t.len() == 5 && t[1..].bytes().all(|b| b.is_ascii_digit()),
        "{t:?}"
    );
}

#[test]
fn formats_that_cannot_be_used_are_400s_naming_the_parameter() {
    let cases = [
        (json!({"guided_regex": "(unclosed"}), "response_format"),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["b"]}),
            "guided_choice",
        ),
        (json!({"guided_choice": "yes"}), "guided_choice"),
    ];
    for (extra, param) in cases {
        let r = post(server(), "/v1/chat/completions", &chat("Hi", extra.clone()));
        let e = assert_error(&r, 400);
        assert_eq!(e["type"], "invalid_request_error", "{extra}: {e}");
        assert_eq!(e["param"], param, "{extra}: {e}");
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                        "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                        "required": ["zone"], "additionalProperties": false}}}
    ])
}

/// The one tool call of a chat response, as (name, arguments).
fn the_call(v: &Value) -> (String, Value) {
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let f = &calls[0]["function"];
    let args = f["arguments"].as_str().unwrap();
    (
        f["name"].as_str().unwrap().to_string(),
        serde_json::from_str(args).unwrap_or_else(|e| panic!("{e}: {args:?}")),
    )
}

#[test]
fn required_and_named_tool_choice_force_a_valid_call() {
    let ask = "What is the capital of France?";
    let r = post(
        server(),
        "/v1/chat/completions",
        &chat(ask, json!({"tools": tools(), "tool_choice": "required"})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (name, args) = the_call(&r.json());
    let key = if name == "get_weather" {
        "city"
    } else {
        "zone"
    };
    assert!(name == "get_weather" || name == "get_time", "{name}");
    assert!(
        args[key].as_str().is_some() && args.as_object().unwrap().len() == 1,
        "{args}"
    );

    let named = chat(
        ask,
        json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    );
    let r = post(server(), "/v1/chat/completions", &named);
    assert_eq!(r.status, 200, "{}", r.text());
    let (name, args) = the_call(&r.json());
    assert_eq!(name, "get_time");
    assert!(
        args["zone"]
            .as_str()
            .is_some_and(|z| z.chars().count() <= 30),
        "{args}"
    );

    // Streamed, the same call arrives as tool_call deltas.
    let mut streamed = named.clone();
    streamed["stream"] = json!(true);
    let r = post(server(), "/v1/chat/completions", &streamed);
    assert_eq!(r.status, 200, "{}", r.text());
    let deltas: Vec<Value> = r
        .sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(deltas[0]["function"]["name"], "get_time", "{deltas:?}");
    let streamed_args: String = deltas
        .iter()
        .filter_map(|d| d["function"]["arguments"].as_str())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&streamed_args).unwrap(), args);
}

#[test]
fn forced_tool_choices_that_cannot_be_met_are_400s() {
    let cases = [
        json!({"tool_choice": "required"}),
        json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        json!({"tools": tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}),
        json!({"tools": tools(), "tool_choice": "sometimes"}),
    ];
    for extra in cases {
        let r = post(server(), "/v1/chat/completions", &chat("Hi", extra.clone()));
        let e = assert_error(&r, 400);
        assert_eq!(e["param"], "tool_choice", "{extra}: {e}");
    }
}

#[test]
fn anthropic_any_and_named_tool_choice_force_a_tool_use_block() {
    let anthropic_tools = json!([
        {"name": "get_weather", "description": "Weather for a city",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": false}}
    ]);
    for choice in [
        json!({"type": "any"}),
        json!({"type": "tool", "name": "get_weather"}),
    ] {
        let body = json!({"model": MODEL_NAME, "max_tokens": 64, "temperature": 0,
                          "messages": [{"role": "user", "content": "What is the capital of France?"}],
                          "tools": anthropic_tools, "tool_choice": choice});
        let r = post(server(), "/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        let uses: Vec<&Value> = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert_eq!(uses.len(), 1, "{v}");
        assert_eq!(uses[0]["name"], "get_weather");
        assert!(
            uses[0]["input"]["city"]
                .as_str()
                .is_some_and(|c| c.chars().count() <= 30),
            "{v}"
        );
    }
}

#[test]
fn responses_text_format_json_schema_constrains_the_output() {
    let body = json!({"model": MODEL_NAME, "input": "Give the capital of France as JSON.", "temperature": 0,
                      "max_output_tokens": 96,
                      "text": {"format": {"type": "json_schema", "name": "capital", "schema": schema(), "strict": true}}});
    let r = post(server(), "/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["text"]["format"]["type"], "json_schema", "{v}");
    let text: String = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["text"].as_str().map(str::to_string))
        .collect();
    check(&serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}")));
    let bad = json!({"model": MODEL_NAME, "input": "x", "text": {"format": {"type": "yaml"}}});
    let e = assert_error(&post(server(), "/v1/responses", &bad), 400);
    assert_eq!(e["param"], "text.format", "{e}");
}

#[test]
fn strict_schemas_admit_only_declared_keys() {
    // No `additionalProperties` and unbounded numbers: with `strict` the
    // answer closes every object and ends on its own.
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string"}, "population": {"type": "integer"},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}}}});
    for stream in [false, true] {
        let body = chat(
            "Describe Paris as JSON with many fields.",
            json!({"max_tokens": 200, "stream": stream, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "city", "schema": schema, "strict": true}}}),
        );
        let r = post(server(), "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let (content, finish) = if stream {
            let chunks: Vec<Value> = r
                .sse_data()
                .iter()
                .filter_map(|d| serde_json::from_str(d).ok())
                .collect();
            let text: String = chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
                .collect();
            let finish = chunks.iter().find_map(|c| {
                c["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string)
            });
            (text, finish.unwrap_or_default())
        } else {
            let v = r.json();
            let c = &v["choices"][0];
            (
                c["message"]["content"].as_str().unwrap().to_string(),
                c["finish_reason"].as_str().unwrap().to_string(),
            )
        };
        assert_eq!(finish, "stop", "{content}");
        let v: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {content}"));
        let o = v.as_object().unwrap();
        assert!(
            o.keys()
                .all(|k| ["city", "population", "location"].contains(&k.as_str())),
            "{v}"
        );
        if let Some(l) = o.get("location") {
            assert!(
                l.as_object()
                    .unwrap()
                    .keys()
                    .all(|k| k == "lat" || k == "lon"),
                "{v}"
            );
        }
        if let Some(p) = o.get("population") {
            assert!(p.is_i64(), "{v}");
        }
    }
}

#[test]
fn formats_the_grammar_library_refuses_are_400s_with_a_reason() {
    let recursive = json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"});
    let many: Vec<String> = (0..2000).map(|i| format!("option {i}")).collect();
    let cases = [
        (
            json!({"response_format": {"type": "json_schema",
                   "json_schema": {"name": "r", "schema": recursive, "strict": true}}}),
            "response_format",
        ),
        (json!({"guided_json": recursive}), "response_format"),
        (json!({"guided_choice": many}), "guided_choice"),
    ];
    for (extra, param) in cases {
        let r = post(server(), "/v1/chat/completions", &chat("Hi", extra.clone()));
        let e = assert_error(&r, 400);
        assert_eq!(e["param"], param, "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(!message.to_lowercase().contains("internal"), "{message}");
    }
}

#[test]
fn a_forced_call_cut_by_max_tokens_is_still_a_call() {
    // Two unbounded strings: the call is still being written at 24 tokens.
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                       "reason": {"type": "string"}}, "required": ["city", "reason"]}}}]);
    let named = json!({"tools": tools, "max_tokens": 24,
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let r = post(
        server(),
        "/v1/chat/completions",
        &chat("What is the weather in Paris?", named.clone()),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{v}");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args = calls[0]["function"]["arguments"].as_str().unwrap();
    // What was written of the arguments, never a complete object.
    assert!(
        args.is_empty() || (args.starts_with('{') && serde_json::from_str::<Value>(args).is_err()),
        "{args:?}"
    );

    // Streamed: the same partial call, and `length`.
    let mut streamed = chat("What is the weather in Paris?", named);
    streamed["stream"] = json!(true);
    let r = post(server(), "/v1/chat/completions", &streamed);
    let chunks: Vec<Value> = r
        .sse_data()
        .iter()
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let streamed_args: String = chunks
        .iter()
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|d| d["function"]["arguments"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed_args, args);
    let finish: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(finish, ["length"]);

    // Anthropic: a tool_use block and `max_tokens`.
    let body = json!({"model": MODEL_NAME, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object",
                   "properties": {"city": {"type": "string"}, "reason": {"type": "string"}},
                   "required": ["city", "reason"]}}],
        "tool_choice": {"type": "tool", "name": "get_weather"}});
    let v = post(server(), "/v1/messages", &body).json();
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    assert_eq!(v["content"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["content"][0]["type"], "tool_use", "{v}");
    assert_eq!(v["content"][0]["name"], "get_weather", "{v}");
}

#[test]
fn forced_call_arguments_stream_as_they_are_written() {
    let mut body = chat(
        "What is the weather in Paris?",
        json!({"tools": tools(), "tool_choice": "required", "stream": true}),
    );
    let r = post(server(), "/v1/chat/completions", &body);
    let deltas: Vec<Value> = r
        .sse_data()
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .flat_map(|c| {
            c["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    let parts: Vec<&str> = deltas
        .iter()
        .filter_map(|d| d["function"]["arguments"].as_str())
        .filter(|a| !a.is_empty())
        .collect();
    assert!(parts.len() > 1, "{deltas:?}");
    assert!(deltas.iter().all(|d| d["index"] == 0), "{deltas:?}");
    // The same call as the whole answer.
    body["stream"] = json!(false);
    let (name, args) = the_call(&post(server(), "/v1/chat/completions", &body).json());
    assert_eq!(deltas[0]["function"]["name"], name.as_str());
    assert_eq!(
        serde_json::from_str::<Value>(&parts.concat()).unwrap(),
        args
    );
}
