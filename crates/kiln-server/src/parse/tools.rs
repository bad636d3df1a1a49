//! Tool calls in the syntaxes of the families Kiln loads, read from the
//! answer text as it streams:
//!
//! - Hermes/Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
//! - Llama 3.x: `<|python_tag|>{"name": …, "parameters": {…}}` and bare
//!   JSON calls separated by `;`;
//! - Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` and the
//!   newer `[TOOL_CALLS]name[ARGS]{…}`;
//! - Gemma: FunctionGemma's `<start_function_call>call:name{k:<escape>v<escape>}<end_function_call>`
//!   and the ```` ```tool_code ```` block of Python calls Gemma 3 is
//!   prompted with;
//! - GLM-4.5's `<arg_key>`/`<arg_value>` calls, DeepSeek-V3's and Kimi-K2's
//!   sections of calls ([`super::xml_calls`]).
//!
//! In every syntax an answer (or the text right after a call) that is
//! nothing but a JSON call naming a declared tool counts as a call too:
//! small models often drop the tags. Text that looks like a call but does
//! not parse stays in the content, as written.
//!
//! The stream releases text as soon as it cannot belong to a call and each
//! call as soon as it is complete, so feeding the output whole or split at
//! any byte gives the same text and the same calls. Whitespace between text
//! and a call, and after the last call, is dropped.

use serde_json::Value;

use super::gemma;
use super::json_scan::value_end;
use super::xml_calls;
use super::Piece;

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text, as OpenAI sends them.
    pub arguments: String,
}

/// Which tool-call syntax a model writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    Hermes,
    Llama3,
    Mistral,
    Gemma,
    Glm45,
    DeepSeekV3,
    KimiK2,
}

impl ToolSyntax {
    /// The syntax a chat template teaches (Hermes when it names none).
    pub fn detect(template: &str) -> ToolSyntax {
        if template.contains("<arg_key>") {
            ToolSyntax::Glm45
        } else if template.contains(xml_calls::DEEPSEEK_OPEN) {
            ToolSyntax::DeepSeekV3
        } else if template.contains(xml_calls::KIMI_OPEN) {
            ToolSyntax::KimiK2
        } else if template.contains("<tool_call>") {
            ToolSyntax::Hermes
        } else if template.contains("[TOOL_CALLS]") {
            ToolSyntax::Mistral
        } else if template.contains("<start_function_call>") || template.contains("tool_code") {
            ToolSyntax::Gemma
        } else if template.contains("<|python_tag|>") || template.contains("<|eom_id|>") {
            ToolSyntax::Llama3
        } else if template.contains("<start_of_turn>") {
            ToolSyntax::Gemma
        } else if template.contains("<|start_header_id|>") {
            ToolSyntax::Llama3
        } else {
            ToolSyntax::Hermes
        }
    }

    /// From a `--tool-call-parser` name (vLLM's names where they exist).
    pub fn from_name(name: &str) -> Option<ToolSyntax> {
        Some(match name {
            "hermes" | "qwen" => ToolSyntax::Hermes,
            "llama3" | "llama3_json" | "llama" => ToolSyntax::Llama3,
            "mistral" => ToolSyntax::Mistral,
            "gemma" | "functiongemma" => ToolSyntax::Gemma,
            "glm45" | "glm47" => ToolSyntax::Glm45,
            "deepseek_v3" | "deepseek_v31" => ToolSyntax::DeepSeekV3,
            "kimi_k2" => ToolSyntax::KimiK2,
            _ => return None,
        })
    }

    /// How a call is spelled, for a grammar that holds calls to their
    /// schemas: `None` where the syntax is not a marker before JSON
    /// (Gemma's Python-like calls, Mistral's `name[ARGS]{…}` form, which a
    /// template teaches by mentioning `[ARGS]`).
    pub fn call_spelling(self, template: &str) -> Option<CallSpelling> {
        match self {
            ToolSyntax::Hermes => Some(CallSpelling {
                begin: "<tool_call>",
                end: "</tool_call>",
                arguments_key: "arguments",
                array: false,
                many: true,
            }),
            ToolSyntax::Llama3 => Some(CallSpelling {
                begin: "<|python_tag|>",
                end: "",
                arguments_key: "parameters",
                array: false,
                many: false,
            }),
            ToolSyntax::Mistral if !template.contains("[ARGS]") => Some(CallSpelling {
                begin: "[TOOL_CALLS]",
                end: "",
                arguments_key: "arguments",
                array: true,
                many: false,
            }),
            ToolSyntax::Mistral
            | ToolSyntax::Gemma
            | ToolSyntax::Glm45
            | ToolSyntax::DeepSeekV3
            | ToolSyntax::KimiK2 => None,
        }
    }

    /// The markers that open a call.
    fn openers(self) -> &'static [&'static str] {
        match self {
            ToolSyntax::Hermes => &["<tool_call>"],
            ToolSyntax::Llama3 => &["<|python_tag|>"],
            ToolSyntax::Mistral => &["[TOOL_CALLS]"],
            ToolSyntax::Gemma => &[gemma::CALL_OPEN, gemma::CODE_OPEN],
            ToolSyntax::Glm45 => &[xml_calls::GLM_OPEN],
            ToolSyntax::DeepSeekV3 => &[xml_calls::DEEPSEEK_OPEN],
            ToolSyntax::KimiK2 => &[xml_calls::KIMI_OPEN],
        }
    }
}

/// How a syntax writes calls: `begin`, a JSON call (`{"name": …,
/// ARGUMENTS_KEY: {…}}`, or an array of them), `end`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallSpelling {
    pub begin: &'static str,
    pub end: &'static str,
    pub arguments_key: &'static str,
    /// The calls after one `begin` are a JSON array.
    pub array: bool,
    /// Whether `begin` may open more calls after the first.
    pub many: bool,
}

/// What the text from an opener on turned out to be.
#[derive(Debug, PartialEq)]
enum Region {
    /// Not decided until more text comes.
    More,
    /// Calls, spelled by the first `len` bytes.
    Calls(Vec<ToolCall>, usize),
    /// Not a call: the first `len` bytes are text.
    Text(usize),
}

/// `{"name": "...", "arguments": {...}}` (or `"parameters"`; arguments may
/// also be a JSON string).
fn call_from_json(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let arguments = match args {
        Value::String(s) => s,
        other @ Value::Object(_) => other.to_string(),
        _ => return None,
    };
    Some(ToolCall { name, arguments })
}

/// One call or an array of calls.
fn calls_from_json(text: &str) -> Option<Vec<ToolCall>> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    match &v {
        Value::Array(items) if !items.is_empty() => items.iter().map(call_from_json).collect(),
        Value::Object(_) => Some(vec![call_from_json(&v)?]),
        _ => None,
    }
}

/// A JSON value starting at the first non-blank byte of `text` (after
/// `skip` bytes): the calls it spells, or text when it spells none.
fn json_region(text: &str, skip: usize, end: bool) -> Region {
    let body = &text[skip..];
    let blank = body.len() - body.trim_start().len();
    let body = &body[blank..];
    if body.is_empty() {
        return if end {
            Region::Text(text.len())
        } else {
            Region::More
        };
    }
    if !body.starts_with(['{', '[']) {
        return Region::Text(skip);
    }
    match value_end(body) {
        Some(len) => {
            let total = skip + blank + len;
            match calls_from_json(&body[..len]) {
                Some(calls) => Region::Calls(calls, total),
                None => Region::Text(total),
            }
        }
        None if end => Region::Text(text.len()),
        None => Region::More,
    }
}

/// `open … close` around a body that `parse` reads; an unclosed block at
/// the end is tried as it is.
fn tagged_region(
    text: &str,
    open: &str,
    close: &str,
    end: bool,
    parse: impl Fn(&str) -> Option<Vec<ToolCall>>,
) -> Region {
    let after = &text[open.len()..];
    let (body, len) = match after.find(close) {
        Some(c) => (&after[..c], open.len() + c + close.len()),
        None if end => (after, text.len()),
        None => return Region::More,
    };
    match parse(body) {
        Some(calls) if !calls.is_empty() => Region::Calls(calls, len),
        _ => Region::Text(len),
    }
}

/// Mistral after `[TOOL_CALLS]`: a JSON array, or `name[ARGS]{…}` (with an
/// optional `[CALL_ID]id` before `[ARGS]`).
fn mistral_region(text: &str, open: usize, end: bool) -> Region {
    let body = text[open..].trim_start();
    if body.starts_with('[') || body.starts_with('{') {
        return json_region(text, open, end);
    }
    const ARGS: &str = "[ARGS]";
    let Some(args) = body.find(ARGS) else {
        let plausible = body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.[]CALID".contains(&b));
        return if end || !plausible {
            Region::Text(open)
        } else {
            Region::More
        };
    };
    let head = &body[..args];
    let name = head.split("[CALL_ID]").next().unwrap_or(head);
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
    {
        return Region::Text(open);
    }
    let skip = text.len() - body.len() + args + ARGS.len();
    match json_region(text, skip, end) {
        Region::Calls(calls, len) if calls.len() == 1 => Region::Calls(
            vec![ToolCall {
                name: name.to_string(),
                arguments: calls_args(&text[skip..len]),
            }],
            len,
        ),
        // `{…}` here is the arguments object itself.
        Region::Text(len) if len > skip => match serde_json::from_str::<Value>(&text[skip..len]) {
            Ok(v @ Value::Object(_)) => Region::Calls(
                vec![ToolCall {
                    name: name.to_string(),
                    arguments: v.to_string(),
                }],
                len,
            ),
            _ => Region::Text(len),
        },
        other => other,
    }
}

/// The arguments object spelled by `text`, compacted.
fn calls_args(text: &str) -> String {
    serde_json::from_str::<Value>(text.trim())
        .map(|v| v.to_string())
        .unwrap_or_else(|_| text.trim().to_string())
}

fn region(syntax: ToolSyntax, opener: &str, text: &str, end: bool) -> Region {
    match syntax {
        ToolSyntax::Hermes => tagged_region(text, opener, "</tool_call>", end, calls_from_json),
        ToolSyntax::Llama3 => json_region(text, opener.len(), end),
        ToolSyntax::Mistral => mistral_region(text, opener.len(), end),
        ToolSyntax::Gemma if opener == gemma::CALL_OPEN => tagged_region(
            text,
            opener,
            gemma::CALL_CLOSE,
            end,
            gemma::parse_function_call,
        ),
        ToolSyntax::Gemma => {
            tagged_region(text, opener, gemma::CODE_CLOSE, end, gemma::parse_tool_code)
        }
        ToolSyntax::Glm45 => tagged_region(
            text,
            opener,
            xml_calls::GLM_CLOSE,
            end,
            xml_calls::parse_glm,
        ),
        ToolSyntax::DeepSeekV3 => tagged_region(
            text,
            opener,
            xml_calls::DEEPSEEK_CLOSE,
            end,
            xml_calls::parse_deepseek,
        ),
        ToolSyntax::KimiK2 => tagged_region(
            text,
            opener,
            xml_calls::KIMI_CLOSE,
            end,
            xml_calls::parse_kimi,
        ),
    }
}

/// The streaming reader of one answer.
#[derive(Debug)]
pub struct ToolStream {
    syntax: ToolSyntax,
    tool_names: Vec<String>,
    /// Text not yet decided.
    buf: String,
    /// Blank text held between released text and whatever follows.
    blank: String,
    /// At the start of the answer or right after a call: a bare JSON call
    /// may come.
    bare: bool,
    /// Right after a call: blanks (and Llama's `;` separators) are dropped.
    after_call: bool,
    calls: usize,
}

impl ToolStream {
    pub fn new(syntax: ToolSyntax, tool_names: Vec<String>) -> Self {
        ToolStream {
            syntax,
            tool_names,
            buf: String::new(),
            blank: String::new(),
            bare: true,
            after_call: false,
            calls: 0,
        }
    }

    /// Takes the next piece of answer text; returns what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(false, &mut out);
        out
    }

    /// The end of the answer: everything still held is decided.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.drain(true, &mut out);
        if self.calls == 0 && !self.blank.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.blank)));
        }
        out
    }

    fn is_separator(&self, c: char) -> bool {
        c.is_whitespace() || (self.after_call && (c == ';' || c == ','))
    }

    fn drain(&mut self, end: bool, out: &mut Vec<Piece>) {
        while !self.buf.is_empty() {
            if self.bare {
                let rest = self.buf.trim_start_matches(|c| self.is_separator(c));
                let skip = self.buf.len() - rest.len();
                if rest.is_empty() {
                    if !end {
                        return;
                    }
                } else if rest.starts_with(['{', '[']) {
                    match json_region(&self.buf, skip, end) {
                        Region::More => return,
                        Region::Calls(calls, len)
                            if calls.iter().all(|c| self.tool_names.contains(&c.name)) =>
                        {
                            self.buf.drain(..len);
                            self.emit_calls(calls, out);
                            continue;
                        }
                        _ => {}
                    }
                }
                self.bare = false;
            }
            let found = self
                .syntax
                .openers()
                .iter()
                .filter_map(|o| self.buf.find(o).map(|pos| (pos, *o)))
                .min();
            let Some((pos, opener)) = found else {
                // Hold a tail that could start an opener.
                let keep = if end {
                    0
                } else {
                    self.syntax
                        .openers()
                        .iter()
                        .filter_map(|o| {
                            // (Openers may be multi-byte: DeepSeek's `｜`.)
                            (1..o.len())
                                .rev()
                                .filter(|&n| o.is_char_boundary(n))
                                .find(|&n| self.buf.ends_with(&o[..n]))
                        })
                        .max()
                        .unwrap_or(0)
                };
                let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.emit_text(&text, out);
                return;
            };
            match region(self.syntax, opener, &self.buf[pos..], end) {
                Region::More => {
                    let text: String = self.buf.drain(..pos).collect();
                    self.emit_text(&text, out);
                    return;
                }
                Region::Calls(calls, len) => {
                    let text: String = self.buf.drain(..pos).collect();
                    self.emit_text(&text, out);
                    self.buf.drain(..len);
                    self.emit_calls(calls, out);
                }
                Region::Text(len) => {
                    // At least the opener itself is text.
                    let text: String = self.buf.drain(..pos + len.max(opener.len())).collect();
                    self.emit_text(&text, out);
                }
            }
        }
    }

    fn emit_calls(&mut self, calls: Vec<ToolCall>, out: &mut Vec<Piece>) {
        self.blank.clear();
        self.calls += calls.len();
        out.extend(calls.into_iter().map(Piece::Call));
        self.bare = true;
        self.after_call = true;
    }

    /// Releases `text`, holding its blank tail (and dropping blanks right
    /// after a call).
    fn emit_text(&mut self, text: &str, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        let mut full = std::mem::take(&mut self.blank);
        full.push_str(text);
        if self.after_call {
            let rest = full.trim_start_matches(|c| self.is_separator(c));
            if rest.is_empty() {
                return;
            }
            full = rest.to_string();
            self.after_call = false;
        }
        let kept = full.trim_end().len();
        self.blank = full[kept..].to_string();
        if kept > 0 {
            full.truncate(kept);
            out.push(Piece::Text(full));
        }
    }
}
