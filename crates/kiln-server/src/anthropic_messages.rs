//! Anthropic messages and tools from the wire, turned into the same template
//! JSON the OpenAI chat route renders: `system` becomes a system message,
//! `tool_use` blocks become an assistant's `tool_calls`, and `tool_result`
//! blocks become `tool` messages (prefixed with [`TOOL_ERROR_MARKER`] when
//! `is_error` is set).

use kiln_engine::TOOL_ERROR_MARKER;
use serde_json::{json, Map, Value};

use crate::anthropic_types::{MessageIn, Role, ToolIn};
use crate::errors::ApiError;
use crate::json_body::reject_unknown;
use crate::messages::{content_text, template_tools};
use crate::openai_types::chat as openai;

/// The conversation as a template sees it.
pub fn template_conversation(
    system: Option<&Value>,
    messages: &[MessageIn],
) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(text) = content_text("system", system)? {
        out.push(json!({"role": "system", "content": text}));
    }
    for (i, m) in messages.iter().enumerate() {
        template_message(&format!("messages[{i}]"), m, &mut out)?;
    }
    Ok(Value::Array(out))
}

/// Appends the template messages of one Anthropic message: for a user, its
/// tool results (as `tool` messages) and then its text; for an assistant,
/// one message with its text and tool calls.
fn template_message(at: &str, m: &MessageIn, out: &mut Vec<Value>) -> Result<(), ApiError> {
    reject_unknown(&m.extra, &format!("{at}."))?;
    let role = match m.role {
        Role::User => "user",
        Role::Assistant => "assistant",
    };
    let blocks = match &m.content {
        Value::String(s) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                format!("`{at}.content` must be a string or a list of content blocks"),
            ))
        }
    };
    let mut texts = Vec::new();
    let mut tool_calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let param = format!("{at}.content[{j}]");
        match (block.get("type").and_then(Value::as_str), m.role) {
            (Some("text"), _) => match block.get("text").and_then(Value::as_str) {
                Some(t) => texts.push(t.to_string()),
                None => {
                    return Err(ApiError::invalid(
                        format!("{param}.text"),
                        format!("`{param}.text` must be a string"),
                    ))
                }
            },
            (Some("tool_use"), Role::Assistant) => tool_calls.push(tool_use(&param, block)?),
            (Some("tool_result"), Role::User) => out.push(tool_result(&param, block)?),
            (Some(kind @ ("tool_use" | "tool_result")), _) => {
                return Err(ApiError::invalid(
                    format!("{param}.type"),
                    format!(
                        "`{kind}` blocks belong in {} messages",
                        if kind == "tool_use" {
                            "assistant"
                        } else {
                            "user"
                        }
                    ),
                ))
            }
            (Some(other), _) => {
                return Err(ApiError::unsupported(
                    format!("{param}.type"),
                    format!(
                        "content blocks of type `{other}` are not supported: only `text`, \
                         `tool_use` and `tool_result` are"
                    ),
                ))
            }
            (None, _) => {
                return Err(ApiError::invalid(
                    param.clone(),
                    format!("`{param}` must be an object with a `type`"),
                ))
            }
        }
    }
    let mut msg = Map::new();
    msg.insert("role".into(), role.into());
    if texts.is_empty() && m.role == Role::User && out.last().is_some_and(is_tool) {
        return Ok(()); // Only tool results: they are the turn.
    }
    // Content is always a string (empty beside tool calls): many templates
    // concatenate it without checking.
    msg.insert("content".into(), texts.join("\n").into());
    if !tool_calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    out.push(Value::Object(msg));
    Ok(())
}

fn is_tool(v: &Value) -> bool {
    v["role"] == "tool"
}

fn str_field<'a>(param: &str, block: &'a Value, field: &str) -> Result<&'a str, ApiError> {
    block.get(field).and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("{param}.{field}"),
            format!("`{param}.{field}` must be a string"),
        )
    })
}

/// A `tool_use` block as an OpenAI-style tool call.
fn tool_use(param: &str, block: &Value) -> Result<Value, ApiError> {
    let id = str_field(param, block, "id")?;
    let name = str_field(param, block, "name")?;
    let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
    Ok(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": input},
    }))
}

/// A `tool_result` block as a `tool` message.
fn tool_result(param: &str, block: &Value) -> Result<Value, ApiError> {
    let id = str_field(param, block, "tool_use_id")?;
    let content = content_text(param, block.get("content"))?.unwrap_or_default();
    let is_error = match block.get("is_error") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{param}.is_error"),
                format!("`{param}.is_error` must be a boolean"),
            ))
        }
    };
    let content = if is_error {
        format!("{TOOL_ERROR_MARKER}{content}")
    } else {
        content
    };
    Ok(json!({"role": "tool", "tool_call_id": id, "content": content}))
}

/// Anthropic tools as the OpenAI-style function tools templates expect.
pub fn template_anthropic_tools(tools: &[ToolIn]) -> Result<Value, ApiError> {
    let converted = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            reject_unknown(&t.extra, &format!("tools[{i}]."))?;
            Ok(openai::ToolIn {
                kind: "function".into(),
                function: openai::FunctionDefIn {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    parameters: Some(t.input_schema.clone()),
                    strict: t.strict,
                },
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    template_tools(&converted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::anthropic_types::MessagesRequest;
    use crate::json_body::parse;

    fn conversation(body: &str) -> Result<Value, ApiError> {
        let req: MessagesRequest = parse(body.as_bytes())?;
        template_conversation(req.system.as_ref(), &req.messages)
    }

    #[test]
    fn tool_use_and_error_results_become_template_messages() {
        let v = conversation(
            r#"{"system": [{"type": "text", "text": "Be brief."}], "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "timeout", "is_error": true}]}
            ]}"#,
        )
        .unwrap();
        assert_eq!(v[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(
            v[1],
            json!({"role": "user", "content": "Weather in Paris?"})
        );
        assert_eq!(v[2]["content"], "Let me check.");
        assert_eq!(
            v[2]["tool_calls"][0]["function"],
            json!({"name": "weather", "arguments": {"city": "Paris"}})
        );
        assert_eq!(
            v[3],
            json!({"role": "tool", "tool_call_id": "t1",
                   "content": format!("{TOOL_ERROR_MARKER}timeout")})
        );
        assert_eq!(v.as_array().map(Vec::len), Some(4));
    }

    #[test]
    fn results_with_blocks_and_text_after_them() {
        let v = conversation(
            r#"{"messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "Thanks"}]}]}"#,
        )
        .unwrap();
        assert_eq!(v[0]["content"], "18C");
        assert_eq!(v[1], json!({"role": "user", "content": "Thanks"}));
    }

    #[test]
    fn refuses_misplaced_and_unknown_blocks() {
        let param = |body: &str| conversation(body).unwrap_err().body()["error"]["param"].clone();
        assert_eq!(
            param(
                r#"{"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}"#
            ),
            json!("messages[0].content[0].type")
        );
        assert_eq!(
            param(
                r#"{"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}"#
            ),
            json!("messages[0].content[0].type")
        );
        assert_eq!(param(r#"{"messages": []}"#), json!("messages"));
        assert_eq!(
            param(r#"{"messages": [{"role": "system", "content": "x"}]}"#),
            json!("messages[0].role")
        );
    }
}
