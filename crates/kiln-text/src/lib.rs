//! Text: tokenizers, chat templates and incremental detokenization.
//!
//! This crate turns text into token ids and back, and conversations into prompts. It
//! matches Hugging Face transformers byte for byte: ids, decoded text and rendered chat
//! templates are checked against goldens that transformers produced from real GGUF
//! files. It must not depend on tensors, devices, models or the server; it knows no
//! HTTP and no OpenAI types (messages arrive as JSON values).
//!
//! Main types:
//! * [`Tokenizer`]: a `tokenizers` tokenizer plus the model's special ids, stop ids,
//!   BOS policy and chat templates; built from a Hugging Face directory
//!   ([`Tokenizer::from_hf_dir`]) or from GGUF metadata ([`Tokenizer::from_gguf`]), and
//!   saved as a Hugging Face directory ([`Tokenizer::save_hf`]).
//! * [`ChatTemplate`] and [`ChatContext`]: Hugging Face chat templates rendered on
//!   minijinja the way transformers renders them on Jinja2.
//! * [`IncrementalDetokenizer`]: streaming text for generated ids, never splitting a
//!   UTF-8 character.
//! * [`TextError`]: the one error type; file and key errors name the file and key.

pub mod detokenizer;
pub mod error;
mod gguf_tokenizer;
mod gguf_tokenizer_write;
mod hf_dir;
mod merges;
mod pyjson;
pub mod template;
pub mod tokenizer;

pub use detokenizer::IncrementalDetokenizer;
pub use error::{Result, TextError};
pub use template::{ChatContext, ChatTemplate};
pub use tokenizer::{ChatTemplates, Tokenizer};
