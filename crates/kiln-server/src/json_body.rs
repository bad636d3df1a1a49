//! Request bodies: bytes (under the size limit) → JSON → a typed request,
//! with errors that name the offending parameter; parameters Kiln cannot
//! honour are refused, and unknown ones ignored and reported (or refused
//! with `--strict-params`).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::errors::ApiError;
use crate::state::AppState;

/// A request body parsed into `T`; rejections are OpenAI-shaped errors.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge {
                    limit: state.max_body_bytes,
                }
            } else {
                ApiError::InvalidRequest {
                    message: format!("cannot read the request body: {}", r.body_text()),
                    param: None,
                }
            }
        })?;
        parse(&bytes).map(ApiJson)
    }
}

/// Parses a JSON object into `T`; a type error names its path
/// (`messages[0].role`).
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    if !value.is_object() {
        return Err(ApiError::InvalidRequest {
            message: "the request body must be a JSON object".into(),
            param: None,
        });
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::InvalidRequest {
                message: inner.to_string(),
                param: None,
            }
        } else {
            ApiError::invalid(path.clone(), format!("`{path}`: {inner}"))
        }
    })
}

/// Parameters Kiln cannot honour: refused in every mode (ignoring them
/// would change what the client gets), each with what to say.
fn cannot_honour(key: &str, value: &Value) -> Option<&'static str> {
    match key {
        "functions" => Some("use `tools`"),
        "function_call" => Some("use `tool_choice`"),
        "audio" => Some("audio output is not supported"),
        "modalities" => {
            let text_only = value
                .as_array()
                .is_some_and(|m| m.iter().all(|v| v.as_str() == Some("text")));
            (!text_only).then_some("only text output is supported")
        }
        "best_of" => (value.as_u64() != Some(1)).then_some("only one candidate is generated"),
        "suffix" => {
            (!value.as_str().is_some_and(str::is_empty)).then_some("insertion is not supported")
        }
        "web_search_options" => Some("web search is not supported"),
        _ => None,
    }
}

/// Parameters clients send that Kiln accepts without acting on them,
/// because what they ask for is already what happens: `cache_prompt`
/// (llama.cpp; the prefix cache is always on), `service_tier` (there is
/// one tier), `modalities: ["text"]` and `best_of: 1` (checked above).
const ACCEPTED: &[&str] = &[
    "cache_prompt",
    "service_tier",
    "modalities",
    "best_of",
    "suffix",
];

/// The unknown parameters one request carried, and whether they are
/// refused (`--strict-params`) or ignored and reported.
#[derive(Debug, Default)]
pub struct IgnoredParams {
    pub strict: bool,
    pub names: Vec<String>,
}

tokio::task_local! {
    /// The request being handled on this task (set by [`track_ignored`]).
    static IGNORED: std::cell::RefCell<IgnoredParams>;
}

/// Checks the fields of `extra` (the fields a request struct did not
/// name) whose value is not `null`; `context` prefixes the parameter path.
/// A field Kiln cannot honour is refused. Unknown fields are ignored and
/// recorded for the `x-kiln-ignored-params` header and the log, or, with
/// `--strict-params` (and outside a request, as in unit tests), the first
/// is refused by name.
pub fn reject_unknown(extra: &Map<String, Value>, context: &str) -> Result<(), ApiError> {
    let mut unknown = Vec::new();
    for (key, value) in extra.iter().filter(|(_, v)| !v.is_null()) {
        let param = format!("{context}{key}");
        if let Some(why) = cannot_honour(key, value) {
            return Err(ApiError::unsupported(
                param.clone(),
                format!("`{param}` is not supported by Kiln: {why}"),
            ));
        }
        if !ACCEPTED.contains(&key.as_str()) {
            unknown.push(param);
        }
    }
    let Some(first) = unknown.first().cloned() else {
        return Ok(());
    };
    let ignored = IGNORED
        .try_with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.strict {
                return false;
            }
            cell.names.append(&mut unknown);
            true
        })
        .unwrap_or(false);
    if ignored {
        Ok(())
    } else {
        Err(ApiError::unsupported(
            first.clone(),
            format!("unknown parameter `{first}`"),
        ))
    }
}

/// The response header that lists the request fields Kiln ignored.
pub const IGNORED_HEADER: &str = "x-kiln-ignored-params";

/// Middleware: runs the request with a fresh [`IgnoredParams`] and, when
/// the handler ignored fields, names them in [`IGNORED_HEADER`] and logs
/// them once.
pub async fn track_ignored(
    axum::extract::State(state): axum::extract::State<AppState>,
    req: Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let path = req.uri().path().to_string();
    let cell = std::cell::RefCell::new(IgnoredParams {
        strict: state.strict_params,
        names: Vec::new(),
    });
    let (mut response, cell) = IGNORED
        .scope(cell, async move {
            let response = next.run(req).await;
            let names = IGNORED.with(|c| std::mem::take(&mut c.borrow_mut().names));
            (response, names)
        })
        .await;
    if !cell.is_empty() {
        let list = cell.join(", ");
        tracing::warn!(route = %path, ignored = %list, "ignored request fields Kiln does not know");
        if let Ok(v) = axum::http::HeaderValue::from_str(&list) {
            response.headers_mut().insert(IGNORED_HEADER, v);
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Probe {
        #[allow(dead_code)]
        n: Option<u32>,
        #[serde(flatten)]
        extra: Map<String, Value>,
    }

    #[test]
    fn type_errors_name_the_path() {
        let e = parse::<Probe>(br#"{"n": "x"}"#).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "n");
        assert!(matches!(
            parse::<Probe>(b"{nope").unwrap_err(),
            ApiError::InvalidJson(_)
        ));
        assert!(parse::<Probe>(b"[1]").is_err());
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        let p = parse::<Probe>(br#"{"n": 1, "frobnicate": true, "user2": null}"#).unwrap();
        let e = reject_unknown(&p.extra, "").unwrap_err();
        assert_eq!(e.body()["error"]["param"], "frobnicate");
        let p = parse::<Probe>(br#"{"audio": {"voice": "alloy"}}"#).unwrap();
        let msg = reject_unknown(&p.extra, "").unwrap_err().to_string();
        assert!(msg.contains("not supported"), "{msg}");
    }

    fn in_request<T>(strict: bool, f: impl FnOnce() -> T) -> (T, Vec<String>) {
        let cell = std::cell::RefCell::new(IgnoredParams {
            strict,
            names: Vec::new(),
        });
        IGNORED.sync_scope(cell, || {
            let out = f();
            (
                out,
                IGNORED.with(|c| std::mem::take(&mut c.borrow_mut().names)),
            )
        })
    }

    #[test]
    fn unknown_fields_are_ignored_and_listed_in_a_request() {
        let p = parse::<Probe>(
            br#"{"n": 1, "frobnicate": true, "cache_prompt": true, "modalities": ["text"], "service_tier": "auto"}"#,
        )
        .unwrap();
        let (r, names) = in_request(false, || reject_unknown(&p.extra, "x."));
        assert!(r.is_ok());
        assert_eq!(names, vec!["x.frobnicate"]);
        let (r, names) = in_request(true, || reject_unknown(&p.extra, ""));
        assert_eq!(r.unwrap_err().body()["error"]["param"], "frobnicate");
        assert!(names.is_empty());
    }

    #[test]
    fn what_kiln_cannot_honour_is_refused_in_every_mode() {
        for body in [
            r#"{"modalities": ["text", "audio"]}"#,
            r#"{"audio": {"voice": "alloy", "format": "wav"}}"#,
            r#"{"best_of": 3}"#,
            r#"{"suffix": "}"}"#,
            r#"{"functions": []}"#,
        ] {
            let p = parse::<Probe>(body.as_bytes()).unwrap();
            let (r, _) = in_request(false, || reject_unknown(&p.extra, ""));
            assert!(r.is_err(), "{body}");
        }
        let p = parse::<Probe>(br#"{"best_of": 1, "suffix": ""}"#).unwrap();
        assert!(in_request(false, || reject_unknown(&p.extra, "")).0.is_ok());
    }
}
