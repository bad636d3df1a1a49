//! Chat messages and tool definitions from the wire, checked and turned into
//! the JSON a chat template renders.

use serde_json::{json, Map, Value};

use crate::errors::ApiError;
use crate::json_body::reject_unknown;
use crate::openai_types::chat::{ChatMessageIn, Role, ToolCallIn, ToolIn};
use crate::state::AppState;

/// Message fields that clients echo back from responses; accepted when empty.
const ECHOED_FIELDS: &[&str] = &["refusal", "annotations", "audio", "function_call"];

/// The messages as a template sees them: `developer` becomes `system`,
/// content parts are joined into one string, and tool-call arguments are
/// parsed back into objects (as transformers' templates expect).
pub fn template_messages(messages: &[ChatMessageIn]) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| template_message(i, m))
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

fn template_message(i: usize, m: &ChatMessageIn) -> Result<Value, ApiError> {
    let at = format!("messages[{i}]");
    let mut extra = m.extra.clone();
    extra.retain(|k, v| !(ECHOED_FIELDS.contains(&k.as_str()) && is_empty(v)));
    reject_unknown(&extra, &format!("{at}."))?;
    let role = match m.role {
        Role::System | Role::Developer => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let mut out = Map::new();
    out.insert("role".into(), role.into());
    match content_text(&at, m.content.as_ref())? {
        Some(text) => {
            out.insert("content".into(), text.into());
        }
        // An assistant turn that only calls tools has no text; templates
        // that do not know tool calls still read `content`.
        None if m.role == Role::Assistant => {
            out.insert("content".into(), "".into());
        }
        None => {
            return Err(ApiError::invalid(
                format!("{at}.content"),
                format!("`{at}.content` is required for a {role} message"),
            ))
        }
    }
    if let Some(name) = &m.name {
        out.insert("name".into(), name.clone().into());
    }
    if let Some(calls) = &m.tool_calls {
        if m.role != Role::Assistant {
            return Err(ApiError::invalid(
                format!("{at}.tool_calls"),
                format!("`{at}.tool_calls` is only allowed in assistant messages"),
            ));
        }
        let calls = calls
            .iter()
            .enumerate()
            .map(|(j, c)| tool_call(&format!("{at}.tool_calls[{j}]"), c))
            .collect::<Result<Vec<_>, _>>()?;
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), id.clone().into());
    }
    Ok(Value::Object(out))
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// A string, or text parts joined with newlines; `None` for null or absent.
pub fn content_text(at: &str, content: Option<&Value>) -> Result<Option<String>, ApiError> {
    let param = format!("{at}.content");
    match content {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                let text = part.get("text").and_then(Value::as_str);
                match (kind, text) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{j}].text"),
                            format!("`{param}[{j}].text` must be a string"),
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::unsupported(
                            format!("{param}[{j}].type"),
                            format!(
                                "content parts of type `{other}` are not supported: \
                                 only `text` parts are"
                            ),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{j}]"),
                            format!("`{param}[{j}]` must be an object with a `type`"),
                        ))
                    }
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(ApiError::invalid(
            param.clone(),
            format!("`{param}` must be a string or a list of content parts"),
        )),
    }
}

/// An assistant's tool call as the template receives it.
pub fn tool_call(at: &str, c: &ToolCallIn) -> Result<Value, ApiError> {
    if let Some(kind) = c.kind.as_deref().filter(|k| *k != "function") {
        return Err(ApiError::unsupported(
            format!("{at}.type"),
            format!("tool calls of type `{kind}` are not supported: only `function`"),
        ));
    }
    let arguments = match &c.function.arguments {
        // Templates index into the arguments; keep the text when it is not JSON.
        Value::String(s) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| s.clone().into()),
        other => other.clone(),
    };
    let mut call = json!({
        "type": "function",
        "function": {"name": c.function.name, "arguments": arguments},
    });
    if let Some(id) = &c.id {
        call["id"] = id.clone().into();
    }
    Ok(call)
}

/// Whether an OpenAI `tool_choice` turns tools off: `"none"` does, `"auto"`
/// and absence do not; forcing a call is refused until structured output
/// can enforce it.
pub fn tool_choice_is_none(choice: Option<&Value>) -> Result<bool, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(false),
        Some(Value::String(s)) if s == "auto" => Ok(false),
        Some(Value::String(s)) if s == "none" => Ok(true),
        Some(other) => Err(ApiError::unsupported(
            "tool_choice",
            format!("`tool_choice` must be \"auto\" or \"none\" for now, got {other}"),
        )),
    }
}

/// What a chat request's `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    /// Some tool must be called.
    Required,
    /// This tool must be called.
    Named(String),
}

/// Read chat completions' `tool_choice`: `"auto"`, `"none"`, `"required"`
/// or `{"type": "function", "function": {"name": ...}}`.
pub fn tool_choice(choice: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let bad = |detail: String| ApiError::invalid("tool_choice", detail);
    match choice {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(bad(format!(
                "`tool_choice` {other:?} is not one of auto, none, required or a named function"
            ))),
        },
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => o
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .map(|n| ToolChoice::Named(n.to_string()))
            .ok_or_else(|| bad("`tool_choice.function.name` is required".into())),
        Some(other) => Err(bad(format!("`tool_choice` {other} is not understood"))),
    }
}

/// The output format that makes a forced tool call valid by construction:
/// `{"name": <a declared tool>, "arguments": <its parameters>}`, which the
/// tool-call parser reads as the call, under strict semantics (arguments
/// hold only the declared parameters, numbers bounded), as OpenAI reads
/// forced calls. `None` unless `choice` forces a call.
pub fn forced_call_format(
    tools: &[(&str, Option<&Value>)],
    choice: &ToolChoice,
) -> Result<Option<kiln_structured::Format>, ApiError> {
    let call = |&(name, params): &(&str, Option<&Value>)| {
        let arguments = params.cloned().unwrap_or(json!({"type": "object"}));
        call_schema(name, "arguments", arguments)
    };
    let schema = match choice {
        ToolChoice::Auto | ToolChoice::None => return Ok(None),
        ToolChoice::Required if tools.is_empty() => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice: required` needs at least one tool in `tools`",
            ))
        }
        ToolChoice::Required => {
            serde_json::json!({"anyOf": tools.iter().map(call).collect::<Vec<_>>()})
        }
        ToolChoice::Named(name) => match tools.iter().find(|t| t.0 == name.as_str()) {
            Some(t) => call(t),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names {name:?}, which is not in `tools`"),
                ))
            }
        },
    };
    Ok(Some(kiln_structured::Format::StrictJsonSchema(schema)))
}

/// `{"name": NAME, ARGUMENTS_KEY: <arguments>}`, nothing else: one call as
/// a JSON schema.
fn call_schema(name: &str, arguments_key: &str, arguments: Value) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: arguments},
        "required": ["name", arguments_key],
        "additionalProperties": false,
    })
}

/// A declared tool as the call formats read it.
pub struct DeclaredTool<'a> {
    pub name: &'a str,
    pub parameters: Option<&'a Value>,
    pub strict: bool,
}

/// Under `tool_choice: auto` with at least one `strict` tool: the format
/// that leaves the answer free and holds every call the model opens, in
/// the syntax it writes, to a declared tool's name and arguments (a strict
/// tool's parameters under strict semantics, any object for the others),
/// as OpenAI holds strict tools. `None` when no tool is strict or the
/// syntax is not a marker before JSON.
pub fn auto_call_format(
    state: &AppState,
    tools: &[DeclaredTool],
    parallel: bool,
) -> Option<kiln_structured::Format> {
    if !tools.iter().any(|t| t.strict) {
        return None;
    }
    let model = state.engine.model();
    let syntax = crate::generation::tool_syntax(model, &state.output);
    let spelling = syntax.call_spelling(crate::generation::template_source(model))?;
    Some(tagged_calls(spelling, tools, parallel))
}

/// The format of [`auto_call_format`] for calls spelled as `spelling`.
fn tagged_calls(
    spelling: crate::parse::CallSpelling,
    tools: &[DeclaredTool],
    parallel: bool,
) -> kiln_structured::Format {
    let calls: Vec<Value> = tools
        .iter()
        .map(|t| {
            let arguments = match (t.strict, t.parameters) {
                (true, Some(p)) => p.clone(),
                (true, None) => json!({"type": "object"}),
                (false, _) => json!({"type": "object", "additionalProperties": true}),
            };
            call_schema(t.name, spelling.arguments_key, arguments)
        })
        .collect();
    let call = json!({"anyOf": calls});
    let schema = if spelling.array {
        let mut array = json!({"type": "array", "items": call, "minItems": 1});
        if !parallel {
            array["maxItems"] = 1.into();
        }
        array
    } else {
        call
    };
    kiln_structured::Format::TaggedJson(kiln_structured::TaggedJson {
        begin: spelling.begin.to_string(),
        schema,
        end: spelling.end.to_string(),
        many: spelling.many && parallel,
    })
}

/// Tool definitions as the template receives them; only `function` tools.
pub fn template_tools(tools: &[ToolIn]) -> Result<Value, ApiError> {
    for (i, t) in tools.iter().enumerate() {
        if t.kind != "function" {
            return Err(ApiError::unsupported(
                format!("tools[{i}].type"),
                format!(
                    "tools of type `{}` are not supported: only `function`",
                    t.kind
                ),
            ));
        }
    }
    serde_json::to_value(tools).map_err(|e| ApiError::Internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json_body::parse;
    use crate::openai_types::chat::ChatCompletionRequest;

    fn messages(body: &str) -> Result<Value, ApiError> {
        let req: ChatCompletionRequest = parse(body.as_bytes())?;
        template_messages(&req.messages)
    }

    #[test]
    fn normalizes_roles_parts_and_tool_calls() {
        let v = messages(
            r#"{"messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "refusal": null,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}
            ]}"#,
        )
        .unwrap();
        assert_eq!(v[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(v[1]["content"], "a\nb");
        assert_eq!(
            v[2]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(v[2]["content"], "", "a tool-call turn has empty text");
        assert_eq!(v[3]["tool_call_id"], "c1");
    }

    #[test]
    fn strict_tools_under_auto_hold_calls_in_the_models_syntax() {
        use crate::parse::ToolSyntax;
        use kiln_structured::Format;
        let params = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let tools = [
            DeclaredTool {
                name: "get_weather",
                parameters: Some(&params),
                strict: true,
            },
            DeclaredTool {
                name: "note",
                parameters: Some(&params),
                strict: false,
            },
        ];
        let hermes = ToolSyntax::Hermes.call_spelling("").unwrap();
        let Format::TaggedJson(t) = tagged_calls(hermes, &tools, true) else {
            panic!("not a tagged format")
        };
        assert_eq!(
            (t.begin.as_str(), t.end.as_str(), t.many),
            ("<tool_call>", "</tool_call>", true)
        );
        let calls = t.schema["anyOf"].as_array().unwrap();
        assert_eq!(
            calls[0]["properties"]["name"],
            json!({"const": "get_weather"})
        );
        assert_eq!(
            calls[0]["properties"]["arguments"], params,
            "a strict tool's parameters"
        );
        assert_eq!(
            calls[1]["properties"]["arguments"]["additionalProperties"], true,
            "a tool that is not strict takes any object"
        );
        let Format::TaggedJson(one) = tagged_calls(hermes, &tools, false) else {
            panic!()
        };
        assert!(!one.many, "parallel_tool_calls: false allows one call");
        // Llama 3 names arguments `parameters`; Mistral writes an array.
        let llama = ToolSyntax::Llama3.call_spelling("").unwrap();
        let Format::TaggedJson(l) = tagged_calls(llama, &tools, true) else {
            panic!()
        };
        assert_eq!(l.begin, "<|python_tag|>");
        assert!(l.schema["anyOf"][0]["properties"]["parameters"].is_object());
        let mistral = ToolSyntax::Mistral.call_spelling("[TOOL_CALLS]").unwrap();
        let Format::TaggedJson(m) = tagged_calls(mistral, &tools, false) else {
            panic!()
        };
        assert_eq!(
            (m.schema["type"].as_str(), m.schema["maxItems"].as_u64()),
            (Some("array"), Some(1))
        );
        // No marker before JSON: no format (the calls are parsed as written).
        assert!(ToolSyntax::Mistral
            .call_spelling("[TOOL_CALLS]name[ARGS]")
            .is_none());
        assert!(ToolSyntax::Gemma.call_spelling("").is_none());
    }

    #[test]
    fn refuses_bad_messages_by_path() {
        let param = |body: &str| {
            let e = messages(body).unwrap_err();
            (e.status().as_u16(), e.body()["error"]["param"].clone())
        };
        assert_eq!(param(r#"{"messages": []}"#), (400, json!("messages")));
        assert_eq!(
            param(r#"{"messages": [{"role": "robot", "content": "x"}]}"#),
            (400, json!("messages[0].role"))
        );
        assert_eq!(
            param(
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#
            ),
            (400, json!("messages[0].content[0].type"))
        );
        assert_eq!(
            param(r#"{"messages": [{"role": "user"}]}"#),
            (400, json!("messages[0].content"))
        );
        assert_eq!(
            param(r#"{"messages": [{"role": "user", "content": "x", "mood": "happy"}]}"#),
            (400, json!("messages[0].mood"))
        );
    }
}
