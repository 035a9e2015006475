//! The console's own stylesheet and script, compiled into the binary. No third-party
//! code: the script only copies a new key's secret to the clipboard.

use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

const FILES: &[(&str, &str, &str)] = &[
    ("console.css", "text/css; charset=utf-8", include_str!("console.css")),
    ("console.js", "text/javascript; charset=utf-8", include_str!("console.js")),
];

pub async fn serve(Path(file): Path<String>) -> Response {
    match FILES.iter().find(|(name, _, _)| *name == file) {
        Some((_, kind, body)) => {
            ([(header::CONTENT_TYPE, *kind), (header::CACHE_CONTROL, "public, max-age=3600")], *body).into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
