//! Request bodies: bytes (under the size limit) → JSON → a typed request,
//! with errors that name the offending parameter, and the refusal of
//! parameters Kiln does not know or does not support.

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

/// OpenAI parameters that Kiln knows but does not implement yet, with what
/// to say about each.
const NOT_YET: &[(&str, &str)] = &[
    ("response_format", "structured output is not supported yet"),
    ("functions", "use `tools`"),
    ("function_call", "use `tool_choice`"),
    ("best_of", "only one candidate is generated"),
    ("suffix", "insertion is not supported"),
    ("audio", "audio output is not supported"),
    ("modalities", "only text output is supported"),
    ("prediction", "predicted outputs are not supported"),
    ("web_search_options", "web search is not supported"),
    ("service_tier", "there are no service tiers"),
];

/// Refuses the first key of `extra` (the fields a request struct did not
/// name) whose value is not `null`; `context` prefixes the parameter path.
pub fn reject_unknown(extra: &Map<String, Value>, context: &str) -> Result<(), ApiError> {
    let Some((key, _)) = extra.iter().find(|(_, v)| !v.is_null()) else {
        return Ok(());
    };
    let param = format!("{context}{key}");
    let message = match NOT_YET.iter().find(|(k, _)| *k == key) {
        Some((_, why)) => format!("`{param}` is not supported by Kiln: {why}"),
        None => format!("unknown parameter `{param}`"),
    };
    Err(ApiError::unsupported(param, message))
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
        let p = parse::<Probe>(br#"{"response_format": {"type": "json_object"}}"#).unwrap();
        let msg = reject_unknown(&p.extra, "").unwrap_err().to_string();
        assert!(msg.contains("not supported"), "{msg}");
    }
}
