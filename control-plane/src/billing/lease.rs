//! Budget leases: admission without a hot row. A control plane takes a slice of an
//! organization's credit in one transaction (`org:` → `leases:`), then admits that
//! organization's requests against the slice in memory: a request's worst case is held
//! by subtracting it from the lease, not by a write. Settlements are written in
//! batches, one transaction for whatever queued while the last one ran (group commit),
//! each charging the lease (`leases:` → `revenue:`), writing the request's settled hold
//! row (one per request id: nothing is charged twice) and its usage record.
//!
//! The slice is sized to the organization's observed spend at this control plane
//! (about `seconds_of_spend` of it), never more than a quarter of what is left in its
//! account, and never less than the request that asked: a small organization's lease
//! is its next request's worst case, so that it sees its last cent. A lease renews in
//! the background once half of it is spent; when it idles, its control plane shuts
//! down, or that control plane stops beating its heart and another one expires it,
//! what it holds — granted − charged − returned, all kept on the lease's row — goes
//! back to the organization.
//!
//! Exactness: in memory, available + held by requests + settling = the lease's
//! remainder on its row; a request holds only from `available`, and is charged at most
//! what it held, so no organization's credit goes below zero however the control plane
//! ends. A settlement that has not committed when its control plane dies is not
//! charged (its lease's remainder returns it); one that arrives after its lease was
//! expired is refused by the lease's row, so the same credit is never spent twice.

use super::ledger::{self, LedgerError, UsageRecord};
use crate::accounts::keys;
pub use crate::rate::Rate;
use sqlx::{AnyPool, Row};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// A lease takes at most this fraction of what is left in the organization's account,
/// so that other control planes (and this one, next time) find credit there.
const SHARE_DIVISOR: i64 = 4;
/// Settlements written in one transaction, at most.
const MAX_BATCH: usize = 256;

/// What the operator tunes.
#[derive(Debug, Clone, Copy)]
pub struct LeaseConfig {
    /// How much of an organization's spend one lease covers, in seconds of it.
    pub seconds_of_spend: f64,
    /// A lease unused this long goes back to its organization.
    pub idle: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self { seconds_of_spend: 2.0, idle: Duration::from_secs(2) }
    }
}

/// One control plane's leases, by organization.
#[derive(Clone)]
pub struct Leases(Arc<Shared>);

struct Shared {
    pool: AnyPool,
    owner: String,
    config: LeaseConfig,
    orgs: Mutex<HashMap<String, Arc<OrgLease>>>,
    settle: mpsc::UnboundedSender<Settling>,
    stats: Arc<Counters>,
}

/// What this control plane's leases have cost the database so far.
#[derive(Debug, Default)]
struct Counters {
    renewals: AtomicU64,
    batches: AtomicU64,
    settlements: AtomicU64,
    returns: AtomicU64,
}

/// A snapshot of `Counters`: transactions are renewals + batches + returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseStats {
    pub renewals: u64,
    pub batches: u64,
    pub settlements: u64,
    pub returns: u64,
}

/// One organization's lease at this control plane.
struct OrgLease {
    org: String,
    current: Mutex<Current>,
    /// One renewal at a time.
    renewing: tokio::sync::Mutex<()>,
    /// A renewal ahead of need is running.
    ahead: AtomicBool,
}

struct Current {
    lease: Option<Arc<Lease>>,
    spend: Rate,
    last_used: Instant,
}

/// A lease's in-memory books: available + held + settling equals its row's remainder.
struct Lease {
    id: String,
    books: Mutex<Books>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Books {
    /// Leased and not held by any request.
    available: i64,
    /// Held by requests in flight.
    held: i64,
    /// Charged by settlements not yet written.
    settling: i64,
    /// The row is closed (expired by another control plane): nothing more from it.
    closed: bool,
}

/// A request's worst case, held against a lease.
pub struct LeaseHold {
    lease: Arc<Lease>,
    held: i64,
}

impl LeaseHold {
    pub fn lease_id(&self) -> &str {
        &self.lease.id
    }
}

/// A settlement waiting for its batch.
struct Settling {
    lease: Arc<Lease>,
    held: i64,
    usage: UsageRecord,
    done: oneshot::Sender<bool>,
}

/// What a renewal takes from an account holding `balance`: at least `need` (None if
/// the balance is short of it), up to `want` within a quarter of the balance.
pub fn slice(balance: i64, need: i64, want: i64) -> Option<i64> {
    if balance < need.max(0) || balance <= 0 {
        return None;
    }
    Some(balance.min(need.max(want.min(balance / SHARE_DIVISOR))))
}

/// What a renewal did.
enum Renewed {
    Took,
    /// The account holds less than was needed: its balance.
    Short(i64),
    /// The lease was expired meanwhile: start another.
    Closed,
}

impl Leases {
    /// Leases taken in the name of control-plane process `owner`; spawns the task that
    /// writes settlements (call it inside a Tokio runtime).
    pub fn new(pool: AnyPool, owner: &str, config: LeaseConfig) -> Self {
        let (settle, queue) = mpsc::unbounded_channel();
        let stats = Arc::new(Counters::default());
        tokio::spawn(write_settlements(pool.clone(), queue, stats.clone()));
        Self(Arc::new(Shared { pool, owner: owner.into(), config, orgs: Default::default(), settle, stats }))
    }

    /// What the leases have cost the database so far.
    pub fn stats(&self) -> LeaseStats {
        let s = &self.0.stats;
        LeaseStats {
            renewals: s.renewals.load(Ordering::Relaxed),
            batches: s.batches.load(Ordering::Relaxed),
            settlements: s.settlements.load(Ordering::Relaxed),
            returns: s.returns.load(Ordering::Relaxed),
        }
    }

    fn org(&self, org_id: &str) -> Arc<OrgLease> {
        let mut orgs = self.0.orgs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(org) = orgs.get(org_id) {
            return org.clone();
        }
        orgs.entry(org_id.to_string())
            .or_insert_with(|| {
                Arc::new(OrgLease {
                    org: org_id.into(),
                    current: Mutex::new(Current {
                        lease: None,
                        spend: Rate::new(crate::limits::now_us()),
                        last_used: Instant::now(),
                    }),
                    renewing: tokio::sync::Mutex::new(()),
                    ahead: AtomicBool::new(false),
                })
            })
            .clone()
    }

    /// Holds `worst` micro-dollars of `org_id`'s credit for a request: from this
    /// control plane's lease when it covers it (no database work), else after renewing
    /// the lease. `Err(balance)` when the organization's credit (its account and this
    /// lease) does not cover it.
    pub async fn hold(&self, org_id: &str, worst: u64) -> Result<Result<LeaseHold, i64>, LedgerError> {
        if let Some(hold) = self.hold_now(org_id, worst) {
            return Ok(Ok(hold));
        }
        self.hold_waiting(org_id, worst).await
    }

    /// `hold` without waiting: the hold when the lease covers it now (counting the
    /// request's arrival either way), else None, and then `hold_waiting`.
    pub fn hold_now(&self, org_id: &str, worst: u64) -> Option<LeaseHold> {
        let worst = i64::try_from(worst).ok().filter(|&w| w > 0)?;
        let org = self.org(org_id);
        let target = self.target(&org, worst);
        let hold = org.take(worst)?;
        self.renew_ahead(&org, target);
        Some(hold)
    }

    /// The rest of `hold` once `hold_now` found the lease short: waits for a renewal
    /// (one at a time per organization).
    pub async fn hold_waiting(&self, org_id: &str, worst: u64) -> Result<Result<LeaseHold, i64>, LedgerError> {
        let worst = ledger::amount(worst)?;
        if worst == 0 {
            // Nothing to lease for (a free request takes a hold of its own).
            return Err(LedgerError::Invalid("a lease holds a positive amount".into()));
        }
        let org = self.org(org_id);
        let target = self.target(&org, 0);
        let _one = org.renewing.lock().await;
        loop {
            if let Some(hold) = org.take(worst) {
                return Ok(Ok(hold));
            }
            let available = org.available();
            match self.renew(&org, worst - available, target - available).await? {
                Renewed::Took | Renewed::Closed => continue,
                Renewed::Short(balance) => return Ok(Err(balance + org.available())),
            }
        }
    }

    /// What a lease should hold for the organization now, counting an arrival of
    /// `worst` first (0: none).
    fn target(&self, org: &OrgLease, worst: i64) -> i64 {
        let mut c = org.current.lock().unwrap_or_else(|e| e.into_inner());
        if worst > 0 {
            c.spend.add(crate::limits::now_us(), worst);
        }
        c.last_used = Instant::now();
        (c.spend.per_sec() * self.0.config.seconds_of_spend) as i64
    }

    /// Renews in the background once the lease is down to half its target, so that
    /// admissions seldom wait for a renewal.
    fn renew_ahead(&self, org: &Arc<OrgLease>, target: i64) {
        if org.available() >= target / 2 || org.ahead.swap(true, Ordering::SeqCst) {
            return;
        }
        let (leases, org) = (self.clone(), org.clone());
        tokio::spawn(async move {
            if let Ok(_one) = org.renewing.try_lock() {
                let want = target - org.available();
                if want > 0
                    && let Err(e) = leases.renew(&org, 0, want).await
                {
                    tracing::warn!("renewing {}'s budget lease: {e}", org.org);
                }
            }
            org.ahead.store(false, Ordering::SeqCst);
        });
    }

    /// Takes at least `need` (and up to `want`, within the share of what is left) from
    /// the organization's account into its lease at this control plane, starting one
    /// if there is none. The caller holds `renewing`.
    async fn renew(&self, org: &OrgLease, need: i64, want: i64) -> Result<Renewed, LedgerError> {
        let current = org.current.lock().unwrap_or_else(|e| e.into_inner()).lease.clone();
        let (org_account, leases_account) = (ledger::org_account(&org.org), ledger::leases_account(&org.org));
        let now = crate::limits::now_us();
        let mut tx = self.0.pool.begin().await?;
        // The lease's row first (every transaction on a lease locks it before accounts).
        let id = match &current {
            Some(lease) => {
                let open =
                    sqlx::query("UPDATE budget_leases SET renewals = renewals + 1 WHERE id = $1 AND closed_at IS NULL")
                        .bind(&lease.id)
                        .execute(&mut *tx)
                        .await?;
                if open.rows_affected() == 0 {
                    tx.rollback().await?;
                    org.drop_closed(lease);
                    return Ok(Renewed::Closed);
                }
                lease.id.clone()
            }
            None => {
                let id = keys::random_id("lease_");
                sqlx::query("INSERT INTO budget_leases (id, org_id, owner, created_at) VALUES ($1, $2, $3, $4)")
                    .bind(&id)
                    .bind(&org.org)
                    .bind(&self.0.owner)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                id
            }
        };
        ledger::open_account(&mut tx, &org_account).await?;
        ledger::open_account(&mut tx, &leases_account).await?;
        // Lock the account's row (a write, which SQLite serialises), then read it.
        sqlx::query("UPDATE ledger_accounts SET balance = balance WHERE id = $1")
            .bind(&org_account)
            .execute(&mut *tx)
            .await?;
        let balance: i64 = sqlx::query("SELECT balance FROM ledger_accounts WHERE id = $1")
            .bind(&org_account)
            .fetch_one(&mut *tx)
            .await?
            .try_get("balance")?;
        let Some(take) = slice(balance, need, want) else {
            tx.rollback().await?;
            return Ok(Renewed::Short(balance));
        };
        if take <= 0 {
            tx.rollback().await?;
            return Ok(Renewed::Took);
        }
        ledger::move_balances(&mut tx, &[(org_account.clone(), -take), (leases_account.clone(), take)]).await?;
        ledger::record(&mut tx, &org_account, &leases_account, take, "lease", None, &id).await?;
        sqlx::query("UPDATE budget_leases SET granted = granted + $1 WHERE id = $2")
            .bind(take)
            .bind(&id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        metrics::counter!(crate::metrics::LEASE_RENEWALS).increment(1);
        self.0.stats.renewals.fetch_add(1, Ordering::Relaxed);
        let lease = current.unwrap_or_else(|| Arc::new(Lease { id, books: Mutex::new(Books::default()) }));
        lease.books.lock().unwrap_or_else(|e| e.into_inner()).available += take;
        org.current.lock().unwrap_or_else(|e| e.into_inner()).lease = Some(lease);
        Ok(Renewed::Took)
    }

    /// Settles a request held against a lease: the cost (at most what it held) is
    /// charged, the rest goes back to the lease at once, and the settlement is written
    /// with the next batch. True once written; false when it could not be (its lease
    /// expired, or the database failed every retry): then it is not charged at all.
    pub async fn settle(&self, hold: LeaseHold, usage: UsageRecord) -> bool {
        let cost = ledger::within_hold(&usage, hold.held);
        {
            let mut b = hold.lease.books.lock().unwrap_or_else(|e| e.into_inner());
            b.held -= hold.held;
            b.available += hold.held - cost;
            b.settling += cost;
        }
        let (done, written) = oneshot::channel();
        let usage = UsageRecord { cost_micros: cost as u64, ..usage };
        if self.0.settle.send(Settling { lease: hold.lease.clone(), held: hold.held, usage, done }).is_err() {
            tracing::error!("the settlement writer is gone: a request is not charged");
            metrics::counter!(crate::metrics::SETTLEMENT_FAILURES).increment(1);
            hold.lease.books.lock().unwrap_or_else(|e| e.into_inner()).settling -= cost;
            return false;
        }
        written.await.unwrap_or(false)
    }

    /// Returns the leases unused for `idle` to their organizations: whole when no
    /// request holds or settles against them, else what is available. Returns how
    /// much credit went back.
    pub async fn return_idle(&self, idle: Duration) -> Result<i64, LedgerError> {
        let orgs: Vec<Arc<OrgLease>> = {
            let mut orgs = self.0.orgs.lock().unwrap_or_else(|e| e.into_inner());
            // Forget organizations without a lease, quiet for a minute, that nobody is
            // admitting (only the map holds them): the map does not grow without end.
            orgs.retain(|_, o| {
                Arc::strong_count(o) > 1 || {
                    let c = o.current.lock().unwrap_or_else(|e| e.into_inner());
                    c.lease.is_some() || c.last_used.elapsed() < Duration::from_secs(60)
                }
            });
            orgs.values().cloned().collect()
        };
        let mut returned = 0;
        for org in orgs {
            let Ok(_one) = org.renewing.try_lock() else { continue };
            let lease = {
                let c = org.current.lock().unwrap_or_else(|e| e.into_inner());
                if c.last_used.elapsed() < idle {
                    continue;
                }
                let Some(lease) = c.lease.clone() else { continue };
                lease
            };
            // Unused: closed in memory at once, under the books' lock, so that an
            // admission racing this one finds it closed and waits for `renewing`.
            let (was_closed, whole, available) = {
                let mut b = lease.books.lock().unwrap_or_else(|e| e.into_inner());
                let was_closed = b.closed;
                let whole = !b.closed && b.held == 0 && b.settling == 0;
                b.closed |= whole;
                (was_closed, whole, b.available)
            };
            if was_closed {
                org.drop_closed(&lease);
            } else if whole {
                org.drop_closed(&lease);
                match close(&self.0.pool, &lease.id, &org.org, "idle").await {
                    Ok(micros) => {
                        returned += micros;
                        self.0.stats.returns.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        // Still open in the database: keep spending it, and try again.
                        tracing::warn!("returning {}'s idle budget lease: {e}", org.org);
                        lease.books.lock().unwrap_or_else(|e| e.into_inner()).closed = false;
                        org.current.lock().unwrap_or_else(|e| e.into_inner()).lease.get_or_insert(lease);
                    }
                }
            } else if available > 0 {
                match self.give_back(&org.org, &lease, available).await {
                    Ok(micros) => returned += micros,
                    Err(e) => tracing::warn!("returning {}'s unused budget: {e}", org.org),
                }
            }
        }
        Ok(returned)
    }

    /// Returns `amount` of a lease's available credit, keeping the lease.
    async fn give_back(&self, org: &str, lease: &Lease, amount: i64) -> Result<i64, LedgerError> {
        {
            let mut b = lease.books.lock().unwrap_or_else(|e| e.into_inner());
            if b.available < amount {
                return Ok(0);
            }
            b.available -= amount;
        }
        let (org_account, leases_account) = (ledger::org_account(org), ledger::leases_account(org));
        let written: Result<bool, LedgerError> = async {
            let mut tx = self.0.pool.begin().await?;
            let open = sqlx::query(
                "UPDATE budget_leases SET returned = returned + $1 WHERE id = $2 AND closed_at IS NULL \
                 AND granted - charged - returned >= $1",
            )
            .bind(amount)
            .bind(&lease.id)
            .execute(&mut *tx)
            .await?;
            if open.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            ledger::move_balances(&mut tx, &[(leases_account.clone(), -amount), (org_account.clone(), amount)]).await?;
            ledger::record(&mut tx, &leases_account, &org_account, amount, "return", None, &lease.id).await?;
            tx.commit().await?;
            Ok(true)
        }
        .await;
        match written {
            Ok(true) => {
                metrics::counter!(crate::metrics::LEASE_RETURNS, "reason" => "idle").increment(1);
                self.0.stats.returns.fetch_add(1, Ordering::Relaxed);
                Ok(amount)
            }
            Ok(false) => {
                lease.books.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
                Ok(0)
            }
            Err(e) => {
                lease.books.lock().unwrap_or_else(|e| e.into_inner()).available += amount;
                Err(e)
            }
        }
    }

    /// At shutdown, once every settlement is written: every lease goes back.
    pub async fn close_all(&self) -> Result<i64, LedgerError> {
        let orgs: Vec<Arc<OrgLease>> =
            self.0.orgs.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, o)| o).collect();
        let mut returned = 0;
        for org in orgs {
            // After any renewal in flight, which would otherwise leave a lease behind.
            let _one = org.renewing.lock().await;
            let lease = org.current.lock().unwrap_or_else(|e| e.into_inner()).lease.take();
            if let Some(lease) = lease {
                lease.books.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
                match close(&self.0.pool, &lease.id, &org.org, "shutdown").await {
                    Ok(micros) => {
                        returned += micros;
                        self.0.stats.returns.fetch_add(1, Ordering::Relaxed);
                    }
                    // Another control plane expires it once this one's heart stops.
                    Err(e) => tracing::error!("returning {}'s budget lease at shutdown: {e}", org.org),
                }
            }
        }
        Ok(returned)
    }

    /// This control plane's leases in memory, by organization: (available, held,
    /// settling). For tests and the operator's view.
    pub fn books(&self, org_id: &str) -> Option<(i64, i64, i64)> {
        let org = self.0.orgs.lock().unwrap_or_else(|e| e.into_inner()).get(org_id).cloned()?;
        let lease = org.current.lock().unwrap_or_else(|e| e.into_inner()).lease.clone()?;
        let b = *lease.books.lock().unwrap_or_else(|e| e.into_inner());
        Some((b.available, b.held, b.settling))
    }
}

impl OrgLease {
    /// Holds `worst` from the current lease, if it has that much available.
    fn take(&self, worst: i64) -> Option<LeaseHold> {
        let lease = self.current.lock().unwrap_or_else(|e| e.into_inner()).lease.clone()?;
        let mut b = lease.books.lock().unwrap_or_else(|e| e.into_inner());
        if b.closed || b.available < worst {
            return None;
        }
        b.available -= worst;
        b.held += worst;
        drop(b);
        Some(LeaseHold { lease, held: worst })
    }

    fn available(&self) -> i64 {
        let lease = self.current.lock().unwrap_or_else(|e| e.into_inner()).lease.clone();
        lease.map_or(0, |l| {
            let b = l.books.lock().unwrap_or_else(|e| e.into_inner());
            if b.closed { 0 } else { b.available }
        })
    }

    /// Forgets a lease another control plane expired (this one was taken for dead).
    fn drop_closed(&self, lease: &Arc<Lease>) {
        lease.books.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        let mut c = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if c.lease.as_ref().is_some_and(|l| Arc::ptr_eq(l, lease)) {
            c.lease = None;
        }
    }
}

/// Closes a lease: its remainder (granted − charged − returned, from its row) goes
/// back to the organization. Returns that remainder; 0 if it was closed already.
async fn close(pool: &AnyPool, lease_id: &str, org: &str, reason: &'static str) -> Result<i64, LedgerError> {
    let mut tx = pool.begin().await?;
    let closed = sqlx::query("UPDATE budget_leases SET closed_at = $1 WHERE id = $2 AND closed_at IS NULL")
        .bind(crate::limits::now_us())
        .bind(lease_id)
        .execute(&mut *tx)
        .await?;
    if closed.rows_affected() == 0 {
        tx.rollback().await?;
        return Ok(0);
    }
    let row = sqlx::query("SELECT granted - charged - returned AS remainder FROM budget_leases WHERE id = $1")
        .bind(lease_id)
        .fetch_one(&mut *tx)
        .await?;
    let remainder: i64 = row.try_get("remainder")?;
    if remainder > 0 {
        let (org_account, leases_account) = (ledger::org_account(org), ledger::leases_account(org));
        sqlx::query("UPDATE budget_leases SET returned = returned + $1 WHERE id = $2")
            .bind(remainder)
            .bind(lease_id)
            .execute(&mut *tx)
            .await?;
        ledger::move_balances(&mut tx, &[(leases_account.clone(), -remainder), (org_account.clone(), remainder)])
            .await?;
        ledger::record(&mut tx, &leases_account, &org_account, remainder, "return", None, lease_id).await?;
    }
    tx.commit().await?;
    metrics::counter!(crate::metrics::LEASE_RETURNS, "reason" => reason).increment(1);
    Ok(remainder)
}

/// Expires the open leases of control planes that have not beaten their hearts since
/// `alive_since_us`. Returns how many.
pub(super) async fn expire_orphaned(pool: &AnyPool, alive_since_us: i64) -> Result<u32, LedgerError> {
    let rows = sqlx::query(
        "SELECT id, org_id FROM budget_leases WHERE closed_at IS NULL \
         AND owner NOT IN (SELECT id FROM control_planes WHERE heartbeat_at >= $1)",
    )
    .bind(alive_since_us)
    .fetch_all(pool)
    .await?;
    let mut expired = 0;
    for r in rows {
        let (id, org): (String, String) = (r.try_get("id")?, r.try_get("org_id")?);
        match close(pool, &id, &org, "expired").await {
            Ok(_) => expired += 1,
            Err(e) => tracing::error!("expiring budget lease {id}: {e}"),
        }
    }
    Ok(expired)
}

/// The task that writes settlements: whatever queued while the last batch was being
/// written goes in the next one.
async fn write_settlements(pool: AnyPool, mut queue: mpsc::UnboundedReceiver<Settling>, stats: Arc<Counters>) {
    while let Some(first) = queue.recv().await {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(s) => batch.push(s),
                Err(_) => break,
            }
        }
        stats.batches.fetch_add(1, Ordering::Relaxed);
        stats.settlements.fetch_add(batch.len() as u64, Ordering::Relaxed);
        write_with_retries(&pool, batch).await;
    }
}

async fn write_with_retries(pool: &AnyPool, mut batch: Vec<Settling>) {
    let start = Instant::now();
    let mut attempt = 0u32;
    while !batch.is_empty() {
        match write_batch(pool, &batch).await {
            Ok(Written::All) => {
                let elapsed = start.elapsed().as_secs_f64();
                for s in batch.drain(..) {
                    metrics::histogram!(crate::metrics::SETTLEMENT).record(elapsed);
                    finish(s, true);
                }
            }
            Ok(Written::LeaseClosed(id)) => {
                // Expired under us: its settlements cannot be charged (its remainder
                // went back whole); the rest are written without them.
                let (lost, kept): (Vec<_>, Vec<_>) = batch.into_iter().partition(|s| s.lease.id == id);
                for s in lost {
                    tracing::error!(
                        "{}: its budget lease {id} expired before it settled; not charged",
                        s.usage.request_id
                    );
                    s.lease.books.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
                    finish(s, false);
                }
                batch = kept;
            }
            Err(e) if attempt < 4 => {
                attempt += 1;
                tracing::warn!("writing {} settlements (attempt {attempt}): {e}", batch.len());
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
            Err(e) => {
                tracing::error!("could not write {} settlements; they are not charged: {e}", batch.len());
                metrics::counter!(crate::metrics::SETTLEMENT_FAILURES).increment(batch.len() as u64);
                for s in batch.drain(..) {
                    finish(s, false);
                }
            }
        }
    }
}

/// Out of the lease's books: written or not, the settlement is no longer pending (a
/// charge not written stays in the row's remainder, which goes back to the organization).
fn finish(s: Settling, written: bool) {
    s.lease.books.lock().unwrap_or_else(|e| e.into_inner()).settling -= s.usage.cost_micros as i64;
    let _ = s.done.send(written);
}

enum Written {
    All,
    LeaseClosed(String),
}

/// One transaction: the settled hold rows (a request id already there is skipped:
/// charged once), each lease's charge on its row, the charge transfers, the usage
/// records, and the balances last, so that the rows every control plane shares are
/// locked only for the end of it.
async fn write_batch(pool: &AnyPool, batch: &[Settling]) -> Result<Written, LedgerError> {
    let now_us = crate::limits::now_us();
    let now_s = now_us / 1_000_000;
    let mut tx = pool.begin().await?;

    let sql = format!(
        "INSERT INTO holds (request_id, org_id, amount, created_at, settled_at, funding, lease_id) VALUES {} \
         ON CONFLICT (request_id) DO NOTHING RETURNING request_id",
        ledger::placeholders(batch.len(), 7)
    );
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for s in batch {
        q = q
            .bind(&s.usage.request_id)
            .bind(&s.usage.org_id)
            .bind(s.held)
            .bind(now_s)
            .bind(now_s)
            .bind("credits")
            .bind(&s.lease.id);
    }
    let mut inserted: std::collections::HashSet<String> =
        q.fetch_all(&mut *tx).await?.iter().map(|r| r.try_get("request_id")).collect::<Result<_, _>>()?;
    // The first of each id inserted is charged; any other (settled before, or twice
    // in this batch) is not.
    let mut fresh: Vec<&Settling> = Vec::with_capacity(batch.len());
    for s in batch {
        if inserted.remove(&s.usage.request_id) {
            fresh.push(s);
        } else {
            tracing::warn!("{}: already settled; not charged again", s.usage.request_id);
        }
    }

    // Each lease's charges on its row, which must still be open.
    let mut by_lease: Vec<(&str, &str, i64)> = Vec::new();
    for s in &fresh {
        let cost = s.usage.cost_micros as i64;
        match by_lease.iter_mut().find(|(id, _, _)| *id == s.lease.id) {
            Some(entry) => entry.2 += cost,
            None => by_lease.push((&s.lease.id, &s.usage.org_id, cost)),
        }
    }
    by_lease.sort();
    for (id, _, charged) in &by_lease {
        let open = sqlx::query("UPDATE budget_leases SET charged = charged + $1 WHERE id = $2 AND closed_at IS NULL")
            .bind(charged)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if open.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(Written::LeaseClosed(id.to_string()));
        }
    }

    // In name order, as every transaction takes accounts.
    let revenue: std::collections::BTreeSet<String> =
        by_lease.iter().filter(|(_, _, c)| *c > 0).map(|(_, org, _)| ledger::revenue_account(org)).collect();
    for account in &revenue {
        ledger::open_account(&mut tx, account).await?;
    }
    let charged: Vec<&&Settling> = fresh.iter().filter(|s| s.usage.cost_micros > 0).collect();
    if !charged.is_empty() {
        let sql = format!(
            "INSERT INTO ledger_transfers (id, from_account, to_account, amount, kind, request_id, memo, created_at) \
             VALUES {}",
            ledger::placeholders(charged.len(), 8)
        );
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for s in &charged {
            q = q
                .bind(keys::random_id("tr_"))
                .bind(ledger::leases_account(&s.usage.org_id))
                .bind(ledger::revenue_account(&s.usage.org_id))
                .bind(s.usage.cost_micros as i64)
                .bind("charge")
                .bind(&s.usage.request_id)
                .bind(&s.lease.id)
                .bind(now_s);
        }
        q.execute(&mut *tx).await?;
    }

    // Credit requests: the meter records them funded by credits, at no discount.
    ledger::insert_usage(&mut tx, &fresh.iter().map(|s| &s.usage).collect::<Vec<_>>()).await?;

    // The balances, per organization, last.
    let mut deltas: Vec<(String, i64)> = Vec::new();
    for (_, org, charged) in &by_lease {
        if *charged == 0 {
            continue;
        }
        deltas.push((ledger::leases_account(org), -charged));
        deltas.push((ledger::revenue_account(org), *charged));
    }
    ledger::move_balances(&mut tx, &deltas).await?;
    tx.commit().await?;
    Ok(Written::All)
}
