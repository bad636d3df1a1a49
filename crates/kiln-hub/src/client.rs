//! The hub's HTTP protocol: model info, file resolution with redirects
//! followed by hand (the token goes only to the hub, never to the CDN it
//! redirects to), and HTTP statuses turned into errors that say what to do.

use std::time::Duration;

use ureq::http::{Response, Uri};
use ureq::Body;

use crate::info::{parse_model_info, RepoInfo};
use crate::repo::{percent_encode, RepoSpec};
use crate::HubError;

/// Where the hub is and who is asking.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// The hub's base URL, without a trailing slash (`https://huggingface.co`).
    pub endpoint: String,
    /// A user access token, sent as `Authorization: Bearer` to the endpoint only.
    pub token: Option<String>,
    /// The hub cache: the folder that holds `models--ORG--NAME`.
    pub cache_dir: std::path::PathBuf,
}

/// The endpoint every tool uses when `HF_ENDPOINT` is unset.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

const MAX_REDIRECTS: usize = 10;
/// Model info answers are small; anything larger is not one.
const MAX_INFO_BYTES: u64 = 64 << 20;

/// A blocking client for one endpoint.
pub struct HubClient {
    agent: ureq::Agent,
    endpoint: String,
    token: Option<String>,
}

impl HubClient {
    pub fn new(config: &HubConfig) -> HubClient {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(format!("kiln/{}", env!("CARGO_PKG_VERSION")))
            .accept_encoding("identity")
            .timeout_connect(Some(Duration::from_secs(15)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .build()
            .new_agent();
        HubClient {
            agent,
            endpoint: config.endpoint.trim_end_matches('/').to_string(),
            token: config.token.clone().filter(|t| !t.is_empty()),
        }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// `GET /api/models/{repo}/revision/{rev}?blobs=true`: the commit and every file with its size and hash.
    pub fn model_info(&self, spec: &RepoSpec) -> Result<RepoInfo, HubError> {
        let url = format!(
            "{}/api/models/{}/revision/{}?blobs=true",
            self.endpoint,
            spec.repo_id,
            percent_encode(&spec.revision, false)
        );
        let resp = self.get(&url, None)?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(self.status_error(&resp, &url, spec, None));
        }
        let text = resp
            .into_body()
            .into_with_config()
            .limit(MAX_INFO_BYTES)
            .read_to_string()
            .map_err(|e| self.network_error(&url, &e))?;
        parse_model_info(&text, &url)
    }

    /// The URL a file of `commit` downloads from.
    pub fn resolve_url(&self, repo_id: &str, commit: &str, path: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            repo_id,
            commit,
            percent_encode(path, true)
        )
    }

    /// GET `url` (with `Range: bytes={start}-` when given), following redirects.
    /// Returns whatever status the last hop answered.
    pub fn get(&self, url: &str, range_start: Option<u64>) -> Result<Response<Body>, HubError> {
        let mut current = url.to_string();
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&current);
            if let Some(start) = range_start {
                req = req.header("Range", format!("bytes={start}-"));
            }
            if let Some(token) = &self.token {
                if same_origin(&current, &self.endpoint) {
                    req = req.header("Authorization", format!("Bearer {token}"));
                }
            }
            let resp = req.call().map_err(|e| self.network_error(&current, &e))?;
            let status = resp.status().as_u16();
            if !matches!(status, 301 | 302 | 303 | 307 | 308) {
                return Ok(resp);
            }
            let location = header(&resp, "location").ok_or_else(|| HubError::BadResponse {
                url: current.clone(),
                reason: format!("HTTP {status} without a Location header"),
            })?;
            current = join_location(&current, &location).ok_or_else(|| HubError::BadResponse {
                url: current.clone(),
                reason: format!("cannot follow the redirect to {location:?}"),
            })?;
        }
        Err(HubError::BadResponse {
            url: url.to_string(),
            reason: format!("more than {MAX_REDIRECTS} redirects"),
        })
    }

    pub(crate) fn network_error(&self, url: &str, e: &ureq::Error) -> HubError {
        HubError::Network {
            endpoint: self.endpoint.clone(),
            url: url.to_string(),
            message: e.to_string(),
        }
    }

    /// The error for a non-success answer about `spec` (and `file`, for downloads).
    pub(crate) fn status_error(
        &self,
        resp: &Response<Body>,
        url: &str,
        spec: &RepoSpec,
        file: Option<&str>,
    ) -> HubError {
        let status = resp.status().as_u16();
        let code = header(resp, "x-error-code").unwrap_or_default();
        let message = header(resp, "x-error-message").unwrap_or_default();
        let detail = if message.is_empty() {
            String::new()
        } else {
            format!(": {message}")
        };
        let repo = spec.repo_id.clone();
        let endpoint = self.endpoint.clone();
        let token_hint = if self.token.is_some() {
            "check that HF_TOKEN belongs to an account that has been granted access"
        } else {
            "set HF_TOKEN to an access token"
        };
        match (status, code.as_str()) {
            (_, "RevisionNotFound") => HubError::NotFound {
                what: format!("revision {:?} of {repo}", spec.revision),
                endpoint,
                status,
                hint: String::new(),
            },
            (_, "EntryNotFound") => HubError::NotFound {
                what: format!("file {:?} in {repo}", file.unwrap_or("?")),
                endpoint,
                status,
                hint: String::new(),
            },
            (_, "GatedRepo") | (401 | 403, _) if code != "RepoNotFound" => HubError::Unauthorized {
                hint: format!(
                    "{token_hint} and accept the model's license at {endpoint}/{repo} (the token must \
                     belong to the account that accepted it)"
                ),
                repo,
                endpoint,
                status,
                detail,
            },
            (401 | 404, "RepoNotFound") if self.token.is_none() => HubError::NotFound {
                what: format!("repository {repo}"),
                endpoint,
                status,
                hint: "; if it is private or gated, set HF_TOKEN to an access token".to_string(),
            },
            (401 | 404, "RepoNotFound") => HubError::NotFound {
                what: format!("repository {repo}"),
                endpoint,
                status,
                hint: String::new(),
            },
            (404, _) => HubError::NotFound {
                what: match file {
                    Some(f) => format!("file {f:?} of {repo} at {}", spec.revision),
                    None => format!("repository {repo} at revision {:?}", spec.revision),
                },
                endpoint,
                status,
                hint: String::new(),
            },
            _ => HubError::Http {
                url: url.to_string(),
                status,
                detail,
            },
        }
    }
}

/// A response header as text.
pub(crate) fn header(resp: &Response<Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Whether two URLs share scheme, host and port.
fn same_origin(a: &str, b: &str) -> bool {
    match (a.parse::<Uri>(), b.parse::<Uri>()) {
        (Ok(a), Ok(b)) => {
            a.scheme() == b.scheme()
                && a.host().map(str::to_ascii_lowercase) == b.host().map(str::to_ascii_lowercase)
                && a.port_u16() == b.port_u16()
        }
        _ => false,
    }
}

/// Resolve a `Location` header against the URL that sent it.
fn join_location(base: &str, location: &str) -> Option<String> {
    if location.starts_with("http://") || location.starts_with("https://") {
        return Some(location.to_string());
    }
    let uri = base.parse::<Uri>().ok()?;
    let origin = format!("{}://{}", uri.scheme_str()?, uri.authority()?);
    if let Some(rest) = location.strip_prefix("//") {
        return Some(format!("{}://{rest}", uri.scheme_str()?));
    }
    if location.starts_with('/') {
        return Some(format!("{origin}{location}"));
    }
    let path = uri.path();
    let dir = &path[..path.rfind('/').map_or(0, |i| i + 1)];
    Some(format!("{origin}{dir}{location}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_absolute_and_relative_locations() {
        let base = "https://huggingface.co/org/m/resolve/main/a.bin";
        assert_eq!(
            join_location(base, "https://cdn.example/x?sig=1").unwrap(),
            "https://cdn.example/x?sig=1"
        );
        assert_eq!(
            join_location(base, "/api/resolve-cache/x").unwrap(),
            "https://huggingface.co/api/resolve-cache/x"
        );
        assert_eq!(
            join_location(base, "b.bin").unwrap(),
            "https://huggingface.co/org/m/resolve/main/b.bin"
        );
        assert_eq!(
            join_location("http://127.0.0.1:9/a", "//h:1/x").unwrap(),
            "http://h:1/x"
        );
    }

    #[test]
    fn the_token_stays_with_its_origin() {
        assert!(same_origin(
            "https://huggingface.co/a/b",
            "https://huggingface.co"
        ));
        assert!(same_origin(
            "http://127.0.0.1:8000/x",
            "http://127.0.0.1:8000"
        ));
        assert!(!same_origin(
            "http://127.0.0.1:8001/x",
            "http://127.0.0.1:8000"
        ));
        assert!(!same_origin(
            "https://cdn-lfs.hf.co/x",
            "https://huggingface.co"
        ));
        assert!(!same_origin(
            "http://huggingface.co/x",
            "https://huggingface.co"
        ));
    }
}
