//! Personal subscriptions through the billing path every request takes (`admit`, the
//! meter, the settlement), on a clock the test moves: the 5-hour, 7-day and monthly
//! caps and their resets, credit fallback, the supply discount locked at request start,
//! plan concurrency, upgrades pro-rated and downgrades at renewal, recurring payment
//! methods; and, on PostgreSQL, caps and concurrency exact across two control planes.

#[path = "support/postgres.rs"]
mod postgres;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use tessera_control_plane::accounts::{ApiKey, BillingMode, NewKey, Store, User};
use tessera_control_plane::api::error::ApiError;
use tessera_control_plane::billing::payments::{
    DEV_CARD, DEV_CARD_DECLINED, DEV_CARD_UNREACHABLE, DEV_CRYPTO, DevProcessor,
};
use tessera_control_plane::billing::plans::{HOUR_US, Plan, WINDOW_5H_US, WINDOW_7D_US, add_months};
use tessera_control_plane::billing::subscriptions::{Agreed, Change, PlanError, Status};
use tessera_control_plane::billing::supply::{SupplyPoint, SupplyState};
use tessera_control_plane::billing::{Ask, Billing, Meter};
use tessera_control_plane::catalog::Prices;
use tessera_control_plane::db::Db;

/// A dollar a token, so that each token counts in whole dollars.
const DOLLAR_A_TOKEN: Prices = Prices { input: 1_000_000_000_000, cache_read: None, output: 1_000_000_000_000 };
const DOLLAR: i64 = 1_000_000;
/// 2026-11-01T00:00:00Z, in µs.
const T0: i64 = 1_793_491_200_000_000;

/// A chat request of one prompt token that may generate `max` tokens.
fn ask(request_id: &str, max: u64) -> Ask<'_> {
    Ask { request_id, client_request_id: None, endpoint: "chat.completions", prompts: &[1], max_completion_each: max }
}

/// A request id no other request of this test has.
fn fresh_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!("req_{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

struct Fixture {
    store: Store,
    billing: Billing,
    clock: Arc<AtomicI64>,
    processor: Arc<DevProcessor>,
    user: User,
    /// A model of this fixture's own: tests sharing a database do not share its supply.
    model: String,
}

impl Fixture {
    async fn new(db: Db, email: &str) -> Self {
        let store = db.accounts();
        let clock = Arc::new(AtomicI64::new(T0));
        let now = clock.clone();
        let processor = Arc::new(DevProcessor::default());
        let billing = db.billing(processor.clone()).with_clock(Arc::new(move || now.load(Ordering::SeqCst)));
        let user = store.create_user(email).await.unwrap();
        Self { store, billing, clock, processor, user, model: format!("vendor-t/{email}") }
    }

    fn at(&self, t: i64) {
        self.clock.store(t, Ordering::SeqCst);
    }

    async fn key(&self, fallback: bool) -> ApiKey {
        let new = NewKey {
            org_id: &self.user.org_id,
            name: "personal",
            billing_mode: BillingMode::Subscription,
            fallback_to_credits: fallback,
            created_by: None,
        };
        self.store.create_key(new).await.unwrap().0
    }

    async fn supply(&self, state: SupplyState, slot: i64) {
        let point =
            SupplyPoint { model: self.model.clone(), slot, state, load_bp: 0, samples: 1, updated_at: T0 + slot };
        assert_eq!(self.billing.supply().record(point).await.unwrap(), state);
    }

    /// Admits a request of one prompt token that may generate `max` tokens.
    async fn admit(&self, key: &ApiKey, max: u64) -> Result<Meter, ApiError> {
        // The API's answer to each refusal, as a client would see it.
        self.billing.admit_priced(key, &self.model, DOLLAR_A_TOKEN, ask(&fresh_id(), max)).await.map_err(ApiError::from)
    }

    /// A request that runs and costs `1 + generated` dollars at standard rates.
    async fn run(&self, key: &ApiKey, generated: usize) -> Result<(), ApiError> {
        let meter = self.admit(key, generated as u64).await?;
        meter.started(0);
        meter.record(0, 0, generated);
        meter.finish("stop", 0);
        meter.settle().await;
        Ok(())
    }

    async fn subscription(&self) -> tessera_control_plane::billing::subscriptions::Subscription {
        self.billing.subscriptions().get(&self.user.id).await.unwrap().unwrap()
    }
}

/// The refusal's retry delay, for a request refused as rate-limited.
fn limited(r: Result<(), ApiError>) -> (String, u64) {
    match r {
        Err(ApiError::SubscriptionLimited { message, retry_after_us }) => (message, retry_after_us),
        other => panic!("expected a subscription limit, got {other:?}"),
    }
}

async fn windows_cap_and_reset(db: Db) {
    let f = Fixture::new(db, "ada@example.com").await;
    f.supply(SupplyState::Low, 0).await;
    let key = f.key(false).await;
    // No plan yet: no quota.
    assert!(matches!(f.run(&key, 0).await, Err(ApiError::InsufficientQuota { .. })));
    f.billing.subscriptions().start(&f.user.id, Plan::Basic, DEV_CARD, T0).await.unwrap();
    // Basic: $20 a month, $5 per 5 hours, $10 per 7 days. Five $1 requests fill the 5-hour window.
    f.at(T0 + HOUR_US);
    for _ in 0..5 {
        f.run(&key, 0).await.unwrap();
    }
    let s = f.subscription().await;
    assert_eq!((s.window_5h.start, s.window_5h.spent, s.spent_micros), (Some(T0 + HOUR_US), 5 * DOLLAR, 5 * DOLLAR));
    assert_eq!((s.held_micros, s.in_flight), (0, 0));
    f.at(T0 + 3 * HOUR_US);
    let (message, retry) = limited(f.run(&key, 0).await);
    assert!(message.contains("5-hour"), "{message}");
    assert_eq!(retry as i64, 3 * HOUR_US, "until the window that began at the first request resets");

    // Reset: five hours after its first request, the window starts again with the next one.
    f.at(T0 + HOUR_US + WINDOW_5H_US);
    for _ in 0..5 {
        f.run(&key, 0).await.unwrap();
    }
    // The 7-day window ($10) is now spent too: the next 5-hour window does not help.
    f.at(T0 + HOUR_US + 2 * WINDOW_5H_US);
    let (message, retry) = limited(f.run(&key, 0).await);
    assert!(message.contains("7-day"), "{message}");
    assert_eq!(retry as i64, WINDOW_7D_US - 2 * WINDOW_5H_US);

    // A week on, $10 more fills the month's $20.
    let week2 = T0 + HOUR_US + WINDOW_7D_US;
    for k in 0..2 {
        f.at(week2 + k * WINDOW_5H_US);
        for _ in 0..5 {
            f.run(&key, 0).await.unwrap();
        }
    }
    assert_eq!(f.subscription().await.left_micros(), 0);
    f.at(week2 + WINDOW_7D_US);
    let (message, retry) = limited(f.run(&key, 0).await);
    assert!(message.contains("monthly"), "{message}");
    let period_end = add_months(T0, 1);
    assert_eq!(retry as i64, period_end - (week2 + WINDOW_7D_US));

    // The period renews (paid again), and included usage starts afresh: nothing rolls over.
    f.at(period_end + 1);
    f.run(&key, 0).await.unwrap();
    let s = f.subscription().await;
    assert_eq!((s.period, s.period_start, s.period_end), (1, period_end, add_months(T0, 2)));
    assert_eq!((s.spent_micros, s.included_micros), (DOLLAR, 20 * DOLLAR));
    let records = f.billing.ledger().usage(&f.user.org_id, 100).await.unwrap();
    assert_eq!(records.len(), 21);
    assert!(
        records.iter().all(|r| r.funding == "subscription" && r.multiplier_bp == 10_000 && r.cost_micros == 1_000_000)
    );
}

async fn credit_fallback_and_the_locked_discount(db: Db) {
    let f = Fixture::new(db, "bob@example.com").await;
    f.supply(SupplyState::Surplus, 0).await;
    f.billing.subscriptions().start(&f.user.id, Plan::Basic, DEV_CARD, T0).await.unwrap();
    let key = f.key(true).await;

    // Surplus: 75 % off. A request of up to 1 + 7 tokens holds $8 × 0.25 = $2 of included usage…
    let meter = f.admit(&key, 7).await.unwrap();
    assert_eq!(f.subscription().await.held_micros, 2 * DOLLAR);
    // …and keeps that discount when the supply state changes while it runs.
    f.supply(SupplyState::Low, 1).await;
    meter.started(0);
    meter.record(0, 0, 3);
    meter.settle().await;
    let s = f.subscription().await;
    assert_eq!((s.spent_micros, s.held_micros), (DOLLAR, 0), "($1 + $3) × 0.25");
    // The next request starts at the new state: full price.
    f.run(&key, 1).await.unwrap();
    assert_eq!(f.subscription().await.spent_micros, 3 * DOLLAR);
    let records = f.billing.ledger().usage(&f.user.org_id, 10).await.unwrap();
    let mut seen: Vec<(u64, u64)> = records.iter().map(|r| (r.multiplier_bp, r.cost_micros)).collect();
    seen.sort();
    assert_eq!(seen, [(2_500, 1_000_000), (10_000, 2_000_000)]);

    // The 5-hour window ($5) cannot cover a $3 worst case with $2 left: with fallback,
    // it runs on credits, at standard rates; without credits, it is refused.
    assert!(matches!(f.run(&key, 2).await, Err(ApiError::InsufficientQuota { .. })));
    let ledger = f.billing.ledger();
    ledger.grant(&f.user.org_id, 10 * DOLLAR as u64, "test").await.unwrap();
    f.run(&key, 2).await.unwrap();
    assert_eq!(ledger.balance(&f.user.org_id).await.unwrap(), 7 * DOLLAR);
    let last = &ledger.usage(&f.user.org_id, 1).await.unwrap()[0];
    assert_eq!((last.funding.as_str(), last.multiplier_bp, last.cost_micros), ("credits", 10_000, 3_000_000));
    assert_eq!(f.subscription().await.spent_micros, 3 * DOLLAR, "the subscription was not charged");
    // A request the window still covers goes to the subscription again.
    f.run(&key, 1).await.unwrap();
    assert_eq!(f.subscription().await.spent_micros, 5 * DOLLAR);
    ledger.audit().await.unwrap();
}

async fn concurrency_and_plan_changes(db: Db) {
    let f = Fixture::new(db, "cy@example.com").await;
    f.supply(SupplyState::Low, 0).await;
    let subs = f.billing.subscriptions();
    // Plans need a recurring method; one-time methods buy credits only.
    let refused = subs.start(&f.user.id, Plan::Basic, DEV_CRYPTO, T0).await;
    assert!(matches!(refused, Err(PlanError::NotRecurring(_))), "{refused:?}");
    let bought = f.billing.ledger().purchase(subs.processor(), &f.user.org_id, 3_000_000, DEV_CRYPTO).await;
    assert!(bought.is_ok());
    assert_eq!(f.billing.ledger().balance(&f.user.org_id).await.unwrap(), 3 * DOLLAR);
    subs.start(&f.user.id, Plan::Basic, DEV_CARD, T0).await.unwrap();
    assert!(matches!(subs.start(&f.user.id, Plan::Pro, DEV_CARD, T0).await, Err(PlanError::AlreadySubscribed(..))));

    // Basic runs two requests at once: a third is refused until one ends.
    let key = f.key(false).await;
    let (a, b) = (f.admit(&key, 0).await.unwrap(), f.admit(&key, 0).await.unwrap());
    let (message, _) = limited(f.admit(&key, 0).await.map(drop));
    assert!(message.contains("at most 2"), "{message}");
    drop(a);
    f.billing.quiesce().await;
    let c = f.admit(&key, 0).await.unwrap();
    drop((b, c));
    f.billing.quiesce().await;

    // Spend $5 (the 5-hour cap), then upgrade to Pro halfway through the month: the
    // difference ($20) for half the period is $10; included usage becomes
    // 2.5 × ($10 + $10) − $5 spent = $45 left.
    f.at(T0 + HOUR_US);
    for _ in 0..5 {
        f.run(&key, 0).await.unwrap();
    }
    let spent = f.subscription().await.spent_micros;
    assert_eq!(spent, 5 * DOLLAR, "five ran; the three that never started cost nothing");
    let half = T0 + (add_months(T0, 1) - T0) / 2;
    // The console's quote, shown before confirming, is what the change charges.
    let quote = f.subscription().await.upgrade_quote(Plan::Pro, half);
    assert_eq!((quote.charged_micros, quote.included_micros), (10 * DOLLAR, 50 * DOLLAR));
    // Agreed to a lower charge than the change would take, or for another period: refused,
    // and nothing charged.
    let shown = f.subscription().await;
    let agreed = |max, period| Agreed { id: shown.id.clone(), period, max_charge_micros: max };
    for wrong in [agreed(quote.charged_micros - 1, 0), agreed(quote.charged_micros, 1)] {
        let refused = subs.change_agreed(&f.user.id, Plan::Pro, half, Some(wrong)).await;
        assert!(matches!(refused, Err(PlanError::Requote(_))), "{refused:?}");
    }
    assert_eq!(f.subscription().await, shown, "unchanged, uncharged");
    assert_eq!(
        subs.change_agreed(&f.user.id, Plan::Pro, half, Some(agreed(quote.charged_micros, 0))).await.unwrap(),
        Change::Upgraded { charged_micros: 10 * DOLLAR }
    );
    let s = f.subscription().await;
    assert_eq!(
        (s.plan, s.paid_micros, s.included_micros, s.left_micros()),
        (Plan::Pro, 20 * DOLLAR, 50 * DOLLAR, 45 * DOLLAR)
    );
    // Pro runs three at once.
    f.at(half);
    let running: Vec<Meter> = [f.admit(&key, 0).await, f.admit(&key, 0).await, f.admit(&key, 0).await]
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(f.admit(&key, 0).await.is_err());
    drop(running);
    f.billing.quiesce().await;

    // A downgrade waits for the next period, which renews at Basic's price.
    let end = add_months(T0, 1);
    assert_eq!(subs.change(&f.user.id, Plan::Basic, half).await.unwrap(), Change::DowngradeScheduled { at: end });
    assert_eq!(f.subscription().await.plan, Plan::Pro);
    // (Other tests' plans may share this database and renew too.)
    assert!(subs.renew_due(end).await.unwrap() >= 1);
    let s = f.subscription().await;
    assert_eq!(
        (s.plan, s.pending_plan, s.paid_micros, s.included_micros, s.spent_micros),
        (Plan::Basic, None, 10 * DOLLAR, 20 * DOLLAR, 0)
    );
    subs.renew_due(end).await.unwrap();
    assert_eq!(f.subscription().await, s, "renewed once");
}

async fn a_declined_renewal_leaves_the_plan_past_due(db: Db) {
    let f = Fixture::new(db, "dee@example.com").await;
    let subs = f.billing.subscriptions();
    subs.start(&f.user.id, Plan::Max, DEV_CARD_DECLINED, T0).await.expect_err("declined");
    assert!(subs.get(&f.user.id).await.unwrap().is_none(), "no plan without payment");
    subs.start(&f.user.id, Plan::Max, DEV_CARD, T0).await.unwrap();
    let key = f.key(false).await;
    // A request still running when the period ends.
    let running = f.admit(&key, 0).await.unwrap();
    running.started(0);

    // The processor does not answer at renewal: the plan stays due (not past due) and
    // its requests wait for the retry.
    subs.set_payment_method(&f.user.id, DEV_CARD_UNREACHABLE).await.unwrap();
    f.at(add_months(T0, 1));
    let (message, retry) = limited(f.run(&key, 0).await);
    assert!(message.contains("could not be paid for yet"), "{message}");
    assert_eq!(retry, 60_000_000);
    assert_eq!(f.subscription().await.status, Status::Active);

    // Declined: past due, and only a new start helps.
    subs.set_payment_method(&f.user.id, DEV_CARD_DECLINED).await.unwrap();
    assert!(matches!(subs.set_payment_method(&f.user.id, DEV_CRYPTO).await, Err(PlanError::NotRecurring(_))));
    assert!(matches!(f.run(&key, 0).await, Err(ApiError::InsufficientQuota { .. })));
    assert_eq!(f.subscription().await.status, Status::PastDue);
    let change = subs.change(&f.user.id, Plan::Basic, add_months(T0, 1)).await;
    assert!(matches!(change, Err(PlanError::PastDue(_))), "{change:?}");

    // Started again with a good card, it is active from now, and the request that was
    // running settles against it without upsetting its counters.
    let restart = add_months(T0, 1) + HOUR_US;
    f.at(restart);
    subs.start(&f.user.id, Plan::Basic, DEV_CARD, restart).await.unwrap();
    assert_eq!(f.subscription().await.in_flight, 1, "the running request kept its slot");
    running.settle().await;
    let s = f.subscription().await;
    assert_eq!((s.in_flight, s.held_micros, s.spent_micros), (0, 0, DOLLAR));
    f.run(&key, 0).await.unwrap();

    // Its next renewal is a charge of its own, not one of the first plan's.
    f.at(add_months(restart, 1));
    f.run(&key, 0).await.unwrap();
    let payments = subs.payments(&f.user.id).await.unwrap();
    let purposes: Vec<(&str, i64)> = payments.iter().map(|p| (p.purpose.as_str(), p.amount_micros)).collect();
    assert_eq!(purposes, [("plan", 100 * DOLLAR), ("plan", 10 * DOLLAR), ("renewal", 10 * DOLLAR)]);
    let s = f.subscription().await;
    assert_eq!((s.period, s.spent_micros), (1, DOLLAR));
}

/// Cancelled, a plan keeps working to the end of its period, then ends uncharged; the
/// cancellation can be called off before, and a plan started again after.
async fn a_cancelled_plan_ends_with_its_period(db: Db) {
    let f = Fixture::new(db, "cal@example.com").await;
    f.supply(SupplyState::Low, 0).await;
    let subs = f.billing.subscriptions();
    subs.start(&f.user.id, Plan::Basic, DEV_CARD, T0).await.unwrap();
    let end = add_months(T0, 1);
    assert_eq!(subs.cancel(&f.user.id, T0 + HOUR_US).await.unwrap(), end);
    assert_eq!(f.subscription().await.cancel_at, Some(end));
    subs.resume(&f.user.id, T0 + HOUR_US).await.unwrap();
    assert_eq!(f.subscription().await.cancel_at, None, "called off");
    subs.cancel(&f.user.id, T0 + HOUR_US).await.unwrap();
    let key = f.key(false).await;
    f.at(T0 + 2 * HOUR_US);
    f.run(&key, 0).await.expect("still the user's until the period ends");

    f.at(end);
    assert!(matches!(f.run(&key, 0).await, Err(ApiError::InsufficientQuota { .. })), "ended");
    subs.renew_due(end).await.unwrap();
    let s = f.subscription().await;
    assert_eq!((s.status, s.period), (Status::Cancelled, 0));
    let purposes: Vec<String> = subs.payments(&f.user.id).await.unwrap().into_iter().map(|p| p.purpose).collect();
    assert_eq!(purposes, ["plan"], "not charged again");
    assert!(matches!(subs.change(&f.user.id, Plan::Pro, end).await, Err(PlanError::NoPlan(_))));
    assert!(matches!(subs.cancel(&f.user.id, end).await, Err(PlanError::NoPlan(_))));

    let again = end + HOUR_US;
    f.at(again);
    let s = subs.start(&f.user.id, Plan::Pro, DEV_CARD, again).await.unwrap();
    assert_eq!((s.status, s.plan, s.cancel_at, s.period_start), (Status::Active, Plan::Pro, None, again));
    f.run(&key, 0).await.unwrap();
}

/// A control plane that dies mid-request leaves holds nobody settles: once its
/// heartbeat stops, another control plane releases them, freeing the plan's concurrency.
async fn a_dead_control_plane_frees_its_holds(db: Db) {
    let f = Fixture::new(db.clone(), "gus@example.com").await;
    f.supply(SupplyState::Low, 0).await;
    f.billing.subscriptions().start(&f.user.id, Plan::Basic, DEV_CARD, T0).await.unwrap();
    let key = f.key(false).await;
    assert_eq!(f.billing.heartbeat(60_000_000).await.unwrap(), 0);
    for _ in 0..2 {
        let meter = f.admit(&key, 1).await.unwrap();
        meter.started(0);
        // The process dies: nothing settles.
        std::mem::forget(meter);
    }
    assert!(f.admit(&key, 0).await.is_err(), "both slots taken");
    let now = f.clock.clone();
    let other = db.billing(Arc::new(DevProcessor::default())).with_clock(Arc::new(move || now.load(Ordering::SeqCst)));
    f.at(T0 + 30_000_000);
    assert_eq!(other.heartbeat(60_000_000).await.unwrap(), 0, "30 s of silence is not death");
    f.at(T0 + 61_000_000);
    assert_eq!(other.heartbeat(60_000_000).await.unwrap(), 2);
    let s = f.subscription().await;
    assert_eq!((s.in_flight, s.held_micros, s.spent_micros), (0, 0, 0), "released unused");
    f.run(&key, 0).await.unwrap();
}

/// Two upgrades at once: whichever way they interleave, every charge kept is in the
/// plan's `paid_micros`, and a charge for a change that lost the race is refunded.
async fn racing_upgrades_keep_only_what_they_apply(db: Db) {
    for (email, to) in [("fay@example.com", [Plan::Pro, Plan::Max]), ("fin@example.com", [Plan::Pro, Plan::Pro])] {
        racing_upgrades(db.clone(), email, to).await;
    }
}

async fn racing_upgrades(db: Db, email: &str, to: [Plan; 2]) {
    let f = Fixture::new(db, email).await;
    let subs = f.billing.subscriptions();
    subs.start(&f.user.id, Plan::Basic, DEV_CARD, T0).await.unwrap();
    let half = T0 + (add_months(T0, 1) - T0) / 2;
    let (a, b) = tokio::join!(subs.change(&f.user.id, to[0], half), subs.change(&f.user.id, to[1], half));
    let conflicts = [&a, &b].iter().filter(|r| matches!(r, Err(PlanError::Conflict(_)))).count();
    let expected = |r: &Result<Change, PlanError>| {
        r.is_ok() || matches!(r, Err(PlanError::Conflict(_)) | Err(PlanError::SamePlan(..)))
    };
    assert!(expected(&a) && expected(&b), "{a:?} {b:?}");
    assert!(a.is_ok() || b.is_ok(), "one of them applies");
    assert_eq!(f.processor.refunded().len(), conflicts);
    let s = f.subscription().await;
    let payments = subs.payments(&f.user.id).await.unwrap();
    let kept: i64 = payments.iter().map(|p| p.amount_micros).sum();
    assert_eq!(kept, s.paid_micros, "{payments:?}");
    assert_eq!(s.included_micros, s.plan.included_for(s.paid_micros));
    assert!(payments.iter().all(|p| !f.processor.refunded().contains(&p.processor_ref)));
}

/// Two control planes (two pools on one PostgreSQL) admit 40 requests of one Max user
/// at once: exactly its concurrency (4) run; then the 5-hour cap holds exactly.
async fn exact_across_control_planes(a: Db, b: Db) {
    let fa = Fixture::new(a, "eve@example.com").await;
    fa.supply(SupplyState::Low, 0).await;
    fa.billing.subscriptions().start(&fa.user.id, Plan::Max, DEV_CARD, T0).await.unwrap();
    let key = fa.key(false).await;
    let clock = fa.clock.clone();
    let now = clock.clone();
    let billing_b =
        b.billing(Arc::new(DevProcessor::default())).with_clock(Arc::new(move || now.load(Ordering::SeqCst)));
    let attempts = (0..40).map(|i| {
        let billing = if i % 2 == 0 { fa.billing.clone() } else { billing_b.clone() };
        let (key, model) = (key.clone(), fa.model.clone());
        async move { billing.admit_priced(&key, &model, DOLLAR_A_TOKEN, ask(&fresh_id(), 0)).await }
    });
    let results = futures_util::future::join_all(attempts).await;
    let admitted: Vec<Meter> = results.into_iter().filter_map(Result::ok).collect();
    assert_eq!(admitted.len(), 4);
    for m in &admitted {
        m.started(0);
        m.settle().await;
    }
    drop(admitted);
    // Max's 5-hour cap is $75: 200 $1 requests, 4 at a time, from both control planes.
    let mut ran = 4;
    for _ in 0..200 {
        let batch = (0..8).map(|i| {
            let billing = if i % 2 == 0 { fa.billing.clone() } else { billing_b.clone() };
            let (key, model) = (key.clone(), fa.model.clone());
            async move {
                let m = billing.admit_priced(&key, &model, DOLLAR_A_TOKEN, ask(&fresh_id(), 0)).await?;
                m.started(0);
                m.settle().await;
                Ok::<(), ApiError>(())
            }
        });
        let results = futures_util::future::join_all(batch).await;
        let ok = results.iter().filter(|r| r.is_ok()).count();
        ran += ok;
        let exhausted = results
            .iter()
            .any(|r| matches!(r, Err(ApiError::SubscriptionLimited { message, .. }) if message.contains("5-hour")));
        if exhausted {
            break;
        }
        assert!(ran <= 75, "ran past the cap");
    }
    assert_eq!(ran, 75);
    assert_eq!(fa.subscription().await.window_5h.spent, 75 * DOLLAR);
}

async fn on(store_url: impl Fn(&str) -> String) {
    windows_cap_and_reset(Db::open(&store_url("a")).await.unwrap()).await;
    credit_fallback_and_the_locked_discount(Db::open(&store_url("b")).await.unwrap()).await;
    concurrency_and_plan_changes(Db::open(&store_url("c")).await.unwrap()).await;
    a_declined_renewal_leaves_the_plan_past_due(Db::open(&store_url("d")).await.unwrap()).await;
    racing_upgrades_keep_only_what_they_apply(Db::open(&store_url("e")).await.unwrap()).await;
    a_dead_control_plane_frees_its_holds(Db::open(&store_url("f")).await.unwrap()).await;
    a_cancelled_plan_ends_with_its_period(Db::open(&store_url("g")).await.unwrap()).await;
}

#[tokio::test]
async fn subscriptions_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    on(|name| format!("sqlite://{}", dir.path().join(format!("{name}.db")).display())).await;
}

#[tokio::test]
async fn subscriptions_on_postgresql() {
    let server = postgres::Server::start();
    // One database: the users' e-mail addresses keep the four cases apart.
    on(|_| server.url.clone()).await;
    let (a, b) = (Db::open(&server.url).await.unwrap(), Db::open(&server.url).await.unwrap());
    exact_across_control_planes(a, b).await;
}
