//! OpenAI's strict semantics as a rewrite of a JSON schema, done before
//! llguidance compiles it (llguidance has no option for them):
//!
//! - an object admits only its declared properties unless the schema says
//!   otherwise: a missing `additionalProperties` becomes `false` (OpenAI's
//!   strict mode requires it, xgrammar's `strict_mode` makes it the
//!   default). llguidance writes declared properties once each, in schema
//!   order, so a closed object has no duplicate keys;
//! - an integer without bounds stays within ±(2^53 − 1), inside int64 and
//!   read exactly by every JSON parser (JavaScript's too);
//! - a number without bounds stays below 10^15 in magnitude (every integer
//!   part a double holds exactly) with at most [`FRACTION_DIGITS`] digits
//!   after the point, unless the schema sets its own `multipleOf`.
//!
//! Where llguidance intersects schemas (`allOf`, or `anyOf` / `oneOf` /
//! `$ref` beside the node's own `properties`), closing each side alone
//! would forbid the other side's properties. There every object side is
//! closed over the union of the names both sides declare; a `$ref` in such
//! a place, and what it points to, are left open.

use serde_json::{json, Map, Value};

/// Digits a number may have after the decimal point.
pub const FRACTION_DIGITS: u32 = 6;
/// Bound of a number's magnitude when the schema gives none.
const NUMBER_BOUND: f64 = 1e15;
/// Bound of an integer's magnitude when the schema gives none (2^53 − 1;
/// llguidance reads bounds as doubles, which hold it exactly).
pub const INTEGER_BOUND: i64 = (1 << 53) - 1;

/// `schema` with strict semantics applied.
pub fn strict_schema(mut schema: Value) -> Value {
    let mut open = Vec::new();
    find_open_refs(&schema, &mut open);
    walk(&mut schema, "", &open, true);
    schema
}

/// Keywords that make a node an object schema of its own.
const OBJECT_KEYS: &[&str] = &["properties", "patternProperties", "additionalProperties"];

fn has_type(node: &Map<String, Value>, ty: &str) -> bool {
    match node.get("type") {
        Some(Value::String(t)) => t == ty,
        Some(Value::Array(ts)) => ts.iter().any(|t| t == ty),
        _ => false,
    }
}

fn is_object_like(node: &Map<String, Value>) -> bool {
    has_type(node, "object") || node.contains_key("properties")
}

fn declares_properties(node: &Map<String, Value>) -> bool {
    OBJECT_KEYS.iter().any(|k| node.contains_key(*k))
}

/// Pointers (after `#`) of every `$ref` that llguidance intersects with
/// something: the target must stay open.
fn find_open_refs(v: &Value, open: &mut Vec<String>) {
    match v {
        Value::Object(node) => {
            let intersected =
                declares_properties(node) || COMBINATORS.iter().any(|k| node.contains_key(*k));
            if let (true, Some(Value::String(r))) = (intersected, node.get("$ref")) {
                open.push(r.trim_start_matches('#').to_string());
            }
            // Members that meet other sides: every allOf member, and
            // anyOf/oneOf members beside the node's own properties.
            for key in COMBINATORS {
                if key != "allOf" && !declares_properties(node) {
                    continue;
                }
                for m in members(node, key) {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        open.push(r.trim_start_matches('#').to_string());
                    }
                }
            }
            node.values().for_each(|c| find_open_refs(c, open));
        }
        Value::Array(items) => items.iter().for_each(|c| find_open_refs(c, open)),
        _ => {}
    }
}

/// A JSON pointer's escaping of one key.
fn pointer_key(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}

/// Rewrite `v` (at JSON pointer `path`); `closable` is false where an
/// intersection handles the closing.
fn walk(v: &mut Value, path: &str, open: &[String], closable: bool) {
    let Value::Object(node) = v else { return };
    let closable = closable && !open.iter().any(|p| p == path);
    bound_numbers(node);
    // Subschemas that are values of a map keyword.
    for key in ["properties", "patternProperties", "$defs", "definitions"] {
        if let Some(Value::Object(map)) = node.get_mut(key) {
            for (name, sub) in map.iter_mut() {
                let p = format!("{path}/{key}/{}", pointer_key(name));
                walk(sub, &p, open, true);
            }
        }
    }
    // Subschemas that are one value or a list.
    for key in ["items", "additionalProperties", "prefixItems"] {
        match node.get_mut(key) {
            Some(sub @ Value::Object(_)) => walk(sub, &format!("{path}/{key}"), open, true),
            Some(Value::Array(subs)) => {
                for (i, sub) in subs.iter_mut().enumerate() {
                    walk(sub, &format!("{path}/{key}/{i}"), open, true);
                }
            }
            _ => {}
        }
    }
    let has_ref = node.contains_key("$ref");
    let combined: Vec<&str> = COMBINATORS
        .into_iter()
        .filter(|k| matches!(node.get(*k), Some(Value::Array(_))))
        .collect();
    if combined.is_empty() && !has_ref {
        if closable && is_object_like(node) {
            close_over_map(node, &[]);
        }
        return;
    }
    // An intersection: anyOf/oneOf members meet the node's own keywords,
    // allOf members meet every side. Each object side admits the names
    // the sides it meets declare.
    let own = property_names(node);
    let mut base = own.clone();
    let mut all = own.clone();
    let mut refs_in_members = false;
    for key in &combined {
        for m in members(node, key).iter().filter_map(Value::as_object) {
            refs_in_members |= m.contains_key("$ref");
            let names = property_names(m);
            if *key == "allOf" {
                base.extend(names.iter().cloned());
            }
            all.extend(names);
        }
    }
    let close_all = closable && !has_ref && !refs_in_members;
    for key in combined {
        let Some(Value::Array(list)) = node.get_mut(key) else {
            continue;
        };
        for (i, m) in list.iter_mut().enumerate() {
            walk(m, &format!("{path}/{key}/{i}"), open, false);
            if close_all {
                close_over(m, if key == "allOf" { &all } else { &base });
            } else if closable && key != "allOf" && own.is_empty() && !has_ref {
                // The member is the whole object on its own.
                close_over(m, &[]);
            }
        }
    }
    if close_all && is_object_like(node) {
        close_over_map(node, &all);
    }
}

const COMBINATORS: [&str; 3] = ["allOf", "anyOf", "oneOf"];

fn members<'a>(node: &'a Map<String, Value>, key: &str) -> &'a [Value] {
    match node.get(key) {
        Some(Value::Array(m)) => m,
        _ => &[],
    }
}

fn property_names(node: &Map<String, Value>) -> Vec<String> {
    match node.get("properties") {
        Some(Value::Object(p)) => p.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Close object side `v` of an intersection, admitting `names` (the other
/// sides' properties) as they are.
fn close_over(v: &mut Value, names: &[String]) {
    if let Value::Object(node) = v {
        if is_object_like(node) {
            close_over_map(node, names);
        }
    }
}

/// Close `node` over its own properties, `names`, and the names it
/// requires without declaring them (admitted as they are).
fn close_over_map(node: &mut Map<String, Value>, names: &[String]) {
    if node.contains_key("additionalProperties") || node.contains_key("$ref") {
        return;
    }
    let required: Vec<String> = match node.get("required") {
        Some(Value::Array(r)) => r
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect(),
        _ => Vec::new(),
    };
    let props = node
        .entry("properties")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(props) = props {
        for n in names.iter().chain(&required) {
            props.entry(n.clone()).or_insert(Value::Bool(true));
        }
    }
    node.insert("additionalProperties".into(), Value::Bool(false));
}

/// Bound the integers and numbers `node` admits where it sets no bound.
fn bound_numbers(node: &mut Map<String, Value>) {
    let number = has_type(node, "number");
    if !number && !has_type(node, "integer") {
        return;
    }
    let (lo, hi) = if number {
        (json!(-NUMBER_BOUND), json!(NUMBER_BOUND))
    } else {
        (json!(-INTEGER_BOUND), json!(INTEGER_BOUND))
    };
    let lower = ["minimum", "exclusiveMinimum"]
        .iter()
        .find_map(|k| node.get(*k).and_then(Value::as_f64));
    let upper = ["maximum", "exclusiveMaximum"]
        .iter()
        .find_map(|k| node.get(*k).and_then(Value::as_f64));
    // A bound is added only where it keeps the range non-empty.
    if lower.is_none() && upper.is_none_or(|u| u >= lo.as_f64().unwrap_or(f64::MIN)) {
        node.insert("minimum".into(), lo);
    }
    if upper.is_none() && lower.is_none_or(|l| l <= hi.as_f64().unwrap_or(f64::MAX)) {
        node.insert("maximum".into(), hi);
    }
    if number && !node.contains_key("multipleOf") {
        let step = 10f64.powi(-(FRACTION_DIGITS as i32));
        node.insert("multipleOf".into(), json!(step));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_close_where_the_schema_says_nothing() {
        let s = strict_schema(json!({"type": "object", "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "free": {"type": "object", "additionalProperties": true},
            "list": {"type": "array", "items": {"properties": {"c": {"type": "boolean"}}}},
        }, "$defs": {"d": {"type": "object"}}}));
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["a"]["additionalProperties"], false);
        assert_eq!(s["properties"]["free"]["additionalProperties"], true);
        assert_eq!(
            s["properties"]["list"]["items"]["additionalProperties"],
            false
        );
        assert_eq!(s["$defs"]["d"]["additionalProperties"], false);
        // A key required but not declared stays admitted.
        let s = strict_schema(json!({"type": "object", "required": ["a"]}));
        assert_eq!(s["properties"]["a"], true);
        assert_eq!(s["additionalProperties"], false);
    }

    #[test]
    fn intersections_close_over_every_side() {
        let s = strict_schema(json!({"allOf": [
            {"type": "object", "properties": {"a": {"type": "string"}}},
            {"type": "object", "properties": {"b": {"type": "string"}}},
        ]}));
        for m in s["allOf"].as_array().unwrap() {
            assert_eq!(m["additionalProperties"], false);
            assert!(m["properties"].get("a").is_some() && m["properties"].get("b").is_some());
        }
        let s = strict_schema(
            json!({"type": "object", "properties": {"kind": {"type": "string"}},
            "anyOf": [{"properties": {"x": {"type": "integer"}}}, {"type": "object"}]}),
        );
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["anyOf"][0]["properties"]["kind"], true);
        assert_eq!(s["anyOf"][1]["additionalProperties"], false);
        // Without own properties an anyOf member is the whole object.
        let s = strict_schema(json!({"type": "object", "anyOf": [{"properties": {"x": {}}}]}));
        assert_eq!(s["anyOf"][0]["additionalProperties"], false);
        assert!(s["anyOf"][0]["properties"].get("kind").is_none());
        // A `$ref` beside properties leaves both it and its target open.
        let s = strict_schema(json!({"$defs": {"base": {"type": "object",
            "properties": {"id": {"type": "integer"}}}},
            "$ref": "#/$defs/base", "properties": {"name": {"type": "string"}}}));
        assert!(s.get("additionalProperties").is_none());
        assert!(s["$defs"]["base"].get("additionalProperties").is_none());
    }

    #[test]
    fn numbers_get_bounds_only_where_they_have_none() {
        let s = strict_schema(json!({"type": "object", "properties": {
            "i": {"type": "integer"},
            "low": {"type": "integer", "minimum": 0},
            "huge": {"type": "integer", "minimum": 1e20},
            "x": {"type": "number"},
            "step": {"type": ["number", "null"], "multipleOf": 0.5, "maximum": 3},
            "s": {"type": "string"},
        }}));
        let p = &s["properties"];
        assert_eq!(p["i"]["minimum"], json!(-INTEGER_BOUND));
        assert_eq!(p["i"]["maximum"], json!(INTEGER_BOUND));
        assert_eq!(p["low"]["minimum"], 0);
        assert_eq!(p["low"]["maximum"], json!(INTEGER_BOUND));
        assert!(p["huge"].get("maximum").is_none(), "{}", p["huge"]);
        assert_eq!(p["x"]["maximum"], json!(1e15));
        assert_eq!(p["x"]["multipleOf"], json!(1e-6));
        assert_eq!(p["step"]["multipleOf"], 0.5);
        assert_eq!(p["step"]["maximum"], 3);
        assert_eq!(p["step"]["minimum"], json!(-1e15));
        assert!(p["s"].get("minimum").is_none());
    }
}
