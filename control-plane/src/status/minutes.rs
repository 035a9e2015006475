//! The per-minute aggregates per model, in the database (table `status_minutes`).

use sqlx::{AnyPool, Row};
use std::collections::HashMap;

/// One model's measurements over some minutes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Generations that ran or failed on our side.
    pub requests: i64,
    pub failures: i64,
    pub ttfb_samples: i64,
    pub ttfb_us: i64,
    /// Generations with tokens after their first, those tokens, and their time.
    pub tps_samples: i64,
    pub decode_tokens: i64,
    pub decode_us: i64,
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        self.requests += o.requests;
        self.failures += o.failures;
        self.ttfb_samples += o.ttfb_samples;
        self.ttfb_us += o.ttfb_us;
        self.tps_samples += o.tps_samples;
        self.decode_tokens += o.decode_tokens;
        self.decode_us += o.decode_us;
    }
}

#[derive(Clone)]
pub struct Minutes {
    pool: AnyPool,
}

impl Minutes {
    pub fn new(pool: AnyPool) -> Self {
        Self { pool }
    }

    /// Adds `counts` to `model`'s row for `minute` (made if missing), as written at `now_us`.
    pub async fn add(&self, minute: i64, model: &str, c: &Counts, now_us: i64) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO status_minutes (minute, model, requests, failures, ttfb_samples, ttfb_us, tps_samples, \
             decode_tokens, decode_us, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
             ON CONFLICT (minute, model) DO UPDATE SET \
             requests = status_minutes.requests + excluded.requests, \
             failures = status_minutes.failures + excluded.failures, \
             ttfb_samples = status_minutes.ttfb_samples + excluded.ttfb_samples, \
             ttfb_us = status_minutes.ttfb_us + excluded.ttfb_us, \
             tps_samples = status_minutes.tps_samples + excluded.tps_samples, \
             decode_tokens = status_minutes.decode_tokens + excluded.decode_tokens, \
             decode_us = status_minutes.decode_us + excluded.decode_us, \
             updated_at = CASE WHEN excluded.updated_at > status_minutes.updated_at \
                          THEN excluded.updated_at ELSE status_minutes.updated_at END",
        )
        .bind(minute)
        .bind(model)
        .bind(c.requests)
        .bind(c.failures)
        .bind(c.ttfb_samples)
        .bind(c.ttfb_us)
        .bind(c.tps_samples)
        .bind(c.decode_tokens)
        .bind(c.decode_us)
        .bind(now_us)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Each model's sums over the minutes from `first_minute` on.
    pub async fn sums_since(&self, first_minute: i64) -> Result<HashMap<String, Counts>, sqlx::Error> {
        // PostgreSQL sums BIGINTs to NUMERIC, which the `Any` driver cannot read.
        let rows = sqlx::query(
            "SELECT model, CAST(SUM(requests) AS BIGINT) AS requests, CAST(SUM(failures) AS BIGINT) AS failures, \
             CAST(SUM(ttfb_samples) AS BIGINT) AS ttfb_samples, CAST(SUM(ttfb_us) AS BIGINT) AS ttfb_us, \
             CAST(SUM(tps_samples) AS BIGINT) AS tps_samples, CAST(SUM(decode_tokens) AS BIGINT) AS decode_tokens, \
             CAST(SUM(decode_us) AS BIGINT) AS decode_us \
             FROM status_minutes WHERE minute >= $1 GROUP BY model",
        )
        .bind(first_minute)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let counts = Counts {
                    requests: r.try_get("requests")?,
                    failures: r.try_get("failures")?,
                    ttfb_samples: r.try_get("ttfb_samples")?,
                    ttfb_us: r.try_get("ttfb_us")?,
                    tps_samples: r.try_get("tps_samples")?,
                    decode_tokens: r.try_get("decode_tokens")?,
                    decode_us: r.try_get("decode_us")?,
                };
                Ok((r.try_get("model")?, counts))
            })
            .collect()
    }

    /// When the newest aggregate was written (µs since the epoch), if any was.
    pub async fn newest(&self) -> Result<Option<i64>, sqlx::Error> {
        let row = sqlx::query("SELECT MAX(updated_at) AS newest FROM status_minutes").fetch_one(&self.pool).await?;
        row.try_get("newest")
    }

    /// Deletes the minutes before `minute`; returns how many rows.
    pub async fn prune(&self, minute: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query("DELETE FROM status_minutes WHERE minute < $1").bind(minute).execute(&self.pool).await?;
        Ok(done.rows_affected())
    }
}
