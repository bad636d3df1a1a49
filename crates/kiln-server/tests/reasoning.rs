//! Reasoning through the real engine, template and server, on a TEST
//! DOUBLE: SmolLM2 does not think, so `ReplayModel` (defined only in this
//! test file, never reachable from `kiln serve`) wraps SmolLM2's tokenizer
//! and cache and answers every step with a one-hot logit on the next token
//! of a recorded script. Everything else is real: the Qwen3-style template
//! (opening `<think>` itself or leaving it to the model), the engine loop,
//! sampling with output-format masks, detokenization and both APIs, whole
//! and streamed.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{assert_error, post, start_loading, wait_idle};
use kiln_engine::{Engine, LoadedModel};
use kiln_models::{CausalLm, ModelConfig};
use kiln_server::{Readiness, ServerConfig};
use kiln_tensor::{Backend, ForwardBatch, KvCache, Tensor};
use serde_json::{json, Value};

/// A Qwen3-style template: `open_think` opens the block in the prompt.
const TEMPLATE: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if open_think is defined and open_think %}<think>\n{%- endif %}{%- endif %}";

const THOUGHT: &str = "The user wants a city as JSON. Paris is the capital of France.";
const ANSWER: &str = "{\"city\": \"Paris\"}";

/// TEST DOUBLE: replays `script` token by token.
struct ReplayModel {
    inner: Box<dyn CausalLm>,
    script: Arc<Mutex<Vec<u32>>>,
    /// Per sequence (its first cache block): the position of its first
    /// generated token.
    starts: Mutex<HashMap<u32, usize>>,
}

impl CausalLm for ReplayModel {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn backend(&self) -> &Arc<dyn Backend> {
        self.inner.backend()
    }

    fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> kiln_models::Result<KvCache> {
        self.inner.new_kv_cache(num_blocks, block_size)
    }

    fn forward(&self, batch: &ForwardBatch, _cache: &mut KvCache) -> kiln_models::Result<Tensor> {
        let vocab = self.config().vocab_size;
        let script = self.script.lock().unwrap().clone();
        let mut starts = self.starts.lock().unwrap();
        let mut logits = Vec::new();
        for seq in &batch.seqs {
            let end = seq.num_computed + seq.num_tokens;
            let key = seq.block_tables[0][0];
            if seq.num_tokens > 1 || seq.num_computed == 0 {
                starts.insert(key, end);
            }
            let k = end - starts.get(&key).copied().unwrap_or(end);
            // Certain at any temperature.
            let mut row = vec![-1e4f32; vocab];
            // Past the script: the end of the turn.
            let next = script.get(k).copied().unwrap_or(script[script.len() - 1]);
            row[next as usize] = 0.0;
            logits.extend(row);
        }
        let rows: Vec<f32> = batch
            .logits_rows
            .iter()
            .enumerate()
            .flat_map(|(i, _)| logits[i * vocab..(i + 1) * vocab].to_vec())
            .collect();
        Ok(self
            .backend()
            .upload(&[batch.logits_rows.len(), vocab], &rows)?)
    }
}

struct Replay {
    addr: std::net::SocketAddr,
    script: Arc<Mutex<Vec<u32>>>,
    model: Arc<LoadedModel>,
}

impl Replay {
    fn start() -> Replay {
        Replay::start_with(ServerConfig::default())
    }

    fn start_with(config: ServerConfig) -> Replay {
        let mut model = common::load_model();
        model.set_chat_template(TEMPLATE).expect("template");
        let script = Arc::new(Mutex::new(Vec::new()));
        let inner = std::mem::replace(&mut model.model, Box::new(NoModel));
        model.model = Box::new(ReplayModel {
            inner,
            script: script.clone(),
            starts: Mutex::new(HashMap::new()),
        });
        let engine = Engine::start(model, common::engine_config()).expect("engine");
        let readiness = Readiness::new();
        readiness.ready(engine.handle());
        let model = engine.handle().model().clone();
        std::mem::forget(engine);
        let addr = start_loading(config, readiness);
        Replay {
            addr,
            script,
            model,
        }
    }

    /// The model will write `text`, then end its turn.
    fn script(&self, text: &str) {
        let mut ids = self.model.tokenizer.encode(text, false).expect("encode");
        ids.push(
            self.model
                .tokenizer
                .token_to_id("<|im_end|>")
                .expect("<|im_end|>"),
        );
        *self.script.lock().unwrap() = ids;
    }
}

/// Stands in while the real model is moved into the double.
struct NoModel;

impl CausalLm for NoModel {
    fn config(&self) -> &ModelConfig {
        unreachable!("replaced at once")
    }
    fn backend(&self) -> &Arc<dyn Backend> {
        unreachable!("replaced at once")
    }
    fn new_kv_cache(&self, _: usize, _: usize) -> kiln_models::Result<KvCache> {
        unreachable!("replaced at once")
    }
    fn forward(&self, _: &ForwardBatch, _: &mut KvCache) -> kiln_models::Result<Tensor> {
        unreachable!("replaced at once")
    }
}

fn sse_json(r: &common::HttpResponse) -> Vec<Value> {
    r.sse_data()
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("SSE data is JSON"))
        .collect()
}

/// `(reasoning, content)` of a chat answer, whole and streamed.
fn chat(addr: std::net::SocketAddr, extra: Value) -> ((Value, Value), (String, String)) {
    let mut body =
        json!({"messages": [{"role": "user", "content": "A city as JSON?"}], "max_tokens": 80});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let whole = post(addr, "/v1/chat/completions", &body);
    assert_eq!(whole.status, 200, "{}", whole.text());
    let msg = whole.json()["choices"][0]["message"].clone();
    body["stream"] = json!(true);
    let streamed = post(addr, "/v1/chat/completions", &body);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for chunk in sse_json(&streamed) {
        let delta = &chunk["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(delta["content"].as_str().unwrap_or(""));
    }
    (
        (msg["reasoning_content"].clone(), msg["content"].clone()),
        (reasoning, content),
    )
}

#[test]
fn reasoning_is_split_the_same_whole_and_streamed() {
    let r = Replay::start();
    // The model opens the block itself.
    r.script(&format!("<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"));
    let ((reasoning, content), (s_reasoning, s_content)) = chat(r.addr, json!({}));
    assert_eq!(reasoning, json!(THOUGHT));
    assert_eq!(content, json!(ANSWER));
    assert_eq!(
        (s_reasoning.as_str(), s_content.as_str()),
        (THOUGHT, ANSWER)
    );

    // The template opens it in the prompt; the model only closes it.
    r.script(&format!("{THOUGHT}\n</think>\n\n{ANSWER}"));
    let kwargs = json!({"chat_template_kwargs": {"open_think": true}});
    let ((reasoning, content), streamed) = chat(r.addr, kwargs.clone());
    assert_eq!((reasoning, content), (json!(THOUGHT), json!(ANSWER)));
    assert_eq!(streamed, (THOUGHT.to_string(), ANSWER.to_string()));

    // Without thinking the answer is all content.
    r.script(ANSWER);
    let ((reasoning, content), streamed) = chat(r.addr, json!({}));
    assert_eq!((reasoning, content), (Value::Null, json!(ANSWER)));
    assert_eq!(streamed, (String::new(), ANSWER.to_string()));

    // Anthropic: a thinking block, then the text block, in both forms.
    r.script(&format!("<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"));
    let mut body = json!({"max_tokens": 80, "messages": [{"role": "user", "content": "A city as JSON?"}],
                          "thinking": {"type": "enabled", "budget_tokens": 64}});
    let whole = post(r.addr, "/v1/messages", &body).json();
    assert_eq!(whole["content"][0]["type"], "thinking");
    assert_eq!(whole["content"][0]["thinking"], THOUGHT);
    assert_eq!(whole["content"][1], json!({"type": "text", "text": ANSWER}));
    body["stream"] = json!(true);
    let events = sse_json(&post(r.addr, "/v1/messages", &body));
    let mut blocks: Vec<(String, String)> = Vec::new();
    for e in &events {
        match e["type"].as_str() {
            Some("content_block_start") => blocks.push((
                e["content_block"]["type"].as_str().unwrap().to_string(),
                String::new(),
            )),
            Some("content_block_delta") => {
                let d = &e["delta"];
                let t = d["thinking"].as_str().or(d["text"].as_str()).unwrap_or("");
                blocks
                    .last_mut()
                    .expect("a delta inside a block")
                    .1
                    .push_str(t);
            }
            _ => {}
        }
    }
    assert_eq!(
        blocks,
        [
            ("thinking".to_string(), THOUGHT.to_string()),
            ("text".to_string(), ANSWER.to_string())
        ]
    );
    assert_eq!(
        post(r.addr, "/v1/messages", &json!({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "sometimes"}}))
            .status,
        400
    );
    let bad = post(
        r.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}),
    );
    assert_error(&bad, 400);
    wait_idle(r.addr);
}

#[test]
fn an_output_format_applies_after_the_reasoning() {
    let r = Replay::start();
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                        "additionalProperties": false});
    let format = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": true}}});
    // The reasoning is free text; a mask over it would change the replay.
    r.script(&format!("<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"));
    let ((reasoning, content), streamed) = chat(r.addr, format.clone());
    assert_eq!((reasoning, content), (json!(THOUGHT), json!(ANSWER)));
    assert_eq!(streamed, (THOUGHT.to_string(), ANSWER.to_string()));
    r.script(&format!("{THOUGHT}\n</think>\n\n{ANSWER}"));
    let mut opened = format.clone();
    opened["chat_template_kwargs"] = json!({"open_think": true});
    let ((reasoning, content), _) = chat(r.addr, opened);
    assert_eq!((reasoning, content), (json!(THOUGHT), json!(ANSWER)));
    // An answer outside the format is masked into it: the replayed prose
    // cannot appear (the double then picks among the allowed tokens at
    // random: blanks, or the schema's object).
    r.script("<think>\nok\n</think>\n\nParis is the answer.");
    let ((reasoning, content), _) = chat(r.addr, format);
    assert_eq!(reasoning, json!("ok"));
    let text = content.as_str().unwrap_or_default().trim();
    assert!(text.is_empty() || text.starts_with('{'), "{text}");
    wait_idle(r.addr);
}

#[test]
fn server_overrides_choose_the_output_syntax() {
    // `--tool-call-parser mistral --reasoning-parser none`: the template
    // (which names neither) no longer decides.
    let output = kiln_server::OutputOverrides {
        tool_syntax: Some(kiln_server::ToolSyntax::Mistral),
        reasoning: Some(false),
    };
    let r = Replay::start_with(ServerConfig {
        output,
        ..ServerConfig::default()
    });
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    r.script("[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}");
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}], "tools": tools, "max_tokens": 40});
    let v = post(r.addr, "/v1/chat/completions", &body).json();
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{v}");
    assert_eq!(
        serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap(),
        json!({"city": "Paris"})
    );
    // Reasoning is not split: the block stays in the content.
    r.script(&format!("<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"));
    let ((reasoning, content), _) = chat(r.addr, json!({}));
    assert_eq!(reasoning, Value::Null);
    assert!(
        content.as_str().unwrap_or_default().starts_with("<think>"),
        "{content}"
    );
    wait_idle(r.addr);
}
