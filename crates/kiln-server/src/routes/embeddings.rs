//! `POST /v1/embeddings`: every input tokenized on a blocking thread (with
//! the model's task prompt, cut at its limit only when asked), embedded by
//! the engine between steps, cut to `dimensions` and renormalized where
//! the model allows it, and sent as floats or base64.

use axum::extract::State;
use axum::Json;
use kiln_engine::EmbedInput;

use crate::errors::ApiError;
use crate::json_body::{reject_unknown, ApiJson};
use crate::openai_types::embeddings::{
    EmbeddingData, EmbeddingInput, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage,
    EmbeddingVector,
};
use crate::state::AppState;

/// The most inputs one request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

enum Inputs {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

fn inputs(value: serde_json::Value) -> Result<Inputs, ApiError> {
    let parsed: EmbeddingInput = serde_json::from_value(value).map_err(|_| {
        ApiError::invalid(
            "input",
            "`input` must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    })?;
    let inputs = match parsed {
        EmbeddingInput::Text(t) => Inputs::Texts(vec![t]),
        EmbeddingInput::Texts(t) => Inputs::Texts(t),
        EmbeddingInput::Ids(ids) => Inputs::Ids(vec![ids]),
        EmbeddingInput::IdLists(lists) => Inputs::Ids(lists),
    };
    let n = match &inputs {
        Inputs::Texts(t) => t.len(),
        Inputs::Ids(i) => i.len(),
    };
    if n == 0 {
        return Err(ApiError::invalid("input", "`input` is an empty list"));
    }
    if n > MAX_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!("`input` has {n} entries, more than the limit of {MAX_INPUTS}"),
        ));
    }
    Ok(inputs)
}

pub async fn handle(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<EmbeddingRequest>,
) -> Result<Json<EmbeddingResponse>, ApiError> {
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` is {other:?}; it must be \"float\" or \"base64\""),
            ))
        }
    };
    let inputs = inputs(req.input)?;
    let head = state.engine.embedding_head()?;
    let dimensions = match req.dimensions {
        None => None,
        Some(d) => Some(state.check_dimensions(&head, d)?),
    };
    let truncate = req.truncate.unwrap_or(false);
    let prompt_name = req.prompt_name;
    let engine = state.engine.clone();
    let vectors =
        tokio::task::spawn_blocking(move || -> Result<(Vec<Vec<f32>>, usize), ApiError> {
            let tokenized: Vec<EmbedInput> = match inputs {
                Inputs::Texts(texts) => texts
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        engine
                            .embed_input(t, prompt_name.as_deref(), truncate)
                            .map_err(|e| with_index(e.into(), i))
                    })
                    .collect::<Result<_, _>>()?,
                Inputs::Ids(lists) => lists
                    .iter()
                    .enumerate()
                    .map(|(i, ids)| {
                        engine
                            .embed_ids(ids, truncate)
                            .map_err(|e| with_index(e.into(), i))
                    })
                    .collect::<Result<_, _>>()?,
            };
            let tokens = tokenized.iter().map(|t| t.ids.len()).sum();
            Ok((engine.embed(tokenized)?, tokens))
        })
        .await
        .map_err(|e| ApiError::Internal(format!("embedding task: {e}")))?;
    let (vectors, tokens) = vectors?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, mut v)| {
            if let Some(d) = dimensions {
                v.truncate(d);
                if head.normalize {
                    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
                    v.iter_mut().for_each(|x| *x /= norm);
                }
            }
            EmbeddingData {
                object: "embedding",
                index,
                embedding: if base64 {
                    EmbeddingVector::Base64(base64_f32(&v))
                } else {
                    EmbeddingVector::Float(v)
                },
            }
        })
        .collect();
    Ok(Json(EmbeddingResponse {
        object: "list",
        data,
        model: state.model_name.to_string(),
        usage: EmbeddingUsage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    }))
}

/// An input's error, naming the input.
fn with_index(e: ApiError, i: usize) -> ApiError {
    match e {
        ApiError::InvalidRequest { message, .. } => ApiError::InvalidRequest {
            message: format!("input[{i}]: {message}"),
            param: Some(format!("input[{i}]")),
        },
        other => other,
    }
}

/// Little-endian f32 bytes in standard base64 (what OpenAI's SDKs decode).
pub fn base64_f32(v: &[f32]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for (k, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            out.push(if k <= c.len() {
                ABC[(n >> shift & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_standard_alphabet_with_padding() {
        // 1.0f32 = 00 00 80 3f; -2.0 = 00 00 00 c0.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, -2.0]), "AACAPwAAAMA=");
        assert_eq!(base64_f32(&[1.0, -2.0, 0.5]), "AACAPwAAAMAAAAA/");
        assert_eq!(base64_f32(&[]), "");
    }
}
