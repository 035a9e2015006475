//! One request's bill, from admission to settlement: the hold taken before anything
//! runs, the tokens counted as the worker reports them, and the settlement when the
//! last of the request's streams is dropped — finished, failed, or abandoned by a
//! client that left — so that no path can skip it or take it twice.

use super::cost::{Tokens, cost_micros, usd, worst_case_micros};
use super::ledger::{Admission, Ledger, NewHold, UsageRecord};
use crate::accounts::{ApiKey, BillingMode};
use crate::api::error::ApiError;
use crate::catalog::Prices;
use crate::router::ServedModel;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Clone)]
pub struct Billing {
    ledger: Ledger,
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
        Self { ledger }
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
        let request_id = crate::api::new_id("req_");
        let hold = NewHold { request_id: request_id.clone(), org_id: key.org_id.clone(), amount: worst };
        match self.ledger.hold(&hold).await.map_err(|e| ApiError::Internal(format!("billing hold: {e}")))? {
            Admission::Held => {}
            Admission::Insufficient { balance } => {
                return Err(ApiError::InsufficientQuota {
                    message: format!(
                        "You exceeded your current quota: the organization's credit balance is {} and this request \
                         may cost up to {}. Add credits, or lower max_tokens.",
                        usd(balance),
                        usd(worst as i64)
                    ),
                });
            }
        }
        let pending = Pending {
            record: UsageRecord {
                request_id,
                org_id: key.org_id.clone(),
                key_id: key.id.clone(),
                model: model.entry.id.clone(),
                endpoint: ask.endpoint.into(),
                prompt_tokens: 0,
                cached_tokens: 0,
                completion_tokens: 0,
                reasoning_tokens: 0,
                cost_micros: 0,
                funding: "credits".into(),
                multiplier_bp: 10_000,
                finish_reason: "abandoned".into(),
                created_at: 0,
            },
            prompts: ask.prompts.iter().map(|&p| p as u64).collect(),
            outputs: vec![Counted::default(); ask.prompts.len()],
        };
        let inner = Inner {
            ledger: self.ledger.clone(),
            prices,
            pending: Mutex::new(pending),
            settled: AtomicBool::new(false),
        };
        Ok(Meter(Arc::new(inner)))
    }
}

/// A request's bill; clones share it, and the last one dropped settles it.
#[derive(Clone)]
pub struct Meter(Arc<Inner>);

struct Inner {
    ledger: Ledger,
    prices: Prices,
    pending: Mutex<Pending>,
    /// Settled by `settle`; the drop then has nothing to do.
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

    /// Settles now, so that the bill is final before the reply ends; a request that
    /// never gets here (its client left) is settled when its meter is dropped.
    pub async fn settle(&self) {
        if !self.0.settled.swap(true, Ordering::SeqCst) {
            self.0.settle_now().await;
        }
    }

    pub fn request_id(&self) -> String {
        self.0.pending.lock().unwrap_or_else(|e| e.into_inner()).record.request_id.clone()
    }

    fn with(&self, f: impl FnOnce(&mut Pending)) {
        // A poisoned lock means a panic mid-update; the counts are still the best bill.
        let mut p = self.0.pending.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut p);
    }
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

impl Inner {
    async fn settle_now(&self) {
        let usage = self.usage();
        if let Err(e) = self.ledger.settle(&usage).await {
            // The hold stays; `release_stale` returns it later. Never lost, never doubled.
            tracing::error!("settling {}: {e}", usage.request_id);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.settled.load(Ordering::SeqCst) {
            return;
        }
        let usage = self.usage();
        let ledger = self.ledger.clone();
        let settle = async move {
            if let Err(e) = ledger.settle(&usage).await {
                tracing::error!("settling {}: {e}", usage.request_id);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(settle);
            }
            Err(_) => tracing::error!("no runtime to settle a request on; its hold is released later"),
        }
    }
}
