//! The console's stylesheet and scripts, compiled into the binary: our own, and uPlot
//! (MIT, pinned in `vendor/README.md`) for the usage charts.

use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

const FILES: &[(&str, &str, &str)] = &[
    ("console.css", "text/css; charset=utf-8", include_str!("console.css")),
    ("console.js", "text/javascript; charset=utf-8", include_str!("console.js")),
    ("usage.js", "text/javascript; charset=utf-8", include_str!("usage.js")),
    ("playground.js", "text/javascript; charset=utf-8", include_str!("playground.js")),
    ("uPlot.iife.min.js", "text/javascript; charset=utf-8", include_str!("vendor/uPlot.iife.min.js")),
    ("uPlot.min.css", "text/css; charset=utf-8", include_str!("vendor/uPlot.min.css")),
];

pub async fn serve(Path(file): Path<String>) -> Response {
    match FILES.iter().find(|(name, _, _)| *name == file) {
        Some((_, kind, body)) => {
            ([(header::CONTENT_TYPE, *kind), (header::CACHE_CONTROL, "public, max-age=3600")], *body).into_response()
        }
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
