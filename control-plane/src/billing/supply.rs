//! Each model's supply state — low, medium, high or surplus — which sets the discount
//! subscription requests get on it: idle capacity is sold cheaply to subscribers.
//!
//! The state is computed from the live load of the model's replicas, sampled every few
//! seconds and averaged over a refresh slot (10 minutes by default); the mean decides
//! the state for the next slot:
//!
//! | mean load of the slot        | state   | usage multiplier |
//! |------------------------------|---------|------------------|
//! | 75 % or more, or no data     | low     | 1.00             |
//! | 50 % to 75 %                 | medium  | 0.75             |
//! | 25 % to 50 %                 | high    | 0.50             |
//! | under 25 %                   | surplus | 0.25             |
//!
//! A sample's load is the share of the replicas' KV-cache blocks in use, or 100 % when
//! any replica has requests waiting (it is full whatever its cache says). A model none
//! of whose replicas reported anything stays at low: no discount on capacity we cannot
//! see. Each slot's state is written once to the database, by whichever control plane
//! gets there first, and read back by all: they agree on one state per slot. The rows
//! are the history /status reports.

use serde::Serialize;
use sqlx::{AnyPool, Row};
use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tessera_proto::UnknownName;
use tessera_proto::worker as pb;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SupplyState {
    Low,
    Medium,
    High,
    Surplus,
}

impl SupplyState {
    /// What a subscription request pays of its standard cost, in basis points.
    pub fn multiplier_bp(self) -> i64 {
        match self {
            Self::Low => 10_000,
            Self::Medium => 7_500,
            Self::High => 5_000,
            Self::Surplus => 2_500,
        }
    }

    pub fn discount_percent(self) -> u32 {
        100 - (self.multiplier_bp() / 100) as u32
    }

    /// The state a slot's mean load (basis points of capacity) leads to.
    pub fn from_load_bp(load_bp: Option<i64>) -> Self {
        match load_bp {
            None => Self::Low,
            Some(l) if l >= 7_500 => Self::Low,
            Some(l) if l >= 5_000 => Self::Medium,
            Some(l) if l >= 2_500 => Self::High,
            Some(_) => Self::Surplus,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Low => "low",
            Self::Medium => "medium",
            Self::High => "high",
            Self::Surplus => "surplus",
        }
    }
}

impl FromStr for SupplyState {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "low" => Ok(Self::Low),
            "medium" => Ok(Self::Medium),
            "high" => Ok(Self::High),
            "surplus" => Ok(Self::Surplus),
            other => Err(UnknownName::new("supply state", other, ["low", "medium", "high", "surplus"])),
        }
    }
}

/// One sample's load over a model's replicas, in basis points; None without reports.
pub fn load_bp(reports: &[pb::LoadReport]) -> Option<i64> {
    if reports.is_empty() {
        return None;
    }
    if reports.iter().any(|r| r.waiting > 0) {
        return Some(10_000);
    }
    let used: i64 = reports.iter().map(|r| r.kv_blocks_used as i64).sum();
    let total: i64 = reports.iter().map(|r| r.kv_blocks_total as i64).sum();
    (total > 0).then(|| (used * 10_000 / total).min(10_000))
}

/// A model's state for one slot, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SupplyPoint {
    pub model: String,
    pub slot: i64,
    pub state: SupplyState,
    pub load_bp: i64,
    pub samples: i64,
    /// µs since the epoch.
    pub updated_at: i64,
}

/// The supply states in effect, shared by every request of this control plane.
#[derive(Clone)]
pub struct Supply {
    pool: AnyPool,
    current: Arc<RwLock<HashMap<String, SupplyPoint>>>,
}

impl Supply {
    pub fn new(pool: AnyPool) -> Self {
        Self { pool, current: Default::default() }
    }

    /// The state in effect for `model` (low until one is recorded).
    pub fn state(&self, model: &str) -> SupplyState {
        self.current.read().unwrap_or_else(|e| e.into_inner()).get(model).map_or(SupplyState::Low, |p| p.state)
    }

    /// Every model's current point.
    pub fn current(&self) -> Vec<SupplyPoint> {
        let mut all: Vec<_> = self.current.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        all.sort_by(|a, b| a.model.cmp(&b.model));
        all
    }

    /// Records `model`'s state for `slot` unless another control plane already did, and
    /// makes the recorded one current. Returns it.
    pub async fn record(&self, point: SupplyPoint) -> Result<SupplyState, sqlx::Error> {
        self.insert(&point).await?;
        self.reload().await?;
        Ok(self.state(&point.model))
    }

    /// Writes a slot's state unless one is there already (`reload` makes it current).
    async fn insert(&self, point: &SupplyPoint) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO supply_states (model, slot, state, load_bp, samples, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (model, slot) DO NOTHING",
        )
        .bind(&point.model)
        .bind(point.slot)
        .bind(point.state.as_str())
        .bind(point.load_bp)
        .bind(point.samples)
        .bind(point.updated_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Makes each model's latest recorded state current (at start, and after a write).
    pub async fn reload(&self) -> Result<(), sqlx::Error> {
        let rows = sqlx::query(
            "SELECT s.model, s.slot, s.state, s.load_bp, s.samples, s.updated_at FROM supply_states s \
             JOIN (SELECT model, MAX(slot) AS slot FROM supply_states GROUP BY model) latest \
             ON s.model = latest.model AND s.slot = latest.slot",
        )
        .fetch_all(&self.pool)
        .await?;
        let points: Vec<SupplyPoint> = rows.iter().filter_map(|r| point_from_row(r).ok()).collect();
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        for p in points {
            current.insert(p.model.clone(), p);
        }
        Ok(())
    }

    /// `model`'s recorded states since `since_us`, oldest first.
    pub async fn history(&self, model: &str, since_us: i64) -> Result<Vec<SupplyPoint>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT model, slot, state, load_bp, samples, updated_at FROM supply_states \
             WHERE model = $1 AND updated_at >= $2 ORDER BY slot",
        )
        .bind(model)
        .bind(since_us)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(point_from_row).collect()
    }
}

fn point_from_row(r: &sqlx::any::AnyRow) -> Result<SupplyPoint, sqlx::Error> {
    let state: String = r.try_get("state")?;
    Ok(SupplyPoint {
        model: r.try_get("model")?,
        slot: r.try_get("slot")?,
        state: state.parse().map_err(|e: UnknownName| sqlx::Error::Decode(e.into()))?,
        load_bp: r.try_get("load_bp")?,
        samples: r.try_get("samples")?,
        updated_at: r.try_get("updated_at")?,
    })
}

/// Samples of one model's load over the current slot.
#[derive(Debug, Default, Clone, Copy)]
struct Samples {
    sum_bp: i64,
    count: i64,
}

/// Averages each model's load over a slot and records the next slot's state.
pub struct Refresher {
    supply: Supply,
    slot_us: i64,
    slot: i64,
    /// When this refresher began sampling the current slot.
    began_us: i64,
    samples: HashMap<String, Samples>,
}

impl Refresher {
    pub fn new(supply: Supply, slot: Duration, now_us: i64) -> Self {
        let slot_us = (slot.as_micros() as i64).max(1);
        Self { supply, slot_us, slot: now_us / slot_us, began_us: now_us, samples: HashMap::new() }
    }

    /// Takes one sample of each model's replicas' latest reports; at a slot's end,
    /// records every model's state for the slot that begins.
    pub async fn sample(&mut self, now_us: i64, loads: &[(String, Vec<pb::LoadReport>)]) -> Result<(), sqlx::Error> {
        let slot = now_us / self.slot_us;
        // A refresher that saw less than half of the slot (it started late) leaves the
        // slot's state to one that saw more, or to the next slot.
        let saw_enough = self.began_us <= self.slot * self.slot_us + self.slot_us / 2;
        if slot != self.slot && !saw_enough {
            self.supply.reload().await?;
        } else if slot != self.slot {
            let models: Vec<&String> = loads.iter().map(|(m, _)| m).collect();
            for model in models {
                let s = self.samples.get(model).copied().unwrap_or_default();
                let mean = (s.count > 0).then(|| s.sum_bp / s.count);
                let point = SupplyPoint {
                    model: model.clone(),
                    slot,
                    state: SupplyState::from_load_bp(mean),
                    load_bp: mean.unwrap_or(0),
                    samples: s.count,
                    updated_at: now_us,
                };
                self.supply.insert(&point).await?;
            }
            // Once for every model: what this or another control plane wrote.
            self.supply.reload().await?;
        }
        if slot != self.slot {
            self.samples.clear();
            self.slot = slot;
            self.began_us = slot * self.slot_us;
        }
        for (model, reports) in loads {
            if let Some(l) = load_bp(reports) {
                let s = self.samples.entry(model.clone()).or_default();
                s.sum_bp += l;
                s.count += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(used: u32, total: u32, waiting: u32) -> pb::LoadReport {
        pb::LoadReport { kv_blocks_used: used, kv_blocks_total: total, waiting, ..Default::default() }
    }

    #[test]
    fn states_follow_the_documented_thresholds() {
        let cases = [
            (None, SupplyState::Low),
            (Some(10_000), SupplyState::Low),
            (Some(7_500), SupplyState::Low),
            (Some(7_499), SupplyState::Medium),
            (Some(5_000), SupplyState::Medium),
            (Some(4_999), SupplyState::High),
            (Some(2_500), SupplyState::High),
            (Some(2_499), SupplyState::Surplus),
            (Some(0), SupplyState::Surplus),
        ];
        for (load, state) in cases {
            assert_eq!(SupplyState::from_load_bp(load), state, "{load:?}");
        }
        let spec: Vec<_> = [SupplyState::Low, SupplyState::Medium, SupplyState::High, SupplyState::Surplus]
            .iter()
            .map(|s| (s.discount_percent(), s.multiplier_bp()))
            .collect();
        assert_eq!(spec, [(0, 10_000), (25, 7_500), (50, 5_000), (75, 2_500)]);
    }

    #[test]
    fn a_sample_is_cache_use_or_full_when_requests_wait() {
        assert_eq!(load_bp(&[]), None);
        assert_eq!(load_bp(&[report(0, 0, 0)]), None, "no capacity reported");
        assert_eq!(load_bp(&[report(10, 100, 0), report(30, 100, 0)]), Some(2_000));
        assert_eq!(load_bp(&[report(0, 100, 0), report(1, 100, 3)]), Some(10_000));
    }

    #[tokio::test]
    async fn each_slot_is_recorded_once_and_all_control_planes_read_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::db::Db::open(&format!("sqlite://{}", dir.path().join("t.db").display())).await.unwrap();
        let slot = Duration::from_secs(600);
        let slot_us = 600_000_000;
        let (a, b) = (store.supply(), store.supply());
        let mut ra = Refresher::new(a.clone(), slot, 10 * slot_us);
        let mut rb = Refresher::new(b.clone(), slot, 10 * slot_us);
        let model = "vendor-a/model-a".to_string();
        let idle = vec![(model.clone(), vec![report(5, 100, 0)])];
        let busy = vec![(model.clone(), vec![report(90, 100, 0)])];
        // Slot 10: control plane A sees an idle replica, B a busy one.
        for t in 0..5 {
            ra.sample(10 * slot_us + t, &idle).await.unwrap();
            rb.sample(10 * slot_us + t, &busy).await.unwrap();
        }
        assert_eq!(a.state(&model), SupplyState::Low, "nothing recorded yet");
        // Slot 11 begins: A writes first, and B adopts A's state.
        ra.sample(11 * slot_us, &idle).await.unwrap();
        rb.sample(11 * slot_us + 1, &busy).await.unwrap();
        assert_eq!((a.state(&model), b.state(&model)), (SupplyState::Surplus, SupplyState::Surplus));
        // A third control plane starting now reads it too.
        let c = store.supply();
        c.reload().await.unwrap();
        assert_eq!(c.state(&model), SupplyState::Surplus);
        // A control plane that starts late in slot 11 does not decide slot 12.
        let mut late = Refresher::new(c.clone(), slot, 11 * slot_us + slot_us * 3 / 4);
        late.sample(11 * slot_us + slot_us * 3 / 4, &idle).await.unwrap();
        late.sample(12 * slot_us, &idle).await.unwrap();
        assert_eq!(c.state(&model), SupplyState::Surplus, "slot 11's state still");
        // Slot 12, from B's samples (A is gone): low; the history has both.
        rb.sample(12 * slot_us, &busy).await.unwrap();
        assert_eq!(b.state(&model), SupplyState::Low);
        let history = b.history(&model, 0).await.unwrap();
        let states: Vec<_> = history.iter().map(|p| (p.slot, p.state)).collect();
        assert_eq!(states, [(11, SupplyState::Surplus), (12, SupplyState::Low)]);
        assert_eq!(history[0].load_bp, 500);
    }
}
