//! Errors of the registry: the database, the files it reads, and queries
//! that match no model or more than one.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("registry database {path}: {source}")]
    Db {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Format(#[from] kiln_formats::FormatError),
    #[error("{path}: {what}")]
    Invalid { path: PathBuf, what: String },
    #[error("no model matches {query:?}; `kiln get ORG/NAME` downloads one, `kiln scan [PATH]` registers what is on disk, `kiln ls` lists what is known")]
    NoMatch { query: String },
    #[error("{query:?} matches {} models: {}; use a longer query or a path", candidates.len(), candidates.join(", "))]
    Ambiguous {
        query: String,
        candidates: Vec<String>,
    },
}

pub type Result<T, E = RegistryError> = std::result::Result<T, E>;
