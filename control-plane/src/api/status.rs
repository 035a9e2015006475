//! GET /status: public, no key. The snapshot of the window asked for, from memory.

use super::App;
use super::error::ApiError;
use crate::status::{Snapshot, Window};
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use std::collections::HashMap;

pub async fn handle(
    State(app): State<App>,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<Json<Snapshot>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::invalid_value("window", e.body_text()))?;
    let window = window_of(&query)?;
    Ok(Json(app.status.snapshot(window)))
}

/// `?window=`, or the default; an unknown one names those allowed.
fn window_of(query: &HashMap<String, String>) -> Result<Window, ApiError> {
    match query.get("window") {
        None => Ok(Window::DEFAULT),
        Some(w) => w.parse().map_err(|message: String| ApiError::invalid_value("window", message)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_asked_for_or_the_default() {
        let query = |w: &str| HashMap::from([("window".to_string(), w.to_string())]);
        assert_eq!(window_of(&HashMap::new()), Ok(Window::Hour));
        assert_eq!(window_of(&query("24h")), Ok(Window::Day));
        let e = window_of(&query("1d")).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e, ApiError::invalid_value("window", "Invalid window \"1d\": expected one of 5m, 1h, 24h, 30d."));
    }
}
