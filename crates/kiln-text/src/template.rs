//! [`ChatTemplate`]: renders Hugging Face chat templates the way transformers does.
//!
//! transformers renders with Jinja2 (`trim_blocks=True`, `lstrip_blocks=True`, no
//! trailing newline kept, loop controls on), `tojson` replaced by Python's
//! `json.dumps`, and the globals `raise_exception` and `strftime_now`. Here the same runs
//! on minijinja with `minijinja-contrib`'s Python methods (`str.strip`, `dict.items`,
//! ...) and Jinja2's `cycler`/`joiner`. Before rendering, as in transformers'
//! `apply_chat_template`, message keys whose value is `null` are dropped, and a message
//! with `reasoning_content`, `thinking` or `reasoning` gets all of `thinking` and
//! `reasoning_content`.
//!
//! Differences from Jinja2 that remain: `strftime_now` formats the current time in UTC
//! (Python uses the local time zone, which on a server is usually UTC), and the
//! `{% generation %}` block, which only marks assistant text for training masks, renders
//! its body like an `{% if true %}` block. The `sequence` test is Jinja2's (true for
//! strings and dicts too). `tests/template_compat.rs` checks feature probes and real
//! templates against Jinja2's output.

use std::collections::BTreeMap;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

use crate::error::{Result, TextError};
use crate::pyjson::tojson_filter;

/// Everything a chat template sees besides its own text.
#[derive(Debug, Clone, Default)]
pub struct ChatContext {
    /// The conversation: a list of message objects (`role`, `content`, `tool_calls`, ...).
    pub messages: Json,
    /// Tool definitions (JSON schemas), passed as `tools`; `None` renders as `none`.
    pub tools: Option<Json>,
    /// Whether to end with the header of an assistant turn.
    pub add_generation_prompt: bool,
    /// Passed as `enable_thinking` when set (Qwen3-style reasoning switch).
    pub enable_thinking: Option<bool>,
    /// Further template variables (OpenAI's `chat_template_kwargs`). They override
    /// `bos_token`/`eos_token` but not the fields above.
    pub extra: Map<String, Json>,
    /// Passed as `bos_token` when set.
    pub bos_token: Option<String>,
    /// Passed as `eos_token` when set.
    pub eos_token: Option<String>,
}

impl ChatContext {
    /// A context for `messages` with every other field empty.
    pub fn new(messages: Json) -> Self {
        ChatContext {
            messages,
            ..ChatContext::default()
        }
    }
}

/// The error `raise_exception` puts into a render error, found again by [`ChatTemplate::render`].
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A compiled chat template with the environment transformers renders it in.
pub struct ChatTemplate {
    env: Environment<'static>,
    name: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a template; it is called `default` in errors.
    pub fn new(source: &str) -> Result<Self> {
        Self::with_name("default", source)
    }

    /// Compiles a template that errors will call `name` (`tool_use`, for example).
    pub fn with_name(name: &str, source: &str) -> Result<Self> {
        let syntax_err = |source| TextError::TemplateSyntax {
            name: name.to_string(),
            source,
        };
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(syntax_err)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_filter("tojson", tojson_filter);
        // Jinja2's `sequence` is anything with a length and items: strings and dicts too.
        env.add_test("sequence", |v: &Value| {
            matches!(
                v.kind(),
                ValueKind::Seq | ValueKind::Map | ValueKind::String | ValueKind::Bytes
            )
        });
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message.clone())
                    .with_source(Raised(message)))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(name.to_string(), rewrite_generation_tags(source))
            .map_err(syntax_err)?;
        Ok(ChatTemplate {
            env,
            name: name.to_string(),
        })
    }

    /// The name errors use.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renders the template for `ctx`.
    pub fn render(&self, ctx: &ChatContext) -> Result<String> {
        let mut vars: BTreeMap<String, Value> = BTreeMap::new();
        for (key, token) in [("bos_token", &ctx.bos_token), ("eos_token", &ctx.eos_token)] {
            if let Some(token) = token {
                vars.insert(key.to_string(), Value::from(token.as_str()));
            }
        }
        for (key, value) in &ctx.extra {
            vars.insert(key.clone(), Value::from(Serde(value)));
        }
        if let Some(enable) = ctx.enable_thinking {
            vars.insert("enable_thinking".to_string(), Value::from(enable));
        }
        let messages = normalize_messages(&ctx.messages)?;
        vars.insert("messages".to_string(), Value::from(Serde(&messages)));
        let tools = ctx.tools.as_ref().map(|t| Value::from(Serde(t)));
        vars.insert("tools".to_string(), tools.unwrap_or(Value::from(())));
        vars.entry("documents".to_string())
            .or_insert(Value::from(()));
        vars.insert(
            "add_generation_prompt".to_string(),
            Value::from(ctx.add_generation_prompt),
        );

        let render_err = |source: Error| match raised_message(&source) {
            Some(message) => TextError::TemplateRaised {
                name: self.name.clone(),
                message,
            },
            None => TextError::TemplateRender {
                name: self.name.clone(),
                source,
            },
        };
        let template = self.env.get_template(&self.name).map_err(render_err)?;
        template.render(Value::from(vars)).map_err(render_err)
    }
}

/// The message of a `raise_exception` call somewhere in an error's source chain.
fn raised_message(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return Some(raised.0.clone());
        }
        source = e.source();
    }
    None
}

/// `strftime_now(format)`: the current time, formatted with Python's `strftime` codes.
fn strftime_now(format: &str) -> Result<String, Error> {
    let now = jiff::Timestamp::now().to_zoned(jiff::tz::TimeZone::UTC);
    jiff::fmt::strtime::format(format, &now).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
        .with_source(e)
    })
}

/// Checks that `messages` is a list of objects, drops `null`-valued keys and aliases the
/// reasoning fields, as transformers does before rendering.
fn normalize_messages(messages: &Json) -> Result<Json> {
    const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
    let Json::Array(list) = messages else {
        return Err(TextError::TemplateInput {
            what: format!("messages must be a list, got {}", json_kind(messages)),
        });
    };
    let mut out = Vec::with_capacity(list.len());
    for (idx, message) in list.iter().enumerate() {
        let Json::Object(fields) = message else {
            return Err(TextError::TemplateInput {
                what: format!(
                    "message {idx} must be an object, got {}",
                    json_kind(message)
                ),
            });
        };
        let kept = fields.iter().filter(|(_, v)| !v.is_null());
        let fields: Map<String, Json> = kept.map(|(k, v)| (k.clone(), v.clone())).collect();
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|k| fields.get(*k))
            .cloned();
        let fields = match reasoning {
            Some(reasoning) => {
                let mut aliased = Map::new();
                aliased.insert("thinking".to_string(), reasoning.clone());
                aliased.extend(fields);
                aliased.insert("reasoning_content".to_string(), reasoning);
                aliased
            }
            None => fields,
        };
        out.push(Json::Object(fields));
    }
    Ok(Json::Array(out))
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a bool",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask
/// extension) into `{% if true %}` / `{% endif %}`, keeping whitespace control.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag[2..].find("%}").map(|i| i + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let body = inner
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+']);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(keyword) => {
                let open = &inner[..inner.len() - inner.trim_start_matches(['-', '+']).len()];
                let close = &inner[inner.trim_end_matches(['-', '+']).len()..];
                out.push_str(&format!("{{%{open} {keyword} {close}%}}"));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, ctx: &ChatContext) -> Result<String> {
        ChatTemplate::new(source)?.render(ctx)
    }

    #[test]
    fn generation_tags_become_if_blocks() {
        let src = "a{%- generation -%} b {%+ endgeneration %}c{% if x %}{% endif %}";
        assert_eq!(
            rewrite_generation_tags(src),
            "a{%- if true -%} b {%+ endif %}c{% if x %}{% endif %}"
        );
        let ctx = ChatContext::new(json!([]));
        let out = render("{% generation %}\nhi\n{% endgeneration %}\n", &ctx).expect("renders");
        assert_eq!(out, "hi\n");
    }

    #[test]
    fn generation_rewrite_survives_odd_tags() {
        for src in [
            "{%",
            "{%}",
            "{%-",
            "%}{%",
            "{% generation",
            "{%%}",
            "a{%}b%}c",
        ] {
            let _ = rewrite_generation_tags(src);
        }
        assert_eq!(rewrite_generation_tags("{%}"), "{%}");
        assert_eq!(rewrite_generation_tags("a{%}b%}c"), "a{%}b%}c");
        assert_eq!(
            rewrite_generation_tags("{%generation%}x{%endgeneration%}"),
            "{% if true %}x{% endif %}"
        );
    }

    #[test]
    fn null_keys_dropped_and_reasoning_aliased() {
        let ctx = ChatContext::new(json!([
            {"role": "assistant", "content": null, "reasoning": "r"}
        ]));
        let src = "{{ messages[0].content is defined }}|{{ messages[0].thinking }}|{{ messages[0].reasoning_content }}|{{ messages[0] | tojson }}";
        let out = render(src, &ctx).expect("renders");
        assert_eq!(
            out,
            "False|r|r|{\"thinking\": \"r\", \"role\": \"assistant\", \"reasoning\": \"r\", \"reasoning_content\": \"r\"}"
        );
    }

    #[test]
    fn non_list_messages_are_an_input_error() {
        let err = render("x", &ChatContext::new(json!({"role": "user"}))).unwrap_err();
        assert!(matches!(err, TextError::TemplateInput { .. }), "{err}");
    }

    #[test]
    fn python_reprs_and_methods() {
        let ctx = ChatContext::new(json!([{"role": "user", "content": "  Hi  "}]));
        let src = "{{ true }} {{ none }} {{ messages[0].content.strip() }} {{ ['a', 1] }} {{ messages[0].items() | list | length }}";
        assert_eq!(
            render(src, &ctx).expect("renders"),
            "True None Hi ['a', 1] 2"
        );
    }
}
