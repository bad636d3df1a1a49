//! The one error type of this crate.
//!
//! Every variant that comes from a file names the file, and every variant that comes
//! from a metadata or configuration entry names the key, so that a caller can report
//! the problem without parsing messages.

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or
/// rendering a chat template.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TextError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A configuration entry (a `tokenizer_config.json` key) has an unusable value.
    #[error("{path}: key {key}: {what}")]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong with it.
        what: String,
    },
    /// A GGUF metadata entry could not be read (wrong type, for example).
    #[error(transparent)]
    Gguf(#[from] kiln_formats::FormatError),
    /// The GGUF tokenizer metadata is missing something or describes a tokenizer this
    /// crate cannot build.
    #[error("{path}: metadata key {key}: {what}")]
    GgufTokenizer {
        /// The GGUF file.
        path: PathBuf,
        /// The metadata key.
        key: String,
        /// What is wrong with it.
        what: String,
    },
    /// The tokenizer has no GGUF form (a vocabulary kind or split GGUF cannot name).
    #[error("cannot write the tokenizer to GGUF: {0}")]
    GgufWrite(String),
    /// The `tokenizers` library rejected a tokenizer file or the parts built from metadata.
    #[error("{path}: cannot build tokenizer: {message}")]
    Build {
        /// The file the tokenizer came from (`tokenizer.json` or the GGUF file).
        path: PathBuf,
        /// The library's message.
        message: String,
    },
    /// Encoding text failed inside the `tokenizers` library.
    #[error("encode failed: {message}")]
    Encode {
        /// The library's message.
        message: String,
    },
    /// Decoding ids failed inside the `tokenizers` library.
    #[error("decode failed: {message}")]
    Decode {
        /// The library's message.
        message: String,
    },
    /// A chat template has a syntax error.
    #[error("chat template {name:?}: {source}")]
    TemplateSyntax {
        /// The template's name (`default` or the named template).
        name: String,
        /// The parse error, with its line.
        #[source]
        source: minijinja::Error,
    },
    /// The template called `raise_exception(message)`.
    #[error("chat template {name:?} raised: {message}")]
    TemplateRaised {
        /// The template's name.
        name: String,
        /// The message the template passed to `raise_exception`.
        message: String,
    },
    /// Rendering a chat template failed for another reason.
    #[error("chat template {name:?}: {source}")]
    TemplateRender {
        /// The template's name.
        name: String,
        /// The render error, with its line.
        #[source]
        source: minijinja::Error,
    },
    /// The values given to a chat template are not usable (for example `messages` is
    /// not a list).
    #[error("chat template input: {what}")]
    TemplateInput {
        /// What is wrong.
        what: String,
    },
}

/// The result type of this crate.
pub type Result<T, E = TextError> = std::result::Result<T, E>;

impl TextError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TextError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn build(path: impl Into<PathBuf>, err: impl std::fmt::Display) -> Self {
        TextError::Build {
            path: path.into(),
            message: err.to_string(),
        }
    }
}
