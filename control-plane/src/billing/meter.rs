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
use super::ledger::{Admission, Ledger, NewHold, UsageRecord};
use crate::accounts::{ApiKey, BillingMode};
use crate::api::error::ApiError;
use crate::catalog::Prices;
use crate::router::ServedModel;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio_util::task::TaskTracker;

#[derive(Clone)]
pub struct Billing {
    ledger: Ledger,
    /// Holds and settlements in flight.
    tasks: TaskTracker,
    /// Meters not yet settled, for shutdown to settle.
    open: Arc<Mutex<HashMap<String, Weak<Inner>>>>,
}

/// What a request asks to generate: each prompt's length and the tokens it may
/// generate in all (max_tokens × n).
pub struct Ask<'a> {
    pub endpoint: &'static str,
    pub prompts: &'a [usize],
    pub max_completion_each: u64,
}

impl Billing {
    pub fn new(ledger: Ledger) -> Self {
        Self { ledger, tasks: TaskTracker::new(), open: Default::default() }
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Holds the request's worst-case cost, or refuses it before anything runs.
    pub async fn admit(&self, key: &ApiKey, model: &ServedModel, ask: Ask<'_>) -> Result<Meter, ApiError> {
        if key.billing_mode == BillingMode::Subscription && !key.fallback_to_credits {
            return Err(ApiError::InsufficientQuota {
                message: "This key is billed to a subscription, and subscription plans are not available yet; \
                          use a credits key or one with credit fallback."
                    .into(),
            });
        }
        let prices = model.entry.prices;
        let worst: u64 =
            ask.prompts.iter().map(|&p| worst_case_micros(&prices, p as u64, ask.max_completion_each)).sum();
        let record = UsageRecord {
            key_id: key.id.clone(),
            model: model.entry.id.clone(),
            endpoint: ask.endpoint.into(),
            ..UsageRecord::unused(&crate::api::new_id("req_"), &key.org_id)
        };
        let hold = NewHold { request_id: record.request_id.clone(), org_id: key.org_id.clone(), amount: worst };
        let pending = Pending {
            record,
            prompts: ask.prompts.iter().map(|&p| p as u64).collect(),
            outputs: vec![Counted::default(); ask.prompts.len()],
        };
        // The hold and the meter that settles it are made together in a task: if this
        // request is cancelled meanwhile, the meter is dropped unreceived and settles.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let billing = self.clone();
        self.tasks.spawn(async move {
            let admitted = match billing.ledger.hold(&hold).await {
                Ok(Admission::Held) => Ok(billing.meter(prices, pending)),
                Ok(Admission::Insufficient { balance }) => Err(Some(balance)),
                Err(e) => {
                    tracing::error!("billing hold: {e}");
                    Err(None)
                }
            };
            let _ = tx.send(admitted);
        });
        match rx.await {
            Ok(Ok(meter)) => Ok(meter),
            Ok(Err(Some(balance))) => Err(ApiError::InsufficientQuota {
                message: format!(
                    "You exceeded your current quota: the organization's credit balance is {} and this request may \
                     cost up to {}. Add credits, or lower max_tokens.",
                    usd(balance),
                    usd(worst as i64)
                ),
            }),
            Ok(Err(None)) | Err(_) => Err(ApiError::Internal("billing hold failed".into())),
        }
    }

    fn meter(&self, prices: Prices, pending: Pending) -> Meter {
        let id = pending.record.request_id.clone();
        let inner = Arc::new(Inner {
            billing: self.clone(),
            prices,
            pending: Mutex::new(pending),
            settled: AtomicBool::new(false),
        });
        self.open.lock().unwrap_or_else(|e| e.into_inner()).insert(id, Arc::downgrade(&inner));
        Meter(inner)
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
    }
}

/// A request's bill; clones share it, and the last one dropped settles it unless the
/// endpoint did.
#[derive(Clone)]
pub struct Meter(Arc<Inner>);

struct Inner {
    billing: Billing,
    prices: Prices,
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

/// Settles, retrying a failing database a few times; true once the ledger has it.
async fn settle_with_retries(ledger: Ledger, usage: UsageRecord) -> bool {
    for attempt in 0..5u32 {
        match ledger.settle(&usage).await {
            Ok(_) => return true,
            Err(e) => {
                tracing::warn!("settling {} (attempt {}): {e}", usage.request_id, attempt + 1);
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    }
    // The hold stays, and `Ledger::release_stale` returns it to the organization later.
    tracing::error!("could not settle {}; its hold is released later", usage.request_id);
    false
}

impl Inner {
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
        UsageRecord {
            prompt_tokens: t.prompt,
            cached_tokens: t.cached,
            completion_tokens: t.completion,
            cost_micros: cost_micros(&self.prices, t),
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
            self.billing.tasks.spawn(settle_with_retries(self.billing.ledger.clone(), usage));
        } else {
            tracing::error!("no runtime to settle {} on; its hold is released later", usage.request_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounts::Store;

    const PRICES: Prices = Prices { input: 1_000_000, cache_read: None, output: 2_000_000 };

    async fn held_request(billing: &Billing, store: &Store, org: &str, id: &str) -> Meter {
        let hold = NewHold { request_id: id.into(), org_id: org.into(), amount: 1_000 };
        assert_eq!(store.ledger().hold(&hold).await.unwrap(), Admission::Held);
        let record = UsageRecord { key_id: "key_t".into(), ..UsageRecord::unused(id, org) };
        let pending = Pending { record, prompts: vec![10], outputs: vec![Counted::default()] };
        billing.meter(PRICES, pending)
    }

    #[tokio::test]
    async fn every_way_a_request_ends_settles_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("sqlite://{}", dir.path().join("t.db").display())).await.unwrap();
        let org = store.create_org("o").await.unwrap().id;
        let ledger = store.ledger();
        ledger.grant(&org, 10_000, "t").await.unwrap();
        let billing = Billing::new(ledger.clone());

        // Settled by the endpoint: 10 prompt tokens at $1/M and 5 completion tokens at $2/M.
        let done = held_request(&billing, &store, &org, "r-done").await;
        done.started(0);
        done.record(0, 0, 5);
        done.finish("stop", 0);
        done.settle().await;
        drop(done);
        // Dropped mid-stream (client gone): settled by the drop, for what it used.
        let gone = held_request(&billing, &store, &org, "r-gone").await;
        gone.started(0);
        gone.record(0, 0, 2);
        drop(gone);
        // Still open at shutdown: settled by it.
        let open = held_request(&billing, &store, &org, "r-open").await;
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
        drop(open);
        ledger.audit().await.unwrap();
    }
}
