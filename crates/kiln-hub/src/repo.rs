//! Repository ids, revisions and repository paths: parsed and checked before
//! they become URLs or cache paths, so neither the user nor the server can
//! name a file outside the cache.

use crate::HubError;

/// The branch a repository id without `@REVISION` means.
pub const DEFAULT_REVISION: &str = "main";

/// `ORG/NAME` plus the revision asked for (a branch, tag or commit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoSpec {
    /// `ORG/NAME`, as the hub spells it.
    pub repo_id: String,
    /// What the user asked for: `main` unless `@REVISION` was given.
    pub revision: String,
}

impl RepoSpec {
    /// Parse `ORG/NAME[@REVISION]`.
    pub fn parse(input: &str) -> Result<RepoSpec, HubError> {
        let bad = |reason: &str| HubError::InvalidRepoId {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let (repo_id, revision) = match input.split_once('@') {
            Some((r, rev)) => (r, rev),
            None => (input, DEFAULT_REVISION),
        };
        let (org, name) = repo_id
            .split_once('/')
            .ok_or_else(|| bad("it has no '/' between organisation and name"))?;
        check_name_part(org).map_err(|r| bad(&format!("organisation {org:?} {r}")))?;
        check_name_part(name).map_err(|r| bad(&format!("name {name:?} {r}")))?;
        check_revision(revision).map_err(|r| bad(&format!("revision {revision:?} {r}")))?;
        Ok(RepoSpec {
            repo_id: repo_id.to_string(),
            revision: revision.to_string(),
        })
    }

    /// The cache folder name: `models--ORG--NAME`.
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.repo_id.replace('/', "--"))
    }
}

/// The hub's rule for each half of a repository id.
fn check_name_part(s: &str) -> Result<(), &'static str> {
    if s.is_empty() || s.len() > 96 {
        return Err("must be 1 to 96 characters");
    }
    if !s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("may hold only letters, digits, '-', '_' and '.'");
    }
    if s.contains("--") || s.contains("..") {
        return Err("may not contain '--' or '..'");
    }
    if s.starts_with(['-', '.']) || s.ends_with(['-', '.']) {
        return Err("may not start or end with '-' or '.'");
    }
    Ok(())
}

/// A revision becomes `refs/{revision}` on disk: it may hold `/` (as in
/// `refs/pr/1`) but no empty, `.` or `..` component and nothing unprintable.
fn check_revision(s: &str) -> Result<(), &'static str> {
    if s.is_empty() || s.len() > 256 {
        return Err("must be 1 to 256 characters");
    }
    if s.chars()
        .any(|c| c.is_control() || c.is_whitespace() || c == '\\')
    {
        return Err("may not hold spaces, backslashes or control characters");
    }
    if s.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
        return Err("may not have empty, '.' or '..' path components");
    }
    Ok(())
}

/// Whether a file name from the server is a plain relative path inside the
/// repository (no absolute path, no `..`, no backslash, no empty component).
pub fn is_safe_repo_path(path: &str) -> bool {
    !path.is_empty()
        && path.len() <= 4096
        && !path.chars().any(|c| c.is_control() || c == '\\')
        && path
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != "..")
}

/// Whether `s` is a full commit hash (40 lowercase hex digits).
pub fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && is_lower_hex(s)
}

pub(crate) fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Percent-encode `s` for a URL path; `/` is kept when `keep_slash`.
pub(crate) fn percent_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let plain = b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'_' | b'.' | b'~')
            || (keep_slash && b == b'/');
        if plain {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repo_ids_and_revisions() {
        let s = RepoSpec::parse("HuggingFaceTB/SmolLM2-135M-Instruct").unwrap();
        assert_eq!(s.repo_id, "HuggingFaceTB/SmolLM2-135M-Instruct");
        assert_eq!(s.revision, "main");
        assert_eq!(
            s.folder_name(),
            "models--HuggingFaceTB--SmolLM2-135M-Instruct"
        );
        let s = RepoSpec::parse("Qwen/Qwen2.5-0.5B@refs/pr/1").unwrap();
        assert_eq!(s.revision, "refs/pr/1");
    }

    #[test]
    fn refuses_ids_that_could_escape_the_cache() {
        for bad in [
            "noslash",
            "a/b/c",
            "../x",
            "a/..",
            "a/b@",
            "a/b@../../etc",
            "a/b@x//y",
            "a/b@with space",
            "a--b/c",
            "-a/b",
            "a/b.",
            "",
        ] {
            let e = RepoSpec::parse(bad).expect_err(bad);
            assert!(e.to_string().contains("ORG/NAME"), "{bad}: {e}");
        }
    }

    #[test]
    fn checks_server_paths() {
        assert!(is_safe_repo_path("config.json"));
        assert!(is_safe_repo_path("sub/dir/model.safetensors"));
        for bad in ["", "/etc/passwd", "a/../../b", "a//b", "./a", "a\\b", "a/"] {
            assert!(!is_safe_repo_path(bad), "{bad}");
        }
    }

    #[test]
    fn percent_encodes_paths() {
        assert_eq!(percent_encode("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(percent_encode("a b/c+d.json", true), "a%20b/c%2Bd.json");
        assert!(is_commit_hash(&"a".repeat(40)));
        assert!(!is_commit_hash(&"A".repeat(40)));
        assert!(!is_commit_hash("main"));
    }
}
