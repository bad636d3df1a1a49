//! `POST /tokenize` (a prompt, or messages through the chat template) and
//! `POST /detokenize`.

use axum::extract::State;
use axum::Json;

use crate::errors::ApiError;
use crate::json_body::{reject_unknown, ApiJson};
use crate::messages::{template_messages, template_tools};
use crate::openai_types::tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};
use crate::state::AppState;

/// What to tokenize, checked.
enum Input {
    Prompt {
        text: String,
        add_special_tokens: bool,
    },
    Messages {
        messages: serde_json::Value,
        tools: Option<serde_json::Value>,
        add_generation_prompt: bool,
    },
}

pub async fn tokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
    let input = match (req.prompt, req.messages) {
        (Some(text), None) => Input::Prompt {
            text,
            add_special_tokens: req.add_special_tokens.unwrap_or(true),
        },
        (None, Some(messages)) => Input::Messages {
            messages: template_messages(&messages)?,
            tools: match &req.tools {
                Some(t) if !t.is_empty() => Some(template_tools(t)?),
                _ => None,
            },
            add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
        },
        _ => {
            return Err(ApiError::InvalidRequest {
                message: "send exactly one of `prompt` and `messages`".into(),
                param: None,
            })
        }
    };
    let engine = state.engine.clone();
    let tokens = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let model = engine.model();
        match input {
            Input::Prompt {
                text,
                add_special_tokens,
            } => Ok(model.tokenizer.encode(&text, add_special_tokens)?),
            Input::Messages {
                messages,
                tools,
                add_generation_prompt,
            } => {
                let mut ctx = model.tokenizer.chat_context(messages);
                ctx.tools = tools;
                ctx.add_generation_prompt = add_generation_prompt;
                let rendered = model.render_chat_with(&ctx)?;
                Ok(model.tokenizer.encode(&rendered, false)?)
            }
        }
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenizer task: {e}")))??;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        tokens,
        max_model_len: state.context_length(),
    }))
}

pub async fn detokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    reject_unknown(&req.extra, "")?;
    state.check_model(req.model.as_deref())?;
    let vocab_size = state.vocab_size();
    if let Some(i) = req.tokens.iter().position(|&t| t as usize >= vocab_size) {
        return Err(ApiError::invalid(
            format!("tokens[{i}]"),
            format!(
                "`tokens[{i}]` is {}, outside this model's vocabulary of {vocab_size}",
                req.tokens[i]
            ),
        ));
    }
    let engine = state.engine.clone();
    let prompt =
        tokio::task::spawn_blocking(move || engine.model().tokenizer.decode(&req.tokens, false))
            .await
            .map_err(|e| ApiError::Internal(format!("tokenizer task: {e}")))??;
    Ok(Json(DetokenizeResponse { prompt }))
}
