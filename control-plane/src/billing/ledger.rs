//! The credit ledger in SQL (SQLite or PostgreSQL through sqlx `Any`): grants, a hold
//! per request taken only if the balance covers it, and its settlement — exactly once,
//! whoever asks and however often — into a charge, a release and a usage record.
//!
//! Admission is one conditional `UPDATE … WHERE balance >= amount`: PostgreSQL locks the
//! row and re-checks the condition for each concurrent writer, SQLite serialises the
//! writers, so no number of control planes can overdraw an organization.

use super::payments::{Charge, PaymentProcessor};
use super::subscriptions::record_payment;
use crate::accounts::keys;
use serde::Serialize;
use sqlx::{Any, AnyPool, Row, Transaction};
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Payment(#[from] super::payments::PaymentError),
}

/// A request's claim on credit, taken before it runs.
#[derive(Debug, Clone)]
pub struct NewHold {
    pub request_id: String,
    pub org_id: String,
    pub amount: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Held,
    /// The balance does not cover the hold; nothing was taken.
    Insufficient {
        balance: i64,
    },
}

/// What a finished request used and cost.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UsageRecord {
    pub request_id: String,
    /// The client's own id for the request, when it gave one (`X-Client-Request-Id`).
    pub client_request_id: Option<String>,
    pub org_id: String,
    pub key_id: String,
    pub model: String,
    pub endpoint: String,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    pub reasoning_tokens: u64,
    pub cost_micros: u64,
    pub funding: String,
    pub multiplier_bp: u64,
    pub finish_reason: String,
    /// When it settled, in microseconds since the Unix epoch.
    pub created_at: i64,
}

impl UsageRecord {
    /// A request that used nothing (yet): no tokens, no cost, funded by credits at no
    /// discount, ended by being abandoned until told otherwise.
    pub fn unused(request_id: &str, org_id: &str) -> Self {
        Self {
            request_id: request_id.into(),
            client_request_id: None,
            org_id: org_id.into(),
            key_id: String::new(),
            model: String::new(),
            endpoint: String::new(),
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            reasoning_tokens: 0,
            cost_micros: 0,
            funding: "credits".into(),
            multiplier_bp: 10_000,
            finish_reason: "abandoned".into(),
            created_at: 0,
        }
    }
}

/// The columns `usage_from_row` reads; a macro so queries stay static strings.
macro_rules! usage_columns {
    () => {
        "request_id, client_request_id, org_id, key_id, model, endpoint, prompt_tokens, cached_tokens, \
         completion_tokens, reasoning_tokens, cost_micros, funding, multiplier_bp, finish_reason, created_at"
    };
}

#[derive(Clone)]
pub struct Ledger {
    pool: AnyPool,
    /// The control-plane process whose holds these are; its heartbeat keeps them.
    owner: Option<String>,
}

pub(super) fn org_account(org: &str) -> String {
    format!("org:{org}")
}

fn holds_account(org: &str) -> String {
    format!("holds:{org}")
}

/// The organization's credit leased to control planes (`lease`), not yet charged.
pub(super) fn leases_account(org: &str) -> String {
    format!("leases:{org}")
}

/// What an organization's requests cost, kept per organization so that settlements of
/// different organizations never wait on one row.
pub(super) fn revenue_account(org: &str) -> String {
    format!("revenue:{org}")
}

fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

pub(super) fn amount(v: u64) -> Result<i64, LedgerError> {
    i64::try_from(v).map_err(|_| LedgerError::Invalid(format!("{v} micro-dollars is out of range")))
}

impl Ledger {
    pub fn new(pool: AnyPool) -> Self {
        Self { pool, owner: None }
    }

    /// Budget leases of this database's credit, taken by control-plane process `owner`.
    pub fn leases(&self, owner: &str, config: super::lease::LeaseConfig) -> super::lease::Leases {
        super::lease::Leases::new(self.pool.clone(), owner, config)
    }

    /// Sums of this database's usage records, for reports.
    pub fn usage_reports(&self) -> super::usage::UsageReports {
        super::usage::UsageReports::new(self.pool.clone())
    }

    /// The same, taking holds on behalf of control-plane process `owner`.
    pub fn owned_by(self, owner: &str) -> Self {
        Self { owner: Some(owner.into()), ..self }
    }

    /// Records that control-plane process `owner` is alive at `now_us`.
    pub async fn heartbeat(&self, owner: &str, now_us: i64) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO control_planes (id, heartbeat_at) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
        )
        .bind(owner)
        .bind(now_us)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Settles as unused every open hold whose owning process has not beaten its heart
    /// since `alive_since_us`, and expires its budget leases (their remainders back to
    /// the organizations). Returns how many holds and leases.
    pub async fn release_orphaned(&self, alive_since_us: i64) -> Result<u32, LedgerError> {
        let leases = super::lease::expire_orphaned(&self.pool, alive_since_us).await?;
        let rows = sqlx::query(
            "SELECT request_id, org_id FROM holds WHERE settled_at IS NULL AND owner IS NOT NULL \
             AND owner NOT IN (SELECT id FROM control_planes WHERE heartbeat_at >= $1)",
        )
        .bind(alive_since_us)
        .fetch_all(&self.pool)
        .await?;
        Ok(self.settle_unused(rows).await? + leases)
    }

    /// Credit for an organization from outside the ledger (a grant or a purchase).
    pub async fn grant(&self, org_id: &str, micros: u64, memo: &str) -> Result<(), LedgerError> {
        let mut tx = self.pool.begin().await?;
        grant_in(&mut tx, org_id, micros, memo).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Credit bought with `method` (one-time methods too): charged through the
    /// processor, then granted. Returns the processor's reference.
    pub async fn purchase(
        &self,
        processor: &dyn PaymentProcessor,
        org_id: &str,
        micros: u64,
        method: &str,
    ) -> Result<String, LedgerError> {
        self.purchase_once(processor, org_id, micros, method, &keys::random_id("credits_")).await
    }

    /// The same, named by `key`: asked again with the same key (a form submitted
    /// twice, a retry after the processor did not answer), it charges and grants
    /// nothing more and returns the first reference — even once the processor has
    /// forgotten the key, since the payment recorded here is looked up first.
    pub async fn purchase_once(
        &self,
        processor: &dyn PaymentProcessor,
        org_id: &str,
        micros: u64,
        method: &str,
        key: &str,
    ) -> Result<String, LedgerError> {
        if micros == 0 {
            return Err(LedgerError::Invalid("a purchase must be positive".into()));
        }
        if let Some(reference) = self.recorded_purchase(key, org_id, micros, method).await? {
            return Ok(reference);
        }
        let charge = Charge {
            idempotency_key: key.into(),
            method: method.into(),
            amount_micros: amount(micros)?,
            description: "credits".into(),
        };
        let receipt = processor.charge(&charge).await?;
        let mut tx = self.pool.begin().await?;
        let now_us = crate::limits::now_us();
        let first =
            record_payment(&mut tx, key, org_id, "credits", charge.amount_micros, method, &receipt.reference, now_us)
                .await?;
        if first {
            grant_in(&mut tx, org_id, micros, &format!("purchase {}", receipt.reference)).await?;
        }
        tx.commit().await?;
        Ok(receipt.reference)
    }

    /// The reference of the credit purchase recorded under `key`, if any; one recorded
    /// for another payer, amount or method is refused rather than taken for this one.
    async fn recorded_purchase(
        &self,
        key: &str,
        org_id: &str,
        micros: u64,
        method: &str,
    ) -> Result<Option<String>, LedgerError> {
        let row = sqlx::query("SELECT payer, amount_micros, payment_method, processor_ref FROM payments WHERE id = $1")
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let (payer, paid, paid_with): (String, i64, String) =
            (row.try_get("payer")?, row.try_get("amount_micros")?, row.try_get("payment_method")?);
        if payer != org_id || paid != amount(micros)? || paid_with != method {
            return Err(LedgerError::Invalid("this purchase was already paid with another amount or method".into()));
        }
        Ok(Some(row.try_get("processor_ref")?))
    }

    /// Credit added to an organization (grants and purchases), newest first: when
    /// (seconds since the epoch), how much, and the memo.
    pub async fn credits_added(&self, org_id: &str, limit: u32) -> Result<Vec<(i64, i64, String)>, LedgerError> {
        let rows = sqlx::query(
            "SELECT created_at, amount, memo FROM ledger_transfers WHERE to_account = $1 AND kind = 'grant' \
             ORDER BY created_at DESC, id LIMIT $2",
        )
        .bind(org_account(org_id))
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| Ok((r.try_get("created_at")?, r.try_get("amount")?, r.try_get("memo")?)))
            .collect::<Result<_, sqlx::Error>>()?)
    }

    /// An organization's credit not yet charged: its own account, and what control
    /// planes have leased of it (per-request holds of requests in flight excluded; the
    /// worst cases held in memory against leases included), read together.
    pub async fn balance(&self, org_id: &str) -> Result<i64, LedgerError> {
        let row = sqlx::query(
            "SELECT CAST(COALESCE(SUM(balance), 0) AS BIGINT) AS balance FROM ledger_accounts WHERE id IN ($1, $2)",
        )
        .bind(org_account(org_id))
        .bind(leases_account(org_id))
        .fetch_one(&self.pool)
        .await?;
        Ok(row.try_get("balance")?)
    }

    /// Credit held by an organization's requests in flight.
    pub async fn held(&self, org_id: &str) -> Result<i64, LedgerError> {
        account_balance(&self.pool, &holds_account(org_id)).await
    }

    /// Takes the hold if the balance covers it, atomically.
    pub async fn hold(&self, h: &NewHold) -> Result<Admission, LedgerError> {
        let micros = amount(h.amount)?;
        let mut tx = self.pool.begin().await?;
        // Writes first, so that SQLite takes its write lock before reading anything (and
        // an organization never granted anything can still take a free request).
        open_account(&mut tx, &org_account(&h.org_id)).await?;
        open_account(&mut tx, &holds_account(&h.org_id)).await?;
        let taken = sqlx::query("UPDATE ledger_accounts SET balance = balance - $1 WHERE id = $2 AND balance >= $1")
            .bind(micros)
            .bind(org_account(&h.org_id))
            .execute(&mut *tx)
            .await?;
        if taken.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(Admission::Insufficient { balance: self.balance(&h.org_id).await? });
        }
        sqlx::query("UPDATE ledger_accounts SET balance = balance + $1 WHERE id = $2")
            .bind(micros)
            .bind(holds_account(&h.org_id))
            .execute(&mut *tx)
            .await?;
        if micros > 0 {
            record(
                &mut tx,
                &org_account(&h.org_id),
                &holds_account(&h.org_id),
                micros,
                "hold",
                Some(&h.request_id),
                "",
            )
            .await?;
        }
        sqlx::query("INSERT INTO holds (request_id, org_id, amount, created_at, owner) VALUES ($1, $2, $3, $4, $5)")
            .bind(&h.request_id)
            .bind(&h.org_id)
            .bind(micros)
            .bind(now())
            .bind(&self.owner)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Admission::Held)
    }

    /// Settles a hold to `usage.cost_micros` (at most the hold): the cost is charged, the
    /// rest released, the usage recorded. True if this call settled it; a hold already
    /// settled is left as it is.
    pub async fn settle(&self, usage: &UsageRecord) -> Result<bool, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let claimed = sqlx::query("UPDATE holds SET settled_at = $1 WHERE request_id = $2 AND settled_at IS NULL")
            .bind(now())
            .bind(&usage.request_id)
            .execute(&mut *tx)
            .await?;
        if claimed.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        let row = sqlx::query("SELECT org_id, amount, funding, user_id FROM holds WHERE request_id = $1")
            .bind(&usage.request_id)
            .fetch_one(&mut *tx)
            .await?;
        let org: String = row.try_get("org_id")?;
        let held: i64 = row.try_get("amount")?;
        let funding: String = row.try_get("funding")?;
        let user: Option<String> = row.try_get("user_id")?;
        let cost = within_hold(usage, held);
        match user.filter(|_| funding == "subscription") {
            // Included usage, which is not money in the ledger.
            Some(user) => super::subscriptions::settle(&mut tx, &user, held, cost).await?,
            None => {
                let (holds, revenue) = (holds_account(&org), revenue_account(&org));
                let id = Some(usage.request_id.as_str());
                open_account(&mut tx, &revenue).await?;
                let deltas = [(org_account(&org), held - cost), (holds.clone(), -held), (revenue.clone(), cost)];
                move_balances(&mut tx, &deltas).await?;
                if cost > 0 {
                    record(&mut tx, &holds, &revenue, cost, "charge", id, "").await?;
                }
                if held > cost {
                    record(&mut tx, &holds, &org_account(&org), held - cost, "release", id, "").await?;
                }
            }
        }
        let u = UsageRecord { cost_micros: cost as u64, org_id: org, funding, ..usage.clone() };
        insert_usage(&mut tx, &[&u]).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// An organization's usage records, newest first.
    pub async fn usage(&self, org_id: &str, limit: u32) -> Result<Vec<UsageRecord>, LedgerError> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            usage_columns!(),
            " FROM usage_records WHERE org_id = $1 ORDER BY created_at DESC, request_id LIMIT $2"
        ))
        .bind(org_id)
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(usage_from_row).collect()
    }

    /// One request's usage record, if it has settled.
    pub async fn usage_record(&self, request_id: &str) -> Result<Option<UsageRecord>, LedgerError> {
        let row = sqlx::query(concat!("SELECT ", usage_columns!(), " FROM usage_records WHERE request_id = $1"))
            .bind(request_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(usage_from_row).transpose()
    }

    /// Holds older than `age_secs` that were never settled (their control plane died
    /// mid-request), settled as unused: their credit returns to the organization.
    pub async fn release_stale(&self, age_secs: i64) -> Result<u32, LedgerError> {
        let rows = sqlx::query("SELECT request_id, org_id FROM holds WHERE settled_at IS NULL AND created_at < $1")
            .bind(now() - age_secs)
            .fetch_all(&self.pool)
            .await?;
        self.settle_unused(rows).await
    }

    async fn settle_unused(&self, rows: Vec<sqlx::any::AnyRow>) -> Result<u32, LedgerError> {
        let mut released = 0;
        for r in rows {
            let (id, org): (String, String) = (r.try_get("request_id")?, r.try_get("org_id")?);
            let usage = UsageRecord::unused(&id, &org);
            // One hold that fails to settle must not keep the others held.
            match self.settle(&usage).await {
                Ok(settled) => released += settled as u32,
                Err(e) => tracing::error!("releasing stale hold {}: {e}", usage.request_id),
            }
        }
        Ok(released)
    }

    /// Checks the ledger's invariants: every account's balance is the sum of its
    /// transfers, and all balances sum to zero. Returns the number of accounts.
    pub async fn audit(&self) -> Result<usize, LedgerError> {
        let accounts = sqlx::query("SELECT id, balance FROM ledger_accounts").fetch_all(&self.pool).await?;
        let mut total: i64 = 0;
        for a in &accounts {
            let id: String = a.try_get("id")?;
            let balance: i64 = a.try_get("balance")?;
            let flows = sqlx::query(
                // PostgreSQL sums BIGINTs as NUMERIC: cast back for the Any driver.
                "SELECT CAST(COALESCE(SUM(CASE WHEN to_account = $1 THEN amount ELSE 0 END), 0) - \
                 COALESCE(SUM(CASE WHEN from_account = $1 THEN amount ELSE 0 END), 0) AS BIGINT) AS net \
                 FROM ledger_transfers WHERE to_account = $1 OR from_account = $1",
            )
            .bind(&id)
            .fetch_one(&self.pool)
            .await?;
            let net: i64 = flows.try_get("net")?;
            if net != balance {
                return Err(LedgerError::Invalid(format!(
                    "account {id}: balance {balance} but transfers sum to {net}"
                )));
            }
            total += balance;
        }
        if total != 0 {
            return Err(LedgerError::Invalid(format!("the balances sum to {total}, not zero")));
        }
        Ok(accounts.len())
    }
}

async fn grant_in(tx: &mut Transaction<'_, Any>, org_id: &str, micros: u64, memo: &str) -> Result<(), LedgerError> {
    if micros == 0 {
        return Err(LedgerError::Invalid("a grant must be positive".into()));
    }
    open_account(tx, &org_account(org_id)).await?;
    let (org, micros) = (org_account(org_id), amount(micros)?);
    move_balances(tx, &[("grants".into(), -micros), (org.clone(), micros)]).await?;
    record(tx, "grants", &org, micros, "grant", None, memo).await?;
    Ok(())
}

async fn account_balance(pool: &AnyPool, id: &str) -> Result<i64, LedgerError> {
    let row = sqlx::query("SELECT balance FROM ledger_accounts WHERE id = $1").bind(id).fetch_optional(pool).await?;
    Ok(match row {
        Some(r) => r.try_get("balance")?,
        None => 0,
    })
}

pub(super) async fn open_account(tx: &mut Transaction<'_, Any>, id: &str) -> Result<(), LedgerError> {
    sqlx::query("INSERT INTO ledger_accounts (id, balance) VALUES ($1, 0) ON CONFLICT (id) DO NOTHING")
        .bind(id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Where an account comes in the order every transaction locks accounts in — grants,
/// an organization's credit, its holds and leases, revenue — so that concurrent transactions on
/// PostgreSQL never wait on each other in a cycle.
fn lock_rank(account: &str) -> u8 {
    match account {
        "grants" => 0,
        a if a.starts_with("org:") => 1,
        a if a.starts_with("holds:") || a.starts_with("leases:") => 2,
        _ => 3,
    }
}

/// Adds each delta to its account's balance, in lock order.
pub(super) async fn move_balances(tx: &mut Transaction<'_, Any>, deltas: &[(String, i64)]) -> Result<(), LedgerError> {
    let mut ordered: Vec<&(String, i64)> = deltas.iter().filter(|(_, d)| *d != 0).collect();
    ordered.sort_by_key(|(a, _)| (lock_rank(a), a.clone()));
    for (account, delta) in ordered {
        sqlx::query("UPDATE ledger_accounts SET balance = balance + $1 WHERE id = $2")
            .bind(delta)
            .bind(account)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// A transfer's row (`move_balances` moves the balances).
pub(super) async fn record(
    tx: &mut Transaction<'_, Any>,
    from: &str,
    to: &str,
    micros: i64,
    kind: &str,
    request_id: Option<&str>,
    memo: &str,
) -> Result<(), LedgerError> {
    sqlx::query(
        "INSERT INTO ledger_transfers (id, from_account, to_account, amount, kind, request_id, memo, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(keys::random_id("tr_"))
    .bind(from)
    .bind(to)
    .bind(micros)
    .bind(kind)
    .bind(request_id)
    .bind(memo)
    .bind(now())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// What a request is charged: its cost, at most what it held.
pub(super) fn within_hold(usage: &UsageRecord, held: i64) -> i64 {
    let asked = i64::try_from(usage.cost_micros).unwrap_or(i64::MAX);
    if asked > held {
        // A correct worst case never allows this: charge what was held, and say so.
        tracing::warn!("{}: cost {asked} exceeds its hold {held}; charging the hold", usage.request_id);
    }
    asked.min(held)
}

/// `rows` rows of `columns` numbered placeholders, for a multi-row VALUES:
/// `($1, $2), ($3, $4)`.
pub(super) fn placeholders(rows: usize, columns: usize) -> String {
    let row = |r: usize| {
        let cells: Vec<String> = (1..=columns).map(|c| format!("${}", r * columns + c)).collect();
        format!("({})", cells.join(", "))
    };
    (0..rows).map(row).collect::<Vec<_>>().join(", ")
}

/// Writes usage records, settled now, in one statement.
pub(super) async fn insert_usage(tx: &mut Transaction<'_, Any>, records: &[&UsageRecord]) -> Result<(), LedgerError> {
    if records.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "INSERT INTO usage_records (request_id, org_id, key_id, model, endpoint, prompt_tokens, cached_tokens, \
         completion_tokens, reasoning_tokens, cost_micros, funding, multiplier_bp, finish_reason, created_at, \
         client_request_id) VALUES {}",
        placeholders(records.len(), 15)
    );
    let now_us = crate::limits::now_us();
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for u in records {
        q = q
            .bind(&u.request_id)
            .bind(&u.org_id)
            .bind(&u.key_id)
            .bind(&u.model)
            .bind(&u.endpoint)
            .bind(u.prompt_tokens as i64)
            .bind(u.cached_tokens as i64)
            .bind(u.completion_tokens as i64)
            .bind(u.reasoning_tokens as i64)
            .bind(u.cost_micros as i64)
            .bind(&u.funding)
            .bind(u.multiplier_bp as i64)
            .bind(&u.finish_reason)
            .bind(now_us)
            .bind(&u.client_request_id);
    }
    q.execute(&mut **tx).await?;
    Ok(())
}

fn usage_from_row(r: &sqlx::any::AnyRow) -> Result<UsageRecord, LedgerError> {
    let n = |c: &str| -> Result<u64, LedgerError> { Ok(r.try_get::<i64, _>(c)?.max(0) as u64) };
    Ok(UsageRecord {
        request_id: r.try_get("request_id")?,
        client_request_id: r.try_get("client_request_id")?,
        org_id: r.try_get("org_id")?,
        key_id: r.try_get("key_id")?,
        model: r.try_get("model")?,
        endpoint: r.try_get("endpoint")?,
        prompt_tokens: n("prompt_tokens")?,
        cached_tokens: n("cached_tokens")?,
        completion_tokens: n("completion_tokens")?,
        reasoning_tokens: n("reasoning_tokens")?,
        cost_micros: n("cost_micros")?,
        funding: r.try_get("funding")?,
        multiplier_bp: n("multiplier_bp")?,
        finish_reason: r.try_get("finish_reason")?,
        created_at: r.try_get("created_at")?,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn placeholders_number_rows_then_columns() {
        assert_eq!(super::placeholders(2, 3), "($1, $2, $3), ($4, $5, $6)");
        assert_eq!(super::placeholders(1, 1), "($1)");
    }
}
