//! The snapshots GET /status serves: every window's figures, summed from the database
//! in the background and kept in memory.

use super::minutes::{Counts, Minutes};
use super::recorder::{Probe, Recorder};
use super::{MIN_SAMPLES, MINUTE_US, STALE_AFTER_US, Window};
use crate::billing::Clock;
use crate::billing::supply::Supply;
use crate::calendar::rfc3339;
use serde::Serialize;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// Minutes kept in the database: the longest window and a day of slack.
const KEEP_MINUTES: i64 = 31 * 24 * 60;

/// The status snapshot GET /status serves (docs/api.md, Status).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Snapshot {
    pub updated_at: String,
    pub window: &'static str,
    pub window_secs: i64,
    pub stale: bool,
    /// When the newest supply state in effect was recorded (null before the first).
    pub current_subscription_supply_updated_at: Option<String>,
    pub models: Vec<ModelStatus>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelStatus {
    pub id: String,
    pub name: String,
    pub tps: Option<f64>,
    pub ttfb_seconds: Option<f64>,
    pub uptime_pct: Option<f64>,
    pub current_subscription_supply_state: &'static str,
    pub current_subscription_discount_percent: u32,
    pub current_subscription_credit_multiplier: f64,
}

impl Snapshot {
    /// `window`'s snapshot at `now` (µs), before its models are added.
    fn header(window: Window, now: i64, stale: bool, supply_updated_at: Option<String>) -> Self {
        Self {
            updated_at: rfc3339(now),
            window: window.as_str(),
            window_secs: window.secs(),
            stale,
            current_subscription_supply_updated_at: supply_updated_at,
            models: Vec::new(),
        }
    }
}

/// A model as /status names it.
#[derive(Debug, Clone, PartialEq)]
pub struct Listed {
    pub id: String,
    pub name: String,
}

/// The figures of this control plane's /status; clones share them.
#[derive(Clone)]
pub struct Status {
    recorder: Recorder,
    minutes: Minutes,
    clock: Clock,
    /// When this process last wrote its counts (µs; 0: never).
    flushed_at: Arc<AtomicI64>,
    /// The hour (minutes / 60) of this process's last deletion of old minutes.
    pruned_hour: Arc<AtomicI64>,
    board: Arc<RwLock<Board>>,
}

/// Every window's snapshot (in `Window::ALL` order) as of `refreshed_at` (µs; 0: never).
#[derive(Default)]
struct Board {
    refreshed_at: i64,
    snapshots: Vec<Snapshot>,
}

impl Status {
    pub fn new(minutes: Minutes, clock: Clock) -> Self {
        Self {
            recorder: Recorder::new(clock.clone()),
            minutes,
            clock,
            flushed_at: Default::default(),
            pruned_hour: Arc::new(AtomicI64::new(i64::MIN)),
            board: Default::default(),
        }
    }

    /// Measures one generation of `model` at `endpoint`, for a request that arrived at
    /// `received`.
    pub fn probe(&self, model: &str, endpoint: &'static str, received: Instant) -> Probe {
        self.recorder.probe(model, endpoint, received)
    }

    /// The background work, every few seconds: writes this process's counts, sums every
    /// window anew for `models`, and (at its first tick of each hour) deletes minutes
    /// no window reaches.
    pub async fn tick(&self, models: &[Listed], supply: &Supply) {
        let served: Vec<String> = models.iter().map(|m| m.id.clone()).collect();
        match self.recorder.flush(&self.minutes, &served).await {
            Ok(()) => self.flushed_at.store((self.clock)(), Ordering::SeqCst),
            Err(e) => tracing::error!("writing status aggregates: {e}"),
        }
        if let Err(e) = self.refresh(models, supply).await {
            tracing::error!("reading status aggregates: {e}");
        }
        let now_minute = (self.clock)().div_euclid(MINUTE_US);
        let hour = now_minute.div_euclid(60);
        let last = self.pruned_hour.swap(hour, Ordering::SeqCst);
        if last != hour
            && let Err(e) = self.minutes.prune(now_minute - KEEP_MINUTES).await
        {
            // Tried again at the next tick.
            self.pruned_hour.store(last, Ordering::SeqCst);
            tracing::error!("deleting old status aggregates: {e}");
        }
    }

    /// Sums every window from the database into new snapshots.
    pub async fn refresh(&self, models: &[Listed], supply: &Supply) -> Result<(), sqlx::Error> {
        let now = (self.clock)();
        let newest = self.minutes.newest().await?;
        let flushed_at = self.flushed_at.load(Ordering::SeqCst);
        let stale = newest.is_none_or(|n| now - n > STALE_AFTER_US) || now - flushed_at > STALE_AFTER_US;
        let supply_updated_at = supply.current().iter().map(|p| p.updated_at).max().map(rfc3339);
        let mut snapshots = Vec::with_capacity(Window::ALL.len());
        for window in Window::ALL {
            let sums = self.minutes.sums_since(window.first_minute(now)).await?;
            snapshots.push(Snapshot {
                models: models.iter().map(|m| model_status(m, sums.get(&m.id), supply)).collect(),
                ..Snapshot::header(window, now, stale, supply_updated_at.clone())
            });
        }
        *self.board.write().unwrap_or_else(|e| e.into_inner()) = Board { refreshed_at: now, snapshots };
        Ok(())
    }

    /// `window`'s snapshot as last refreshed; stale when that was too long ago (the
    /// refresh stopped), or when none was made yet.
    pub fn snapshot(&self, window: Window) -> Snapshot {
        let now = (self.clock)();
        let board = self.board.read().unwrap_or_else(|e| e.into_inner());
        let mut snapshot =
            board.snapshots.get(window.index()).cloned().unwrap_or_else(|| Snapshot::header(window, now, true, None));
        snapshot.stale |= now - board.refreshed_at > STALE_AFTER_US;
        snapshot
    }
}

fn model_status(model: &Listed, counts: Option<&Counts>, supply: &Supply) -> ModelStatus {
    let c = counts.copied().unwrap_or_default();
    let enough = |samples: i64| samples >= MIN_SAMPLES;
    let state = supply.state(&model.id);
    ModelStatus {
        id: model.id.clone(),
        name: model.name.clone(),
        tps: enough(c.tps_samples).then(|| round(c.decode_tokens as f64 * 1e6 / c.decode_us.max(1) as f64, 2)),
        ttfb_seconds: enough(c.ttfb_samples).then(|| round(c.ttfb_us as f64 / 1e6 / c.ttfb_samples as f64, 4)),
        uptime_pct: enough(c.requests).then(|| round(100.0 * (c.requests - c.failures) as f64 / c.requests as f64, 2)),
        current_subscription_supply_state: state.as_str(),
        current_subscription_discount_percent: state.discount_percent(),
        current_subscription_credit_multiplier: state.multiplier_bp() as f64 / 10_000.0,
    }
}

fn round(x: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (x * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::billing::supply::{SupplyPoint, SupplyState};
    use serde_json::{Value, json};

    /// 2026-11-23 12:00:30 UTC.
    const T: i64 = 1_795_435_230_000_000;
    const A: &str = "vendor-a/model-a";
    const B: &str = "vendor-b/model-b";

    fn listed() -> Vec<Listed> {
        vec![Listed { id: A.into(), name: "Model A".into() }, Listed { id: B.into(), name: "Model B".into() }]
    }

    fn counts(requests: i64, failures: i64, ttfb: (i64, i64), tps: (i64, i64, i64)) -> Counts {
        Counts {
            requests,
            failures,
            ttfb_samples: ttfb.0,
            ttfb_us: ttfb.1,
            tps_samples: tps.0,
            decode_tokens: tps.1,
            decode_us: tps.2,
        }
    }

    /// The figures of every model in `window`'s snapshot: (tps, ttfb, uptime) by id.
    fn figures(status: &Status, window: Window) -> Value {
        let s = serde_json::to_value(status.snapshot(window)).unwrap();
        let models = s["models"].as_array().unwrap();
        models
            .iter()
            .map(|m| (m["id"].as_str().unwrap().to_string(), json!([m["tps"], m["ttfb_seconds"], m["uptime_pct"]])))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    #[tokio::test]
    async fn every_window_sums_its_minutes_from_the_database() {
        assert_eq!(crate::calendar::rfc3339(T), "2026-11-23T12:00:30Z");
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let store = crate::db::Db::open(&url).await.unwrap();
        let now = Arc::new(AtomicI64::new(T));
        let clock: Clock = {
            let now = now.clone();
            Arc::new(move || now.load(Ordering::SeqCst))
        };
        let status = Status::new(store.status_minutes(), clock.clone());
        let supply = store.supply();

        // Before its first refresh a snapshot says it is stale, and lists nothing.
        let empty = status.snapshot(Window::Hour);
        assert!(empty.stale && empty.models.is_empty());

        // Fabricated minutes, as control planes would have written them.
        let minutes = store.status_minutes();
        let minute = T / MINUTE_US;
        let add = |ago: i64, model: &'static str, c: Counts| {
            let minutes = minutes.clone();
            async move { minutes.add(minute - ago, model, &c, T - ago * MINUTE_US).await.unwrap() }
        };
        // A, this minute: 3 generations, 0.1 s to first token each, 100 tokens/s.
        add(0, A, counts(3, 0, (3, 300_000), (3, 300, 3_000_000))).await;
        // 30 minutes ago: 2 more, one failed; slower.
        add(30, A, counts(2, 1, (2, 500_000), (2, 100, 2_000_000))).await;
        // 29 days ago: 5 failures. 32 days ago: past every window, and kept no longer.
        add(29 * 1440, A, counts(5, 5, (0, 0), (0, 0, 0))).await;
        add(32 * 1440, A, counts(100, 100, (0, 0), (0, 0, 0))).await;
        // B: one generation two minutes ago, below the minimum of every window.
        add(2, B, counts(1, 0, (1, 200_000), (1, 10, 1_000_000))).await;
        // A's supply is high (50 % off) since a minute ago; B has none recorded.
        let point = SupplyPoint {
            model: A.into(),
            slot: 1,
            state: SupplyState::High,
            load_bp: 3_000,
            samples: 6,
            updated_at: T - MINUTE_US,
        };
        supply.record(point).await.unwrap();

        status.tick(&listed(), &supply).await;
        assert_eq!(figures(&status, Window::FiveMinutes), json!({A: [100.0, 0.1, 100.0], B: [null, null, null]}));
        assert_eq!(figures(&status, Window::Hour), json!({A: [80.0, 0.16, 80.0], B: [null, null, null]}));
        assert_eq!(figures(&status, Window::Day), json!({A: [80.0, 0.16, 80.0], B: [null, null, null]}));
        assert_eq!(figures(&status, Window::Month), json!({A: [80.0, 0.16, 40.0], B: [null, null, null]}));
        let month = serde_json::to_value(status.snapshot(Window::Month)).unwrap();
        assert_eq!(
            month,
            json!({
                "updated_at": "2026-11-23T12:00:30Z", "window": "30d", "window_secs": 2_592_000, "stale": false,
                "current_subscription_supply_updated_at": "2026-11-23T11:59:30Z",
                "models": [
                    {"id": A, "name": "Model A", "tps": 80.0, "ttfb_seconds": 0.16, "uptime_pct": 40.0,
                     "current_subscription_supply_state": "high", "current_subscription_discount_percent": 50,
                     "current_subscription_credit_multiplier": 0.5},
                    {"id": B, "name": "Model B", "tps": null, "ttfb_seconds": null, "uptime_pct": null,
                     "current_subscription_supply_state": "low", "current_subscription_discount_percent": 0,
                     "current_subscription_credit_multiplier": 1.0},
                ]
            })
        );
        // The hour's first tick deleted the minutes no window reaches.
        assert_eq!(store.status_minutes().sums_since(0).await.unwrap()[A].requests, 10);

        // Another control plane (or this one restarted) reads the same figures.
        let other = Status::new(store.status_minutes(), clock.clone());
        other.refresh(&listed(), &supply).await.unwrap();
        assert_eq!(other.snapshot(Window::Month).models, status.snapshot(Window::Month).models);

        // Five minutes on with no refresh: the snapshot in memory is stale.
        now.store(T + 5 * MINUTE_US, Ordering::SeqCst);
        assert!(status.snapshot(Window::Hour).stale);
        // Refreshed, but nothing written for five minutes: still stale.
        status.refresh(&listed(), &supply).await.unwrap();
        assert!(status.snapshot(Window::Hour).stale);
        // And the first minute's figures left the 5-minute window.
        assert_eq!(figures(&status, Window::FiveMinutes), json!({A: [null, null, null], B: [null, null, null]}));
        // The aggregator writes again: current. Later ticks of the hour delete nothing;
        // the next hour's first does.
        add(33 * 1440, A, counts(7, 7, (0, 0), (0, 0, 0))).await;
        status.tick(&listed(), &supply).await;
        assert!(!status.snapshot(Window::Hour).stale);
        assert_eq!(store.status_minutes().sums_since(0).await.unwrap()[A].requests, 17);
        now.store(T + 60 * MINUTE_US, Ordering::SeqCst);
        status.tick(&listed(), &supply).await;
        assert_eq!(store.status_minutes().sums_since(0).await.unwrap()[A].requests, 10);
    }
}
