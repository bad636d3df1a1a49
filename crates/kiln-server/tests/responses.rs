//! The OpenAI Responses API end to end on the real SmolLM2, through the raw
//! HTTP client: plain and streamed answers, `max_output_tokens`, a function
//! call round trip, and the refusals (stored state, unknown parameters, bad
//! input) in OpenAI's error shape.

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::{assert_error, post, request, HttpResponse, MODEL_NAME};
use kiln_server::ServerConfig;
use serde_json::{json, Value};

const PARIS: &str = "The capital of France is Paris.";

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| common::start(ServerConfig::default(), common::engine_config()))
}

fn respond(body: &Value) -> HttpResponse {
    post(server(), "/v1/responses", body)
}

fn france(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_NAME,
        "input": "What is the capital of France?",
        "temperature": 0,
        "max_output_tokens": 24,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

/// The text of a response's message items.
fn text_of(v: &Value) -> String {
    items(v, "message")
        .iter()
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter(|p| p["type"] == "output_text")
        .filter_map(|p| p["text"].as_str().map(str::to_string))
        .collect()
}

/// A response's output items of type `kind`.
fn items(v: &Value, kind: &str) -> Vec<Value> {
    v["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["type"] == kind)
        .cloned()
        .collect()
}

/// `(event name, data)` for each event of an SSE body; each name must be
/// its data's `type`, and the sequence numbers must count up from 0.
fn events(r: &HttpResponse) -> Vec<(String, Value)> {
    let evs: Vec<(String, Value)> = r
        .text()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "));
            let data = e.lines().find_map(|l| l.strip_prefix("data: "));
            let (Some(name), Some(data)) = (name, data) else {
                panic!("an event without a name or data: {e:?}");
            };
            let data: Value = serde_json::from_str(data).expect("event data is JSON");
            assert_eq!(data["type"], name, "{data}");
            (name.to_string(), data)
        })
        .collect();
    for (i, (_, d)) in evs.iter().enumerate() {
        assert_eq!(d["sequence_number"], i as u64, "{d}");
    }
    evs
}

/// The response with its generated ids blanked, to compare two answers.
fn without_ids(v: &Value) -> Value {
    let mut v = v.clone();
    v["id"] = Value::Null;
    v["created_at"] = Value::Null;
    v["usage"]["input_tokens_details"]["cached_tokens"] = Value::Null;
    for item in v["output"].as_array_mut().into_iter().flatten() {
        item["id"] = Value::Null;
        if item.get("call_id").is_some() {
            item["call_id"] = Value::Null;
        }
    }
    v
}

#[test]
fn answers_with_a_message_and_usage() {
    let r = respond(&france(json!({"metadata": {"k": "v"}, "user": "u1"})));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")));
    assert_eq!(v["object"], "response");
    assert!(v["created_at"].as_u64().is_some_and(|t| t > 0));
    assert_eq!(v["status"], "completed");
    assert!(v["incomplete_details"].is_null() && v["error"].is_null());
    assert_eq!(v["model"], MODEL_NAME);
    assert_eq!(v["store"], false);
    assert_eq!(v["metadata"], json!({"k": "v"}));
    assert_eq!(v["user"], "u1");
    assert!(v.get("output_text").is_none(), "a client-side convenience");
    let output = v["output"].as_array().cloned().unwrap_or_default();
    assert_eq!(output.len(), 1, "{v}");
    let m = &output[0];
    assert_eq!(m["type"], "message");
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["status"], "completed");
    assert!(m["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(m["content"][0]["type"], "output_text");
    assert_eq!(m["content"][0]["annotations"], json!([]));
    assert_eq!(text_of(&v), PARIS);
    let u = &v["usage"];
    let (i, o) = (
        u["input_tokens"].as_u64().unwrap_or(0),
        u["output_tokens"].as_u64().unwrap_or(0),
    );
    assert!(i > 5 && o >= 7, "{u}");
    assert_eq!(u["total_tokens"].as_u64(), Some(i + o));
    assert!(u["input_tokens_details"]["cached_tokens"].is_u64(), "{u}");
    assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);
}

#[test]
fn instructions_and_message_items_render_like_chat() {
    let chat = post(
        server(),
        "/v1/chat/completions",
        &json!({
            "messages": [
                {"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            "temperature": 0, "max_tokens": 24,
        }),
    )
    .json();
    let body = france(json!({
        "instructions": "Answer in one sentence.",
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
    }));
    let v = respond(&body).json();
    assert_eq!(v["instructions"], "Answer in one sentence.");
    assert_eq!(v["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(
        text_of(&v),
        chat["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
    );
}

#[test]
fn max_output_tokens_makes_it_incomplete() {
    let v = respond(&france(json!({"max_output_tokens": 3}))).json();
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 3);
    assert_eq!(v["max_output_tokens"], 3);
    assert_eq!(items(&v, "message")[0]["status"], "incomplete");
}

#[test]
fn the_stream_is_well_formed_and_matches_the_plain_answer() {
    let plain = respond(&france(json!({}))).json();
    let r = respond(&france(json!({"stream": true})));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    assert!(!r.text().contains("[DONE]"));
    let evs = events(&r);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    let n = names.len();
    assert_eq!(
        names[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
    );
    assert_eq!(
        names[n - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert!(n > 9, "{names:?}");
    assert!(names[4..n - 4]
        .iter()
        .all(|n| *n == "response.output_text.delta"));
    let created = &evs[0].1["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    assert!(created["usage"].is_null());
    let id = created["id"].clone();
    assert!(evs
        .iter()
        .all(|(_, d)| d.get("response").is_none_or(|resp| resp["id"] == id)));
    let added = &evs[2].1;
    assert_eq!(added["output_index"], 0);
    assert_eq!(added["item"]["status"], "in_progress");
    assert_eq!(added["item"]["content"], json!([]));
    let item_id = added["item"]["id"].clone();
    assert_eq!(evs[3].1["part"]["text"], "");
    let mut text = String::new();
    for (_, d) in &evs[4..n - 4] {
        assert_eq!(
            (&d["item_id"], &d["output_index"], &d["content_index"]),
            (&item_id, &json!(0), &json!(0))
        );
        text.push_str(d["delta"].as_str().unwrap_or_default());
    }
    assert_eq!(text, PARIS);
    assert_eq!(evs[n - 4].1["text"], PARIS);
    assert_eq!(evs[n - 3].1["part"]["text"], PARIS);
    assert_eq!(evs[n - 2].1["item"]["status"], "completed");
    assert_eq!(evs[n - 2].1["item"]["id"], item_id);
    let done = &evs[n - 1].1["response"];
    assert_eq!(done["output"][0], evs[n - 2].1["item"]);
    assert_eq!(without_ids(done), without_ids(&plain));
}

fn weather_tool() -> Value {
    json!([{
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    }])
}

/// Two worked examples, so that greedy SmolLM2 answers the third question
/// with a call.
fn weather_questions() -> Vec<Value> {
    let mut input = Vec::new();
    for city in ["London", "Berlin"] {
        input.push(json!({"role": "user", "content": format!("Weather in {city}?")}));
        let call = json!({"name": "get_weather", "arguments": {"city": city}});
        input.push(json!({"role": "assistant", "content": call.to_string()}));
    }
    input.push(json!({"role": "user", "content": "Weather in Paris?"}));
    input
}

#[test]
fn a_function_call_round_trip() {
    let ask = json!({
        "model": MODEL_NAME, "temperature": 0, "max_output_tokens": 40,
        "tools": weather_tool(), "tool_choice": "auto", "input": weather_questions(),
    });
    let v = respond(&ask).json();
    assert_eq!(v["status"], "completed", "{v}");
    let calls = items(&v, "function_call");
    assert_eq!(calls.len(), 1, "{v}");
    let call = &calls[0];
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    assert!(call["id"].as_str().is_some_and(|id| id.starts_with("fc_")));
    assert!(call["call_id"]
        .as_str()
        .is_some_and(|id| id.starts_with("call_")));
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap_or("")).expect("JSON");
    assert_eq!(args, json!({"city": "Paris"}));
    assert_eq!(v["tools"][0]["name"], "get_weather");

    // The same call streamed.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let evs = events(&respond(&streamed));
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names[2..],
        [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(evs[2].1["item"]["arguments"], "");
    assert_eq!(evs[4].1["arguments"], call["arguments"]);
    assert_eq!(evs[4].1["name"], "get_weather");
    assert_eq!(without_ids(&evs[6].1["response"]), without_ids(&v));

    // The call and its output sent back: the model answers in text.
    let mut input = weather_questions();
    input.push(call.clone());
    input.push(
        json!({"type": "function_call_output", "call_id": call["call_id"],
                      "output": "{\"temperature_c\": 18, \"sky\": \"sunny\"}"}),
    );
    let answer = json!({
        "model": MODEL_NAME, "temperature": 0, "max_output_tokens": 40,
        "tools": weather_tool(), "input": input,
    });
    let r = respond(&answer);
    assert_eq!(r.status, 200, "{}", r.text());
    let done = r.json();
    assert!(
        done["usage"]["input_tokens"].as_u64() > v["usage"]["input_tokens"].as_u64(),
        "the call and its output are in the prompt: {done}"
    );
    assert!(
        !done["output"].as_array().is_some_and(Vec::is_empty),
        "{done}"
    );
    for item in done["output"].as_array().into_iter().flatten() {
        assert!(["message", "function_call"].contains(&item["type"].as_str().unwrap_or("")));
    }

    // With `tool_choice: "none"` the tools are neither offered nor parsed.
    let mut none = ask;
    none["tool_choice"] = json!("none");
    let v = respond(&none).json();
    assert!(items(&v, "function_call").is_empty(), "{v}");
    assert_eq!(v["tool_choice"], "none");
    assert!(!text_of(&v).is_empty());
}

#[test]
fn stored_state_is_refused() {
    for (extra, param) in [
        (json!({"store": true}), "store"),
        (
            json!({"previous_response_id": "resp_123"}),
            "previous_response_id",
        ),
        (json!({"conversation": "conv_123"}), "conversation"),
    ] {
        let e = assert_error(&respond(&france(extra)), 400);
        assert_eq!(e["param"], param);
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("stateless")),
            "{e}"
        );
    }
    assert_eq!(respond(&france(json!({"store": false}))).status, 200);
}

#[test]
fn unknown_parameters_are_ignored_and_unsupported_ones_refused_by_name() {
    // A reasoning-effort hint is not acted on either (the answer is the
    // same without it): ignored and named.
    let r = respond(&france(
        json!({"frobnicate": 1, "reasoning": {"effort": "low"}}),
    ));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.header("x-kiln-ignored-params"),
        Some("frobnicate, reasoning")
    );
    let e = assert_error(&respond(&france(json!({"tool_choice": "required"}))), 400);
    assert_eq!(e["param"], "tool_choice");
    let e = assert_error(
        &respond(&france(json!({"tools": [{"type": "web_search"}]}))),
        400,
    );
    assert_eq!(e["param"], "tools[0].type");
}

#[test]
fn bad_input_is_400_with_the_parameter() {
    let r = request(server(), "POST", "/v1/responses", &[], b"{nope");
    assert_eq!(assert_error(&r, 400)["code"], "invalid_json");
    let mut body = france(json!({}));
    body.as_object_mut().map(|o| o.remove("input"));
    assert_eq!(assert_error(&respond(&body), 400)["param"], "input");
    for (extra, param) in [
        (json!({"input": 42}), "input"),
        (json!({"input": []}), "input"),
        (
            json!({"input": [{"role": "robot", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"type": "function_call_output", "output": "x"}]}),
            "input[0].call_id",
        ),
        (json!({"max_output_tokens": 0}), "max_output_tokens"),
        (json!({"temperature": 3}), "temperature"),
        (json!({"instructions": 7}), "instructions"),
    ] {
        let e = assert_error(&respond(&france(extra.clone())), 400);
        assert_eq!(e["param"], param, "{extra}");
    }
    let e = assert_error(&respond(&france(json!({"model": "nope"}))), 404);
    assert_eq!(e["code"], "model_not_found");
}
