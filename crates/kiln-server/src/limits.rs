//! Bounds on what one request may ask for, checked on the JSON body before
//! any route parses it: stop strings (how many, how long), stop token ids,
//! logit-bias entries, tools (how many, how large) and messages. Past a
//! bound the request is a 400 naming the field; within them, the work a
//! request hands the engine loop (stop matchers, bias tables) stays small,
//! so one request cannot slow every other stream.

use serde_json::Value;

use crate::errors::ApiError;

/// Most stop strings (`stop`, `stop_sequences`).
pub(crate) const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, in bytes.
pub(crate) const MAX_STOP_BYTES: usize = 1024;
/// Most stop token ids.
pub(crate) const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Most `logit_bias` entries.
pub(crate) const MAX_LOGIT_BIAS: usize = 1024;
/// Most tools, and the largest one as JSON, in bytes.
pub(crate) const MAX_TOOLS: usize = 128;
pub(crate) const MAX_TOOL_BYTES: usize = 64 << 10;
/// Most messages (`messages`, or the items of the Responses API's `input`).
pub(crate) const MAX_MESSAGES: usize = 4096;

/// Refuses a request body that asks for more than the bounds allow.
pub(crate) fn check(body: &Value) -> Result<(), ApiError> {
    for key in ["stop", "stop_sequences"] {
        match body.get(key) {
            Some(Value::String(s)) => check_stop(key, s)?,
            Some(Value::Array(stops)) => {
                at_most(key, stops.len(), MAX_STOP_STRINGS, "stop strings")?;
                for (i, s) in stops.iter().enumerate() {
                    if let Some(s) = s.as_str() {
                        check_stop(&format!("{key}[{i}]"), s)?;
                    }
                }
            }
            _ => {}
        }
    }
    if let Some(Value::Array(ids)) = body.get("stop_token_ids") {
        at_most("stop_token_ids", ids.len(), MAX_STOP_TOKEN_IDS, "ids")?;
    }
    if let Some(Value::Object(bias)) = body.get("logit_bias") {
        at_most("logit_bias", bias.len(), MAX_LOGIT_BIAS, "entries")?;
    }
    if let Some(Value::Array(tools)) = body.get("tools") {
        at_most("tools", tools.len(), MAX_TOOLS, "tools")?;
        for (i, tool) in tools.iter().enumerate() {
            let bytes = serde_json::to_string(tool).map_or(0, |s| s.len());
            if bytes > MAX_TOOL_BYTES {
                return Err(ApiError::invalid(
                    format!("tools[{i}]"),
                    format!(
                        "`tools[{i}]` is {bytes} bytes of JSON; at most {MAX_TOOL_BYTES} are allowed"
                    ),
                ));
            }
        }
    }
    for key in ["messages", "input"] {
        if let Some(Value::Array(items)) = body.get(key) {
            at_most(key, items.len(), MAX_MESSAGES, "items")?;
        }
    }
    Ok(())
}

fn check_stop(param: &str, s: &str) -> Result<(), ApiError> {
    if s.len() > MAX_STOP_BYTES {
        return Err(ApiError::invalid(
            param,
            format!(
                "`{param}` is {} bytes long; stop strings are at most {MAX_STOP_BYTES} bytes",
                s.len()
            ),
        ));
    }
    Ok(())
}

fn at_most(param: &str, n: usize, max: usize, what: &str) -> Result<(), ApiError> {
    if n > max {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` has {n} {what}; at most {max} are allowed"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(body: Value) -> String {
        check(&body).unwrap_err().body()["error"]["param"]
            .as_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn each_bound_names_its_field() {
        let stops: Vec<String> = (0..2000).map(|i| format!("s{i}")).collect();
        assert_eq!(param(json!({"stop": stops})), "stop");
        assert_eq!(param(json!({"stop_sequences": stops})), "stop_sequences");
        assert_eq!(param(json!({"stop": "x".repeat(2000)})), "stop");
        assert_eq!(param(json!({"stop": ["a", "x".repeat(2000)]})), "stop[1]");
        let bias: serde_json::Map<String, Value> =
            (0..2000).map(|i| (i.to_string(), json!(1))).collect();
        assert_eq!(param(json!({"logit_bias": bias})), "logit_bias");
        let tools: Vec<Value> = (0..200).map(|_| json!({"type": "function"})).collect();
        assert_eq!(param(json!({"tools": tools})), "tools");
        let big = json!([{"type": "function", "function": {"description": "d".repeat(70_000)}}]);
        assert_eq!(param(json!({"tools": big})), "tools[0]");
        let messages: Vec<Value> = (0..5000).map(|_| json!({"role": "user"})).collect();
        assert_eq!(param(json!({"messages": messages})), "messages");
        assert_eq!(
            param(json!({"stop_token_ids": vec![1; 2000]})),
            "stop_token_ids"
        );
    }

    #[test]
    fn ordinary_requests_pass() {
        let ok = json!({"stop": ["\n\n", "User:"], "logit_bias": {"1": -100},
                        "messages": [{"role": "user", "content": "hi"}],
                        "tools": [{"type": "function", "function": {"name": "f"}}]});
        assert!(check(&ok).is_ok());
        assert!(check(&json!({"stop": "END"})).is_ok());
    }
}
