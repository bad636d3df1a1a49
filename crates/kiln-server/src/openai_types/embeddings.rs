//! `POST /v1/embeddings` (OpenAI's shape; `truncate` and `prompt_name` as
//! Text Embeddings Inference spells them).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `input`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: Value,
    /// `float` (default) or `base64` (little-endian f32 bytes).
    pub encoding_format: Option<String>,
    /// Shorter vectors, for models trained to give them (Matryoshka).
    pub dimensions: Option<usize>,
    /// OpenAI's end-user id: accepted, not used.
    #[allow(dead_code)]
    pub user: Option<String>,
    /// Cut inputs past the model's limit instead of refusing them.
    pub truncate: Option<bool>,
    /// The model's task prompt to put before each text (`query`, ...).
    pub prompt_name: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Serialize)]
pub struct EmbeddingData {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingVector,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingResponse {
    pub object: &'static str,
    pub data: Vec<EmbeddingData>,
    pub model: String,
    pub usage: EmbeddingUsage,
}
