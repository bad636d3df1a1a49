//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's
//! routes and bodies), mounted only with `kiln serve
//! --enable-lora-runtime`, behind the API key like every API route. A
//! loaded adapter is named by `model` in requests; unloading one lets the
//! requests already running with it finish.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::errors::ApiError;
use crate::json_body::{reject_unknown, ApiJson};
use crate::state::AppState;

#[derive(Debug, Deserialize)]
pub struct LoadLora {
    pub lora_name: String,
    pub lora_path: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub struct UnloadLora {
    pub lora_name: String,
    /// vLLM's numeric id: accepted, not used (adapters are named).
    #[allow(dead_code)]
    pub lora_int_id: Option<i64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

pub async fn load(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<LoadLora>,
) -> Result<Response, ApiError> {
    reject_unknown(&req.extra, "")?;
    if req.lora_name == &*state.model_name {
        return Err(ApiError::invalid(
            "lora_name",
            format!("{:?} is the served model's name", req.lora_name),
        ));
    }
    let adapters = state.engine.adapters().clone();
    let (name, path) = (
        req.lora_name.clone(),
        std::path::PathBuf::from(&req.lora_path),
    );
    tokio::task::spawn_blocking(move || adapters.add(&name, &path))
        .await
        .map_err(|e| ApiError::Internal(format!("adapter task: {e}")))??;
    Ok(format!(
        "Success: LoRA adapter '{}' added successfully.",
        req.lora_name
    )
    .into_response())
}

pub async fn unload(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<UnloadLora>,
) -> Result<Response, ApiError> {
    reject_unknown(&req.extra, "")?;
    state.engine.adapters().remove(&req.lora_name)?;
    Ok(format!(
        "Success: LoRA adapter '{}' removed successfully.",
        req.lora_name
    )
    .into_response())
}
