//! Tool calls in the Hermes/Qwen form, `<tool_call>{"name": ..., "arguments":
//! {...}}</tool_call>`, parsed out of generated text; and the streaming
//! variant, which lets ordinary text through at once and holds back
//! everything from the first `<tool_call>` to the end.
//!
//! Small models often drop the tags and answer with the bare object; an
//! answer that is nothing but `{"name": ..., "arguments": ...}` naming a
//! declared tool is taken as a call too. A block that does not parse stays
//! in the content as text. The structured-output work will make tool calls
//! robust by constraining generation; this parser only reads what the model
//! wrote.

use serde_json::Value;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text, as OpenAI sends them.
    pub arguments: String,
}

/// Text with its tool-call blocks taken out.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// The text outside the blocks, trimmed; `None` when nothing is left.
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// Takes every well-formed `<tool_call>` block out of `text`; with no
/// block, takes `text` as one bare call when it is exactly a call of one of
/// `tool_names`.
pub fn parse(text: &str, tool_names: &[String]) -> Parsed {
    if !text.contains(OPEN) {
        if let Some(call) = parse_call(text).filter(|c| tool_names.contains(&c.name)) {
            return Parsed {
                content: None,
                calls: vec![call],
            };
        }
    }
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(OPEN) {
        let after = &rest[open + OPEN.len()..];
        // An unclosed block (generation cut short) is tried up to the end.
        let (body, next) = match after.find(CLOSE) {
            Some(close) => (&after[..close], &after[close + CLOSE.len()..]),
            None => (after, ""),
        };
        match parse_call(body) {
            Some(call) => {
                content.push_str(&rest[..open]);
                calls.push(call);
            }
            None => content.push_str(&rest[..rest.len() - next.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    let content = content.trim();
    Parsed {
        content: (!content.is_empty()).then(|| content.to_string()),
        calls,
    }
}

/// `{"name": "...", "arguments": {...}}` (or `"parameters"`; arguments may
/// also be a JSON string).
fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Streaming: text before any `<tool_call>` is released as it comes; from
/// the first block on, text is held until [`ToolCallStream::finish`]. An
/// answer that opens with `{` is held whole (it may be a bare call).
#[derive(Debug, Default)]
pub struct ToolCallStream {
    tool_names: Vec<String>,
    held: String,
    in_call: bool,
    /// Whether any text has been released.
    released: bool,
}

impl ToolCallStream {
    pub fn new(tool_names: Vec<String>) -> Self {
        ToolCallStream {
            tool_names,
            ..ToolCallStream::default()
        }
    }

    /// Takes the next piece of text and returns what can be sent now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        if !self.released {
            let start = self.held.trim_start();
            if start.is_empty() {
                return String::new();
            }
            if start.starts_with('{') {
                self.in_call = true;
                return String::new();
            }
        }
        if let Some(pos) = self.held.find(OPEN) {
            self.in_call = true;
            let out = self.held[..pos].to_string();
            self.held.drain(..pos);
            return out;
        }
        // Hold a tail that could be the start of `<tool_call>`.
        let keep = (1..OPEN.len())
            .rev()
            .find(|&n| self.held.ends_with(&OPEN[..n]))
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        self.released |= !out.is_empty();
        out
    }

    /// The held text at the end: the tool calls in it, and the rest as text
    /// (untrimmed when no block was started, so nothing sent is changed).
    pub fn finish(self) -> (String, Vec<ToolCall>) {
        if !self.in_call {
            return (self.held, Vec::new());
        }
        let parsed = parse(&self.held, &self.tool_names);
        if parsed.calls.is_empty() {
            // Nothing parsed: the held text goes out as it was written.
            return (self.held, Vec::new());
        }
        (parsed.content.unwrap_or_default(), parsed.calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hermes_blocks() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let p = parse(text, &[]);
        assert_eq!(p.content.as_deref(), Some("Let me check."));
        assert_eq!(
            p.calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }]
        );
        let two = "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"x\\\":1}\"}</tool_call>";
        let p = parse(two, &[]);
        assert_eq!(p.content, None);
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[1].arguments, r#"{"x":1}"#);
    }

    #[test]
    fn malformed_blocks_stay_text() {
        let text = "x <tool_call>{not json}</tool_call> y";
        let p = parse(text, &[]);
        assert!(p.calls.is_empty());
        assert_eq!(p.content.as_deref(), Some(text));
        assert_eq!(parse("plain", &[]).content.as_deref(), Some("plain"));
    }

    #[test]
    fn a_bare_call_needs_a_declared_name() {
        let names = vec!["get_weather".to_string()];
        let bare = r#" {"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        let p = parse(bare, &names);
        assert_eq!((p.content, p.calls.len()), (None, 1));
        let p = parse(r#"{"name": "other", "arguments": {}}"#, &names);
        assert!(p.calls.is_empty() && p.content.is_some());

        let mut s = ToolCallStream::new(names.clone());
        assert_eq!(s.push(" "), "");
        assert_eq!(s.push("{\"name\": \"get_weather\", "), "");
        assert_eq!(s.push("\"arguments\": {}}"), "");
        assert_eq!(s.finish().1.len(), 1);

        let mut s = ToolCallStream::new(names);
        assert_eq!(s.push("{not a call}"), "");
        assert_eq!(s.finish(), ("{not a call}".to_string(), vec![]));
    }

    #[test]
    fn stream_holds_back_from_the_first_block() {
        let mut s = ToolCallStream::new(Vec::new());
        let mut sent = String::new();
        for piece in [
            "Sure",
            ". <tool",
            "_ca",
            "ll>{\"name\": \"f\", ",
            "\"arguments\": {}}</tool_call>",
        ] {
            sent.push_str(&s.push(piece));
        }
        assert_eq!(sent, "Sure. ");
        let (rest, calls) = s.finish();
        assert_eq!(rest, "");
        assert_eq!(calls[0].name, "f");

        let mut s = ToolCallStream::new(Vec::new());
        assert_eq!(s.push("a <to"), "a ");
        assert_eq!(s.push("day"), "<today");
        assert_eq!(s.push(" <"), " ");
        assert_eq!(s.finish(), ("<".to_string(), vec![]));
    }
}
