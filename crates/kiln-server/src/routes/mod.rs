//! The HTTP handlers, one file per API surface.

pub mod chat;
pub mod completions;
pub mod ops;
pub mod tokenize;
