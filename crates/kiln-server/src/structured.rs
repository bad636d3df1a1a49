//! The output-format fields of OpenAI-style requests, turned into a
//! [`Format`]: OpenAI's `response_format` (`text`, `json_object`,
//! `json_schema`) and the fields vLLM users send (`guided_json`,
//! `guided_regex`, `guided_grammar`, `guided_choice`, or
//! `structured_outputs: {json | regex | grammar | choice}`). At most one may
//! be given. They are taken out of a request's unrecognised fields before
//! those are refused, so the wire types need not name them. A schema with
//! `strict: true` becomes [`Format::StrictJsonSchema`] (OpenAI's strict
//! semantics). A format over the limits (too many choices) is refused here,
//! naming the field; one that does not compile is refused at submission,
//! naming `response_format`.

use kiln_structured::Format;
use serde_json::{Map, Value};

/// The fields this module reads.
const FIELDS: &[&str] = &[
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "structured_outputs",
];

/// Remove the format fields from `extra` and return the format they ask
/// for; `Err((param, reason))` for a malformed or conflicting request.
pub fn take_format(extra: &mut Map<String, Value>) -> Result<Option<Format>, (String, String)> {
    let given: Vec<(String, Value)> = FIELDS
        .iter()
        .filter_map(|&f| extra.remove(f).map(|v| (f.to_string(), v)))
        .filter(|(_, v)| !v.is_null())
        .collect();
    let mut formats = Vec::new();
    for (field, value) in given {
        let f = match field.as_str() {
            "response_format" => response_format(&value),
            "structured_outputs" => structured_outputs(&value),
            other => guided(other, &value),
        }
        .map_err(|reason| (field.clone(), reason))?;
        if let Some(f) = &f {
            f.check().map_err(|e| (field.clone(), e.to_string()))?;
        }
        if let Some(f) = f {
            formats.push((field, f));
        }
    }
    match formats.len() {
        0 => Ok(None),
        1 => Ok(formats.pop().map(|(_, f)| f)),
        _ => Err((
            formats[1].0.clone(),
            format!(
                "only one output format may be given ({} and {})",
                formats[0].0, formats[1].0
            ),
        )),
    }
}

/// Remove the Responses API's `text` field from `extra` and return the
/// format its `text.format` asks for (`text`, `json_object`, or
/// `json_schema` with the schema inline), and the format's type name.
pub fn take_text_format(
    extra: &mut Map<String, Value>,
) -> Result<(Option<Format>, &'static str), (String, String)> {
    let Some(text) = extra.remove("text").filter(|v| !v.is_null()) else {
        return Ok((None, "text"));
    };
    let err = |reason: &str| ("text.format".to_string(), reason.to_string());
    let Some(format) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok((None, "text"));
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok((None, "text")),
        Some("json_object") => Ok((Some(Format::JsonObject), "json_object")),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .cloned()
                .ok_or_else(|| err("`schema` is required with type json_schema"))?;
            let f = schema_format(schema, format.get("strict"));
            f.check().map_err(|e| err(&e.to_string()))?;
            Ok((Some(f), "json_schema"))
        }
        _ => Err(err("`type` must be text, json_object or json_schema")),
    }
}

fn response_format(v: &Value) -> Result<Option<Format>, String> {
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Format::JsonObject)),
        Some("json_schema") => {
            let js = v
                .get("json_schema")
                .ok_or("`json_schema` is required with type json_schema")?;
            let schema = js
                .get("schema")
                .cloned()
                .unwrap_or(Value::Object(Map::new()));
            Ok(Some(schema_format(schema, js.get("strict"))))
        }
        Some(other) => Err(format!(
            "type {other:?} is not one of text, json_object, json_schema"
        )),
        None => Err("`type` is required".into()),
    }
}

/// The format of `schema`, strict when `strict` is `true`.
fn schema_format(schema: Value, strict: Option<&Value>) -> Format {
    if strict.and_then(Value::as_bool) == Some(true) {
        Format::StrictJsonSchema(schema)
    } else {
        Format::JsonSchema(schema)
    }
}

fn structured_outputs(v: &Value) -> Result<Option<Format>, String> {
    let obj = v.as_object().ok_or("an object is expected")?;
    let mut found = Vec::new();
    for (k, val) in obj {
        let f = match k.as_str() {
            "json" => guided("guided_json", val)?,
            "regex" => guided("guided_regex", val)?,
            "grammar" => guided("guided_grammar", val)?,
            "choice" => guided("guided_choice", val)?,
            other => {
                return Err(format!(
                    "unknown key {other:?} (json, regex, grammar, choice)"
                ))
            }
        };
        found.extend(f);
    }
    if found.len() > 1 {
        return Err("give one of json, regex, grammar, choice".into());
    }
    Ok(found.pop())
}

fn guided(field: &str, v: &Value) -> Result<Option<Format>, String> {
    let text = |what: &str| -> Result<String, String> {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("{what} as a string is expected"))
    };
    Ok(Some(match field {
        "guided_json" => match v {
            Value::String(s) => Format::JsonSchema(
                serde_json::from_str(s).map_err(|e| format!("not a JSON schema: {e}"))?,
            ),
            other => Format::JsonSchema(other.clone()),
        },
        "guided_regex" => Format::Regex(text("a regex")?),
        "guided_grammar" => Format::Lark(text("a grammar")?),
        _ => {
            let options = v
                .as_array()
                .ok_or("a list of strings is expected")?
                .iter()
                .map(|o| o.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or("a list of strings is expected")?;
            Format::Choice(options)
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn take(v: Value) -> Result<Option<Format>, (String, String)> {
        let mut m = v.as_object().unwrap().clone();
        let r = take_format(&mut m);
        assert!(
            FIELDS.iter().all(|f| !m.contains_key(*f)),
            "fields taken out"
        );
        r
    }

    #[test]
    fn every_spelling_maps_to_its_format() {
        let schema = json!({"type": "object"});
        assert_eq!(take(json!({"response_format": {"type": "text"}})), Ok(None));
        assert_eq!(
            take(json!({"response_format": {"type": "json_object"}})),
            Ok(Some(Format::JsonObject))
        );
        assert_eq!(
            take(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}})
            ),
            Ok(Some(Format::StrictJsonSchema(schema.clone())))
        );
        assert_eq!(
            take(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
            ),
            Ok(Some(Format::JsonSchema(schema.clone())))
        );
        assert_eq!(
            take(json!({"guided_json": "{\"type\": \"object\"}"})),
            Ok(Some(Format::JsonSchema(schema.clone())))
        );
        assert_eq!(
            take(json!({"guided_regex": "[0-9]+"})),
            Ok(Some(Format::Regex("[0-9]+".into())))
        );
        assert_eq!(
            take(json!({"structured_outputs": {"choice": ["a", "b"]}})),
            Ok(Some(Format::Choice(vec!["a".into(), "b".into()])))
        );
        assert_eq!(
            take(json!({"guided_grammar": "start: \"x\""})),
            Ok(Some(Format::Lark("start: \"x\"".into())))
        );
        assert_eq!(take(json!({"other": 1})), Ok(None));
    }

    #[test]
    fn malformed_or_conflicting_formats_name_the_parameter() {
        let bad = [
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format",
            ),
            (json!({"guided_choice": "yes"}), "guided_choice"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (
                json!({"structured_outputs": {"yaml": "x"}}),
                "structured_outputs",
            ),
            (
                json!({"guided_regex": "a", "guided_choice": ["b"]}),
                "guided_choice",
            ),
            (json!({"guided_choice": []}), "guided_choice"),
            (
                json!({"guided_choice": (0..2000).map(|i| i.to_string()).collect::<Vec<_>>()}),
                "guided_choice",
            ),
            (
                json!({"structured_outputs": {"choice": ["x".repeat(70_000)]}}),
                "structured_outputs",
            ),
        ];
        for (req, param) in bad {
            let err = take(req.clone()).expect_err(&req.to_string());
            assert_eq!(err.0, param, "{req}");
            assert!(!err.1.is_empty());
        }
    }
}
