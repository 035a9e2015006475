//! Personal subscriptions: starting, changing and renewing a plan through the payment
//! processor, and paying requests from its included usage.
//!
//! A subscription request holds its worst-case cost (at the discount locked when it
//! starts) against the period's included usage and both rolling windows at once, and
//! counts against the plan's concurrency, in one transaction on the subscription's row:
//! lock it, read it, decide (`Subscription::admit`, plain Rust), write it back. The
//! settlement (in `Ledger::settle`) moves the hold to what the request used.
//! Control planes sharing a PostgreSQL queue on that row lock, so neither the caps nor
//! the concurrency can be overshot however many of them admit at once.

use super::payments::{Charge, MethodKind, PaymentError, PaymentProcessor, Receipt};
use super::plans::{Plan, WINDOW_5H_US, WINDOW_7D_US, add_months};
use crate::accounts::keys;
use serde::Serialize;
use sqlx::{Any, AnyPool, Row, Transaction};
use std::sync::Arc;
use tessera_proto::UnknownName;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("user {0:?} not found")]
    NoUser(String),
    #[error("{0} already has a plan ({1}); change it with `tessera plans change`")]
    AlreadySubscribed(String, &'static str),
    #[error("{0} has no plan")]
    NoPlan(String),
    #[error("{0}'s renewal payment failed: start the plan again (`tessera plans start`) with a working card")]
    PastDue(String),
    #[error("{0} is already on the {1} plan")]
    SamePlan(String, &'static str),
    #[error(
        "plans renew every month and need a recurring payment method (a card); {0:?} is one-time only and can buy credits"
    )]
    NotRecurring(String),
    #[error("{0}'s plan changed while this change was being paid for; the charge was refunded: try again")]
    Conflict(String),
    #[error("{0}'s plan changed since this change was priced; nothing was charged: review it again")]
    Requote(String),
    #[error("{0}")]
    Payment(#[from] PaymentError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Active,
    /// The renewal payment failed: no included usage until the plan is started again.
    PastDue,
    /// Cancelled at the end of a period: no included usage; a plan can be started again.
    Cancelled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::PastDue => "past_due",
            Self::Cancelled => "cancelled",
        }
    }
}

/// A rolling usage window: started by the first request after it lapsed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Window {
    /// µs since the epoch; None while no window runs.
    pub start: Option<i64>,
    pub spent: i64,
}

impl Window {
    /// Clears a window whose time is up.
    fn lapse(&mut self, now: i64, length: i64) {
        if self.start.is_some_and(|s| now >= s + length) {
            *self = Self::default();
        }
    }
}

/// A user's plan and its counters (money in micro-dollars, times in µs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Subscription {
    pub user_id: String,
    /// New each time the plan is started; its charges are named after it.
    pub id: String,
    pub plan: Plan,
    /// A downgrade waiting for the next period.
    pub pending_plan: Option<Plan>,
    pub status: Status,
    /// The plan ends at this time (the end of its period) instead of renewing.
    pub cancel_at: Option<i64>,
    pub payment_method: String,
    pub started_at: i64,
    /// Months since `started_at`: the current billing period.
    pub period: i64,
    pub period_start: i64,
    pub period_end: i64,
    /// Paid for this period (the price, plus any upgrade's pro-rated difference).
    pub paid_micros: i64,
    /// This period's included usage: the plan's multiplier × `paid_micros`.
    pub included_micros: i64,
    pub spent_micros: i64,
    /// Reserved by requests in flight.
    pub held_micros: i64,
    pub in_flight: i64,
    pub window_5h: Window,
    pub window_7d: Window,
}

/// Why included usage cannot pay for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    NoPlan,
    PastDue,
    /// The plan's concurrency is taken by requests in flight.
    Concurrency {
        limit: u32,
    },
    /// The period is over and its renewal could not be charged yet (the processor
    /// did not answer): tried again with the next request.
    Renewing,
    /// A window (or the month) cannot cover the request's worst case until it resets.
    Exhausted {
        window: &'static str,
        left: i64,
        asked: i64,
        resets_at: i64,
    },
}

impl Subscription {
    /// Admits a request holding `amount` at `now`, or says why not; counters are
    /// changed only when it is admitted.
    pub fn admit(&mut self, now: i64, amount: i64) -> Result<(), Refusal> {
        if self.status == Status::Cancelled {
            return Err(Refusal::NoPlan);
        }
        if self.status == Status::PastDue || now >= self.period_end {
            return Err(Refusal::PastDue);
        }
        let limit = self.plan.concurrency();
        if self.in_flight >= limit as i64 {
            return Err(Refusal::Concurrency { limit });
        }
        let (mut w5, mut w7) = (self.window_5h, self.window_7d);
        w5.lapse(now, WINDOW_5H_US);
        w7.lapse(now, WINDOW_7D_US);
        let checks = [
            ("monthly", self.included_micros - self.spent_micros, self.period_end),
            ("5-hour", self.plan.cap_5h() - w5.spent, w5.start.unwrap_or(now) + WINDOW_5H_US),
            ("7-day", self.plan.cap_7d() - w7.spent, w7.start.unwrap_or(now) + WINDOW_7D_US),
        ];
        // Blocked until the last of the windows that cannot cover it resets.
        let blocking = checks
            .iter()
            .filter(|(_, left, _)| left - self.held_micros < amount)
            .max_by_key(|(_, _, resets_at)| *resets_at);
        if let Some(&(window, left, resets_at)) = blocking {
            return Err(Refusal::Exhausted {
                window,
                left: (left - self.held_micros).max(0),
                asked: amount,
                resets_at,
            });
        }
        w5.start.get_or_insert(now);
        w7.start.get_or_insert(now);
        (self.window_5h, self.window_7d) = (w5, w7);
        self.held_micros += amount;
        self.in_flight += 1;
        Ok(())
    }

    /// Ok if the plan is running; else why it cannot be changed.
    fn active(&self) -> Result<(), PlanError> {
        match self.status {
            Status::Active => Ok(()),
            Status::PastDue => Err(PlanError::PastDue(self.user_id.clone())),
            Status::Cancelled => Err(PlanError::NoPlan(self.user_id.clone())),
        }
    }

    /// Included usage left this period.
    pub fn left_micros(&self) -> i64 {
        (self.included_micros - self.spent_micros).max(0)
    }

    /// What upgrading to `plan` at `now` costs (docs/api.md, Subscription plans): the price
    /// difference for the rest of the period, rounded to the nearest micro-dollar,
    /// and the included usage it brings (new multiplier × everything paid this period).
    pub fn upgrade_quote(&self, plan: Plan, now: i64) -> UpgradeQuote {
        let (length, rest) = ((self.period_end - self.period_start) as i128, (self.period_end - now).max(0) as i128);
        let difference = (plan.price_micros() - self.plan.price_micros()) as i128;
        let charged = ((difference * rest + length / 2) / length.max(1)) as i64;
        let paid = self.paid_micros + charged;
        UpgradeQuote { charged_micros: charged, paid_micros: paid, included_micros: plan.included_for(paid) }
    }
}

/// What a payer agreed to when a plan change was shown to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreed {
    /// The subscription (`Subscription::id`) and period shown.
    pub id: String,
    pub period: i64,
    /// The charge shown: the change may cost no more.
    pub max_charge_micros: i64,
}

/// The price of an upgrade, as charged and as shown before confirming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UpgradeQuote {
    pub charged_micros: i64,
    /// Paid this period once upgraded.
    pub paid_micros: i64,
    /// The period's included usage once upgraded (what was spent still counts against it).
    pub included_micros: i64,
}

#[derive(Clone)]
pub struct Subscriptions {
    pool: AnyPool,
    processor: Arc<dyn PaymentProcessor>,
    /// The control-plane process whose holds these are (see `Ledger::owned_by`).
    owner: Option<String>,
}

macro_rules! sub_columns {
    () => {
        "user_id, id, plan, pending_plan, status, cancel_at, payment_method, started_at, period, period_start, period_end, \
         paid_micros, included_micros, spent_micros, held_micros, in_flight, window_5h_start, window_5h_spent, \
         window_7d_start, window_7d_spent"
    };
}

/// Money taken through the processor, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Payment {
    /// The charge's idempotency key.
    pub id: String,
    pub purpose: String,
    pub amount_micros: i64,
    pub processor_ref: String,
    pub created_at: i64,
}

/// What a plan change did.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "change")]
pub enum Change {
    /// Effective now; `charged_micros` is the pro-rated price difference.
    Upgraded { charged_micros: i64 },
    /// Effective when the period renews.
    DowngradeScheduled { at: i64 },
    /// A scheduled downgrade called off.
    DowngradeCancelled,
}

impl Subscriptions {
    pub fn new(pool: AnyPool, processor: Arc<dyn PaymentProcessor>) -> Self {
        Self { pool, processor, owner: None }
    }

    /// The same, taking holds on behalf of control-plane process `owner`.
    pub fn owned_by(self, owner: &str) -> Self {
        Self { owner: Some(owner.into()), ..self }
    }

    pub fn processor(&self) -> &dyn PaymentProcessor {
        self.processor.as_ref()
    }

    pub async fn get(&self, user_id: &str) -> Result<Option<Subscription>, PlanError> {
        let row = sqlx::query(concat!("SELECT ", sub_columns!(), " FROM subscriptions WHERE user_id = $1"))
            .bind(user_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(sub_from_row).transpose()?)
    }

    /// Starts `plan` for a user with no plan (or one whose renewal failed), paid now
    /// with `method`, which must be recurring.
    pub async fn start(&self, user_id: &str, plan: Plan, method: &str, now: i64) -> Result<Subscription, PlanError> {
        let exists = sqlx::query("SELECT id FROM users WHERE id = $1").bind(user_id).fetch_optional(&self.pool).await?;
        if exists.is_none() {
            return Err(PlanError::NoUser(user_id.into()));
        }
        let restart = match self.get(user_id).await? {
            Some(s) if s.status == Status::Active => {
                return Err(PlanError::AlreadySubscribed(user_id.into(), s.plan.as_str()));
            }
            Some(_) => true,
            None => false,
        };
        self.recurring(method)?;
        let id = keys::random_id("sub_");
        let key = format!("plan:{id}");
        let receipt = self.charge(&key, method, plan.price_micros(), format!("{} plan", plan.as_str())).await?;
        let written = async {
            let mut tx = self.pool.begin().await?;
            // A past-due or cancelled plan is started again in place, keeping the holds
            // and concurrency of its requests still in flight; a plan raced in by
            // another operator since the check above makes this write fail.
            let sql = if restart {
                "UPDATE subscriptions SET id = $2, plan = $3, pending_plan = NULL, status = 'active',                  cancel_at = NULL, payment_method = $4, started_at = $5, period = 0, period_start = $5, period_end = $6,                  paid_micros = $7, included_micros = $8, spent_micros = 0, window_5h_start = NULL,                  window_5h_spent = 0, window_7d_start = NULL, window_7d_spent = 0                  WHERE user_id = $1 AND status <> 'active'"
            } else {
                "INSERT INTO subscriptions (user_id, id, plan, status, payment_method, started_at, period,                  period_start, period_end, paid_micros, included_micros)                  VALUES ($1, $2, $3, 'active', $4, $5, 0, $5, $6, $7, $8)"
            };
            let done = sqlx::query(sql)
                .bind(user_id)
                .bind(&id)
                .bind(plan.as_str())
                .bind(method)
                .bind(now)
                .bind(add_months(now, 1))
                .bind(plan.price_micros())
                .bind(plan.included_micros())
                .execute(&mut *tx)
                .await;
            let raced = match &done {
                Ok(d) => d.rows_affected() == 0,
                Err(sqlx::Error::Database(e)) => e.is_unique_violation(),
                Err(_) => false,
            };
            if raced {
                return Err(PlanError::Conflict(user_id.into()));
            }
            done?;
            record_payment(&mut tx, &key, user_id, "plan", plan.price_micros(), method, &receipt.reference, now)
                .await?;
            tx.commit().await?;
            Ok(())
        };
        self.keep_or_refund(&receipt, written.await).await?;
        self.get(user_id).await?.ok_or_else(|| PlanError::NoPlan(user_id.into()))
    }

    /// Payments recorded for `payer` (a user or an organization), oldest first.
    pub async fn payments(&self, payer: &str) -> Result<Vec<Payment>, PlanError> {
        let rows = sqlx::query(
            "SELECT id, purpose, amount_micros, processor_ref, created_at FROM payments WHERE payer = $1 \
             ORDER BY created_at, id",
        )
        .bind(payer)
        .fetch_all(&self.pool)
        .await?;
        let payment = |r: &sqlx::any::AnyRow| -> Result<Payment, sqlx::Error> {
            Ok(Payment {
                id: r.try_get("id")?,
                purpose: r.try_get("purpose")?,
                amount_micros: r.try_get("amount_micros")?,
                processor_ref: r.try_get("processor_ref")?,
                created_at: r.try_get("created_at")?,
            })
        };
        Ok(rows.iter().map(payment).collect::<Result<_, _>>()?)
    }

    /// Puts another payment method on file for renewals and upgrades; it must be
    /// recurring.
    pub async fn set_payment_method(&self, user_id: &str, method: &str) -> Result<(), PlanError> {
        self.recurring(method)?;
        let done = sqlx::query("UPDATE subscriptions SET payment_method = $1 WHERE user_id = $2")
            .bind(method)
            .bind(user_id)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 0 {
            return Err(PlanError::NoPlan(user_id.into()));
        }
        Ok(())
    }

    /// Upgrades now, pro-rated: the price difference for the rest of the period is
    /// charged, and included usage becomes the new multiplier × everything paid this
    /// period, less what was already spent. Downgrades wait for the next period.
    pub async fn change(&self, user_id: &str, plan: Plan, now: i64) -> Result<Change, PlanError> {
        self.change_agreed(user_id, plan, now, None).await
    }

    /// The same, only as the payer agreed on a review page: for the subscription and
    /// period shown then, and charging no more than was shown (a renewal or another
    /// change in between is refused, uncharged, to be reviewed again).
    pub async fn change_agreed(
        &self,
        user_id: &str,
        plan: Plan,
        now: i64,
        agreed: Option<Agreed>,
    ) -> Result<Change, PlanError> {
        let s = self.current(user_id, now).await?;
        s.active()?;
        if let Some(a) = &agreed
            && (a.id != s.id || a.period != s.period || s.upgrade_quote(plan, now).charged_micros > a.max_charge_micros)
        {
            return Err(PlanError::Requote(user_id.into()));
        }
        if plan == s.plan && s.pending_plan.is_none() {
            return Err(PlanError::SamePlan(user_id.into(), plan.as_str()));
        }
        if plan <= s.plan {
            // Scheduling or calling off a downgrade, for this period only: a renewal
            // in between makes it a conflict.
            let pending = (plan < s.plan).then_some(plan.as_str());
            let done = sqlx::query(
                "UPDATE subscriptions SET pending_plan = $1 WHERE user_id = $2 AND period = $3 AND status = 'active'",
            )
            .bind(pending)
            .bind(user_id)
            .bind(s.period)
            .execute(&self.pool)
            .await?;
            if done.rows_affected() == 0 {
                return Err(PlanError::Conflict(user_id.into()));
            }
            return Ok(match pending {
                Some(_) => Change::DowngradeScheduled { at: s.period_end },
                None => Change::DowngradeCancelled,
            });
        }
        let quote = s.upgrade_quote(plan, now);
        let charged = quote.charged_micros;
        // Each attempt its own charge: one that loses a race is refunded alone.
        let key = format!("upgrade:{}:{}", s.id, keys::random_id(""));
        let receipt = if charged > 0 {
            let description = format!("upgrade to {}, pro-rated", plan.as_str());
            Some(self.charge(&key, &s.payment_method, charged, description).await?)
        } else {
            None
        };
        let written = async {
            let mut tx = self.pool.begin().await?;
            // Only if nothing changed the plan or the period since it was read.
            let done = sqlx::query(
                "UPDATE subscriptions SET plan = $1, pending_plan = NULL, paid_micros = $2, included_micros = $3 \
                 WHERE user_id = $4 AND plan = $5 AND period = $6 AND id = $7 AND status = 'active'",
            )
            .bind(plan.as_str())
            .bind(quote.paid_micros)
            .bind(quote.included_micros)
            .bind(user_id)
            .bind(s.plan.as_str())
            .bind(s.period)
            .bind(&s.id)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 0 {
                return Err(PlanError::Conflict(user_id.into()));
            }
            if let Some(r) = &receipt {
                record_payment(&mut tx, &key, user_id, "upgrade", charged, &s.payment_method, &r.reference, now)
                    .await?;
            }
            tx.commit().await?;
            Ok(())
        };
        let written = written.await;
        match &receipt {
            Some(r) => self.keep_or_refund(r, written).await?,
            None => written?,
        }
        Ok(Change::Upgraded { charged_micros: charged })
    }

    /// Ends the plan when its period does, instead of renewing (`resume` calls it off):
    /// included usage stays until then. Returns when it ends.
    pub async fn cancel(&self, user_id: &str, now: i64) -> Result<i64, PlanError> {
        let s = self.current(user_id, now).await?;
        s.active()?;
        self.set_cancel_at(&s, Some(s.period_end)).await?;
        Ok(s.period_end)
    }

    /// Calls off a cancellation: the plan renews again.
    pub async fn resume(&self, user_id: &str, now: i64) -> Result<(), PlanError> {
        let s = self.current(user_id, now).await?;
        if s.status != Status::Active {
            return Err(PlanError::NoPlan(user_id.into()));
        }
        self.set_cancel_at(&s, None).await
    }

    /// For this period only: a renewal in between makes it a conflict.
    async fn set_cancel_at(&self, s: &Subscription, at: Option<i64>) -> Result<(), PlanError> {
        let done = sqlx::query(
            "UPDATE subscriptions SET cancel_at = $1 WHERE user_id = $2 AND period = $3 AND id = $4 \
             AND status = 'active'",
        )
        .bind(at)
        .bind(&s.user_id)
        .bind(s.period)
        .bind(&s.id)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(PlanError::Conflict(s.user_id.clone()));
        }
        Ok(())
    }

    /// The subscription as of `now`, renewed first if its period is over.
    async fn current(&self, user_id: &str, now: i64) -> Result<Subscription, PlanError> {
        let s = self.get(user_id).await?.ok_or_else(|| PlanError::NoPlan(user_id.into()))?;
        if s.status == Status::Active && now >= s.period_end {
            self.renew(&s, now).await?;
            return self.get(user_id).await?.ok_or_else(|| PlanError::NoPlan(user_id.into()));
        }
        Ok(s)
    }

    /// Renews every active subscription whose period is over; the number renewed.
    pub async fn renew_due(&self, now: i64) -> Result<u32, PlanError> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            sub_columns!(),
            " FROM subscriptions WHERE status = 'active' AND period_end <= $1"
        ))
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        let mut renewed = 0;
        for row in &rows {
            let s = sub_from_row(row)?;
            match self.renew(&s, now).await {
                Ok(true) => renewed += 1,
                Ok(false) => {}
                Err(e) => tracing::error!("renewing {}'s plan: {e}", s.user_id),
            }
        }
        Ok(renewed)
    }

    /// Moves a subscription into the period that contains `now`, charging that period's
    /// price (the pending downgrade's, if any): included usage starts afresh, unspent
    /// usage does not roll over. A declined payment leaves it past due; a processor
    /// that cannot be reached leaves it due, to be tried again. Periods missed while
    /// nothing ran are not charged. True if this call renewed it.
    ///
    /// Control planes renewing the same period at once send the same idempotency key,
    /// so the processor charges once; one of them writes the new period.
    async fn renew(&self, s: &Subscription, now: i64) -> Result<bool, PlanError> {
        if s.cancel_at.is_some() {
            self.end_cancelled(s).await?;
            return Ok(false);
        }
        let mut period = s.period + 1;
        while add_months(s.started_at, period + 1) <= now {
            period += 1;
        }
        let plan = s.pending_plan.unwrap_or(s.plan);
        let key = format!("renewal:{}:{period}", s.id);
        let description = format!("{} plan, month {}", plan.as_str(), period + 1);
        let receipt = match self.charge(&key, &s.payment_method, plan.price_micros(), description).await {
            Ok(r) => r,
            Err(PlanError::Payment(e @ (PaymentError::Declined(_) | PaymentError::UnknownMethod(_)))) => {
                tracing::warn!("{}'s renewal was not paid: {e}", s.user_id);
                sqlx::query(
                    "UPDATE subscriptions SET status = 'past_due' WHERE user_id = $1 AND id = $2 AND period = $3 \
                     AND status = 'active'",
                )
                .bind(&s.user_id)
                .bind(&s.id)
                .bind(s.period)
                .execute(&self.pool)
                .await?;
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "UPDATE subscriptions SET plan = $1, pending_plan = NULL, period = $2, period_start = $3, period_end = $4, \
             paid_micros = $5, included_micros = $6, spent_micros = 0 \
             WHERE user_id = $7 AND id = $8 AND period = $9 AND status = 'active' AND cancel_at IS NULL",
        )
        .bind(plan.as_str())
        .bind(period)
        .bind(add_months(s.started_at, period))
        .bind(add_months(s.started_at, period + 1))
        .bind(plan.price_micros())
        .bind(plan.included_micros())
        .bind(&s.user_id)
        .bind(&s.id)
        .bind(s.period)
        .execute(&mut *tx)
        .await?;
        let renewed = done.rows_affected() == 1;
        if renewed {
            let (price, method) = (plan.price_micros(), &s.payment_method);
            record_payment(&mut tx, &key, &s.user_id, "renewal", price, method, &receipt.reference, now).await?;
        }
        tx.commit().await?;
        if !renewed {
            // Another control plane renewed this period (with this same charge: keep it),
            // or the plan was cancelled since it was read: then the charge paid for nothing.
            if self.end_cancelled(s).await? {
                self.refund(&receipt.reference).await;
            }
        }
        Ok(renewed)
    }

    /// Ends a cancelled plan whose period is over (still at `s`'s period); true if this
    /// call ended it.
    async fn end_cancelled(&self, s: &Subscription) -> Result<bool, PlanError> {
        let done = sqlx::query(
            "UPDATE subscriptions SET status = 'cancelled', pending_plan = NULL WHERE user_id = $1 AND id = $2 \
             AND period = $3 AND status = 'active' AND cancel_at IS NOT NULL",
        )
        .bind(&s.user_id)
        .bind(&s.id)
        .bind(s.period)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Holds `amount` of the included usage of the user whose personal organization is
    /// `org_id`, for request `request_id` starting at `now`. Ok(Err) says why it cannot.
    pub async fn hold(
        &self,
        org_id: &str,
        request_id: &str,
        amount: i64,
        now: i64,
    ) -> Result<Result<(), Refusal>, PlanError> {
        let user =
            sqlx::query("SELECT id FROM users WHERE org_id = $1").bind(org_id).fetch_optional(&self.pool).await?;
        let Some(user_id) = user.map(|r| r.try_get::<String, _>("id")).transpose()? else {
            return Ok(Err(Refusal::NoPlan));
        };
        match self.current(&user_id, now).await {
            Ok(_) => {}
            Err(PlanError::NoPlan(_)) => return Ok(Err(Refusal::NoPlan)),
            Err(PlanError::Payment(e)) => {
                tracing::warn!("{user_id}'s renewal is due and could not be charged yet: {e}");
                return Ok(Err(Refusal::Renewing));
            }
            Err(e) => return Err(e),
        }
        let mut tx = self.pool.begin().await?;
        // Lock the row first (SQLite: take the write lock), so that the read below is
        // the latest and no other admission interleaves with this one.
        sqlx::query("UPDATE subscriptions SET in_flight = in_flight WHERE user_id = $1")
            .bind(&user_id)
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(concat!("SELECT ", sub_columns!(), " FROM subscriptions WHERE user_id = $1"))
            .bind(&user_id)
            .fetch_one(&mut *tx)
            .await?;
        let mut s = sub_from_row(&row)?;
        if let Err(refusal) = s.admit(now, amount) {
            tx.rollback().await?;
            return Ok(Err(refusal));
        }
        sqlx::query(
            "UPDATE subscriptions SET held_micros = $1, in_flight = $2, window_5h_start = $3, window_5h_spent = $4, \
             window_7d_start = $5, window_7d_spent = $6 WHERE user_id = $7",
        )
        .bind(s.held_micros)
        .bind(s.in_flight)
        .bind(s.window_5h.start)
        .bind(s.window_5h.spent)
        .bind(s.window_7d.start)
        .bind(s.window_7d.spent)
        .bind(&user_id)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO holds (request_id, org_id, amount, created_at, funding, user_id, owner) \
             VALUES ($1, $2, $3, $4, 'subscription', $5, $6)",
        )
        .bind(request_id)
        .bind(org_id)
        .bind(amount)
        .bind(now / 1_000_000)
        .bind(&user_id)
        .bind(&self.owner)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Ok(()))
    }

    /// A charge whose plan change was then not written is refunded: it paid for
    /// nothing.
    async fn keep_or_refund(&self, receipt: &Receipt, written: Result<(), PlanError>) -> Result<(), PlanError> {
        if written.is_err() {
            self.refund(&receipt.reference).await;
        }
        written
    }

    /// Refunds a charge that paid for nothing; a refund that fails is logged for
    /// people to settle, since the plan change itself has been refused.
    async fn refund(&self, reference: &str) {
        if let Err(e) = self.processor.refund(reference).await {
            tracing::error!("refunding charge {reference}, which paid for nothing: {e}");
        }
    }

    fn recurring(&self, method: &str) -> Result<(), PlanError> {
        match self.processor.method_kind(method) {
            Some(MethodKind::Recurring) => Ok(()),
            Some(MethodKind::OneTime) => Err(PlanError::NotRecurring(method.into())),
            None => Err(PaymentError::UnknownMethod(method.into()).into()),
        }
    }

    async fn charge(
        &self,
        key: &str,
        method: &str,
        amount_micros: i64,
        description: String,
    ) -> Result<Receipt, PlanError> {
        let charge = Charge { idempotency_key: key.into(), method: method.into(), amount_micros, description };
        Ok(self.processor.charge(&charge).await?)
    }
}

/// Settles a subscription hold (inside `Ledger::settle`'s transaction): the hold is
/// returned, the cost spent from the period and both windows, the concurrency slot
/// freed. A request counts against the windows that admitted it, whose caps covered
/// its hold; if they have lapsed meanwhile, the cost lands in counters the next
/// admission clears (or in windows begun since, erring on the side of the caps).
pub(super) async fn settle(
    tx: &mut Transaction<'_, Any>,
    user_id: &str,
    held: i64,
    cost: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE subscriptions SET held_micros = held_micros - $1, in_flight = in_flight - 1, \
         spent_micros = spent_micros + $2, window_5h_spent = window_5h_spent + $2, \
         window_7d_spent = window_7d_spent + $2 WHERE user_id = $3",
    )
    .bind(held)
    .bind(cost)
    .bind(user_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Records money taken; a payment recorded before (same idempotency key) is kept as is.
/// True if this call recorded it.
#[allow(clippy::too_many_arguments)]
pub(super) async fn record_payment(
    tx: &mut Transaction<'_, Any>,
    key: &str,
    payer: &str,
    purpose: &str,
    amount: i64,
    method: &str,
    reference: &str,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "INSERT INTO payments (id, payer, purpose, amount_micros, payment_method, processor_ref, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO NOTHING",
    )
    .bind(key)
    .bind(payer)
    .bind(purpose)
    .bind(amount)
    .bind(method)
    .bind(reference)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

fn sub_from_row(r: &sqlx::any::AnyRow) -> Result<Subscription, sqlx::Error> {
    let plan = |c: &str| -> Result<Option<Plan>, sqlx::Error> {
        r.try_get::<Option<String>, _>(c)?
            .map(|p| p.parse().map_err(|e: UnknownName| sqlx::Error::Decode(e.into())))
            .transpose()
    };
    let status: String = r.try_get("status")?;
    Ok(Subscription {
        user_id: r.try_get("user_id")?,
        id: r.try_get("id")?,
        plan: plan("plan")?.ok_or_else(|| sqlx::Error::Decode("a subscription without a plan".into()))?,
        pending_plan: plan("pending_plan")?,
        status: match status.as_str() {
            "past_due" => Status::PastDue,
            "cancelled" => Status::Cancelled,
            _ => Status::Active,
        },
        cancel_at: r.try_get("cancel_at")?,
        payment_method: r.try_get("payment_method")?,
        started_at: r.try_get("started_at")?,
        period: r.try_get("period")?,
        period_start: r.try_get("period_start")?,
        period_end: r.try_get("period_end")?,
        paid_micros: r.try_get("paid_micros")?,
        included_micros: r.try_get("included_micros")?,
        spent_micros: r.try_get("spent_micros")?,
        held_micros: r.try_get("held_micros")?,
        in_flight: r.try_get("in_flight")?,
        window_5h: Window { start: r.try_get("window_5h_start")?, spent: r.try_get("window_5h_spent")? },
        window_7d: Window { start: r.try_get("window_7d_start")?, spent: r.try_get("window_7d_spent")? },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(plan: Plan) -> Subscription {
        Subscription {
            user_id: "u".into(),
            id: "sub_t".into(),
            plan,
            pending_plan: None,
            status: Status::Active,
            cancel_at: None,
            payment_method: "pm".into(),
            started_at: 0,
            period: 0,
            period_start: 0,
            period_end: add_months(0, 1),
            paid_micros: plan.price_micros(),
            included_micros: plan.included_micros(),
            spent_micros: 0,
            held_micros: 0,
            in_flight: 0,
            window_5h: Window::default(),
            window_7d: Window::default(),
        }
    }

    #[test]
    fn the_first_request_starts_both_windows_and_lapsed_ones_restart() {
        let mut s = fresh(Plan::Basic);
        s.admit(1_000, 10).unwrap();
        assert_eq!((s.window_5h.start, s.window_7d.start), (Some(1_000), Some(1_000)));
        assert_eq!((s.held_micros, s.in_flight), (10, 1));
        s.window_5h.spent = 123;
        s.in_flight = 0;
        // Five hours on, the 5-hour window is cleared and starts again; the 7-day one runs on.
        s.admit(1_000 + WINDOW_5H_US, 10).unwrap();
        assert_eq!(s.window_5h, Window { start: Some(1_000 + WINDOW_5H_US), spent: 0 });
        assert_eq!(s.window_7d.start, Some(1_000));
    }

    #[test]
    fn refusals_name_the_window_that_resets_last() {
        let mut s = fresh(Plan::Basic);
        s.admit(0, 1).unwrap();
        s.in_flight = 0;
        s.held_micros = 0;
        // The 5-hour cap ($5) is spent; the 7-day one ($10) is not.
        s.window_5h.spent = Plan::Basic.cap_5h();
        s.window_7d.spent = Plan::Basic.cap_5h();
        let refused = s.clone().admit(HOUR_US, 1);
        assert_eq!(refused, Err(Refusal::Exhausted { window: "5-hour", left: 0, asked: 1, resets_at: WINDOW_5H_US }));
        // Both spent: blocked until the 7-day window resets.
        s.window_7d.spent = Plan::Basic.cap_7d();
        let Err(Refusal::Exhausted { window, resets_at, .. }) = s.clone().admit(HOUR_US, 1) else { panic!() };
        assert_eq!((window, resets_at), ("7-day", WINDOW_7D_US));
        // Holds of requests in flight count against every window.
        let mut t = fresh(Plan::Basic);
        t.held_micros = Plan::Basic.cap_5h() - 5;
        assert!(matches!(t.clone().admit(0, 6), Err(Refusal::Exhausted { window: "5-hour", left: 5, .. })));
        assert!(t.admit(0, 5).is_ok());
        let mut busy = fresh(Plan::Basic);
        busy.in_flight = 2;
        assert_eq!(busy.admit(0, 1), Err(Refusal::Concurrency { limit: 2 }));
        let mut due = fresh(Plan::Basic);
        assert_eq!(due.admit(due.period_end, 1), Err(Refusal::PastDue));
    }

    use super::super::plans::HOUR_US;
}
