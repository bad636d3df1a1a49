//! Ollama's API for the tools that speak it (Open WebUI, Continue, the
//! `ollama` client libraries): `/api/version`, `/api/tags`, `/api/ps`,
//! `/api/show`, `/api/chat` and `/api/generate` (newline-delimited JSON
//! streams, or one object with `"stream": false`) and `/api/embed` (the
//! pool's routes answer `/api/tags` and `/api/ps` from `dispatch`), with
//! Ollama's field names (`options.num_predict`, `temperature`, `top_p`,
//! `top_k`, `seed`, `stop`, `num_ctx`; `think`; `keep_alive`) and its error
//! body `{"error": "..."}`. Models are named as `/api/tags` lists them
//! (with or without `:latest`). Tools are the chat
//! template's, their calls read in the model's syntax and answered with the
//! arguments as an object; `format` (`"json"` or a JSON schema) constrains
//! the answer as `response_format` does; images are refused by name.

use std::path::Path;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{EmbedInput, LoadedModel, Usage};
use kiln_sampling::{FinishReason, Sampled};
use serde_json::{json, Map, Value};

use crate::dispatch::ServedModel;
use crate::errors::{ApiError, ErrorShape};
use crate::generation::{self, ChatRender, Generate, Prepared};
use crate::parse::{OutputParser, OutputSyntax, Piece};
use crate::pool::ModelStatus;
use crate::sampling::{SamplingFields, OPENAI_MAX_TEMPERATURE};
use crate::sse::{self, StreamFormat};
use crate::state::AppState;

/// An error answered in Ollama's shape.
#[derive(Debug)]
pub struct OllamaError(pub ApiError);

impl<E: Into<ApiError>> From<E> for OllamaError {
    fn from(e: E) -> Self {
        OllamaError(e.into())
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        self.0.response_in(ErrorShape::Ollama)
    }
}

type Result<T> = std::result::Result<T, OllamaError>;

/// The request body as JSON (Ollama's clients send no content type at times).
fn body(bytes: &Bytes) -> Result<Map<String, Value>> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::InvalidJson("the body must be a JSON object".into()).into()),
        Err(e) => Err(ApiError::InvalidJson(e.to_string()).into()),
    }
}

/// The served model's name as `model` may give it.
fn check_model(state: &AppState, req: &Map<String, Value>) -> Result<()> {
    let name = match req.get("model").or_else(|| req.get("name")) {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string").into()),
    };
    let bare = name.strip_suffix(":latest").unwrap_or(name);
    state.check_model(Some(bare))?;
    Ok(())
}

pub(crate) fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs)
}

/// `secs` since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (civil from days).
fn rfc3339(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `details` of a model, as `/api/tags` and `/api/show` give them (the
/// family is known once it is loaded).
fn details(path: &Path, model: Option<&LoadedModel>) -> Value {
    let family = model.map_or("", |m| m.model.config().model_type.as_str());
    let format = match path.is_dir() {
        true => "safetensors",
        false => "gguf",
    };
    json!({
        "parent_model": "",
        "format": format,
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": "",
    })
}

fn file_bytes(path: &Path) -> u64 {
    let meta = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    match std::fs::read_dir(path) {
        Ok(entries) => entries.flatten().map(|e| meta(&e.path())).sum(),
        Err(_) => meta(path),
    }
}

fn modified_at(path: &Path) -> String {
    let modified = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs());
    rfc3339(modified)
}

/// A model's entry in `/api/tags` (and the start of one in `/api/ps`).
pub(crate) fn pool_entry(s: &ModelStatus<ServedModel>) -> Value {
    let model = s.value.as_ref().map(|v| v.state.engine.model());
    json!({
        "name": s.name,
        "model": s.name,
        "modified_at": modified_at(&s.path),
        "size": file_bytes(&s.path),
        "digest": "",
        "details": details(&s.path, model.map(|m| &**m)),
    })
}

/// What `/api/ps` adds for a loaded model: when it will be unloaded if
/// left idle (`unloads_in`; never: far in the future), its device memory
/// and context.
pub(crate) async fn running_fields(
    entry: &mut Value,
    state: &AppState,
    unloads_in: Option<std::time::Duration>,
) {
    // Read in the engine's process (its own, under isolation).
    let engine = state.engine.clone();
    let vram = tokio::task::spawn_blocking(move || engine.stats())
        .await
        .ok()
        .and_then(|s| s.ok())
        .and_then(|s| s.device_memory)
        .map_or(0, |m| m.active_bytes);
    let expires = match unloads_in {
        Some(left) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            rfc3339(now + left.as_secs())
        }
        None => "9999-12-31T23:59:59Z".to_string(),
    };
    entry["expires_at"] = json!(expires);
    entry["size_vram"] = json!(vram);
    entry["context_length"] = json!(state.context_length());
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

pub async fn show(State(state): State<AppState>, bytes: Bytes) -> Result<Json<Value>> {
    let req = body(&bytes)?;
    check_model(&state, &req)?;
    let model = state.engine.model();
    let cfg = model.model.config();
    let family = cfg.model_type.as_str();
    let template = generation::template_source(model).to_string();
    let mut capabilities = Vec::new();
    if model.model.generates() {
        capabilities.push("completion");
    }
    if generation::thinks(&state) {
        capabilities.push("thinking");
    }
    if state.engine.embedding_head().is_ok() {
        capabilities.push("embedding");
    }
    Ok(Json(json!({
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": details(&model.path, Some(model)),
        "model_info": {
            "general.architecture": family,
            format!("{family}.context_length"): state.context_length(),
            format!("{family}.embedding_length"): cfg.hidden_size,
            format!("{family}.block_count"): cfg.num_layers,
        },
        "capabilities": capabilities,
        "modified_at": modified_at(&model.path),
    })))
}

/// Refuses what is not taken yet, by name.
fn refuse_unsupported(req: &Map<String, Value>, keys: &[&str]) -> Result<()> {
    for key in keys {
        // Absent, null, "" and [] all mean none (clients send their defaults).
        if req
            .get(*key)
            .is_some_and(|v| !v.is_null() && v != &json!([]) && v != &json!(""))
        {
            return Err(ApiError::unsupported(
                *key,
                format!("`{key}` is not supported on Kiln's Ollama API yet"),
            )
            .into());
        }
    }
    Ok(())
}

/// Ollama's `options` as sampling fields (unknown options are ignored, as
/// Ollama does).
fn sampling(state: &AppState, req: &Map<String, Value>) -> Result<kiln_sampling::SamplingParams> {
    let empty = Map::new();
    let o = req
        .get("options")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let f = |k: &str| o.get(k).and_then(Value::as_f64).map(|v| v as f32);
    let i = |k: &str| o.get(k).and_then(Value::as_i64);
    let max_tokens = match i("num_predict") {
        // -1 (and -2): until the context is full.
        Some(n) if n < 0 => None,
        Some(n) => Some((n, "options.num_predict")),
        None => None,
    };
    let fields = SamplingFields {
        max_tokens,
        temperature: f("temperature"),
        top_p: f("top_p"),
        top_k: i("top_k").filter(|&k| k > 0),
        min_p: f("min_p"),
        presence_penalty: f("presence_penalty"),
        frequency_penalty: f("frequency_penalty"),
        repetition_penalty: f("repeat_penalty"),
        seed: i("seed"),
        stop: o.get("stop").cloned(),
        max_temperature: OPENAI_MAX_TEMPERATURE,
        ..SamplingFields::default()
    };
    let vocab = state.engine.model().model.config().vocab_size;
    Ok(fields.into_params(vocab, &state.sampling_defaults)?)
}

/// Ollama's `format`: `"json"` (any JSON object) or a JSON schema.
fn format(req: &Map<String, Value>) -> Result<Option<kiln_structured::Format>> {
    match req.get("format") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => Ok(Some(kiln_structured::Format::JsonObject)),
        Some(schema @ Value::Object(_)) => {
            Ok(Some(kiln_structured::Format::JsonSchema(schema.clone())))
        }
        Some(other) => Err(ApiError::invalid(
            "format",
            format!("`format` must be \"json\" or a JSON schema, not {other}"),
        )
        .into()),
    }
}

fn stream_wanted(req: &Map<String, Value>) -> bool {
    req.get("stream").and_then(Value::as_bool).unwrap_or(true)
}

fn think(req: &Map<String, Value>) -> Option<bool> {
    match req.get("think") {
        Some(Value::Bool(b)) => Some(*b),
        // "low" / "medium" / "high" (gpt-oss): thinking on.
        Some(Value::String(_)) => Some(true),
        _ => None,
    }
}

/// Ollama's chat messages as the template's (role and content; a tool
/// result's `tool_name` as `name`).
fn template_messages(req: &Map<String, Value>) -> Result<Value> {
    let Some(Value::Array(messages)) = req.get("messages") else {
        return Err(ApiError::invalid("messages", "`messages` must be a list").into());
    };
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        // A message with tool calls may have no content.
        let content = match m.get("content") {
            None | Some(Value::Null) => Some(""),
            Some(c) => c.as_str(),
        };
        let (Some(role), Some(content)) = (role, content) else {
            return Err(ApiError::invalid(
                format!("messages[{i}]"),
                format!("`messages[{i}]` needs a string `role` and `content`"),
            )
            .into());
        };
        if m.get("images")
            .is_some_and(|v| v != &json!([]) && !v.is_null())
        {
            return Err(ApiError::unsupported(
                format!("messages[{i}].images"),
                "images are not supported: the served model reads text only",
            )
            .into());
        }
        let mut t = json!({"role": role, "content": content});
        if let Some(name) = m.get("tool_name").and_then(Value::as_str) {
            t["name"] = json!(name);
        }
        if let Some(Value::Array(calls)) = m.get("tool_calls") {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| json!({"type": "function", "function": c.get("function").cloned().unwrap_or(Value::Null)}))
                .collect();
            t["tool_calls"] = Value::Array(calls);
        }
        out.push(t);
    }
    Ok(Value::Array(out))
}

/// Ollama's `tools` (OpenAI's function form) for the template, and their
/// names, whose calls are parsed from the output.
fn tools(req: &Map<String, Value>) -> Result<(Option<Value>, Vec<String>)> {
    let list = match req.get("tools") {
        None | Some(Value::Null) => return Ok((None, Vec::new())),
        Some(Value::Array(l)) if l.is_empty() => return Ok((None, Vec::new())),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list").into()),
    };
    let mut names = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let name = t
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|_| t.get("type").and_then(Value::as_str).unwrap_or("function") == "function");
        match name {
            Some(n) => names.push(n.to_string()),
            None => {
                return Err(ApiError::invalid(
                    format!("tools[{i}]"),
                    format!("`tools[{i}]` must be a function with a `function.name`"),
                )
                .into())
            }
        }
    }
    Ok((Some(Value::Array(list.clone())), names))
}

/// A call as Ollama writes it: the arguments as an object.
fn call_json(c: &crate::parse::ToolCall) -> Value {
    let arguments: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"function": {"name": c.name, "arguments": arguments}})
}

/// What every line of one answer shares.
struct Line {
    model: String,
    chat: bool,
    start: Instant,
}

impl Line {
    fn base(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("model".into(), json!(self.model));
        m.insert("created_at".into(), json!(now_rfc3339()));
        m
    }

    /// A piece of the answer (thinking and calls apart from the text).
    fn piece(&self, s: &Split, done: bool) -> Map<String, Value> {
        let mut m = self.base();
        if self.chat {
            let mut msg = json!({"role": "assistant", "content": s.text});
            if !s.thinking.is_empty() {
                msg["thinking"] = json!(s.thinking);
            }
            if !s.calls.is_empty() {
                msg["tool_calls"] = json!(s.calls);
            }
            m.insert("message".into(), msg);
        } else {
            m.insert("response".into(), json!(s.text));
            if !s.thinking.is_empty() {
                m.insert("thinking".into(), json!(s.thinking));
            }
        }
        m.insert("done".into(), json!(done));
        m
    }

    /// The closing fields: why it stopped and the counts and times.
    fn finish(&self, m: &mut Map<String, Value>, reason: FinishReason, usage: &Usage) {
        let total = self.start.elapsed().as_nanos() as u64;
        m.insert("done".into(), json!(true));
        let reason = match reason {
            FinishReason::Length => "length",
            _ => "stop",
        };
        m.insert("done_reason".into(), json!(reason));
        m.insert("total_duration".into(), json!(total));
        m.insert("load_duration".into(), json!(0));
        m.insert("prompt_eval_count".into(), json!(usage.prompt_tokens));
        m.insert("eval_count".into(), json!(usage.completion_tokens));
        m.insert("eval_duration".into(), json!(total));
    }
}

fn ndjson(m: &Map<String, Value>) -> Bytes {
    let mut s = serde_json::to_string(m).unwrap_or_else(|_| "{}".into());
    s.push('\n');
    Bytes::from(s)
}

/// Pieces as Ollama's text, thinking and tool calls.
#[derive(Default)]
struct Split {
    text: String,
    thinking: String,
    calls: Vec<Value>,
}

fn split(pieces: Vec<Piece>) -> Split {
    let mut s = Split::default();
    for p in pieces {
        match p {
            Piece::Text(t) => s.text.push_str(&t),
            Piece::Reasoning(r) => s.thinking.push_str(&r),
            Piece::Call(c) => s.calls.push(call_json(&c)),
            Piece::CallOpen { .. } | Piece::CallArguments(_) => {}
        }
    }
    s
}

impl Split {
    fn text(text: &str) -> Split {
        Split {
            text: text.to_string(),
            ..Split::default()
        }
    }

    fn is_empty(&self) -> bool {
        self.text.is_empty() && self.thinking.is_empty() && self.calls.is_empty()
    }
}

/// An answer streamed as newline-delimited JSON.
struct NdjsonStream {
    line: Line,
    parser: Option<OutputParser>,
}

impl StreamFormat for NdjsonStream {
    fn on_token(&mut self, _: usize, text: &str, _: Option<&Sampled>) -> Vec<Bytes> {
        let s = match self.parser.as_mut() {
            Some(p) => split(p.push(text)),
            None => Split::text(text),
        };
        if s.is_empty() {
            return Vec::new();
        }
        vec![ndjson(&self.line.piece(&s, false))]
    }

    fn on_finish(&mut self, _: usize, reason: FinishReason, usage: &Usage) -> Vec<Bytes> {
        let s = match self.parser.as_mut() {
            Some(p) => split(p.finish()),
            None => Split::default(),
        };
        let mut m = self.line.piece(&s, true);
        self.line.finish(&mut m, reason, usage);
        vec![ndjson(&m)]
    }

    fn keepalive_frame(&self) -> Option<Bytes> {
        None
    }

    fn error_frame(&mut self, e: &ApiError) -> Bytes {
        Bytes::from(format!("{}\n", e.body_in(ErrorShape::Ollama)))
    }

    fn end_frame(&self) -> Option<Bytes> {
        None
    }

    fn content_type(&self) -> &'static str {
        "application/x-ndjson"
    }
}

/// Runs a prepared request and answers as Ollama does.
async fn answer(
    state: &AppState,
    req: &Map<String, Value>,
    chat: bool,
    prepare: impl FnOnce(&LoadedModel) -> std::result::Result<Prepared<OutputSyntax>, ApiError>
        + Send
        + 'static,
) -> Result<Response> {
    let start = Instant::now();
    let params = sampling(state, req)?;
    let format = format(req)?;
    let parses = generation::thinks(state)
        || req
            .get("tools")
            .is_some_and(|t| t != &json!([]) && !t.is_null());
    let generate = Generate {
        params,
        skip_special_tokens: !parses,
        format,
        adapter: None,
        prediction: None,
    };
    let admitted = generation::start(state, generate, prepare).await?;
    let syntax: OutputSyntax = admitted.extra;
    let line = Line {
        model: state.model_name.to_string(),
        chat,
        start,
    };
    let parser = (!syntax.is_plain()).then(|| OutputParser::new(&syntax));
    if stream_wanted(req) {
        let format = NdjsonStream { line, parser };
        return Ok(sse::response(
            admitted.events,
            format,
            Vec::new(),
            state.sse_keepalive,
        ));
    }
    let c = admitted.events.collect(|_, _| {}).await?;
    let s = match parser {
        Some(mut p) => {
            let mut pieces = p.push(&c.text);
            pieces.extend(p.finish());
            split(pieces)
        }
        None => Split::text(&c.text),
    };
    let mut m = line.piece(&s, true);
    line.finish(&mut m, c.finish_reason, &c.usage);
    Ok(Json(Value::Object(m)).into_response())
}

pub async fn chat(State(state): State<AppState>, bytes: Bytes) -> Result<Response> {
    let req = body(&bytes)?;
    check_model(&state, &req)?;
    state.check_generates()?;
    let messages = template_messages(&req)?;
    let (tools, tool_names) = tools(&req)?;
    let render = ChatRender {
        tools,
        tool_names,
        enable_thinking: think(&req),
        kwargs: Map::new(),
        overrides: crate::parse::OutputOverrides {
            reasoning: think(&req).filter(|t| !t),
            ..state.output
        },
    };
    let thinks = think(&req) != Some(false);
    answer(&state, &req, true, move |model| {
        let mut p = generation::chat_prompt(model, messages, render)?;
        if !thinks {
            p.syntax.think = None;
        }
        let syntax = p.syntax.clone();
        Ok(p.prepared(syntax))
    })
    .await
}

pub async fn generate(State(state): State<AppState>, bytes: Bytes) -> Result<Response> {
    let req = body(&bytes)?;
    check_model(&state, &req)?;
    state.check_generates()?;
    refuse_unsupported(&req, &["images", "suffix", "context"])?;
    let prompt = match req.get("prompt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::invalid("prompt", "`prompt` must be a string").into()),
    };
    // An empty prompt only loads the model (which is loaded): done at once.
    if prompt.is_empty() {
        let line = Line {
            model: state.model_name.to_string(),
            chat: false,
            start: Instant::now(),
        };
        let mut m = line.piece(&Split::default(), true);
        m.insert("done_reason".into(), json!("load"));
        return Ok(Json(Value::Object(m)).into_response());
    }
    let raw = req.get("raw").and_then(Value::as_bool).unwrap_or(false);
    let system = req
        .get("system")
        .and_then(Value::as_str)
        .map(str::to_string);
    let think = think(&req);
    let overrides = state.output;
    answer(&state, &req, false, move |model| {
        if raw || model.tokenizer.chat_template().is_none() {
            let tokens = model.tokenizer.encode(&prompt, true)?;
            return Ok(Prepared::new(tokens, OutputSyntax::default()));
        }
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.push(json!({"role": "user", "content": prompt}));
        let render = ChatRender {
            tools: None,
            tool_names: Vec::new(),
            enable_thinking: think,
            kwargs: Map::new(),
            overrides,
        };
        let mut p = generation::chat_prompt(model, Value::Array(messages), render)?;
        if think == Some(false) {
            p.syntax.think = None;
        }
        let syntax = p.syntax.clone();
        Ok(p.prepared(syntax))
    })
    .await
}

/// `/api/embed`'s answer (vectors as f32, written shortest, as
/// `/v1/embeddings` writes them).
#[derive(serde::Serialize)]
pub struct EmbedOut {
    model: String,
    embeddings: Vec<Vec<f32>>,
    total_duration: u64,
    load_duration: u64,
    prompt_eval_count: usize,
}

pub async fn embed(State(state): State<AppState>, bytes: Bytes) -> Result<Json<EmbedOut>> {
    let req = body(&bytes)?;
    check_model(&state, &req)?;
    let start = Instant::now();
    let texts: Vec<String> = match req.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.iter().all(Value::is_string) && !items.is_empty() => {
            items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        }
        _ => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or a non-empty list of strings",
            )
            .into())
        }
    };
    state.engine.embedding_head()?;
    let truncate = req.get("truncate").and_then(Value::as_bool).unwrap_or(true);
    let engine = state.engine.clone();
    let (vectors, tokens) = tokio::task::spawn_blocking(
        move || -> std::result::Result<(Vec<Vec<f32>>, usize), ApiError> {
            let inputs: Vec<EmbedInput> = texts
                .iter()
                .map(|t| {
                    engine
                        .embed_input(t, None, truncate)
                        .map_err(ApiError::from)
                })
                .collect::<std::result::Result<_, _>>()?;
            let tokens = inputs.iter().map(|t| t.ids.len()).sum();
            Ok((engine.embed(inputs)?, tokens))
        },
    )
    .await
    .map_err(|e| ApiError::Internal(format!("embedding task: {e}")))??;
    Ok(Json(EmbedOut {
        model: state.model_name.to_string(),
        embeddings: vectors,
        total_duration: start.elapsed().as_nanos() as u64,
        load_duration: 0,
        prompt_eval_count: tokens,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_432_523), "2026-12-05T01:02:03Z");
    }
}
