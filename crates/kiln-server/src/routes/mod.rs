//! The HTTP handlers, one file per API surface.

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod lora;
pub mod messages;
pub mod ollama;
pub mod ops;
pub mod responses;
pub mod tokenize;
