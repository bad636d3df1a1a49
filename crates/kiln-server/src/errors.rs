//! Every error the server answers with, and the one place that maps them to
//! an HTTP status and an error body: OpenAI's
//! `{"error": {"message", "type", "param", "code"}}`, or, for the Anthropic
//! routes, `{"type": "error", "error": {"type", "message"}}` (each route
//! picks its [`ErrorShape`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::EngineError;
use kiln_sampling::SamplingError;
use kiln_scheduler::SubmitError;
use serde_json::json;

/// Seconds a client is asked to wait after a 429.
const RETRY_AFTER_SECONDS: &str = "1";

/// Which API's error body a route answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    OpenAi,
    Anthropic,
    /// Ollama's `{"error": "..."}` (the `/api/` routes).
    Ollama,
}

impl ErrorShape {
    /// The shape of the API a path belongs to: Anthropic's under
    /// `/v1/messages`, else OpenAI's.
    pub fn for_path(path: &str) -> Self {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            ErrorShape::Anthropic
        } else if path.starts_with("/api/") {
            ErrorShape::Ollama
        } else {
            ErrorShape::OpenAi
        }
    }
}

/// A request the server refuses or could not serve.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// Malformed input: wrong types, bad values, missing fields (400).
    #[error("{message}")]
    InvalidRequest {
        message: String,
        /// The offending parameter, as a path such as `messages[0].role`.
        param: Option<String>,
    },
    /// The body is not JSON at all (400).
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(String),
    /// A parameter Kiln does not know or does not support (400).
    #[error("{message}")]
    UnsupportedParam { message: String, param: String },
    /// The prompt (and `max_tokens`) do not fit the model's context (400).
    #[error("{message}")]
    ContextLengthExceeded {
        message: String,
        param: Option<String>,
    },
    /// The request names a model this server does not serve (404), and
    /// what it does serve.
    #[error("the model `{name}` does not exist; available: {}", available.join(", "))]
    ModelNotFound {
        name: String,
        available: Vec<String>,
    },
    /// No route for this path (404).
    #[error("no route for {0}")]
    NotFound(String),
    /// The route exists but not for this method (405).
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The body is larger than the configured limit (413).
    #[error("the request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The `Host` header names a host this server does not answer for
    /// (403): the defence against DNS rebinding.
    #[error("{0}")]
    HostNotAllowed(String),
    /// A body that is not JSON (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The client took too long to send its request (408).
    #[error("{0}")]
    RequestTimeout(String),
    /// The request target is longer than the limit (414).
    #[error("the request URI is longer than the limit of {limit} bytes")]
    UriTooLong { limit: usize },
    /// The request's headers are larger than the limit (431).
    #[error("the request headers are larger than the limit of {limit} bytes")]
    HeadersTooLarge { limit: usize },
    /// Missing or wrong `Authorization: Bearer` key (401).
    #[error(
        "missing or incorrect API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
    )]
    Unauthorized,
    /// The engine's waiting queue is full; retry later (429 with `Retry-After`).
    #[error("the server is busy: {0}")]
    Busy(String),
    /// The engine has stopped or the server is shutting down (503).
    #[error("{0}")]
    Unavailable(String),
    /// A failure that is not the client's fault (500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// A 400 for a parameter Kiln does not support.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::UnsupportedParam {
            message: message.into(),
            param: param.into(),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. }
            | ApiError::InvalidJson(_)
            | ApiError::UnsupportedParam { .. }
            | ApiError::ContextLengthExceeded { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound { .. } | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::HostNotAllowed(_) => StatusCode::FORBIDDEN,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UriTooLong { .. } => StatusCode::URI_TOO_LONG,
            ApiError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `type`, `param` and `code` fields.
    fn kind(&self) -> (&'static str, Option<&str>, Option<&'static str>) {
        match self {
            ApiError::InvalidRequest { param, .. } => {
                ("invalid_request_error", param.as_deref(), None)
            }
            ApiError::InvalidJson(_) => ("invalid_request_error", None, Some("invalid_json")),
            ApiError::UnsupportedParam { param, .. } => (
                "invalid_request_error",
                Some(param.as_str()),
                Some("unsupported_parameter"),
            ),
            ApiError::ContextLengthExceeded { param, .. } => (
                "invalid_request_error",
                param.as_deref(),
                Some("context_length_exceeded"),
            ),
            ApiError::ModelNotFound { .. } => (
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
            ApiError::NotFound(_) => ("invalid_request_error", None, Some("not_found")),
            ApiError::MethodNotAllowed => {
                ("invalid_request_error", None, Some("method_not_allowed"))
            }
            ApiError::BodyTooLarge { .. } => {
                ("invalid_request_error", None, Some("request_too_large"))
            }
            ApiError::HostNotAllowed(_) => ("permission_error", None, Some("host_not_allowed")),
            ApiError::UnsupportedMediaType(_) => (
                "invalid_request_error",
                None,
                Some("unsupported_media_type"),
            ),
            ApiError::RequestTimeout(_) => ("invalid_request_error", None, Some("request_timeout")),
            ApiError::UriTooLong { .. } => ("invalid_request_error", None, Some("uri_too_long")),
            ApiError::HeadersTooLarge { .. } => {
                ("invalid_request_error", None, Some("headers_too_large"))
            }
            ApiError::Unauthorized => ("authentication_error", None, Some("invalid_api_key")),
            ApiError::Busy(_) => ("rate_limit_error", None, Some("rate_limit_exceeded")),
            ApiError::Unavailable(_) => ("server_error", None, Some("service_unavailable")),
            ApiError::Internal(_) => ("server_error", None, None),
        }
    }

    /// Anthropic's error `type` for this error's status.
    fn anthropic_kind(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "authentication_error",
            ApiError::HostNotAllowed(_) => "permission_error",
            ApiError::UriTooLong { .. } | ApiError::HeadersTooLarge { .. } => "request_too_large",
            ApiError::ModelNotFound { .. } | ApiError::NotFound(_) => "not_found_error",
            ApiError::Busy(_) => "rate_limit_error",
            ApiError::Unavailable(_) => "overloaded_error",
            ApiError::Internal(_) => "api_error",
            ApiError::InvalidRequest { .. }
            | ApiError::InvalidJson(_)
            | ApiError::UnsupportedParam { .. }
            | ApiError::ContextLengthExceeded { .. }
            | ApiError::MethodNotAllowed
            | ApiError::UnsupportedMediaType(_)
            | ApiError::RequestTimeout(_) => "invalid_request_error",
            ApiError::BodyTooLarge { .. } => "request_too_large",
        }
    }

    /// The JSON error body in `shape`, also sent as an SSE event when a
    /// stream fails.
    pub fn body_in(&self, shape: ErrorShape) -> serde_json::Value {
        match shape {
            ErrorShape::OpenAi => self.body(),
            ErrorShape::Anthropic => json!({"type": "error", "error": {
                "type": self.anthropic_kind(),
                "message": self.to_string(),
            }}),
            ErrorShape::Ollama => json!({"error": self.to_string()}),
        }
    }

    /// The response in `shape`: status, body, and `Retry-After` or
    /// `WWW-Authenticate` where they apply.
    pub fn response_in(self, shape: ErrorShape) -> Response {
        let mut response = (self.status(), Json(self.body_in(shape))).into_response();
        if matches!(self, ApiError::Busy(_)) {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        if matches!(self, ApiError::Unauthorized) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }

    /// The OpenAI JSON error body.
    pub fn body(&self) -> serde_json::Value {
        let (kind, param, code) = self.kind();
        json!({"error": {
            "message": self.to_string(),
            "type": kind,
            "param": param,
            "code": code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.response_in(ErrorShape::OpenAi)
    }
}

/// An error answered in Anthropic's shape (the `/v1/messages` routes).
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl<E: Into<ApiError>> From<E> for AnthropicError {
    fn from(e: E) -> Self {
        AnthropicError(e.into())
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        self.0.response_in(ErrorShape::Anthropic)
    }
}

impl From<SamplingError> for ApiError {
    fn from(e: SamplingError) -> Self {
        let param = match &e {
            SamplingError::OutOfRange { param, .. }
            | SamplingError::GuardTooSmall { param, .. } => *param,
            SamplingError::LogitBiasTokenOutOfVocab { .. }
            | SamplingError::LogitBiasValueOutOfRange { .. }
            | SamplingError::DuplicateLogitBias { .. } => "logit_bias",
            SamplingError::TooManyLogprobs { .. } => "logprobs",
            SamplingError::ZeroMaxTokens => "max_tokens",
            SamplingError::EmptyStopString { .. } => "stop",
            SamplingError::StopTokenOutOfVocab { .. } => "stop_token_ids",
            // The rest come from sampling itself, not from validation.
            _ => return ApiError::Internal(e.to_string()),
        };
        ApiError::invalid(param, e.to_string())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Sampling(s) => s.into(),
            // Template errors (`raise_exception`) and tokenizer errors come
            // from the messages and the prompt the client sent.
            EngineError::Text(t) => ApiError::InvalidRequest {
                message: t.to_string(),
                param: None,
            },
            e @ EngineError::PromptTooLong { .. } => ApiError::ContextLengthExceeded {
                message: e.to_string(),
                param: None,
            },
            e @ (EngineError::EmptyPrompt | EngineError::NoChatTemplate) => {
                ApiError::InvalidRequest {
                    message: e.to_string(),
                    param: None,
                }
            }
            EngineError::InvalidRequest(message) => ApiError::InvalidRequest {
                message,
                param: None,
            },
            EngineError::Busy(message) => ApiError::Busy(message),
            EngineError::Refused(s) => s.into(),
            // The output format does not compile: the client's schema,
            // regex or grammar.
            EngineError::Structured(s) => ApiError::InvalidRequest {
                message: s.to_string(),
                param: Some("response_format".into()),
            },
            EngineError::EngineStopped | EngineError::Restarting => {
                ApiError::Unavailable(e.to_string())
            }
            e => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<kiln_text::TextError> for ApiError {
    fn from(e: kiln_text::TextError) -> Self {
        EngineError::Text(e).into()
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Busy { .. } => ApiError::Busy(e.to_string()),
            SubmitError::TooLong { .. } => ApiError::ContextLengthExceeded {
                message: e.to_string(),
                param: Some("max_tokens".into()),
            },
            SubmitError::ExceedsPool { .. } | SubmitError::ZeroMaxTokens => {
                ApiError::invalid("max_tokens", e.to_string())
            }
            SubmitError::EmptyPrompt => ApiError::InvalidRequest {
                message: e.to_string(),
                param: None,
            },
            e => ApiError::Internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_is_429_with_retry_after() {
        let e: ApiError = SubmitError::Busy {
            waiting: 3,
            max_waiting: 3,
        }
        .into();
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }

    #[test]
    fn sampling_errors_name_their_parameter() {
        let e: ApiError = SamplingError::OutOfRange {
            param: "top_p",
            value: 2.0,
            range: "(0, 1]",
        }
        .into();
        let body = e.body();
        assert_eq!(body["error"]["param"], "top_p");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn anthropic_shape_has_the_same_status() {
        let e = AnthropicError(ApiError::Unauthorized).into_response();
        assert_eq!(e.status(), StatusCode::UNAUTHORIZED);
        let body = ApiError::Busy("full".into()).body_in(ErrorShape::Anthropic);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert!(body["error"]["message"].as_str().is_some());
    }

    #[test]
    fn too_long_keeps_the_numbers() {
        let e: ApiError = SubmitError::TooLong {
            prompt_tokens: 100,
            max_tokens: 50,
            max_model_len: 120,
        }
        .into();
        let msg = e.to_string();
        assert!(msg.contains("100") && msg.contains("120"), "{msg}");
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
    }
}
