//! Gemma's call forms: FunctionGemma's
//! `<start_function_call>call:name{key:<escape>text<escape>,n:3}<end_function_call>`
//! and the ```` ```tool_code ```` block of Python calls,
//! `get_weather(city="Paris")`, that Gemma 3 is prompted to write.

use serde_json::{Map, Number, Value};

use super::tools::ToolCall;

pub const CALL_OPEN: &str = "<start_function_call>";
pub const CALL_CLOSE: &str = "<end_function_call>";
pub const CODE_OPEN: &str = "```tool_code";
pub const CODE_CLOSE: &str = "```";
const ESCAPE: &str = "<escape>";

/// A small cursor over the body of a call.
struct Cursor<'a> {
    s: &'a str,
}

impl<'a> Cursor<'a> {
    fn skip_blank(&mut self) {
        self.s = self.s.trim_start();
    }

    fn eat(&mut self, prefix: &str) -> bool {
        self.skip_blank();
        match self.s.strip_prefix(prefix) {
            Some(rest) => {
                self.s = rest;
                true
            }
            None => false,
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_blank();
        self.s.chars().next()
    }

    /// A run of identifier characters (`.` included, for `module.name`).
    fn ident(&mut self) -> Option<&'a str> {
        self.skip_blank();
        let len = self
            .s
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.' || c == '-'))
            .unwrap_or(self.s.len());
        let (id, rest) = self.s.split_at(len);
        self.s = rest;
        (!id.is_empty()).then_some(id)
    }

    /// A number or a bare word (`true`, `None`, ...), up to a delimiter.
    fn scalar(&mut self, python: bool) -> Option<Value> {
        self.skip_blank();
        let len = self
            .s
            .find([',', '}', ']', ')', '\n'])
            .unwrap_or(self.s.len());
        let (word, rest) = self.s.split_at(len);
        let word = word.trim();
        self.s = rest;
        Some(match word {
            "true" | "True" => Value::Bool(true),
            "false" | "False" => Value::Bool(false),
            "null" | "None" => Value::Null,
            _ => {
                if let Ok(i) = word.parse::<i64>() {
                    Value::from(i)
                } else if let Some(n) = word.parse::<f64>().ok().and_then(Number::from_f64) {
                    Value::Number(n)
                } else if python || word.is_empty() {
                    return None;
                } else {
                    Value::String(word.to_string())
                }
            }
        })
    }
}

/// The body of `<start_function_call>…<end_function_call>`.
pub fn parse_function_call(body: &str) -> Option<Vec<ToolCall>> {
    let mut c = Cursor { s: body };
    if !c.eat("call:") {
        return None;
    }
    let name = c.ident()?.to_string();
    let args = fg_object(&mut c)?;
    c.skip_blank();
    c.s.is_empty().then(|| {
        vec![ToolCall {
            name,
            arguments: args.to_string(),
        }]
    })
}

fn fg_object(c: &mut Cursor<'_>) -> Option<Value> {
    if !c.eat("{") {
        return None;
    }
    let mut map = Map::new();
    if c.eat("}") {
        return Some(Value::Object(map));
    }
    loop {
        c.skip_blank();
        let colon = c.s.find(':')?;
        let key = c.s[..colon].trim();
        if key.is_empty() || key.contains(['{', '}', ',']) {
            return None;
        }
        let key = key.to_string();
        c.s = &c.s[colon + 1..];
        let value = fg_value(c)?;
        map.insert(key, value);
        if c.eat("}") {
            return Some(Value::Object(map));
        }
        if !c.eat(",") {
            return None;
        }
    }
}

fn fg_value(c: &mut Cursor<'_>) -> Option<Value> {
    if c.eat(ESCAPE) {
        let end = c.s.find(ESCAPE)?;
        let text = c.s[..end].to_string();
        c.s = &c.s[end + ESCAPE.len()..];
        return Some(Value::String(text));
    }
    match c.peek()? {
        '{' => fg_object(c),
        '[' => {
            c.eat("[");
            let mut items = Vec::new();
            if c.eat("]") {
                return Some(Value::Array(items));
            }
            loop {
                items.push(fg_value(c)?);
                if c.eat("]") {
                    return Some(Value::Array(items));
                }
                if !c.eat(",") {
                    return None;
                }
            }
        }
        _ => c.scalar(false),
    }
}

/// The body of a ```` ```tool_code ```` block: one Python call per line,
/// keyword arguments only, optionally inside `print(…)`.
pub fn parse_tool_code(body: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let line = line
            .strip_prefix("print(")
            .and_then(|l| l.strip_suffix(')'))
            .unwrap_or(line);
        let mut c = Cursor { s: line };
        let name = c.ident()?;
        let name = name.rsplit('.').next().unwrap_or(name).to_string();
        if !c.eat("(") {
            return None;
        }
        let mut args = Map::new();
        if !c.eat(")") {
            loop {
                let key = c.ident()?.to_string();
                if !c.eat("=") {
                    return None;
                }
                args.insert(key, py_value(&mut c)?);
                if c.eat(")") {
                    break;
                }
                if !c.eat(",") {
                    return None;
                }
            }
        }
        c.skip_blank();
        if !c.s.is_empty() {
            return None;
        }
        calls.push(ToolCall {
            name,
            arguments: Value::Object(args).to_string(),
        });
    }
    (!calls.is_empty()).then_some(calls)
}

fn py_value(c: &mut Cursor<'_>) -> Option<Value> {
    match c.peek()? {
        q @ ('"' | '\'') => {
            c.s = &c.s[1..];
            let mut out = String::new();
            let mut chars = c.s.char_indices();
            while let Some((i, ch)) = chars.next() {
                match ch {
                    '\\' => {
                        let (_, e) = chars.next()?;
                        out.push(match e {
                            'n' => '\n',
                            't' => '\t',
                            other => other,
                        });
                    }
                    _ if ch == q => {
                        c.s = &c.s[i + 1..];
                        return Some(Value::String(out));
                    }
                    _ => out.push(ch),
                }
            }
            None
        }
        open @ ('[' | '{') => {
            c.s = &c.s[1..];
            let close = if open == '[' { "]" } else { "}" };
            let mut items = Vec::new();
            let mut map = Map::new();
            if !c.eat(close) {
                loop {
                    if open == '[' {
                        items.push(py_value(c)?);
                    } else {
                        let Value::String(k) = py_value(c)? else {
                            return None;
                        };
                        if !c.eat(":") {
                            return None;
                        }
                        map.insert(k, py_value(c)?);
                    }
                    if c.eat(close) {
                        break;
                    }
                    if !c.eat(",") {
                        return None;
                    }
                }
            }
            Some(if open == '[' {
                Value::Array(items)
            } else {
                Value::Object(map)
            })
        }
        _ => c.scalar(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_gemma_bodies() {
        let calls = parse_function_call(
            "call:get_weather{city:<escape>Paris, FR<escape>,days:3,metric:true,tags:[<escape>a<escape>,2],opt:{x:null}}",
        )
        .expect("parses");
        assert_eq!(calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(
            args,
            serde_json::json!({"city": "Paris, FR", "days": 3, "metric": true, "tags": ["a", 2], "opt": {"x": null}})
        );
        assert_eq!(parse_function_call("call:f{}").unwrap()[0].arguments, "{}");
        for bad in [
            "get_weather{}",
            "call:f{city:<escape>Paris}",
            "call:f{a:1",
            "call:f{a:1} x",
        ] {
            assert_eq!(parse_function_call(bad), None, "{bad}");
        }
    }

    #[test]
    fn python_calls() {
        let calls = parse_tool_code(
            "\nget_weather(city=\"Paris\", days=2)\nprint(default_api.search(q='a \\'b\\'', n=[1, 2.5], o={'k': None}))\n",
        )
        .expect("parses");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, r#"{"city":"Paris","days":2}"#);
        assert_eq!(calls[1].name, "search");
        assert_eq!(
            calls[1].arguments,
            r#"{"q":"a 'b'","n":[1,2.5],"o":{"k":null}}"#
        );
        assert_eq!(parse_tool_code("f()").unwrap()[0].arguments, "{}");
        for bad in ["f(1)", "f(a=)", "f(a=\"x)", "x = f(a=1)", ""] {
            assert_eq!(parse_tool_code(bad), None, "{bad}");
        }
    }
}
