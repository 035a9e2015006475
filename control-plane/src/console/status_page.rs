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
    /// What plan usage pays in this state, in words.
    price: String,
    windows: Vec<Figures>,
}

#[derive(Template)]
#[template(path = "status.html")]
struct StatusPage {
    frame: Frame,
    updated_at: String,
    /// When supply states were last measured, in words.
    supply_measured: String,
    stale: bool,
    models: Vec<ModelRow>,
}

fn figure(v: Option<f64>, unit: &str, digits: usize) -> String {
    v.map_or_else(|| "—".to_string(), |v| format!("{v:.digits$}{unit}"))
}

/// An RFC 3339 UTC timestamp (`2026-11-23T12:00:05Z`) as the console shows times:
/// `2026-11-23 12:00 UTC`.
fn shown(rfc3339: &str) -> String {
    match (rfc3339.get(..10), rfc3339.get(11..16)) {
        (Some(day), Some(time)) => format!("{day} {time} UTC"),
        _ => rfc3339.to_string(),
    }
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
            price: match m.current_subscription_discount_percent {
                0 => "plan usage at the standard price".into(),
                d => format!("plan usage {d}% off"),
            },
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
        updated_at: shown(&first.updated_at),
        supply_measured: match &first.current_subscription_supply_updated_at {
            Some(at) => format!("supply states measured {}", shown(at)),
            None => "supply states not measured yet (every model starts at the standard price)".into(),
        },
        stale: snapshots.iter().any(|s| s.stale),
        models,
    };
    secured(render(StatusCode::OK, &page))
}

#[cfg(test)]
mod tests {
    #[test]
    fn times_read_as_on_every_other_page() {
        assert_eq!(super::shown("2026-11-23T12:00:05Z"), "2026-11-23 12:00 UTC");
        assert_eq!(super::shown("x"), "x");
    }
}
