//! The bearer key: checked on every request against the store, so a revoked key is
//! refused from the very next request; then its organization's request rate.

use super::error::ApiError;
use super::{App, AppState};
use crate::accounts::{ApiKey, keys};
use crate::limits::{Decision, go_duration};
use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::{Arc, Mutex};

/// The authenticated key of a request.
pub struct Authed(pub ApiKey);

impl FromRequestParts<App> for Authed {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &App) -> Result<Self, ApiError> {
        let header = parts.headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let secret = match header.map(str::trim) {
            None | Some("") => return Err(ApiError::MissingKey),
            Some(h) => match h.split_once(' ') {
                Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() => {
                    token.trim()
                }
                _ => return Err(ApiError::MissingKey),
            },
        };
        let key = authenticate(app, secret).await?;
        let decision =
            app.limits.check(&key.org_id).await.map_err(|e| ApiError::Internal(format!("rate limit: {e}")))?;
        if !decision.allowed {
            return Err(ApiError::RateLimited { org: key.org_id.clone(), decision });
        }
        if let Some(RateSlot(slot)) = parts.extensions.get::<RateSlot>() {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(decision);
        }
        Ok(Authed(key))
    }
}

/// Where the extractor leaves its decision for the response's headers.
#[derive(Clone, Default)]
struct RateSlot(Arc<Mutex<Option<Decision>>>);

/// Adds the x-ratelimit-* headers to every response whose request was rate-checked.
pub async fn rate_limit_headers(mut request: Request, next: Next) -> Response {
    let slot = RateSlot::default();
    request.extensions_mut().insert(slot.clone());
    let mut response = next.run(request).await;
    if let Some(d) = *slot.0.lock().unwrap_or_else(|e| e.into_inner()) {
        set_rate_headers(response.headers_mut(), &d);
    }
    response
}

/// OpenAI's rate-limit headers, and on a refusal when to retry (`retry-after-ms` wins
/// over `Retry-After` in the SDKs).
pub fn set_rate_headers(h: &mut HeaderMap, d: &Decision) {
    let mut set = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::from_str(&value) {
            h.insert(name, v);
        }
    };
    set("x-ratelimit-limit-requests", d.limit.to_string());
    set("x-ratelimit-remaining-requests", d.remaining.to_string());
    set("x-ratelimit-reset-requests", go_duration(d.reset_us));
    if !d.allowed {
        set("retry-after", d.retry_after_us.div_ceil(1_000_000).to_string());
        set("retry-after-ms", d.retry_after_us.div_ceil(1_000).to_string());
    }
}

pub async fn authenticate(app: &Arc<AppState>, secret: &str) -> Result<ApiKey, ApiError> {
    let invalid = || ApiError::InvalidKey { masked: keys::mask(secret) };
    if !keys::well_formed(secret) {
        return Err(invalid());
    }
    match app.store.authenticate(secret).await {
        Ok(Some(key)) => Ok(key),
        Ok(None) => Err(invalid()),
        Err(e) => Err(ApiError::Internal(format!("key lookup: {e}"))),
    }
}
