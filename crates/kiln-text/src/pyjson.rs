//! Python's `json.dumps` for template values: the `tojson` filter of Hugging Face chat
//! templates.
//!
//! transformers replaces Jinja's `tojson` with `json.dumps(x, ensure_ascii=False,
//! indent=None, separators=None, sort_keys=False)`, so a template's JSON has Python's
//! spacing (`{"a": 1, "b": [1, 2]}`), keeps non-ASCII text as is and keeps key order.
//! This module reproduces that output byte for byte, including Python's float `repr`
//! (`1e-09`, `1e+16`, `0.1`) and `NaN`/`Infinity`.

use std::fmt::Write;

use minijinja::value::{from_args, Kwargs, Rest, Value, ValueKind, ValueOrKwargs};
use minijinja::{Error, ErrorKind};

/// The options of `json.dumps` that the filter accepts.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Pretty-print with this string per level; `None` is one line.
    pub indent: Option<String>,
    /// The separator between items and between a key and its value.
    pub separators: (String, String),
    /// Sort the keys of every object.
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            separators: (", ".to_string(), ": ".to_string()),
            sort_keys: false,
        }
    }
}

fn invalid(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, what.into())
}

/// The `tojson` filter: `x | tojson`, `x | tojson(indent=2)`, with the positional
/// order of transformers' Python function (`ensure_ascii, indent, separators,
/// sort_keys`).
pub(crate) fn tojson_filter(value: &Value, args: Rest<ValueOrKwargs>) -> Result<String, Error> {
    let args = args.into_values();
    type Args = (
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Kwargs,
    );
    let (ensure_ascii, indent, separators, sort_keys, kwargs) = from_args::<Args>(&args)?;
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named.or(positional))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => {
            let n = v
                .as_i64()
                .ok_or_else(|| invalid("tojson: indent must be an integer or a string"))?;
            Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
        }
    };
    let separators = match pick(separators, "separators")? {
        Some(v) if !(v.is_none() || v.is_undefined()) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => match (item.as_str(), key.as_str()) {
                    (Some(i), Some(k)) => (i.to_string(), k.to_string()),
                    _ => return Err(invalid("tojson: separators must be two strings")),
                },
                _ => return Err(invalid("tojson: separators must be two strings")),
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = pick(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    dumps(
        value,
        &DumpOptions {
            ensure_ascii,
            indent,
            separators,
            sort_keys,
        },
    )
}

/// Serializes `value` as Python's `json.dumps` would with these options.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_value(&mut out, value, opts, 0)?;
    Ok(out)
}

fn newline(out: &mut String, opts: &DumpOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_value(
    out: &mut String,
    value: &Value,
    opts: &DumpOptions,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value)?,
        ValueKind::String => write_string(out, value.as_str().unwrap_or(""), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.separators.0);
                }
                newline(out, opts, level + 1);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.separators.0);
                }
                newline(out, opts, level + 1);
                write_string(out, key, opts.ensure_ascii);
                out.push_str(&opts.separators.1);
                write_value(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push('}');
        }
        kind => {
            return Err(invalid(format!(
                "tojson: object of type {kind} is not JSON serializable"
            )))
        }
    }
    Ok(())
}

/// A key as Python's encoder turns it into a string (`True` -> `true`, `1` -> `1`).
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or("").to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key)?;
            Ok(s)
        }
        kind => Err(invalid(format!(
            "tojson: keys must be str, int, float, bool or None, not {kind}"
        ))),
    }
}

fn write_number(out: &mut String, value: &Value) -> Result<(), Error> {
    if value.is_integer() {
        let n = i128::try_from(value.clone())
            .map(|n| n.to_string())
            .or_else(|_| u128::try_from(value.clone()).map(|n| n.to_string()))?;
        out.push_str(&n);
    } else {
        let f = f64::try_from(value.clone())?;
        out.push_str(&python_float_repr(f));
    }
    Ok(())
}

/// Python's `float.__repr__` (and `json` spellings of the non-finite values).
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // Rust's `{:e}` gives the shortest digits that round-trip, as Python's repr does.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let num_digits = digits.len() as i32;
        let body = if exp < 0 {
            format!("0.{}{}", "0".repeat((-exp - 1) as usize), digits)
        } else if num_digits > exp + 1 {
            let (int, frac) = digits.split_at((exp + 1) as usize);
            format!("{int}.{frac}")
        } else {
            format!(
                "{}{}.0",
                digits,
                "0".repeat((exp + 1 - num_digits) as usize)
            )
        };
        format!("{sign}{body}")
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    }
}

/// A JSON string literal with Python's escapes.
fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && c as u32 > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-9, "1e-09"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e22, "1e+22"),
            (100.0, "100.0"),
            (-0.0, "-0.0"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_uses_python_spacing_and_escapes() {
        let v: Value = Value::from(minijinja::value::Serde(serde_json::json!({
            "b": [1, 2.5, true, null], "a": "é\"\n\u{7f}", "e": {}, "l": []
        })));
        let s = dumps(&v, &DumpOptions::default()).expect("serializable");
        assert_eq!(
            s,
            "{\"b\": [1, 2.5, true, null], \"a\": \"é\\\"\\n\u{7f}\", \"e\": {}, \"l\": []}"
        );
        let opts = DumpOptions {
            ensure_ascii: true,
            indent: Some("  ".to_string()),
            separators: (",".to_string(), ": ".to_string()),
            sort_keys: true,
        };
        let s = dumps(&v, &opts).expect("serializable");
        let want = "{\n  \"a\": \"\\u00e9\\\"\\n\\u007f\",\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"e\": {},\n  \"l\": []\n}";
        assert_eq!(s, want);
    }
}
