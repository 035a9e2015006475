//! What an organization used, summed in SQL from its usage records: per UTC day or
//! hour and per model, over a half-open range of time, filtered by key, model and how
//! it was paid. The console's charts, its table, its CSV and the billing history all
//! read these sums; nothing is summed twice or anywhere else.
//!
//! Buckets are whole days or hours since the Unix epoch, so they start at UTC
//! midnight and on the hour whatever the browser's time zone; a bucket holds the sum
//! of every record in it (never the last one written), and a range adds no bucket
//! before its start or after its end.

use serde::Serialize;
use sqlx::{AnyPool, Row};

pub const HOUR_US: i64 = 3_600_000_000;
pub const DAY_US: i64 = 24 * HOUR_US;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Granularity {
    Day,
    Hour,
}

impl Granularity {
    pub fn micros(self) -> i64 {
        match self {
            Self::Day => DAY_US,
            Self::Hour => HOUR_US,
        }
    }
}

/// Which records count. `None` means any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub key_id: Option<String>,
    pub model: Option<String>,
    /// `credits` or `subscription`.
    pub funding: Option<String>,
}

/// One bucket of one model: sums over its records.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Sums {
    /// The bucket's start, µs since the epoch (UTC).
    pub bucket: i64,
    pub model: String,
    pub requests: i64,
    /// Prompt tokens, cached ones included (as the API's `prompt_tokens`).
    pub input_tokens: i64,
    pub cached_input_tokens: i64,
    /// Completion tokens, reasoning included (as the API's `completion_tokens`).
    pub output_tokens: i64,
    pub reasoning_tokens: i64,
    /// What was charged: credits at standard rates, plan usage at its discount.
    pub cost_micros: i64,
}

impl Sums {
    pub fn add(&mut self, o: &Sums) {
        self.requests += o.requests;
        self.input_tokens += o.input_tokens;
        self.cached_input_tokens += o.cached_input_tokens;
        self.output_tokens += o.output_tokens;
        self.reasoning_tokens += o.reasoning_tokens;
        self.cost_micros += o.cost_micros;
    }
}

#[derive(Clone)]
pub struct UsageReports {
    pool: AnyPool,
}

impl UsageReports {
    pub fn new(pool: AnyPool) -> Self {
        Self { pool }
    }

    /// The sums per bucket and model for `org`'s records in `[start, end)` (µs),
    /// ordered by bucket then model; buckets without records are absent.
    pub async fn sums(
        &self,
        org: &str,
        start: i64,
        end: i64,
        by: Granularity,
        filter: &Filter,
    ) -> Result<Vec<Sums>, sqlx::Error> {
        // PostgreSQL sums BIGINTs as NUMERIC: cast back. Integer division floors for
        // the non-negative times stored here on both databases.
        let mut sql = String::from(
            "SELECT (created_at / $1) * $1 AS bucket, model, COUNT(*) AS requests, \
             CAST(SUM(prompt_tokens) AS BIGINT) AS input_tokens, \
             CAST(SUM(cached_tokens) AS BIGINT) AS cached_input_tokens, \
             CAST(SUM(completion_tokens) AS BIGINT) AS output_tokens, \
             CAST(SUM(reasoning_tokens) AS BIGINT) AS reasoning_tokens, \
             CAST(SUM(cost_micros) AS BIGINT) AS cost_micros \
             FROM usage_records WHERE org_id = $2 AND created_at >= $3 AND created_at < $4",
        );
        let mut binds = Vec::new();
        for (column, value) in [("key_id", &filter.key_id), ("model", &filter.model), ("funding", &filter.funding)] {
            if let Some(v) = value {
                binds.push(v.clone());
                sql.push_str(&format!(" AND {column} = ${}", 4 + binds.len()));
            }
        }
        sql.push_str(" GROUP BY bucket, model ORDER BY bucket, model");
        // Only the fixed fragments above make up the text; every value is bound.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(by.micros()).bind(org).bind(start).bind(end);
        for v in binds {
            query = query.bind(v);
        }
        let rows = query.fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                Ok(Sums {
                    bucket: r.try_get("bucket")?,
                    model: r.try_get("model")?,
                    requests: r.try_get("requests")?,
                    input_tokens: r.try_get("input_tokens")?,
                    cached_input_tokens: r.try_get("cached_input_tokens")?,
                    output_tokens: r.try_get("output_tokens")?,
                    reasoning_tokens: r.try_get("reasoning_tokens")?,
                    cost_micros: r.try_get("cost_micros")?,
                })
            })
            .collect()
    }
}

/// The totals of a report: one `Sums` without bucket or model.
pub fn total(rows: &[Sums]) -> Sums {
    let mut t = Sums::default();
    for r in rows {
        t.add(r);
    }
    t
}
