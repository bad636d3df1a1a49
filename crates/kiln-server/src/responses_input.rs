//! The Responses API's `instructions`, `input` items and function tools,
//! checked and turned into the same template JSON the chat route renders:
//! `instructions` and `system`/`developer` messages become system messages,
//! `function_call` items become an assistant's `tool_calls` (consecutive
//! calls join one assistant turn), and `function_call_output` items become
//! `tool` messages.

use serde_json::{json, Map, Value};

use crate::errors::ApiError;
use crate::json_body::reject_unknown;
use crate::messages::{template_tools, tool_call};
use crate::openai_types::chat::{self as openai, FunctionCallIn, ToolCallIn};
use crate::openai_types::responses::{InputItem, ToolIn};

/// Fields that output items carry and clients echo back inside content
/// parts; accepted and not used.
const ECHOED_PART_FIELDS: &[&str] = &["annotations", "logprobs"];

/// The conversation as a template sees it.
pub fn template_input(instructions: Option<&str>, input: &Value) -> Result<Value, ApiError> {
    let mut out = Vec::new();
    if let Some(text) = instructions {
        out.push(json!({"role": "system", "content": text}));
    }
    match input {
        Value::String(text) => out.push(json!({"role": "user", "content": text})),
        Value::Array(items) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let item: InputItem = serde_json::from_value(item.clone())
                    .map_err(|e| ApiError::invalid(at.clone(), format!("`{at}`: {e}")))?;
                template_item(&at, item, &mut out)?;
            }
        }
        Value::Array(_) => {
            return Err(ApiError::invalid(
                "input",
                "`input` must contain at least one item",
            ))
        }
        _ => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or a list of input items",
            ))
        }
    }
    Ok(Value::Array(out))
}

fn template_item(at: &str, item: InputItem, out: &mut Vec<Value>) -> Result<(), ApiError> {
    reject_unknown(&item.extra, &format!("{at}."))?;
    match item.kind.as_deref() {
        None | Some("message") => {
            only(
                at,
                "a message",
                &[
                    ("call_id", item.call_id.is_some()),
                    ("name", item.name.is_some()),
                    ("arguments", item.arguments.is_some()),
                    ("output", item.output.is_some()),
                ],
            )?;
            out.push(message(at, item.role.as_deref(), item.content.as_ref())?);
        }
        Some("function_call") => {
            only(
                at,
                "a function_call",
                &[
                    ("role", item.role.is_some()),
                    ("content", item.content.is_some()),
                    ("output", item.output.is_some()),
                ],
            )?;
            let call = ToolCallIn {
                id: Some(required(at, "call_id", item.call_id)?),
                kind: None,
                function: FunctionCallIn {
                    name: required(at, "name", item.name)?,
                    arguments: item.arguments.unwrap_or_else(|| Value::String("{}".into())),
                },
            };
            let call = tool_call(at, &call)?;
            push_tool_call(call, out);
        }
        Some("function_call_output") => {
            only(
                at,
                "a function_call_output",
                &[
                    ("role", item.role.is_some()),
                    ("content", item.content.is_some()),
                    ("name", item.name.is_some()),
                    ("arguments", item.arguments.is_some()),
                ],
            )?;
            let call_id = required(at, "call_id", item.call_id)?;
            let output = parts_text(&format!("{at}.output"), item.output.as_ref())?;
            let Some(output) = output else {
                return Err(ApiError::invalid(
                    format!("{at}.output"),
                    format!("`{at}.output` is required for a function_call_output item"),
                ));
            };
            out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        }
        Some(other) => {
            return Err(ApiError::unsupported(
                format!("{at}.type"),
                format!(
                    "input items of type `{other}` are not supported: only `message`, \
                     `function_call` and `function_call_output` are (Kiln is stateless, so \
                     `item_reference` cannot be resolved either)"
                ),
            ))
        }
    }
    Ok(())
}

/// Refuses the first field that is present but does not belong to `what`.
fn only(at: &str, what: &str, present: &[(&str, bool)]) -> Result<(), ApiError> {
    match present.iter().find(|(_, p)| *p) {
        Some((field, _)) => Err(ApiError::invalid(
            format!("{at}.{field}"),
            format!("`{at}.{field}` does not belong in {what} item"),
        )),
        None => Ok(()),
    }
}

fn required(at: &str, field: &str, value: Option<String>) -> Result<String, ApiError> {
    value.ok_or_else(|| {
        ApiError::invalid(
            format!("{at}.{field}"),
            format!("`{at}.{field}` is required"),
        )
    })
}

fn message(at: &str, role: Option<&str>, content: Option<&Value>) -> Result<Value, ApiError> {
    let role = match role {
        Some("system" | "developer") => "system",
        Some(r @ ("user" | "assistant")) => r,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                format!("`{at}.role` must be user, system, developer or assistant, got `{other}`"),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                format!("`{at}.role` is required for a message"),
            ))
        }
    };
    let param = format!("{at}.content");
    match parts_text(&param, content)? {
        Some(text) => Ok(json!({"role": role, "content": text})),
        None => Err(ApiError::invalid(
            param.clone(),
            format!("`{param}` is required for a message"),
        )),
    }
}

/// A string, or `input_text` / `output_text` parts joined with newlines;
/// `None` for null or absent.
fn parts_text(param: &str, content: Option<&Value>) -> Result<Option<String>, ApiError> {
    let parts = match content {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => return Ok(Some(s.clone())),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` must be a string or a list of content parts"),
            ))
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{param}[{j}]");
        let Some(fields) = part.as_object() else {
            return Err(ApiError::invalid(
                at.clone(),
                format!("`{at}` must be an object with a `type`"),
            ));
        };
        match fields.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text") => {}
            Some(other) => {
                return Err(ApiError::unsupported(
                    format!("{at}.type"),
                    format!(
                        "content parts of type `{other}` are not supported: only \
                         `input_text` and `output_text` are"
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{at}.type"),
                    format!("`{at}.type` must be a string"),
                ))
            }
        }
        let Some(text) = fields.get("text").and_then(Value::as_str) else {
            return Err(ApiError::invalid(
                format!("{at}.text"),
                format!("`{at}.text` must be a string"),
            ));
        };
        let extra: Map<String, Value> = fields
            .iter()
            .filter(|(k, _)| !["type", "text"].contains(&k.as_str()))
            .filter(|(k, _)| !ECHOED_PART_FIELDS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        reject_unknown(&extra, &format!("{at}."))?;
        texts.push(text);
    }
    Ok(Some(texts.join("\n")))
}

/// Adds a call to the assistant turn just before it, or opens one. Content
/// is always a string (empty beside tool calls): many templates
/// concatenate it without checking.
fn push_tool_call(call: Value, out: &mut Vec<Value>) {
    if let Some(Value::Object(last)) = out.last_mut() {
        if last.get("role").and_then(Value::as_str) == Some("assistant") {
            match last.get_mut("tool_calls") {
                Some(Value::Array(calls)) => calls.push(call),
                _ => {
                    last.insert("tool_calls".into(), Value::Array(vec![call]));
                }
            }
            return;
        }
    }
    out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}));
}

/// Function tools as the chat template receives them, and their names.
pub fn template_function_tools(tools: &[ToolIn]) -> Result<(Value, Vec<String>), ApiError> {
    let mut converted = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        if t.kind != "function" {
            return Err(ApiError::unsupported(
                format!("{at}.type"),
                format!(
                    "tools of type `{}` are not supported: only `function`",
                    t.kind
                ),
            ));
        }
        reject_unknown(&t.extra, &format!("{at}."))?;
        let Some(name) = t.name.clone().filter(|n| !n.is_empty()) else {
            return Err(ApiError::invalid(
                format!("{at}.name"),
                format!("`{at}.name` is required for a function tool"),
            ));
        };
        converted.push(openai::ToolIn {
            kind: "function".into(),
            function: openai::FunctionDefIn {
                name,
                description: t.description.clone(),
                parameters: t.parameters.clone(),
                strict: t.strict,
            },
        });
    }
    let names = converted.iter().map(|t| t.function.name.clone()).collect();
    Ok((template_tools(&converted)?, names))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(instructions: Option<&str>, input: Value) -> Result<Value, ApiError> {
        template_input(instructions, &input)
    }

    fn param_of(input: Value) -> Value {
        convert(None, input).unwrap_err().body()["error"]["param"].clone()
    }

    #[test]
    fn a_string_is_one_user_message_after_the_instructions() {
        let v = convert(Some("Be brief."), json!("Hi")).unwrap();
        assert_eq!(
            v,
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        );
    }

    #[test]
    fn items_become_template_messages() {
        let v = convert(
            None,
            json!([
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}]},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                 "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
                {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
                {"type": "function_call_output", "call_id": "call_2",
                 "output": [{"type": "input_text", "text": "noon"}]},
            ]),
        )
        .unwrap();
        assert_eq!(v[0], json!({"role": "system", "content": "Use tools."}));
        assert_eq!(
            v[1],
            json!({"role": "user", "content": "Weather\nin Paris?"})
        );
        assert_eq!(v[2]["content"], "Checking.");
        let calls = v[2]["tool_calls"].as_array().cloned().unwrap_or_default();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["id"], "call_1");
        assert_eq!(
            calls[0]["function"],
            json!({"name": "get_weather", "arguments": {"city": "Paris"}})
        );
        assert_eq!(calls[1]["function"]["name"], "get_time");
        assert_eq!(
            v[3],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "18C"})
        );
        assert_eq!(v[4]["content"], "noon");
        assert_eq!(v.as_array().map(Vec::len), Some(5));
        // A call with no assistant text before it opens its own turn.
        let v = convert(
            None,
            json!([{"role": "user", "content": "x"},
                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]),
        )
        .unwrap();
        assert_eq!(v[1]["role"], "assistant");
        assert_eq!(v[1]["content"], "");
    }

    #[test]
    fn bad_items_are_refused_by_path() {
        assert_eq!(param_of(json!([])), json!("input"));
        assert_eq!(param_of(json!(42)), json!("input"));
        assert_eq!(
            param_of(json!([{"role": "tool", "content": "x"}])),
            json!("input[0].role")
        );
        assert_eq!(
            param_of(json!([{"role": "user"}])),
            json!("input[0].content")
        );
        assert_eq!(
            param_of(
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
            ),
            json!("input[0].content[0].type")
        );
        assert_eq!(
            param_of(
                json!([{"role": "user", "content": [{"type": "input_text", "text": "x", "mood": 1}]}])
            ),
            json!("input[0].content[0].mood")
        );
        assert_eq!(
            param_of(json!([{"role": "user", "content": "x", "mood": "happy"}])),
            json!("input[0].mood")
        );
        assert_eq!(
            param_of(json!([{"type": "item_reference", "id": "msg_1"}])),
            json!("input[0].type")
        );
        assert_eq!(
            param_of(json!([{"type": "function_call", "name": "f", "arguments": "{}"}])),
            json!("input[0].call_id")
        );
        assert_eq!(
            param_of(json!([{"type": "function_call_output", "call_id": "c"}])),
            json!("input[0].output")
        );
        assert_eq!(
            param_of(json!([{"role": "user", "content": "x", "output": "y"}])),
            json!("input[0].output")
        );
        assert_eq!(
            param_of(json!([{"role": 7, "content": "x"}])),
            json!("input[0]")
        );
    }

    #[test]
    fn only_named_function_tools() {
        let tool = |v: Value| -> ToolIn { serde_json::from_value(v).expect("a tool") };
        let (rendered, names) = template_function_tools(&[tool(json!({
            "type": "function", "name": "get_weather", "description": "Weather",
            "parameters": {"type": "object"}, "strict": false,
        }))])
        .unwrap();
        assert_eq!(names, ["get_weather"]);
        assert_eq!(rendered[0]["function"]["name"], "get_weather");
        assert_eq!(rendered[0]["type"], "function");
        let param = |v: Value| {
            template_function_tools(&[tool(v)]).unwrap_err().body()["error"]["param"].clone()
        };
        assert_eq!(param(json!({"type": "web_search"})), json!("tools[0].type"));
        assert_eq!(param(json!({"type": "function"})), json!("tools[0].name"));
        assert_eq!(
            param(json!({"type": "function", "name": "f", "color": "red"})),
            json!("tools[0].color")
        );
    }
}
