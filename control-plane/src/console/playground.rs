//! The playground: chat with a model through one of the organization's keys, streamed,
//! with the model's reasoning shown apart from its answer and each turn's usage and cost.
//!
//! A turn is a chat completion through the API's own handler (`api::chat::handle`)
//! with the chosen key, after the same rate limit: it is admitted, metered, billed and
//! recorded exactly as the API would, and shows up in Usage like any other request. The
//! key's secret is never needed (the console knows the key by id, as its owner does). One
//! difference: the playground never falls back from a plan to credits on
//! its own, so a subscription key's fallback is off here.

use super::State;
use super::authz::{Action, authorize};
use super::page::{ConsoleError, Frame, Refusal, Result, render, usd};
use super::session::Viewer;
use crate::accounts::{ApiKey, BillingMode, Membership};
use crate::api::RequestId;
use crate::api::auth::Authed;
use crate::api::error::ApiError;
use askama::Template;
use axum::Form;
use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State as Ctx};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

/// The most a playground turn may generate.
const MAX_TOKENS: i64 = 4096;

struct KeyChoice {
    id: String,
    label: String,
}

#[derive(Template)]
#[template(path = "playground.html")]
struct PlaygroundPage {
    frame: Frame,
    membership: Membership,
    models: Vec<String>,
    keys: Vec<KeyChoice>,
}

fn key_label(k: &ApiKey) -> String {
    let billing = match k.billing_mode {
        BillingMode::Credits => "credits",
        BillingMode::Subscription => "plan, no fallback here",
    };
    format!("{} ({billing})", k.name)
}

pub async fn page(Ctx(console): Ctx<State>, viewer: Viewer, Path(org): Path<String>) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::View).await?;
    let models = match &console.api {
        Some(app) => app.models.listed().into_iter().map(|m| m.id).collect(),
        None => Vec::new(),
    };
    let keys = console
        .store
        .list_keys(&org)
        .await?
        .into_iter()
        .filter(|k| k.revoked_at.is_none())
        .map(|k| KeyChoice { label: key_label(&k), id: k.id })
        .collect();
    let page =
        PlaygroundPage { frame: viewer.frame(&console, "Playground", Some(&org)).await?, membership, models, keys };
    Ok(render(StatusCode::OK, &page))
}

/// A turn, as the page posts it (a form, so that the anti-forgery check reads it like
/// any other): the conversation so far is JSON in `messages`.
#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Turn {
    key: String,
    model: String,
    messages: String,
    max_tokens: String,
    reasoning_effort: String,
}

/// An error the page shows, in the API's own shape (the page reads `error.message`).
fn refused(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": "invalid_request_error"}}))).into_response()
}

/// The chat request's body for a turn, or why not.
fn body(t: &Turn) -> std::result::Result<Value, Refusal> {
    let messages: Value = serde_json::from_str(&t.messages).map_err(|_| "The conversation is not valid JSON.")?;
    if messages.as_array().is_none_or(|m| m.is_empty()) {
        return Err("Write a message first.".into());
    }
    let mut body = json!({
        "model": t.model,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !t.max_tokens.trim().is_empty() {
        match t.max_tokens.trim().parse::<i64>() {
            Ok(n) if (1..=MAX_TOKENS).contains(&n) => body["max_tokens"] = json!(n),
            _ => return Err(format!("Maximum tokens is a whole number from 1 to {MAX_TOKENS}.").into()),
        }
    }
    if !t.reasoning_effort.is_empty() {
        body["reasoning_effort"] = json!(t.reasoning_effort);
    }
    Ok(body)
}

pub async fn chat(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(turn): Form<Turn>,
) -> Result<Response> {
    authorize(&console, &viewer, &org, Action::View).await?;
    let Some(app) = console.api.clone() else {
        return Ok(refused(StatusCode::SERVICE_UNAVAILABLE, "This console does not serve the API."));
    };
    let mut key = match console.store.key(&turn.key).await? {
        Some(k) if k.org_id == org && k.revoked_at.is_none() => k,
        _ => return Ok(refused(StatusCode::BAD_REQUEST, "Choose one of this organization's active keys.")),
    };
    key.fallback_to_credits = false;
    let body = match body(&turn) {
        Ok(b) => b,
        Err(why) => return Ok(refused(StatusCode::BAD_REQUEST, &why.0)),
    };
    // The API's rate limit for the key's organization, as its extractor applies it.
    let decision =
        app.limits.check(&key.org_id).await.map_err(|e| ConsoleError::Internal(format!("rate limit: {e}")))?;
    if !decision.allowed {
        return Ok(ApiError::RateLimited { org: key.org_id.clone(), decision }.into_response());
    }
    let request_id = RequestId::new();
    let id = request_id.id.clone();
    let bytes = Bytes::from(body.to_string());
    let mut response = match crate::api::chat::handle(
        axum::extract::State(app),
        Authed(key),
        Extension(request_id),
        Ok(bytes),
    )
    .await
    {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", v);
    }
    Ok(response)
}

/// What a finished request used and cost (the playground shows it under each turn):
/// from its usage record, so it is the amount billed.
pub async fn request_cost(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, id)): Path<(String, String)>,
) -> Result<Response> {
    authorize(&console, &viewer, &org, Action::View).await?;
    let record = console.billing.ledger().usage_record(&id).await?;
    let Some(u) = record.filter(|u| u.org_id == org) else { return Err(ConsoleError::NotFound) };
    Ok(Json(json!({
        "request_id": u.request_id,
        "model": u.model,
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": u.cached_tokens,
        "completion_tokens": u.completion_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "cost_micros": u.cost_micros,
        "cost": usd(u.cost_micros as i64),
        "funding": u.funding,
        "multiplier_bp": u.multiplier_bp,
    }))
    .into_response())
}
