//! The model info answer (`/api/models/{repo}/revision/{rev}?blobs=true`),
//! parsed into native types. Its JSON shape is known here and nowhere else.

use serde::Deserialize;

use crate::repo::{is_commit_hash, is_lower_hex, is_safe_repo_path};
use crate::HubError;

/// One revision of a repository: its commit and its files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoInfo {
    /// The commit hash the revision resolved to.
    pub commit: String,
    pub files: Vec<RepoFile>,
}

/// A file of a revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// Its path in the repository (`/`-separated, checked to stay inside it).
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its blob name in the cache and how to verify it.
    pub etag: Etag,
}

/// A blob's identity, which is also its file name under `blobs/`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Etag {
    /// An LFS file: the sha256 of its bytes.
    Sha256(String),
    /// A file kept in git: its git blob sha1, `sha1("blob {size}\0" + bytes)`.
    GitSha1(String),
}

impl Etag {
    /// The hex digest, which is the blob's file name.
    pub fn hex(&self) -> &str {
        match self {
            Etag::Sha256(h) | Etag::GitSha1(h) => h,
        }
    }

    /// The name of the check, for messages.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Etag::Sha256(_) => "sha256",
            Etag::GitSha1(_) => "git blob sha1",
        }
    }
}

#[derive(Deserialize)]
struct WireInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<WireSibling>,
}

#[derive(Deserialize)]
struct WireSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<WireLfs>,
}

#[derive(Deserialize)]
struct WireLfs {
    sha256: String,
    size: u64,
}

/// Parse and check a model info answer from `url`.
pub(crate) fn parse_model_info(text: &str, url: &str) -> Result<RepoInfo, HubError> {
    let bad = |reason: String| HubError::BadResponse {
        url: url.to_string(),
        reason,
    };
    let wire: WireInfo = serde_json::from_str(text)
        .map_err(|e| bad(format!("model info is not valid JSON: {e}")))?;
    let commit = wire
        .sha
        .filter(|s| is_commit_hash(s))
        .ok_or_else(|| bad("model info has no 40-digit commit `sha`".into()))?;
    let mut files = Vec::with_capacity(wire.siblings.len());
    for s in wire.siblings {
        if !is_safe_repo_path(&s.rfilename) {
            return Err(bad(format!("unsafe file name {:?}", s.rfilename)));
        }
        let (size, etag) = match (s.lfs, s.blob_id, s.size) {
            (Some(lfs), _, _) if lfs.sha256.len() == 64 && is_lower_hex(&lfs.sha256) => {
                (lfs.size, Etag::Sha256(lfs.sha256))
            }
            (Some(lfs), _, _) => {
                return Err(bad(format!(
                    "{}: bad lfs sha256 {:?}",
                    s.rfilename, lfs.sha256
                )))
            }
            (None, Some(id), Some(size)) if id.len() == 40 && is_lower_hex(&id) => {
                (size, Etag::GitSha1(id))
            }
            _ => {
                return Err(bad(format!(
                    "{} has no blobId and size (was ?blobs=true honoured?)",
                    s.rfilename
                )))
            }
        };
        files.push(RepoFile {
            path: s.rfilename,
            size,
            etag,
        });
    }
    Ok(RepoInfo { commit, files })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn parses_lfs_and_git_files() {
        let text = format!(
            r#"{{"id":"o/m","sha":"{SHA}","siblings":[
              {{"rfilename":"config.json","size":12,"blobId":"{b}"}},
              {{"rfilename":"m.safetensors","size":99,"blobId":"{b}","lfs":{{"sha256":"{h}","size":99,"pointerSize":130}}}}]}}"#,
            b = "a".repeat(40),
            h = "b".repeat(64)
        );
        let info = parse_model_info(&text, "u").unwrap();
        assert_eq!(info.commit, SHA);
        assert_eq!(info.files[0].etag, Etag::GitSha1("a".repeat(40)));
        assert_eq!(info.files[1].etag, Etag::Sha256("b".repeat(64)));
        assert_eq!(info.files[1].size, 99);
    }

    #[test]
    fn refuses_what_could_escape_or_cannot_be_checked() {
        let sib = |s: &str| format!(r#"{{"sha":"{SHA}","siblings":[{s}]}}"#);
        for text in [
            sib(
                r#"{"rfilename":"../x","size":1,"blobId":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}"#,
            ),
            sib(r#"{"rfilename":"x"}"#),
            sib(
                r#"{"rfilename":"x","size":1,"blobId":"../../../../../../../../../../etc/passwd"}"#,
            ),
            sib(r#"{"rfilename":"x","lfs":{"sha256":"nothex","size":1}}"#),
            r#"{"sha":"main","siblings":[]}"#.to_string(),
            "not json".to_string(),
        ] {
            let e = parse_model_info(&text, "u").expect_err(&text);
            assert!(e.to_string().starts_with("unexpected answer from u"), "{e}");
        }
    }
}
