//! The request guard, in front of every route (also while the model
//! loads): the `Host` header must name a host the server answers for (on
//! loopback, only loopback names, so a web page cannot reach the server
//! through DNS rebinding), a POST with a body must say it is JSON (so a
//! page cannot post a `text/plain` "simple request" without CORS), the
//! target and headers stay under their limits, and the body must arrive
//! within `body_read_timeout`, under the size limit and within the
//! request bounds (`limits.rs`). Each refusal is in the error shape of the
//! route's API.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::errors::{ApiError, ErrorShape};
use crate::server::ServerConfig;

/// Longest request target, in bytes (hyper's own limit is far above).
pub(crate) const MAX_URI_BYTES: usize = 8 << 10;
/// Largest sum of header names and values, in bytes.
pub(crate) const MAX_HEADER_BYTES: usize = 64 << 10;
/// Most headers in a request (hyper is set to parse more, so this answer,
/// with its JSON body, comes first).
pub(crate) const MAX_HEADERS: usize = 100;

/// What the guard checks, from the server's configuration.
#[derive(Debug)]
pub(crate) struct Guard {
    /// Host names accepted in `Host` (lowercase, without port); `None`:
    /// any.
    allowed_hosts: Option<Vec<String>>,
    body_read_timeout: Duration,
    max_body_bytes: usize,
}

impl Guard {
    pub(crate) fn new(config: &ServerConfig) -> Arc<Self> {
        Arc::new(Guard {
            allowed_hosts: allowed_hosts(&config.host, &config.allowed_hosts),
            body_read_timeout: config.body_read_timeout,
            max_body_bytes: config.max_body_bytes,
        })
    }

    fn check_head(&self, req: &Request) -> Result<(), ApiError> {
        if req.uri().to_string().len() > MAX_URI_BYTES {
            return Err(ApiError::UriTooLong {
                limit: MAX_URI_BYTES,
            });
        }
        let header_bytes: usize = req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum();
        if header_bytes > MAX_HEADER_BYTES || req.headers().len() > MAX_HEADERS {
            return Err(ApiError::HeadersTooLarge {
                limit: MAX_HEADER_BYTES,
            });
        }
        if let Some(allowed) = &self.allowed_hosts {
            let given = req
                .headers()
                .get(header::HOST)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .or_else(|| req.uri().authority().map(|a| a.to_string()));
            // A request without a host cannot come from a browser.
            if let Some(given) = given {
                let name = host_name(&given);
                if !is_loopback_name(&name) && !allowed.contains(&name) {
                    return Err(ApiError::HostNotAllowed(format!(
                        "the Host `{given}` is not allowed: this server answers for \
                         loopback names only; start it with `--allowed-hosts {name}` \
                         (or `*` for any) to accept it"
                    )));
                }
            }
        }
        if req.method() == Method::POST && has_body(req.headers()) && !is_json(req.headers()) {
            let given = req
                .headers()
                .get(header::CONTENT_TYPE)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            let said = match given {
                Some(t) => format!("`{t}`"),
                None => "no Content-Type".into(),
            };
            return Err(ApiError::UnsupportedMediaType(format!(
                "the request body must be JSON with `Content-Type: application/json`, got {said}"
            )));
        }
        Ok(())
    }

    /// Reads the whole body within the time and size limits.
    async fn read_body(&self, body: Body) -> Result<Body, ApiError> {
        let limited = Limited::new(body, self.max_body_bytes);
        match tokio::time::timeout(self.body_read_timeout, limited.collect()).await {
            Err(_) => Err(ApiError::RequestTimeout(format!(
                "the request body did not arrive within {} s",
                self.body_read_timeout.as_secs_f64()
            ))),
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                Err(ApiError::BodyTooLarge {
                    limit: self.max_body_bytes,
                })
            }
            Ok(Err(e)) => Err(ApiError::InvalidRequest {
                message: format!("cannot read the request body: {e}"),
                param: None,
            }),
            Ok(Ok(collected)) => {
                let bytes = collected.to_bytes();
                // A body that is not a JSON object is the route's error.
                if let Ok(value @ serde_json::Value::Object(_)) = serde_json::from_slice(&bytes) {
                    crate::limits::check(&value)?;
                }
                Ok(Body::from(bytes))
            }
        }
    }
}

/// The middleware: refuses what the guard does not let through, else
/// passes the request on with its body read.
pub(crate) async fn check(State(guard): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    let shape = ErrorShape::for_path(req.uri().path());
    if let Err(e) = guard.check_head(&req) {
        return e.response_in(shape);
    }
    let (parts, body) = req.into_parts();
    match guard.read_body(body).await {
        Ok(body) => next.run(Request::from_parts(parts, body)).await,
        Err(e) => e.response_in(shape),
    }
}

/// The names accepted besides loopback ones: `None` (any) when `allowed`
/// has `*`, or when it is empty and the server binds a non-loopback
/// address (it is meant to be reached from elsewhere).
fn allowed_hosts(bind: &str, allowed: &[String]) -> Option<Vec<String>> {
    if allowed.iter().any(|h| h.trim() == "*") {
        return None;
    }
    if allowed.is_empty() && !is_loopback_name(&host_name(bind)) {
        return None;
    }
    Some(allowed.iter().map(|h| host_name(h.trim())).collect())
}

/// The host of a `Host` value or an address, lowercase, without port or
/// trailing dot; IPv6 addresses keep their brackets.
fn host_name(host: &str) -> String {
    let host = host.trim().to_ascii_lowercase();
    let name = if host.starts_with('[') {
        match host.find(']') {
            Some(end) => host[..=end].to_string(),
            None => host,
        }
    } else if host.matches(':').count() > 1 {
        // A bare IPv6 address (as given to `--host`).
        format!("[{host}]")
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name.to_string(),
            _ => host,
        }
    };
    name.trim_end_matches('.').to_string()
}

/// `localhost`, `127.0.0.0/8` and `[::1]`.
fn is_loopback_name(name: &str) -> bool {
    if name == "localhost" || name == "[::1]" {
        return true;
    }
    match name.parse::<Ipv4Addr>() {
        Ok(ip) => IpAddr::V4(ip).is_loopback(),
        Err(_) => false,
    }
}

fn has_body(headers: &HeaderMap) -> bool {
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match length {
        Some(n) => n > 0,
        None => headers.contains_key(header::TRANSFER_ENCODING),
    }
}

/// `application/json` or a `+json` type, with any parameters.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|t| t.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_lose_their_port() {
        assert_eq!(host_name("localhost:8080"), "localhost");
        assert_eq!(host_name("LOCALHOST."), "localhost");
        assert_eq!(host_name("[::1]:80"), "[::1]");
        assert_eq!(host_name("::1"), "[::1]");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        assert!(is_loopback_name(&host_name("127.0.0.2:1")));
        assert!(!is_loopback_name(&host_name("evil.example:8080")));
        assert!(!is_loopback_name(&host_name("localhost.evil.example")));
    }

    #[test]
    fn binding_elsewhere_or_a_star_allows_any_host() {
        assert_eq!(allowed_hosts("127.0.0.1", &[]), Some(vec![]));
        assert_eq!(allowed_hosts("::1", &[]), Some(vec![]));
        assert_eq!(allowed_hosts("0.0.0.0", &[]), None);
        assert_eq!(allowed_hosts("127.0.0.1", &["*".into()]), None);
        assert_eq!(
            allowed_hosts("0.0.0.0", &["Kiln.LAN:8080".into()]),
            Some(vec!["kiln.lan".into()])
        );
    }

    #[test]
    fn json_types() {
        let with = |t: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, t.parse().unwrap());
            h
        };
        assert!(is_json(&with("application/json")));
        assert!(is_json(&with("Application/JSON; charset=utf-8")));
        assert!(is_json(&with("application/vnd.api+json")));
        assert!(!is_json(&with("text/plain")));
        assert!(!is_json(&with("application/x-www-form-urlencoded")));
        assert!(!is_json(&HeaderMap::new()));
    }
}
