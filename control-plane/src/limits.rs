//! Requests per minute per organization, by the generic cell rate algorithm: each
//! organization has a theoretical arrival time (TAT) that every admitted request pushes
//! one emission interval T = 60 s / rpm further; a request is admitted while the TAT is
//! at most (burst − 1) × T ahead of now. The TAT lives in the database and moves by one
//! conditional `UPDATE`, so control planes sharing a PostgreSQL share one limit — no
//! N-fold overshoot — and at most rpm + burst requests pass in any minute.
//!
//! An organization sending fast takes its tokens in batches (a token lease): one update
//! advances the TAT by n intervals when the first of them is admitted, and this control
//! plane admits the other n − 1 from memory within the n intervals they stand for. n
//! follows the organization's arrival rate here (50 ms of it) and is at most 50 ms of
//! its limit, so under 1,200 rpm it is 1 and the limit is exact; above, each control
//! plane may admit at most n − 1 requests beyond the bound (`TOKEN_LEASE_US`).

use sqlx::{AnyPool, Row};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// The time a token lease stands for, at most, and the arrivals it is sized to: 50 ms.
pub const TOKEN_LEASE_US: i64 = 50_000;
/// Arrivals are counted over windows this long to size token leases.
const ARRIVAL_WINDOW_US: i64 = 250_000;

/// The server's defaults (organizations may have their own rpm).
#[derive(Debug, Clone, Copy)]
pub struct RateConfig {
    pub default_rpm: u32,
    /// Requests that may arrive at once after a quiet spell.
    pub burst: u32,
}

impl Default for RateConfig {
    fn default() -> Self {
        Self { default_rpm: 200, burst: 20 }
    }
}

/// What the limiter decided, with what the x-ratelimit-* headers report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    pub limit: u32,
    pub remaining: u32,
    /// Until the organization's full burst is available again.
    pub reset_us: u64,
    /// Refused: how long until a retry is admitted.
    pub retry_after_us: u64,
}

#[derive(Clone)]
pub struct RateLimiter {
    pool: AnyPool,
    config: RateConfig,
    /// Tokens this control plane has leased, by organization.
    local: Arc<Mutex<HashMap<String, Tokens>>>,
    /// Decisions that went to the database.
    database_checks: Arc<std::sync::atomic::AtomicU64>,
}

/// An organization's leased tokens here, and its arrival rate.
#[derive(Debug, Clone, Copy)]
struct Tokens {
    left: u32,
    /// They stand for the intervals up to here (µs since the epoch): unused, they lapse.
    until: i64,
    /// The decision that leased them.
    decision: Decision,
    /// Refused until here: the TAT only moves forward, so no request is admitted
    /// sooner (unless the organization's limit is raised meanwhile).
    refused_until: i64,
    window_start: i64,
    arrivals: u32,
    per_sec: f64,
}

impl Tokens {
    fn arrive(&mut self, now: i64) {
        let dt = now - self.window_start;
        if dt >= ARRIVAL_WINDOW_US {
            let recent = self.arrivals as f64 * 1e6 / dt as f64;
            self.per_sec = if dt > 8 * ARRIVAL_WINDOW_US { recent } else { (self.per_sec + recent) / 2.0 };
            (self.window_start, self.arrivals) = (now, 0);
        }
        self.arrivals += 1;
    }

    /// How many tokens to lease: 50 ms of arrivals (the window in progress counted as
    /// if whole), within `most`.
    fn batch(&self, most: u32) -> u32 {
        let per_sec = self.per_sec.max(self.arrivals as f64 * 1e6 / ARRIVAL_WINDOW_US as f64);
        ((per_sec * TOKEN_LEASE_US as f64 / 1e6) as u32).clamp(1, most.max(1))
    }
}

pub fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

impl RateLimiter {
    pub fn new(pool: AnyPool, config: RateConfig) -> Self {
        Self { pool, config, local: Default::default(), database_checks: Default::default() }
    }

    /// How many decisions went to the database (the rest were leased tokens, or a
    /// refusal repeated before its retry time).
    pub fn database_checks(&self) -> u64 {
        self.database_checks.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub async fn check(&self, org_id: &str) -> Result<Decision, sqlx::Error> {
        self.check_at(org_id, now_us()).await
    }

    /// The decision for a request arriving at `now` (µs since the epoch; tests pass
    /// their own clock).
    pub async fn check_at(&self, org_id: &str, now: i64) -> Result<Decision, sqlx::Error> {
        let arrival = {
            let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
            if local.len() >= 65_536 {
                // Forget organizations quiet for a minute rather than grow without end.
                local.retain(|_, t| now - t.window_start < 60_000_000);
            }
            let t = local.entry(org_id.to_string()).or_insert(Tokens {
                left: 0,
                until: 0,
                decision: Decision { allowed: false, limit: 0, remaining: 0, reset_us: 0, retry_after_us: 0 },
                refused_until: 0,
                window_start: now,
                arrivals: 0,
                per_sec: 0.0,
            });
            t.arrive(now);
            if t.left > 0 && now < t.until {
                t.left -= 1;
                return Ok(Decision { remaining: t.decision.remaining + t.left, ..t.decision });
            }
            if now < t.refused_until {
                let wait = (t.refused_until - now) as u64;
                return Ok(Decision { retry_after_us: wait, reset_us: t.decision.reset_us.max(wait), ..t.decision });
            }
            *t
        };
        self.database_checks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let rpm = sqlx::query("SELECT rate_limit_rpm FROM orgs WHERE id = $1")
            .bind(org_id)
            .fetch_optional(&self.pool)
            .await?
            .and_then(|r| r.try_get::<Option<i64>, _>("rate_limit_rpm").ok().flatten())
            .map_or(self.config.default_rpm, |r| r.clamp(1, u32::MAX as i64) as u32);
        // At least a microsecond: a limit above 60 million a minute is no limit.
        let interval = (60_000_000 / rpm as i64).max(1);
        let batch = arrival.batch((TOKEN_LEASE_US / interval).clamp(1, u32::MAX as i64) as u32);
        let tolerance = interval * (self.config.burst.max(1) as i64 - 1);
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO rate_limit_state (org_id, tat_us) VALUES ($1, $2) ON CONFLICT (org_id) DO NOTHING")
            .bind(org_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        // max(tat, now) without MAX/GREATEST, which the two databases spell differently.
        let admitted = sqlx::query(
            "UPDATE rate_limit_state SET tat_us = (CASE WHEN tat_us > $1 THEN tat_us ELSE $1 END) + $2 \
             WHERE org_id = $3 AND (CASE WHEN tat_us > $1 THEN tat_us ELSE $1 END) - $1 <= $4",
        )
        .bind(now)
        .bind(interval * batch as i64)
        .bind(org_id)
        .bind(tolerance)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        let tat: i64 = sqlx::query("SELECT tat_us FROM rate_limit_state WHERE org_id = $1")
            .bind(org_id)
            .fetch_one(&mut *tx)
            .await?
            .try_get("tat_us")?;
        tx.commit().await?;
        let ahead = (tat - now).max(0);
        let decision = Decision {
            allowed: admitted,
            limit: rpm,
            remaining: ((tolerance + interval - ahead).max(0) / interval) as u32,
            reset_us: ahead as u64,
            retry_after_us: if admitted { 0 } else { (ahead - tolerance).max(1) as u64 },
        };
        if admitted && batch > 1 {
            metrics::counter!(crate::metrics::RATE_TOKEN_LEASES).increment(1);
        }
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = local.get_mut(org_id) {
            t.decision = decision;
            if admitted {
                (t.left, t.until) = (batch - 1, now + interval * batch as i64);
            } else {
                t.refused_until = now + decision.retry_after_us as i64;
            }
        }
        Ok(decision)
    }

    /// Sets an organization's own limit; None returns it to the server's default.
    pub async fn set_org_rpm(&self, org_id: &str, rpm: Option<u32>) -> Result<bool, sqlx::Error> {
        let done = sqlx::query("UPDATE orgs SET rate_limit_rpm = $1 WHERE id = $2")
            .bind(rpm.map(|r| r as i64))
            .bind(org_id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// A duration as OpenAI's x-ratelimit-reset-* headers write it (Go style): `12ms`,
/// `1s`, `6m0s`, `1h2m3.5s`.
pub fn go_duration(us: u64) -> String {
    if us < 1_000_000 {
        return format!("{}ms", us.div_ceil(1_000));
    }
    let ms = us.div_ceil(1_000);
    let (h, m, s) = (ms / 3_600_000, ms / 60_000 % 60, (ms % 60_000) as f64 / 1_000.0);
    let secs = format!("{s}s");
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_openai_writes_them() {
        assert_eq!(go_duration(11_200), "12ms");
        assert_eq!(go_duration(1_000_000), "1s");
        assert_eq!(go_duration(360_000_000), "6m0s");
        assert_eq!(go_duration(17_016_314_000), "4h43m36.314s");
    }
}
