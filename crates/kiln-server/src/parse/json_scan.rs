//! Where a JSON value ends, found without parsing it: enough to know when a
//! streamed tool call is complete.

/// How far a JSON object or array starting at `text[0]` (`{` or `[`) goes:
/// `Some(len)` when its closing bracket is in `text`, `None` while it is
/// still open. Brackets inside strings (with escapes) are not counted;
/// mismatched brackets end the value early, and the parse that follows
/// rejects it.
pub fn value_end(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, b) in text.bytes().enumerate() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ if depth == 0 => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::value_end;

    #[test]
    fn finds_the_closing_bracket() {
        assert_eq!(value_end(r#"{"a": [1, {"b": "}"}]} tail"#), Some(22));
        assert_eq!(value_end(r#"["x\"]", 2]"#), Some(11));
        assert_eq!(value_end(r#"{"a": "\\"}"#), Some(11));
        assert_eq!(value_end(r#"{"a": [1, 2"#), None);
        assert_eq!(value_end(r#"{"a": "}"#), None);
        assert_eq!(value_end("{}"), Some(2));
    }
}
