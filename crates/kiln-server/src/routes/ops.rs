//! Operations: `GET /stats` (JSON), `GET /metrics` (Prometheus text), and
//! what `/health` and `/v1/models` say of one model (the pool's routes in
//! `dispatch` answer them).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_engine::{EngineStats, EngineStatus};
use serde_json::{json, Value};

use crate::errors::ApiError;
use crate::openai_types::ModelCard;
use crate::state::AppState;

/// 200 once the model is loaded and the engine runs (before that, the
/// loading gate answers 503); 503 while the engine restarts after a
/// failure, or after it stopped.
pub(crate) fn health_of(state: &AppState) -> (StatusCode, Value) {
    let restarts = state.engine.num_restarts();
    let (code, status) = match state.engine.status() {
        EngineStatus::Running => (StatusCode::OK, "ok"),
        EngineStatus::Restarting => (StatusCode::SERVICE_UNAVAILABLE, "restarting"),
        EngineStatus::Stopped => (StatusCode::SERVICE_UNAVAILABLE, "stopped"),
    };
    (code, json!({"status": status, "restarts": restarts}))
}

/// The engine's counters, read off the async threads (the engine answers
/// between steps).
async fn engine_stats(state: &AppState) -> Result<EngineStats, ApiError> {
    let engine = state.engine.clone();
    tokio::task::spawn_blocking(move || engine.stats())
        .await
        .map_err(|e| ApiError::Internal(format!("stats task: {e}")))?
        .map_err(ApiError::from)
}

/// The `experts` object of `/stats`.
fn expert_balance(tokens: &[Vec<u64>], steps: u64) -> Value {
    if tokens.is_empty() {
        return Value::Null;
    }
    let imbalance: Vec<f64> = tokens
        .iter()
        .map(|layer| {
            let total: u64 = layer.iter().sum();
            let max = layer.iter().copied().max().unwrap_or(0);
            match total {
                0 => 1.0,
                t => max as f64 * layer.len() as f64 / t as f64,
            }
        })
        .collect();
    json!({
        "steps": steps,
        "tokens_per_expert": tokens,
        "max_over_mean": imbalance,
    })
}

pub async fn stats(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let stats = engine_stats(&state).await?;
    let s = &stats.scheduler;
    let (prompt, generated, cached) = state.metrics.token_totals();
    let requests: Vec<Value> = state
        .metrics
        .requests()
        .into_iter()
        .map(|((endpoint, status), count)| {
            json!({"endpoint": endpoint, "status": status, "count": count})
        })
        .collect();
    let model = state.engine.model();
    let latency: serde_json::Map<String, Value> = state
        .metrics
        .latency
        .named()
        .into_iter()
        .map(|(name, _, h)| {
            let s = h.summary();
            let v =
                json!({"count": s.count, "mean": s.mean, "p50": s.p50, "p90": s.p90, "p99": s.p99});
            (name.to_string(), v)
        })
        .collect();
    Ok(Json(json!({
        "model": &*state.model_name,
        "model_path": model.path.display().to_string(),
        "device": &stats.device,
        "context_length": state.context_length(),
        "trained_context_length": model.context_length(),
        "sampling_defaults": crate::openai_types::SamplingDefaultsOut::from(&*state.sampling_defaults),
        "scheduler": {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_blocks_used": s.num_blocks_used,
            "num_blocks_total": s.num_blocks_total,
            "num_blocks_cached": s.num_blocks_cached,
            "num_preemptions": s.num_preemptions,
            "num_evictions": s.num_evictions,
            "num_finished": s.num_finished,
            "num_cancelled": s.num_cancelled,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_generated_tokens": s.num_generated_tokens,
            "speculative": {
                "num_speculative_decodes": s.num_speculative_decodes,
                "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_draft_tokens": s.num_accepted_draft_tokens,
                "acceptance_rate": if s.num_draft_tokens == 0 {
                    0.0
                } else {
                    s.num_accepted_draft_tokens as f64 / s.num_draft_tokens as f64
                },
            },
            "prefix_cache": {
                "num_lookups": s.prefix_cache.num_lookups,
                "num_queried_tokens": s.prefix_cache.num_queried_tokens,
                "num_hit_tokens": s.prefix_cache.num_hit_tokens,
                "num_hit_blocks": s.prefix_cache.num_hit_blocks,
            },
        },
        "engine": {
            "num_steps": stats.num_steps,
            "step_seconds_total": stats.step_seconds_total,
            "last_step_seconds": stats.last_step_seconds,
            "decode_steps": stats.decode_steps,
            "decode_step_seconds_total": stats.decode_step_seconds_total,
            "decode_step_tokens": stats.decode_step_tokens,
            // Output-format masks, computed alongside the forward passes;
            // `wait` is the part a step waited for after its forward pass.
            "mask_steps": stats.mask_steps,
            "masks": stats.masks,
            "mask_seconds_total": stats.mask_seconds_total,
            "mask_wait_seconds_total": stats.mask_wait_seconds_total,
        },
        // Mixture-of-Experts load balance (null for a dense model): tokens
        // routed to each expert of each sparse layer over the last steps,
        // and the busiest expert's share against an even one (1 = even).
        "experts": expert_balance(&stats.expert_tokens, stats.expert_steps),
        // The weight matrices' bytes on the device as they are stored
        // (quantized blocks counted at their size), by storage.
        "weights": (!stats.weight_bytes.is_empty()).then(|| json!({
            "bytes": stats.weight_bytes.values().sum::<u64>(),
            "by_storage": &stats.weight_bytes,
        })),
        // Device memory (null on the CPU): driver free/total and the
        // backend's active, peak and reserved bytes.
        "memory": stats.device_memory.map(|m| json!({
            "free_bytes": m.free_bytes,
            "total_bytes": m.total_bytes,
            "active_bytes": m.active_bytes,
            "peak_active_bytes": m.peak_active_bytes,
            "reserved_bytes": m.reserved_bytes,
        })),
        // Per-request latencies in seconds (estimated from histogram
        // buckets; null before the first request).
        "latency": latency,
        "server": {
            "prompt_tokens": prompt,
            "generation_tokens": generated,
            "cached_tokens": cached,
            "requests": requests,
        },
    })))
}

pub async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let stats = engine_stats(&state).await?;
    let text = state.metrics.render(&state.model_name, &stats);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// A model's `/v1/models` entries: the model, then its LoRA adapters
/// (each with `parent`).
pub(crate) fn model_cards(state: &AppState) -> Vec<ModelCard> {
    let card = |id: String, parent: Option<String>, root: Option<String>| ModelCard {
        id,
        object: "model",
        created: state.started_at,
        owned_by: "kiln",
        max_model_len: state.context_length(),
        sampling_defaults: (&*state.sampling_defaults).into(),
        parent,
        root,
    };
    let mut data = vec![card(state.model_name.to_string(), None, None)];
    for a in state.engine.adapters().list() {
        data.push(card(
            a.name,
            Some(state.model_name.to_string()),
            Some(a.path.display().to_string()),
        ));
    }
    data
}
