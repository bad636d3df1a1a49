//! Model families. Each is one file; [`crate::registry`] maps `model_type`
//! to a family's loader.

pub mod llama;
