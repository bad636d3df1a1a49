//! The answer of a forced tool call (`tool_choice` required or named),
//! which the output format makes `{"name": "<tool>", "arguments": <args>}`
//! in compact form, read as it streams: the call opens as soon as its name
//! is written and its arguments follow as they are generated. An answer cut
//! short (by `max_tokens`) is still a call, with the arguments written so
//! far.

use super::json_scan::value_end;
use super::Piece;

/// What the format writes before the name and between name and arguments.
const NAME_KEY: &str = r#"{"name": "#;
const ARGS_KEY: &str = r#", "arguments": "#;

/// The streaming reader of one forced call.
#[derive(Debug)]
pub struct ForcedCallStream {
    tool_names: Vec<String>,
    /// Text not yet released: the head before the arguments, then at most
    /// the one `}` that may close the call.
    buf: String,
    /// The arguments released so far (once the call is open).
    args: Option<String>,
}

impl ForcedCallStream {
    pub fn new(tool_names: Vec<String>) -> Self {
        ForcedCallStream {
            tool_names,
            buf: String::new(),
            args: None,
        }
    }

    /// Takes the next piece of answer text; returns what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        if self.args.is_none() {
            let Some((name, len)) = head(&self.buf) else {
                return out;
            };
            self.buf.drain(..len);
            self.args = Some(String::new());
            out.push(Piece::CallOpen { name });
        }
        // The last `}` may close the call rather than the arguments.
        let keep = usize::from(self.buf.ends_with('}'));
        let released: String = self.buf.drain(..self.buf.len() - keep).collect();
        if !released.is_empty() {
            if let Some(args) = self.args.as_mut() {
                args.push_str(&released);
            }
            out.push(Piece::CallArguments(released));
        }
        out
    }

    /// The end of the answer: a complete call drops its closing `}`, a cut
    /// one keeps every byte of its arguments (and a call cut before its
    /// arguments began is named from what was written).
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.buf);
        let Some(args) = self.args.as_ref() else {
            let name = self.name_from_prefix(&held);
            return name
                .map(|name| vec![Piece::CallOpen { name }])
                .unwrap_or_default();
        };
        let complete = held == "}" && value_end(args).is_some_and(|end| end == args.len());
        if complete || held.is_empty() {
            return Vec::new();
        }
        vec![Piece::CallArguments(held)]
    }

    /// The declared tool whose name begins as the cut head spells it.
    fn name_from_prefix(&self, head: &str) -> Option<String> {
        let partial = head.get(NAME_KEY.len()..).unwrap_or("");
        let partial = partial.strip_prefix('"').unwrap_or(partial);
        let partial = partial.split('"').next().unwrap_or("");
        self.tool_names
            .iter()
            .find(|n| n.starts_with(partial))
            .or(self.tool_names.first())
            .cloned()
    }
}

/// The tool name of a head `{"name": "<name>", "arguments": ` and the
/// head's length, once it is all there.
fn head(text: &str) -> Option<(String, usize)> {
    let rest = text.strip_prefix(NAME_KEY)?;
    let end = string_end(rest)?;
    let name: String = serde_json::from_str(&rest[..end]).ok()?;
    rest[end..]
        .starts_with(ARGS_KEY)
        .then(|| (name, NAME_KEY.len() + end + ARGS_KEY.len()))
}

/// The length of the JSON string literal `text` starts with.
fn string_end(text: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, b) in text.bytes().enumerate().skip(1) {
        match b {
            _ if escaped => escaped = false,
            b'\\' => escaped = true,
            b'"' => return Some(i + 1),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into(), "get_time".into()]
    }

    /// Every piece of `text` fed in chunks of `step` bytes, then finished.
    fn feed(text: &str, step: usize) -> Vec<Piece> {
        let mut s = ForcedCallStream::new(names());
        let mut out = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let j = (i + step).min(text.len());
            out.extend(s.push(&text[i..j]));
            i = j;
        }
        out.extend(s.finish());
        out
    }

    fn call_of(pieces: &[Piece]) -> (String, String) {
        let mut name = String::new();
        let mut args = String::new();
        for p in pieces {
            match p {
                Piece::CallOpen { name: n } => name = n.clone(),
                Piece::CallArguments(a) => args.push_str(a),
                other => panic!("{other:?}"),
            }
        }
        (name, args)
    }

    #[test]
    fn a_whole_call_streams_its_arguments_at_any_split() {
        let text = r#"{"name": "get_time", "arguments": {"zone": "a}b", "n": {"m": 1}}}"#;
        for step in 1..text.len() {
            let pieces = feed(text, step);
            assert_eq!(
                call_of(&pieces),
                (
                    "get_time".into(),
                    r#"{"zone": "a}b", "n": {"m": 1}}"#.into()
                ),
                "step {step}"
            );
        }
        assert!(feed(text, 3).len() > 3, "arguments come in several pieces");
    }

    #[test]
    fn a_cut_call_keeps_what_was_written() {
        let cut = r#"{"name": "get_weather", "arguments": {"city": "Pa"#;
        assert_eq!(
            call_of(&feed(cut, 4)),
            ("get_weather".into(), r#"{"city": "Pa"#.into())
        );
        // Cut right after a nested object closes: that `}` is an argument.
        let cut = r#"{"name": "get_weather", "arguments": {"a": {"b": 1}"#;
        assert_eq!(call_of(&feed(cut, 5)).1, r#"{"a": {"b": 1}"#);
        // Cut inside the name: the declared tool it begins.
        assert_eq!(
            call_of(&feed(r#"{"name": "get_ti"#, 2)),
            ("get_time".into(), String::new())
        );
        assert_eq!(call_of(&feed("", 1)).0, "get_weather");
    }
}
