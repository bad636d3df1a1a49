//! Errors of the tensor layer.

#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op}: tensor belongs to another backend (expected {expected})")]
    WrongBackend {
        op: &'static str,
        expected: &'static str,
    },
    #[error("KV cache full: {needed} tokens needed, capacity {capacity}")]
    KvCacheFull { needed: usize, capacity: usize },
    #[error("{backend}: {message}")]
    Device {
        backend: &'static str,
        message: String,
    },
    /// Something the backend does not implement (an extension op, a kind
    /// of weight); raised while a model loads, never mid-request.
    #[error("the {backend} backend does not support {what}")]
    Unsupported { backend: &'static str, what: String },
    #[error("{backend}: out of memory allocating {bytes} bytes for {what}")]
    OutOfMemory {
        backend: &'static str,
        bytes: u64,
        what: String,
    },
}

pub type Result<T, E = TensorError> = std::result::Result<T, E>;
