//! GET /v1/models and /v1/models/{id}: the catalog models with a ready replica.

use super::App;
use super::auth::Authed;
use super::error::ApiError;
use crate::router::ServedModel;
use axum::Json;
use axum::extract::{Path, State};
use serde_json::{Value, json};

/// 2026-11-22, when these ids were first served; the catalog does not date models.
const CREATED: u64 = 1_795_305_600;

fn entry(m: &ServedModel) -> Value {
    let e = &m.entry;
    json!({
        "id": e.id,
        "object": "model",
        "created": CREATED,
        "owned_by": e.id.split('/').next().unwrap_or_default(),
        "name": e.name,
        "context_length": m.context_length(),
        "max_model_len": m.context_length(),
        "quantization": e.quantization,
        "capabilities": {
            "image_input": e.capabilities.image_input,
            "video_input": e.capabilities.video_input,
            "tool_calling": e.capabilities.tool_calling,
            "structured_output": e.capabilities.structured_output,
            "reasoning": e.reasoning.default,
        },
        "pricing": {
            "currency": "USD",
            "unit": "micro-dollars per million tokens",
            "input": e.prices.input,
            "cache_read": e.prices.cache_read,
            "output": e.prices.output,
        },
    })
}

pub async fn list(State(app): State<App>, _key: Authed) -> Json<Value> {
    let data: Vec<Value> = app.models.all().iter().map(|m| entry(m)).collect();
    Json(json!({"object": "list", "data": data}))
}

pub async fn retrieve(State(app): State<App>, _key: Authed, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let model = app.models.get(&id).ok_or_else(|| ApiError::ModelNotFound {
        meant: app.models.meant(&id),
        model: id,
        param: Some("model"),
    })?;
    Ok(Json(entry(&model)))
}
