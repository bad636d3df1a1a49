//! Every way a download can fail, each with what the user should do about it.

use std::path::PathBuf;

/// What a hub request or a cache write failed on.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The repository argument is not `ORG/NAME[@REVISION]`.
    #[error(
        "{input:?} is not a model repository: {reason} (expected ORG/NAME or ORG/NAME@REVISION)"
    )]
    InvalidRepoId { input: String, reason: String },

    /// 401/403: private, gated, or a token the hub refuses.
    #[error(
        "access to {repo} was refused by {endpoint} (HTTP {status}{detail}): the repository is gated or private. \
         {hint}"
    )]
    Unauthorized {
        repo: String,
        endpoint: String,
        status: u16,
        detail: String,
        hint: String,
    },

    /// 404 for the repository or the revision.
    #[error("{what} not found on {endpoint} (HTTP {status}){hint}")]
    NotFound {
        what: String,
        endpoint: String,
        status: u16,
        hint: String,
    },

    /// Any other unexpected HTTP status.
    #[error("{url} answered HTTP {status}{detail}")]
    Http {
        url: String,
        status: u16,
        detail: String,
    },

    /// The hub could not be reached or the connection failed before any answer.
    #[error(
        "could not reach {endpoint} for {url}: {message} (check the network, or set HF_ENDPOINT)"
    )]
    Network {
        endpoint: String,
        url: String,
        message: String,
    },

    /// A download stopped part-way; what arrived is kept and resumed next time.
    #[error(
        "download of {file} stopped at {received} of {size} bytes ({message}); \
         the partial file is kept, run the command again to resume"
    )]
    Interrupted {
        file: String,
        received: u64,
        size: u64,
        message: String,
    },

    /// The bytes did not hash to what the hub promised.
    #[error(
        "{file}: {algorithm} mismatch, expected {expected} but the downloaded bytes give {actual}; \
         the partial download was deleted"
    )]
    Integrity {
        file: String,
        algorithm: &'static str,
        expected: String,
        actual: String,
    },

    /// The server said something that does not follow the hub protocol.
    #[error("unexpected answer from {url}: {reason}")]
    BadResponse { url: String, reason: String },

    /// Not enough free space on the cache's filesystem.
    #[error(
        "not enough disk space in {dir}: {required} needed ({missing} still to download + {reserve} reserve), \
         {available} available"
    )]
    DiskSpace {
        dir: PathBuf,
        required: ByteSize,
        missing: ByteSize,
        reserve: ByteSize,
        available: ByteSize,
    },

    /// The include/exclude patterns leave nothing to download.
    #[error("no file of {repo} at {commit} matches the include/exclude patterns ({num_files} files in the repository)")]
    NoFilesMatch {
        repo: String,
        commit: String,
        num_files: usize,
    },

    /// An include or exclude pattern does not parse.
    #[error("bad pattern {pattern:?}: {reason}")]
    BadPattern { pattern: String, reason: String },

    /// A file-system operation on the cache failed.
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl HubError {
    pub(crate) fn io(action: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        HubError::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A byte count that prints in human units (`1.5 GB`), with the exact count for small numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0 as f64;
        if self.0 < 1000 {
            write!(f, "{} B", self.0)
        } else if b < 1e6 {
            write!(f, "{:.1} kB", b / 1e3)
        } else if b < 1e9 {
            write!(f, "{:.1} MB", b / 1e6)
        } else {
            write!(f, "{:.2} GB", b / 1e9)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ByteSize;

    #[test]
    fn byte_sizes_print_in_human_units() {
        assert_eq!(ByteSize(999).to_string(), "999 B");
        assert_eq!(ByteSize(1500).to_string(), "1.5 kB");
        assert_eq!(ByteSize(2_500_000).to_string(), "2.5 MB");
        assert_eq!(ByteSize(16_060_000_000).to_string(), "16.06 GB");
    }
}
