//! Organizations' scheduling weights: each organization's share of a replica's batch
//! relative to the others' while they contend (the engine's fair sharing). Set by the
//! operator (`tessera orgs set-weight`), kept in the organization's row, and read
//! through a per-process cache, so that a request costs no database read for it; a
//! change reaches every control plane within `FRESH_FOR`.

use sqlx::{AnyPool, Row};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Every organization's weight until the operator sets its own.
pub const DEFAULT_WEIGHT: u32 = 1;
/// The largest weight: a thousand times a default organization's share.
pub const MAX_WEIGHT: u32 = 1000;
/// How long a weight read from the database is used before it is read again.
const FRESH_FOR: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct Weights {
    pool: AnyPool,
    cache: Arc<Mutex<HashMap<String, (u32, Instant)>>>,
}

impl Weights {
    pub fn new(pool: AnyPool) -> Self {
        Self { pool, cache: Arc::default() }
    }

    /// `org_id`'s weight. A database that cannot be read leaves the last weight known
    /// (or the default) in force: scheduling goes on.
    pub async fn of(&self, org_id: &str) -> u32 {
        let cached = self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(org_id).copied();
        if let Some((w, at)) = cached
            && at.elapsed() < FRESH_FOR
        {
            return w;
        }
        let read =
            sqlx::query("SELECT sched_weight FROM orgs WHERE id = $1").bind(org_id).fetch_optional(&self.pool).await;
        let weight = match read {
            Ok(row) => row
                .and_then(|r| r.try_get::<Option<i64>, _>("sched_weight").ok().flatten())
                .map_or(DEFAULT_WEIGHT, |w| w.clamp(1, MAX_WEIGHT as i64) as u32),
            Err(e) => {
                tracing::warn!("reading {org_id}'s scheduling weight: {e}");
                cached.map_or(DEFAULT_WEIGHT, |(w, _)| w)
            }
        };
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).insert(org_id.to_string(), (weight, Instant::now()));
        weight
    }

    /// Sets `org_id`'s weight (1..=MAX_WEIGHT); None returns it to the default. False
    /// when there is no such organization.
    pub async fn set(&self, org_id: &str, weight: Option<u32>) -> Result<bool, sqlx::Error> {
        let done = sqlx::query("UPDATE orgs SET sched_weight = $1 WHERE id = $2")
            .bind(weight.map(|w| i64::from(w.clamp(1, MAX_WEIGHT))))
            .bind(org_id)
            .execute(&self.pool)
            .await?;
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).remove(org_id);
        Ok(done.rows_affected() == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::Db;

    #[tokio::test]
    async fn weights_default_to_one_and_follow_the_operator() {
        let db = Db::open("sqlite::memory:").await.unwrap();
        let org = db.accounts().create_org("o").await.unwrap().id;
        let weights = db.weights();
        assert_eq!(weights.of(&org).await, DEFAULT_WEIGHT);
        assert!(weights.set(&org, Some(4)).await.unwrap());
        assert_eq!(weights.of(&org).await, 4, "this process sees its own change at once");
        // Another control plane sees it once its cached weight is stale.
        let other = db.weights();
        assert_eq!(other.of(&org).await, 4);
        assert!(weights.set(&org, Some(MAX_WEIGHT + 5)).await.unwrap());
        assert_eq!(weights.of(&org).await, MAX_WEIGHT, "bounded");
        assert!(weights.set(&org, None).await.unwrap());
        assert_eq!(weights.of(&org).await, DEFAULT_WEIGHT);
        assert!(!weights.set("org_missing", Some(2)).await.unwrap());
        assert_eq!(weights.of("org_missing").await, DEFAULT_WEIGHT);
    }
}
