//! GET /status: public, no key. The snapshot of the window asked for, from memory, as
//! JSON for clients; a browser (asking for HTML first) gets the status page instead,
//! which /status-page always serves.

use super::App;
use super::error::ApiError;
use crate::status::{Snapshot, Window};
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;

pub async fn handle(
    State(app): State<App>,
    headers: HeaderMap,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<Response, ApiError> {
    let mut response = if wants_html(&headers) {
        crate::console::status_page::page(&app.status)
    } else {
        let Query(query) = query.map_err(|e| ApiError::invalid_value("window", e.body_text()))?;
        let window = window_of(&query)?;
        Json::<Snapshot>(app.status.snapshot(window)).into_response()
    };
    // One address, two representations: caches must key on Accept.
    response.headers_mut().insert(header::VARY, header::HeaderValue::from_static("accept"));
    Ok(response)
}

pub async fn page(State(app): State<App>) -> Response {
    crate::console::status_page::page(&app.status)
}

/// A browser's Accept header puts text/html first; SDKs and curl ask for JSON or
/// anything (`*/*`), and get JSON.
fn wants_html(headers: &HeaderMap) -> bool {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
    accept.split(',').next().is_some_and(|first| first.trim().starts_with("text/html"))
}

/// `?window=`, or the default; an unknown one names those allowed.
fn window_of(query: &HashMap<String, String>) -> Result<Window, ApiError> {
    match query.get("window") {
        None => Ok(Window::DEFAULT),
        Some(w) => w.parse().map_err(|e: tessera_proto::UnknownName| {
            ApiError::invalid_value("window", format!("Invalid window {w:?}: expected one of {}.", e.known.join(", ")))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn browsers_get_the_page_and_clients_json() {
        let accept = |v: &'static str| HeaderMap::from_iter([(header::ACCEPT, v.parse().unwrap())]);
        assert!(wants_html(&accept("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8")));
        assert!(!wants_html(&accept("application/json")));
        assert!(!wants_html(&accept("*/*")));
        assert!(!wants_html(&HeaderMap::new()));
    }

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
