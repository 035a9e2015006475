//! The public status page: GET /status for a browser (`Accept: text/html`) and
//! /status-page, drawn from the same snapshots as the JSON: each model's output
//! tokens per second, time to first token and success rate over the four windows, and
//! its supply state. No sign-in; it refreshes itself every minute.

use super::page::{Frame, render, secured};
use crate::status::{Snapshot, Status, Window};
use askama::Template;
use axum::http::StatusCode;
use axum::response::Response;

struct Figures {
    window: &'static str,
    tps: String,
    ttft: String,
    success: String,
}

struct ModelRow {
    id: String,
    name: String,
    supply: &'static str,
    discount: u32,
    multiplier: f64,
    windows: Vec<Figures>,
}

#[derive(Template)]
#[template(path = "status.html")]
struct StatusPage {
    frame: Frame,
    updated_at: String,
    supply_updated_at: String,
    stale: bool,
    models: Vec<ModelRow>,
}

fn figure(v: Option<f64>, unit: &str, digits: usize) -> String {
    v.map_or_else(|| "—".to_string(), |v| format!("{v:.digits$}{unit}"))
}

/// The page from one snapshot per window (the same `Status` GET /status reads).
pub fn page(status: &Status) -> Response {
    let snapshots: Vec<Snapshot> = Window::ALL.iter().map(|w| status.snapshot(*w)).collect();
    let first = &snapshots[0];
    let models = first
        .models
        .iter()
        .map(|m| ModelRow {
            id: m.id.clone(),
            name: m.name.clone(),
            supply: m.current_subscription_supply_state,
            discount: m.current_subscription_discount_percent,
            multiplier: m.current_subscription_credit_multiplier,
            windows: snapshots
                .iter()
                .map(|s| {
                    let f = s.models.iter().find(|x| x.id == m.id);
                    Figures {
                        window: s.window,
                        tps: figure(f.and_then(|f| f.tps), "", 1),
                        ttft: figure(f.and_then(|f| f.ttfb_seconds), " s", 2),
                        success: figure(f.and_then(|f| f.uptime_pct), "%", 2),
                    }
                })
                .collect(),
        })
        .collect();
    let page = StatusPage {
        frame: Frame::signed_out("Status", String::new()),
        updated_at: first.updated_at.clone(),
        supply_updated_at: first.current_subscription_supply_updated_at.clone().unwrap_or_else(|| "never".into()),
        stale: snapshots.iter().any(|s| s.stale),
        models,
    };
    secured(render(StatusCode::OK, &page))
}
