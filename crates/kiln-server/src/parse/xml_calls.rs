//! Tool-call syntaxes of the DeepSeek-style families, each a tagged block
//! whose body [`super::tools`] hands to a function here:
//!
//! - GLM-4.5: `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>`
//!   pairs, `</tool_call>`; a value that parses as JSON is that JSON, any
//!   other is a string (vLLM's `glm45` reading);
//! - DeepSeek-V3: `<｜tool▁calls▁begin｜>` then calls
//!   `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a fenced JSON block
//!   (V3, R1) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}` (V3.1), each
//!   closed by `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`;
//! - Kimi-K2: `<|tool_calls_section_begin|>` then calls
//!   `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{…}<|tool_call_end|>`,
//!   then `<|tool_calls_section_end|>`.

use serde_json::Value;

use super::tools::ToolCall;

pub const GLM_OPEN: &str = "<tool_call>";
pub const GLM_CLOSE: &str = "</tool_call>";
pub const DEEPSEEK_OPEN: &str = "<｜tool▁calls▁begin｜>";
pub const DEEPSEEK_CLOSE: &str = "<｜tool▁calls▁end｜>";
const DEEPSEEK_CALL: &str = "<｜tool▁call▁begin｜>";
const DEEPSEEK_CALL_END: &str = "<｜tool▁call▁end｜>";
const DEEPSEEK_SEP: &str = "<｜tool▁sep｜>";
pub const KIMI_OPEN: &str = "<|tool_calls_section_begin|>";
pub const KIMI_CLOSE: &str = "<|tool_calls_section_end|>";
const KIMI_CALL: &str = "<|tool_call_begin|>";
const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";

fn plausible_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

/// A JSON object's compact text, or `None`.
fn object(text: &str) -> Option<String> {
    match serde_json::from_str::<Value>(text.trim()).ok()? {
        v @ Value::Object(_) => Some(v.to_string()),
        _ => None,
    }
}

/// The text between `open` and the next `close` in `s`, and what follows.
fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<(&'a str, &'a str)> {
    let rest = s.trim_start().strip_prefix(open)?;
    let end = rest.find(close)?;
    Some((&rest[..end], &rest[end + close.len()..]))
}

/// GLM-4.5's call body: the name, then its argument pairs.
pub fn parse_glm(body: &str) -> Option<Vec<ToolCall>> {
    let body = body.trim();
    let name_end = body.find("<arg_key>").unwrap_or(body.len());
    let name = body[..name_end].trim();
    if !plausible_name(name) {
        return None;
    }
    let mut args = serde_json::Map::new();
    let mut rest = &body[name_end..];
    while !rest.trim().is_empty() {
        let (key, after) = between(rest, "<arg_key>", "</arg_key>")?;
        let (value, after) = between(after, "<arg_value>", "</arg_value>")?;
        let value = serde_json::from_str::<Value>(value)
            .unwrap_or_else(|_| Value::String(value.to_string()));
        args.insert(key.trim().to_string(), value);
        rest = after;
    }
    Some(vec![ToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
    }])
}

/// The calls of a section body: each between `open` and `close`, read by
/// `call` into a name and an arguments object.
fn section_calls(
    body: &str,
    open: &str,
    close: &str,
    call: impl Fn(&str) -> Option<(&str, &str)>,
) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body;
    while !rest.trim().is_empty() {
        let (text, after) = between(rest, open, close)?;
        let (name, args) = call(text)?;
        if !plausible_name(name) {
            return None;
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: object(args)?,
        });
        rest = after;
    }
    Some(calls)
}

/// DeepSeek-V3's calls between its section markers.
pub fn parse_deepseek(body: &str) -> Option<Vec<ToolCall>> {
    section_calls(body, DEEPSEEK_CALL, DEEPSEEK_CALL_END, |call| {
        let (head, tail) = call.split_once(DEEPSEEK_SEP)?;
        Some(match tail.split_once("```json") {
            // V3 / R1: `function<sep>NAME\n```json\n{…}\n````.
            Some((name, fenced)) => (name.trim(), fenced.rsplit_once("```")?.0),
            // V3.1: `NAME<sep>{…}`.
            None => (head.trim(), tail),
        })
    })
}

/// Kimi-K2's calls between its section markers: `functions.NAME:INDEX` ids.
pub fn parse_kimi(body: &str) -> Option<Vec<ToolCall>> {
    section_calls(body, KIMI_CALL, KIMI_CALL_END, |call| {
        let (id, args) = call.split_once(KIMI_ARGS)?;
        let id = id.trim();
        let id = id.strip_prefix("functions.").unwrap_or(id);
        Some((id.rsplit_once(':').map_or(id, |(n, _)| n), args))
    })
}
