//! One request's bill, from admission to settlement: the hold taken before anything
//! runs, the tokens counted as the worker reports them, and the settlement when the
//! reply ends — or, when it never ends (client gone, worker failure, shutdown), when
//! the last of the request's streams is dropped — so that no path skips it or takes it
//! twice.
//!
//! Database work runs in tasks of its own, never in the request's future: a client
//! that leaves cancels that future at any await, and a transaction cut off there would
//! roll back and leave the hold unsettled. The tasks are tracked, so that shutdown can
//! wait for them.

use super::cost::{Tokens, cost_micros, usd, worst_case_micros};
use super::lease::{LeaseConfig, LeaseHold, Leases};
use super::ledger::{Admission, Ledger, LedgerError, NewHold, UsageRecord};
use super::subscriptions::{Refusal, Subscriptions};
use super::supply::Supply;
use crate::accounts::{ApiKey, BillingMode};
use crate::catalog::Prices;
use crate::router::ServedModel;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio_util::task::TaskTracker;

/// The time now, in µs since the epoch; tests inject their own.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

#[derive(Clone)]
pub struct Billing {
    /// This control-plane process, as the owner of its holds.
    process: String,
    ledger: Ledger,
    subscriptions: Subscriptions,
    supply: Supply,
    clock: Clock,
    /// Holds and settlements in flight.
    tasks: TaskTracker,
    /// Meters not yet settled, for shutdown to settle.
    open: Arc<Mutex<HashMap<String, Weak<Inner>>>>,
    /// Credit requests draw from this process's budget leases rather than from the
    /// organization's account, one write per request (`lease`); None: per request.
    leases: Option<(Leases, LeaseConfig)>,
}

/// What a request asks to generate: each prompt's length and the tokens it may
/// generate in all (max_tokens × n).
pub struct Ask<'a> {
    /// The id the usage record is kept under (the request's `x-request-id`).
    pub request_id: &'a str,
    /// The client's own id for it, recorded beside.
    pub client_request_id: Option<&'a str>,
    pub endpoint: &'static str,
    pub prompts: &'a [usize],
    pub max_completion_each: u64,
}

/// Who pays for a request, decided at admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Funding {
    Credits,
    /// Included subscription usage, at the supply multiplier in effect when the
    /// request started (basis points), locked for the request.
    Subscription {
        multiplier_bp: i64,
    },
}

/// Why a request is not admitted. The words are billing's; the API decides what each
/// is on the wire (`api::error`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdmitError {
    /// The organization's credit does not cover the request's worst case.
    #[error(
        "You exceeded your current quota: the organization's credit balance is {} and this request may cost up to \
         {}. Add credits, or lower max_tokens.",
        usd(*balance),
        usd(*worst)
    )]
    Credit { balance: i64, worst: i64 },
    /// The key's subscription cannot pay now (`now`: when it was asked, for when its
    /// window resets).
    #[error("{}", subscription_message(refusal, *now))]
    Subscription { refusal: Refusal, now: i64 },
    /// The ledger could not take the hold.
    #[error("billing hold failed")]
    Failed,
}

impl AdmitError {
    /// When retrying may help: a subscription's window or concurrency that frees up,
    /// or a renewal tried again. None: retrying will not help as things stand.
    pub fn retry_after_us(&self) -> Option<u64> {
        let Self::Subscription { refusal, now } = self else { return None };
        match refusal {
            Refusal::NoPlan | Refusal::PastDue => None,
            Refusal::Renewing => Some(60_000_000),
            Refusal::Concurrency { .. } => Some(1_000_000),
            Refusal::Exhausted { resets_at, .. } => Some((resets_at - now).max(1) as u64),
        }
    }
}

/// Why a request could not be funded.
enum Refused {
    Credit { balance: i64 },
    Subscription(Refusal),
    Failed,
}

impl Billing {
    /// Billing for one control-plane process: its holds are taken in the name of a
    /// fresh process id, which `heartbeat` keeps alive.
    pub fn new(ledger: Ledger, subscriptions: Subscriptions, supply: Supply) -> Self {
        let process = crate::accounts::keys::random_id("cp_");
        Self {
            ledger: ledger.owned_by(&process),
            subscriptions: subscriptions.owned_by(&process),
            process,
            supply,
            clock: Arc::new(crate::limits::now_us),
            tasks: TaskTracker::new(),
            open: Default::default(),
            leases: None,
        }
    }

    /// The same, admitting credit requests against budget leases (call inside a Tokio
    /// runtime: the leases' settlement writer is a task).
    pub fn with_leases(self, config: LeaseConfig) -> Self {
        let leases = self.ledger.leases(&self.process, config);
        Self { leases: Some((leases, config)), ..self }
    }

    /// This process's budget leases, when it takes them.
    pub fn leases(&self) -> Option<&Leases> {
        self.leases.as_ref().map(|(l, _)| l)
    }

    /// Returns the budget leases that have idled to their organizations.
    pub async fn return_idle_leases(&self) -> Result<i64, LedgerError> {
        match &self.leases {
            Some((leases, config)) => leases.return_idle(config.idle).await,
            None => Ok(0),
        }
    }

    /// The same, on another clock (tests).
    pub fn with_clock(self, clock: Clock) -> Self {
        Self { clock, ..self }
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn subscriptions(&self) -> &Subscriptions {
        &self.subscriptions
    }

    pub fn usage(&self) -> super::usage::UsageReports {
        self.ledger.usage_reports()
    }

    pub fn supply(&self) -> &Supply {
        &self.supply
    }

    /// Holds the request's worst-case cost, or refuses it before anything runs.
    pub async fn admit(&self, key: &ApiKey, model: &ServedModel, ask: Ask<'_>) -> Result<Meter, AdmitError> {
        self.admit_priced(key, &model.entry.id, model.entry.prices, ask).await
    }

    /// `admit` for a model known by its id and prices.
    pub async fn admit_priced(
        &self,
        key: &ApiKey,
        model: &str,
        prices: Prices,
        ask: Ask<'_>,
    ) -> Result<Meter, AdmitError> {
        let worst: u64 =
            ask.prompts.iter().map(|&p| worst_case_micros(&prices, p as u64, ask.max_completion_each)).sum();
        let record = UsageRecord {
            key_id: key.id.clone(),
            model: model.into(),
            endpoint: ask.endpoint.into(),
            client_request_id: ask.client_request_id.map(str::to_string),
            ..UsageRecord::unused(ask.request_id, &key.org_id)
        };
        let prompts = ask.prompts.iter().map(|&p| p as u64).collect();
        let pending = Pending { record, prompts, outputs: vec![Counted::default(); ask.prompts.len()] };
        let now = (self.clock)();
        // A credit request its control plane's lease covers is held at once, with no
        // await between the hold and the meter that settles it.
        let leased = match &self.leases {
            Some((leases, _)) if key.billing_mode == BillingMode::Credits && worst > 0 => {
                if let Some(hold) = leases.hold_now(&key.org_id, worst) {
                    return Ok(self.meter(prices, Funding::Credits, Some(hold), pending));
                }
                true
            }
            _ => false,
        };
        // Otherwise the hold and the meter are made together in a task: if this request
        // is cancelled meanwhile, the meter is dropped unreceived and settles.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (billing, key) = (self.clone(), key.clone());
        self.tasks.spawn(async move {
            let admitted = match billing.take_hold(&key, &pending.record, worst, now, leased).await {
                Ok((funding, lease)) => Ok(billing.meter(prices, funding, lease, pending)),
                Err(refused) => Err(refused),
            };
            let _ = tx.send(admitted);
        });
        match rx.await {
            Ok(Ok(meter)) => Ok(meter),
            Ok(Err(Refused::Credit { balance })) => Err(AdmitError::Credit { balance, worst: worst as i64 }),
            Ok(Err(Refused::Subscription(refusal))) => Err(AdmitError::Subscription { refusal, now }),
            Ok(Err(Refused::Failed)) | Err(_) => Err(AdmitError::Failed),
        }
    }

    /// Subscription keys draw included usage at the current discount; when it cannot
    /// pay, keys with credit fallback (and credits keys) draw credit at standard rates.
    /// `leased`: the lease was tried already (`Leases::hold_now`) and found short.
    async fn take_hold(
        &self,
        key: &ApiKey,
        record: &UsageRecord,
        worst: u64,
        now: i64,
        leased: bool,
    ) -> Result<(Funding, Option<LeaseHold>), Refused> {
        let failed = |e: &dyn std::fmt::Display| {
            tracing::error!("billing hold: {e}");
            Refused::Failed
        };
        if key.billing_mode == BillingMode::Subscription {
            let multiplier_bp = self.supply.state(&record.model).multiplier_bp();
            let amount = discounted(worst, multiplier_bp, true) as i64;
            match self.subscriptions.hold(&key.org_id, &record.request_id, amount, now).await {
                Ok(Ok(())) => return Ok((Funding::Subscription { multiplier_bp }, None)),
                Ok(Err(refusal)) if !key.fallback_to_credits => return Err(Refused::Subscription(refusal)),
                Ok(Err(_)) => {}
                Err(e) => return Err(failed(&e)),
            }
        }
        if let Some((leases, _)) = &self.leases
            && worst > 0
        {
            let held = if leased {
                leases.hold_waiting(&key.org_id, worst).await
            } else {
                leases.hold(&key.org_id, worst).await
            };
            return match held {
                Ok(Ok(lease)) => Ok((Funding::Credits, Some(lease))),
                Ok(Err(balance)) => Err(Refused::Credit { balance }),
                Err(e) => Err(failed(&e)),
            };
        }
        let hold = NewHold { request_id: record.request_id.clone(), org_id: key.org_id.clone(), amount: worst };
        match self.ledger.hold(&hold).await {
            Ok(Admission::Held) => Ok((Funding::Credits, None)),
            Ok(Admission::Insufficient { balance }) => Err(Refused::Credit { balance }),
            Err(e) => Err(failed(&e)),
        }
    }

    fn meter(&self, prices: Prices, funding: Funding, lease: Option<LeaseHold>, pending: Pending) -> Meter {
        let id = pending.record.request_id.clone();
        let inner = Arc::new(Inner {
            billing: self.clone(),
            prices,
            funding,
            on_lease: lease.is_some(),
            lease: Mutex::new(lease),
            pending: Mutex::new(pending),
            settled: AtomicBool::new(false),
        });
        self.open.lock().unwrap_or_else(|e| e.into_inner()).insert(id, Arc::downgrade(&inner));
        Meter(inner)
    }

    /// Says this process is alive, and releases the holds of processes that stopped
    /// saying so for `dead_after_us` (crashed mid-request): their credit returns to the
    /// organizations, their concurrency slots to the users. Returns how many.
    pub async fn heartbeat(&self, dead_after_us: i64) -> Result<u32, LedgerError> {
        let now = (self.clock)();
        self.ledger.heartbeat(&self.process, now).await?;
        self.ledger.release_orphaned(now - dead_after_us).await
    }

    /// Waits for the holds and settlements in flight (tests: a dropped meter settles
    /// in a task of its own).
    pub async fn quiesce(&self) {
        self.tasks.close();
        self.tasks.wait().await;
        self.tasks.reopen();
    }

    /// At shutdown: settles every request still open with what it used so far, then
    /// waits (up to `limit`) for settlements in flight.
    pub async fn shutdown(&self, limit: Duration) {
        let open: Vec<Arc<Inner>> =
            self.open.lock().unwrap_or_else(|e| e.into_inner()).values().filter_map(Weak::upgrade).collect();
        for inner in open {
            Meter(inner).settle().await;
        }
        self.tasks.close();
        if tokio::time::timeout(limit, self.tasks.wait()).await.is_err() {
            tracing::error!("settlements still running at exit; their holds are released later");
        }
        if let Some((leases, _)) = &self.leases {
            match leases.close_all().await {
                Ok(micros) => tracing::info!("budget leases returned: {} to their organizations", usd(micros)),
                Err(e) => tracing::error!("returning budget leases (another control plane expires them): {e}"),
            }
        }
    }
}

/// A request's bill; clones share it, and the last one dropped settles it unless the
/// endpoint did.
#[derive(Clone)]
pub struct Meter(Arc<Inner>);

impl Meter {
    /// The organization the request is billed to.
    pub fn org_id(&self) -> String {
        self.0.pending.lock().unwrap_or_else(|e| e.into_inner()).record.org_id.clone()
    }

    /// The request's id (the key of its hold and usage record).
    pub fn request_id(&self) -> String {
        self.0.pending.lock().unwrap_or_else(|e| e.into_inner()).record.request_id.clone()
    }
}

struct Inner {
    billing: Billing,
    prices: Prices,
    funding: Funding,
    /// The request's hold on a budget lease, taken out by its one settlement.
    lease: Mutex<Option<LeaseHold>>,
    on_lease: bool,
    pending: Mutex<Pending>,
    /// The ledger has this settlement; the drop has nothing left to do.
    settled: AtomicBool,
}

struct Pending {
    record: UsageRecord,
    prompts: Vec<u64>,
    outputs: Vec<Counted>,
}

/// One prompt's generation as the worker reported it.
#[derive(Debug, Clone, Copy, Default)]
struct Counted {
    /// The worker accepted it: its prompt was processed and is billed.
    started: bool,
    cached: u64,
    completion: u64,
}

impl Meter {
    /// The worker accepted prompt `slot`'s generation.
    pub fn started(&self, slot: usize) {
        self.with(|p| {
            if let Some(o) = p.outputs.get_mut(slot) {
                o.started = true;
            }
        });
    }

    /// Counts a delta of prompt `slot`'s generation.
    pub fn record(&self, slot: usize, cached_prompt_tokens: u32, tokens: usize) {
        self.with(|p| {
            if let Some(o) = p.outputs.get_mut(slot) {
                o.cached = cached_prompt_tokens as u64;
                o.completion += tokens as u64;
            }
        });
    }

    /// How the request ended, and how many of its tokens were reasoning.
    pub fn finish(&self, finish_reason: &str, reasoning_tokens: u32) {
        self.with(|p| {
            p.record.finish_reason = finish_reason.into();
            p.record.reasoning_tokens = reasoning_tokens as u64;
        });
    }

    /// Settles now, so that the bill is final before the reply ends. The settlement
    /// runs in its own task: cancelling this call does not cut it off, and if it fails
    /// the drop tries again.
    pub async fn settle(&self) {
        if self.0.settled.load(Ordering::SeqCst) {
            return;
        }
        if self.0.on_lease {
            if let Some(task) = self.0.settle_lease()
                && matches!(task.await, Ok(true))
            {
                self.0.settled.store(true, Ordering::SeqCst);
            }
            return;
        }
        let task = self.0.billing.tasks.spawn(settle_with_retries(self.0.billing.ledger.clone(), self.0.usage()));
        if matches!(task.await, Ok(true)) {
            self.0.settled.store(true, Ordering::SeqCst);
        }
    }

    fn with(&self, f: impl FnOnce(&mut Pending)) {
        // A poisoned lock means a panic mid-update; the counts are still the best bill.
        let mut p = self.0.pending.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut p);
    }
}

/// `micros` × the multiplier (basis points): rounded up for a hold, which must cover
/// the cost; to the nearest micro-dollar for the cost itself.
fn discounted(micros: u64, multiplier_bp: i64, round_up: bool) -> u64 {
    let scaled = micros as u128 * multiplier_bp.max(0) as u128;
    (if round_up { scaled.div_ceil(10_000) } else { (scaled + 5_000) / 10_000 }) as u64
}

/// A subscription that cannot pay, in words: what is spent, and what to do.
fn subscription_message(refusal: &Refusal, now: i64) -> String {
    match refusal {
        Refusal::NoPlan => "This key is billed to a subscription, and its account has no active plan. Start a plan, \
                            or use a key with credit fallback."
            .into(),
        Refusal::PastDue => "This key is billed to a subscription whose renewal payment failed. Update the payment \
                             method and start the plan again, or use a key with credit fallback."
            .into(),
        Refusal::Renewing => "Your plan's new period could not be paid for yet (the payment processor did not \
                              answer); it is tried again with your next request."
            .into(),
        Refusal::Concurrency { limit } => format!(
            "Your plan runs at most {limit} requests at once, and {limit} are running. Retry when one finishes."
        ),
        Refusal::Exhausted { window, left, asked, resets_at } => format!(
            "Your subscription's {window} usage limit is reached: {} left, and this request may use up to {}. It \
             resets in {}; lower max_tokens, or use a key with credit fallback.",
            usd(*left),
            usd(*asked),
            crate::limits::go_duration((resets_at - now).max(1) as u64)
        ),
    }
}

/// Settles, retrying a failing database a few times; true once the ledger has it.
async fn settle_with_retries(ledger: Ledger, usage: UsageRecord) -> bool {
    let start = std::time::Instant::now();
    for attempt in 0..5u32 {
        match ledger.settle(&usage).await {
            Ok(_) => {
                metrics::histogram!(crate::metrics::SETTLEMENT).record(start.elapsed().as_secs_f64());
                return true;
            }
            Err(e) => {
                tracing::warn!("settling {} (attempt {}): {e}", usage.request_id, attempt + 1);
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    }
    // The hold stays, and `Ledger::release_stale` returns it to the organization later.
    tracing::error!("could not settle {}; its hold is released later", usage.request_id);
    metrics::counter!(crate::metrics::SETTLEMENT_FAILURES).increment(1);
    false
}

impl Inner {
    /// Settles against the request's budget lease, once: the first call takes the hold
    /// and writes the settlement in a task; later calls (and requests not on a lease)
    /// get None.
    fn settle_lease(&self) -> Option<tokio::task::JoinHandle<bool>> {
        let hold = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        let Some((leases, _)) = self.billing.leases.clone() else {
            tracing::error!("a lease hold without leases");
            return None;
        };
        let usage = self.usage();
        Some(self.billing.tasks.spawn(async move { leases.settle(hold, usage).await }))
    }

    /// The usage to settle: prompts the worker accepted, and every token it sent back.
    fn usage(&self) -> UsageRecord {
        let p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = Tokens::default();
        for (&prompt, o) in p.prompts.iter().zip(&p.outputs) {
            if o.started {
                t.prompt += prompt;
                t.cached += o.cached.min(prompt);
            }
            t.completion += o.completion;
        }
        let standard = cost_micros(&self.prices, t);
        let (cost, funding, multiplier_bp) = match self.funding {
            Funding::Credits => (standard, "credits", 10_000),
            Funding::Subscription { multiplier_bp } => {
                (discounted(standard, multiplier_bp, false), "subscription", multiplier_bp as u64)
            }
        };
        UsageRecord {
            prompt_tokens: t.prompt,
            cached_tokens: t.cached,
            completion_tokens: t.completion,
            cost_micros: cost,
            funding: funding.into(),
            multiplier_bp,
            ..p.record.clone()
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let usage = self.usage();
        self.billing.open.lock().unwrap_or_else(|e| e.into_inner()).remove(&usage.request_id);
        if self.settled.load(Ordering::SeqCst) {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            if self.on_lease {
                // Unless `Meter::settle` took the hold already (and its write failed,
                // which leaves the request uncharged: nothing to retry).
                self.settle_lease();
            } else {
                self.billing.tasks.spawn(settle_with_retries(self.billing.ledger.clone(), usage));
            }
        } else {
            tracing::error!("no runtime to settle {} on; its hold is released later", usage.request_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::Db;

    const PRICES: Prices = Prices { input: 1_000_000, cache_read: None, output: 2_000_000 };

    /// A request holding 1,000 micro-dollars: from the database, or from the billing's
    /// budget lease when it has leases.
    async fn held_request(billing: &Billing, db: &Db, org: &str, id: &str) -> Meter {
        let lease = match billing.leases() {
            Some(leases) => Some(leases.hold(org, 1_000).await.unwrap().unwrap()),
            None => {
                let hold = NewHold { request_id: id.into(), org_id: org.into(), amount: 1_000 };
                assert_eq!(db.ledger().hold(&hold).await.unwrap(), Admission::Held);
                None
            }
        };
        let record = UsageRecord { key_id: "key_t".into(), ..UsageRecord::unused(id, org) };
        let pending = Pending { record, prompts: vec![10], outputs: vec![Counted::default()] };
        billing.meter(PRICES, Funding::Credits, lease, pending)
    }

    #[tokio::test]
    async fn every_way_a_request_ends_settles_it_once() {
        every_way_settles_once(false).await;
    }

    #[tokio::test]
    async fn every_way_a_leased_request_ends_settles_it_once() {
        every_way_settles_once(true).await;
    }

    async fn every_way_settles_once(leased: bool) {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&format!("sqlite://{}", dir.path().join("t.db").display())).await.unwrap();
        let org = db.accounts().create_org("o").await.unwrap().id;
        let ledger = db.ledger();
        ledger.grant(&org, 10_000, "t").await.unwrap();
        let mut billing = db.billing(Arc::new(crate::billing::payments::DevProcessor::default()));
        if leased {
            billing = billing.with_leases(LeaseConfig::default());
        }

        // Settled by the endpoint: 10 prompt tokens at $1/M and 5 completion tokens at $2/M.
        let done = held_request(&billing, &db, &org, "r-done").await;
        done.started(0);
        done.record(0, 0, 5);
        done.finish("stop", 0);
        done.settle().await;
        drop(done);
        // Dropped mid-stream (client gone): settled by the drop, for what it used.
        let gone = held_request(&billing, &db, &org, "r-gone").await;
        gone.started(0);
        gone.record(0, 0, 2);
        drop(gone);
        // Still open at shutdown: settled by it.
        let open = held_request(&billing, &db, &org, "r-open").await;
        open.started(0);
        open.record(0, 0, 1);
        billing.shutdown(Duration::from_secs(5)).await;

        let records = ledger.usage(&org, 10).await.unwrap();
        let by_id = |id: &str| records.iter().find(|r| r.request_id == id).unwrap_or_else(|| panic!("{id} unsettled"));
        assert_eq!(records.len(), 3);
        assert_eq!((by_id("r-done").cost_micros, by_id("r-done").finish_reason.as_str()), (20, "stop"));
        assert_eq!((by_id("r-gone").completion_tokens, by_id("r-gone").finish_reason.as_str()), (2, "abandoned"));
        assert_eq!(by_id("r-open").cost_micros, 12);
        assert_eq!(ledger.held(&org).await.unwrap(), 0);
        assert_eq!(ledger.balance(&org).await.unwrap(), 10_000 - 20 - 14 - 12);
        if let Some(leases) = billing.leases() {
            assert_eq!(leases.books(&org), None, "the lease went back at shutdown");
        }
        drop(open);
        ledger.audit().await.unwrap();
    }
}
