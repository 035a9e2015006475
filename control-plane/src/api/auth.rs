//! The bearer key: checked on every request against the store, so a revoked key is
//! refused from the very next request.

use super::error::ApiError;
use super::{App, AppState};
use crate::accounts::{ApiKey, keys};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use std::sync::Arc;

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
        authenticate(app, secret).await.map(Authed)
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
