//! Errors of the weight-format layer. Every variant names the file it came from.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated or corrupt at byte {offset}: {what}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("{path}: tensor {tensor}: unsupported dtype {dtype}")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("{path}: missing tensor {tensor}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{index}: shard {shard} (listed for tensor {tensor}) cannot be read: {source}")]
    MissingShard {
        index: PathBuf,
        shard: PathBuf,
        tensor: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: tensor {tensor}: shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("{path}: metadata key {key}: {what}")]
    Metadata {
        path: PathBuf,
        key: String,
        what: String,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: unknown architecture {arch:?} (supported: {supported})")]
    UnknownArchitecture {
        path: PathBuf,
        arch: String,
        supported: String,
    },
    #[error("{path}: {what}")]
    Invalid { path: PathBuf, what: String },
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }
}
