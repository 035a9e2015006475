//! Requests per minute per organization, by the generic cell rate algorithm: each
//! organization has a theoretical arrival time (TAT) that every admitted request pushes
//! one emission interval T = 60 s / rpm further; a request is admitted while the TAT is
//! at most (burst − 1) × T ahead of now. The TAT lives in the database and moves by one
//! conditional `UPDATE`, so control planes sharing a PostgreSQL share one limit — no
//! N-fold overshoot — and at most rpm + burst requests pass in any minute.
//!
//! An organization sending fast takes its tokens in batches (a token lease): one update
//! admits n requests at once, as GCRA would admit n arriving together, and this control
//! plane spends them from memory within the n intervals they stand for. n follows the
//! organization's arrival rate here (50 ms of it), within 50 ms of its limit and half
//! the burst, so under 1,200 rpm it is 1 and the limit is exact. Above, the next lease
//! is taken in the background once half of one is spent, and a token spent later than
//! it was leased (within 50 ms) may land in a later window: each control plane holds
//! fewer than 1.5 n unspent, so admits fewer than 1.5 n beyond the bound in any window. Near the limit GCRA admits
//! fewer at once, and n falls to 1.

use crate::rate::Rate;
use sqlx::{AnyPool, Row};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// The time a token lease stands for, at most, and the arrivals it is sized to: 50 ms.
pub const TOKEN_LEASE_US: i64 = 50_000;

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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
#[derive(Debug, Clone)]
struct Tokens {
    /// Held by the one decision going to the database.
    gate: Arc<tokio::sync::Mutex<()>>,
    left: u32,
    /// They stand for the intervals up to here (µs since the epoch): unused, they lapse.
    until: i64,
    /// How many the last lease took (a refill is due at half of it).
    leased: u32,
    /// The decision that leased them.
    decision: Decision,
    /// The last refusal, standing until `refused_until`.
    refused: Decision,
    /// Refused until here: the TAT only moves forward, so no request is admitted
    /// sooner (unless the organization's limit is raised meanwhile).
    refused_until: i64,
    /// Arrivals per second here.
    arrivals: Rate,
}

impl Tokens {
    fn new(now: i64) -> Self {
        Self {
            gate: Default::default(),
            left: 0,
            leased: 0,
            until: 0,
            decision: Decision::default(),
            refused: Decision::default(),
            refused_until: 0,
            arrivals: Rate::new(now),
        }
    }

    /// What a lease of `taken` tokens (0: refused) leaves here. They may be spent for
    /// 50 ms (at least the intervals they stand for): at most n − 1 unspent when the
    /// next lease is due, and fewer than 1.5 n after it.
    fn take(&mut self, taken: i64, decision: Decision, now: i64) {
        if taken > 0 {
            self.decision = decision;
            let interval = 60_000_000 / decision.limit.max(1) as i64;
            let live = if now < self.until { self.left } else { 0 };
            self.left = live + taken as u32;
            self.leased = taken as u32;
            self.until = now + (interval.max(1) * taken).max(TOKEN_LEASE_US);
        } else {
            self.refused = decision;
            self.refused_until = now + decision.retry_after_us as i64;
        }
    }

    /// The decision from memory, when there is one: a leased token, or the refusal
    /// still standing.
    fn decide(&mut self, now: i64) -> Option<Decision> {
        if self.left > 0 && now < self.until {
            self.left -= 1;
            return Some(Decision { remaining: self.decision.remaining + self.left, ..self.decision });
        }
        if now < self.refused_until {
            let wait = (self.refused_until - now) as u64;
            return Some(Decision { retry_after_us: wait, reset_us: self.refused.reset_us.max(wait), ..self.refused });
        }
        None
    }

    /// How many tokens to lease: 50 ms of arrivals (the window in progress counted as
    /// if whole), within `most`.
    fn batch(&self, most: u32) -> u32 {
        ((self.arrivals.per_sec() * TOKEN_LEASE_US as f64 / 1e6) as u32).clamp(1, most.max(1))
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
        let decision = self.decide(org_id, now_us).await?;
        self.refill_ahead(org_id);
        Ok(decision)
    }

    /// The decision for a request arriving at `now` (µs since the epoch; tests pass
    /// their own clock).
    pub async fn check_at(&self, org_id: &str, now: i64) -> Result<Decision, sqlx::Error> {
        self.decide(org_id, || now).await
    }

    /// The decision, on `clock`: from this control plane's leased tokens when it has
    /// one (or a refusal standing), else from the database.
    async fn decide(&self, org_id: &str, clock: impl Fn() -> i64) -> Result<Decision, sqlx::Error> {
        let now = clock();
        let gate = {
            let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
            if local.len() >= 65_536 {
                // Forget organizations quiet for a minute rather than grow without end.
                local.retain(|_, t| now - t.arrivals.since() < 60_000_000);
            }
            let t = local.entry(org_id.to_string()).or_insert_with(|| Tokens::new(now));
            t.arrivals.add(now, 1);
            if let Some(d) = t.decide(now) {
                return Ok(d);
            }
            t.gate.clone()
        };
        // One lease at a time goes to the database per organization; those that waited
        // for it take from what it leased.
        let _one = gate.lock_owned().await;
        if let Some(d) = self.local_decision(org_id, clock()) {
            return Ok(d);
        }
        let (taken, decision) = self.lease(org_id, &clock).await?;
        let now = clock();
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = local.get_mut(org_id) {
            t.take(taken, decision, now);
            if taken > 0 {
                t.left -= 1;
            }
        }
        Ok(decision)
    }

    fn local_decision(&self, org_id: &str, now: i64) -> Option<Decision> {
        self.local.lock().unwrap_or_else(|e| e.into_inner()).get_mut(org_id)?.decide(now)
    }

    /// Leases the next tokens in the background once half of a lease is spent, so
    /// that a fast organization's requests seldom wait for the database.
    fn refill_ahead(&self, org_id: &str) {
        let gate = {
            let local = self.local.lock().unwrap_or_else(|e| e.into_inner());
            let Some(t) = local.get(org_id) else { return };
            // Not while refused: no token is to be had before the retry time.
            if t.leased < 2 || t.left * 2 > t.leased || now_us() < t.refused_until {
                return;
            }
            match t.gate.clone().try_lock_owned() {
                Ok(gate) => gate,
                Err(_) => return,
            }
        };
        let (limiter, org_id) = (self.clone(), org_id.to_string());
        tokio::spawn(async move {
            let _one = gate;
            match limiter.lease(&org_id, &now_us).await {
                Ok((taken, decision)) => {
                    let mut local = limiter.local.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(t) = local.get_mut(&org_id) {
                        t.take(taken, decision, now_us());
                    }
                }
                Err(e) => tracing::warn!("leasing rate-limit tokens for {org_id}: {e}"),
            }
        });
    }

    /// One transaction: as many tokens as GCRA admits at once now, up to the batch the
    /// organization's arrivals here ask for. Judged on the clock read after the row,
    /// since a request that waited for it would otherwise see the TAT from the past.
    async fn lease(&self, org_id: &str, clock: &impl Fn() -> i64) -> Result<(i64, Decision), sqlx::Error> {
        self.database_checks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let arrival = self.local.lock().unwrap_or_else(|e| e.into_inner()).get(org_id).cloned();
        let rpm = sqlx::query("SELECT rate_limit_rpm FROM orgs WHERE id = $1")
            .bind(org_id)
            .fetch_optional(&self.pool)
            .await?
            .and_then(|r| r.try_get::<Option<i64>, _>("rate_limit_rpm").ok().flatten())
            .map_or(self.config.default_rpm, |r| r.clamp(1, u32::MAX as i64) as u32);
        // At least a microsecond: a limit above 60 million a minute is no limit.
        let interval = (60_000_000 / rpm as i64).max(1);
        let tolerance = interval * (self.config.burst.max(1) as i64 - 1);
        // Up to 50 ms of the limit and half the burst: a lease never takes so many that
        // another control plane's request would be refused below the limit.
        let most = (TOKEN_LEASE_US / interval).min(self.config.burst as i64 / 2).clamp(1, u32::MAX as i64);
        let batch = arrival.map_or(1, |a| a.batch(most as u32)) as i64;
        let (taken, tat, now) = loop {
            let mut tx = self.pool.begin().await?;
            sqlx::query(
                "INSERT INTO rate_limit_state (org_id, tat_us) VALUES ($1, $2) ON CONFLICT (org_id) DO NOTHING",
            )
            .bind(org_id)
            .bind(clock())
            .execute(&mut *tx)
            .await?;
            let seen: i64 = sqlx::query("SELECT tat_us FROM rate_limit_state WHERE org_id = $1")
                .bind(org_id)
                .fetch_one(&mut *tx)
                .await?
                .try_get("tat_us")?;
            let now = clock();
            let base = seen.max(now);
            if base - now > tolerance {
                tx.commit().await?;
                break (0, seen, now);
            }
            let taken = batch.min((tolerance - (base - now)) / interval + 1);
            let tat = base + taken * interval;
            // Compare and set: another control plane that moved the TAT since the read
            // makes this one read again (SQLite's write lock, taken by the insert,
            // already excludes it).
            let set = sqlx::query("UPDATE rate_limit_state SET tat_us = $1 WHERE org_id = $2 AND tat_us = $3")
                .bind(tat)
                .bind(org_id)
                .bind(seen)
                .execute(&mut *tx)
                .await?;
            if set.rows_affected() == 1 {
                tx.commit().await?;
                break (taken, tat, now);
            }
            tx.rollback().await?;
        };
        if taken > 1 {
            metrics::counter!(crate::metrics::RATE_TOKEN_LEASES).increment(1);
        }
        let ahead = (tat - now).max(0);
        let admitted = taken > 0;
        Ok((
            taken,
            Decision {
                allowed: admitted,
                limit: rpm,
                remaining: ((tolerance + interval - ahead).max(0) / interval) as u32,
                reset_us: ahead as u64,
                retry_after_us: if admitted { 0 } else { (ahead - tolerance).max(1) as u64 },
            },
        ))
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
