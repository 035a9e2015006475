//! Personal plans (docs/api.md, Subscription plans): starting one with a
//! recurring payment method, upgrading now at the pro-rated price shown before
//! confirming, downgrading at the next period (or calling that off), cancelling at
//! the end of the period (or calling that off); and what the plan leaves this month,
//! its two rolling windows, its concurrency, and each model's discount right now.
//! Organizations shared by several people are told that plans are personal.

use super::authz::{Action, authorize};
use super::confirm::Confirm;
use super::page::{ConsoleError, Frame, Notice, Result, done, render, usd, when};
use super::session::Viewer;
use super::{Console, State};
use crate::accounts::Membership;
use crate::billing::payments::{Method, MethodKind};
use crate::billing::plans::{Plan, WINDOW_5H_US, WINDOW_7D_US};
use crate::billing::subscriptions::{Agreed, PlanError, Status, Subscription, Window};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

const PLANS: [Plan; 3] = [Plan::Basic, Plan::Pro, Plan::Max];

/// A plan as the page offers it.
struct Offer {
    plan: Plan,
    name: &'static str,
    price: String,
    included: String,
    concurrency: u32,
    /// What choosing it would do: start, upgrade, downgrade, or nothing (current).
    action: &'static str,
}

/// A rolling window as shown: used of its cap, and when it resets.
struct Gauge {
    name: &'static str,
    used: String,
    cap: String,
    percent: i64,
    resets: String,
}

struct ModelSupply {
    model: String,
    state: &'static str,
    discount: u32,
    multiplier: String,
}

/// The subscription as the page shows it.
struct Current {
    s: Subscription,
    name: &'static str,
    status: &'static str,
    period: String,
    left: String,
    included: String,
    left_percent: i64,
    gauges: Vec<Gauge>,
    concurrency: u32,
    pending: Option<&'static str>,
    renews: String,
    cancel_at: Option<String>,
    method: String,
}

#[derive(Template)]
#[template(path = "plan.html")]
struct PlanPage {
    frame: Frame,
    membership: Membership,
    manage: bool,
    current: Option<Current>,
    offers: Vec<Offer>,
    methods: Vec<Method>,
    supply: Vec<ModelSupply>,
    payments: Vec<(String, String, String)>,
    done: Option<&'static str>,
    error: Option<String>,
}

fn plan_name(p: Plan) -> &'static str {
    match p {
        Plan::Basic => "Basic",
        Plan::Pro => "Pro",
        Plan::Max => "Max",
    }
}

fn plan_error(e: PlanError) -> std::result::Result<String, ConsoleError> {
    Ok(match e {
        PlanError::Db(e) => return Err(e.into()),
        PlanError::NotRecurring(_) => "Plans renew every month, so they need a recurring payment method such as a \
                                       card. One-time methods (crypto) can buy credits but not plans."
            .into(),
        PlanError::PastDue(_) => "Your last renewal payment failed: start the plan again with a working card.".into(),
        PlanError::AlreadySubscribed(..) => "You already have a plan: change it instead.".into(),
        PlanError::NoPlan(_) => "You have no plan running.".into(),
        PlanError::SamePlan(_, plan) => format!("You are already on the {plan} plan."),
        PlanError::Conflict(_) => "Your plan changed in the meantime (any charge was refunded): try again.".into(),
        PlanError::Requote(_) => {
            "Your plan changed since this price was shown (a renewal or another change); nothing was charged. \
             Review the change again."
                .into()
        }
        PlanError::NoUser(_) => "Plans are for personal accounts only.".into(),
        PlanError::Payment(e) => format!("The payment did not go through: {e}."),
    })
}

fn gauge(name: &'static str, w: Window, length: i64, cap: i64, now: i64) -> Gauge {
    let running = w.start.filter(|s| now < s + length);
    let used = if running.is_some() { w.spent } else { 0 };
    Gauge {
        name,
        used: usd(used),
        cap: usd(cap),
        percent: (used * 100 / cap.max(1)).clamp(0, 100),
        resets: match running {
            Some(s) => format!("resets {}", when((s + length) / 1_000_000)),
            None => "starts with your next plan request".into(),
        },
    }
}

fn current(s: Subscription, methods: &[Method], now: i64) -> Current {
    let method =
        methods.iter().find(|m| m.id == s.payment_method).map_or(s.payment_method.clone(), |m| m.label.clone());
    Current {
        name: plan_name(s.plan),
        status: s.status.as_str(),
        period: format!("{} – {}", when(s.period_start / 1_000_000), when(s.period_end / 1_000_000)),
        left: usd(s.left_micros()),
        included: usd(s.included_micros),
        left_percent: s.left_micros() * 100 / s.included_micros.max(1),
        gauges: vec![
            gauge("5-hour window", s.window_5h, WINDOW_5H_US, s.plan.cap_5h(), now),
            gauge("7-day window", s.window_7d, WINDOW_7D_US, s.plan.cap_7d(), now),
        ],
        concurrency: s.plan.concurrency(),
        pending: s.pending_plan.map(plan_name),
        renews: when(s.period_end / 1_000_000),
        cancel_at: s.cancel_at.map(|t| when(t / 1_000_000)),
        method,
        s,
    }
}

/// Each model's discount now: the catalog's models when this process serves the API,
/// else those with a recorded state.
fn supply(console: &Console) -> Vec<ModelSupply> {
    let supply = console.billing.supply();
    let models: Vec<String> = match &console.api {
        Some(app) => app.models.listed().into_iter().map(|m| m.id).collect(),
        None => supply.current().into_iter().map(|p| p.model).collect(),
    };
    models
        .into_iter()
        .map(|model| {
            let state = supply.state(&model);
            let bp = state.multiplier_bp();
            ModelSupply {
                model,
                state: state.as_str(),
                discount: state.discount_percent(),
                multiplier: format!("{}.{:02}", bp / 10_000, bp % 10_000 / 100),
            }
        })
        .collect()
}

async fn show(
    console: &Console,
    viewer: &Viewer,
    membership: Membership,
    done: Option<&'static str>,
    error: Option<String>,
) -> Result<Response> {
    let org = membership.org.id.clone();
    let now = crate::limits::now_us();
    let methods = console.billing.subscriptions().processor().methods();
    let (subscription, payments) = if membership.personal {
        let plans = console.billing.subscriptions();
        let s = plans.get(viewer.user_id()).await?;
        let paid = plans.payments(viewer.user_id()).await?;
        let paid =
            paid.into_iter().rev().map(|p| (when(p.created_at / 1_000_000), p.purpose, usd(p.amount_micros))).collect();
        (s.filter(|s| s.status != Status::Cancelled), paid)
    } else {
        (None, Vec::new())
    };
    let on = subscription.as_ref().filter(|s| s.status == Status::Active).map(|s| s.plan);
    let offers = PLANS
        .iter()
        .map(|&plan| Offer {
            plan,
            name: plan_name(plan),
            price: usd(plan.price_micros()),
            included: usd(plan.included_micros()),
            concurrency: plan.concurrency(),
            action: match on {
                None => "start",
                Some(p) if plan > p => "upgrade",
                Some(p) if plan < p => "downgrade",
                Some(_) => "current",
            },
        })
        .collect();
    let status = if error.is_some() { StatusCode::BAD_REQUEST } else { StatusCode::OK };
    let page = PlanPage {
        frame: viewer.frame(console, "Plan", Some(&org)).await?,
        manage: membership.personal,
        current: subscription.map(|s| current(s, &methods, now)),
        offers,
        // One-time methods too: choosing one is answered with why plans need a card.
        methods,
        supply: supply(console),
        payments,
        membership,
        done,
        error,
    };
    Ok(render(status, &page))
}

pub async fn page(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(notice): Query<Notice>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::View).await?;
    show(&console, &viewer, membership, notice.text(), None).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct PlanForm {
    plan: String,
    method: String,
    /// From a review page: the subscription, period and charge shown.
    sub: String,
    period: String,
    quoted: String,
}

/// The viewer's own personal organization, where they manage their plan; shared
/// organizations are refused with the rule.
async fn personal(console: &Console, viewer: &Viewer, org: &str) -> Result<Membership> {
    let membership = authorize(console, viewer, org, Action::ManageBilling).await?;
    if !membership.personal {
        return Err(ConsoleError::BadRequest(
            "Plans are for personal accounts only: organizations pay with credits. Open your personal organization \
             to start a plan."
                .into(),
        ));
    }
    Ok(membership)
}

/// The review page's record of what was shown: the subscription, its period, the charge.
fn agreed_fields(s: &Subscription, charge: i64) -> [(&'static str, String); 3] {
    [("sub", s.id.clone()), ("period", s.period.to_string()), ("quoted", charge.to_string())]
}

fn parse_plan(text: &str) -> Result<Plan> {
    text.parse().map_err(|_| ConsoleError::BadRequest("Choose Basic, Pro or Max.".into()))
}

/// The review before any plan change: what it costs now and what it brings.
pub async fn review(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<PlanForm>,
) -> Result<Response> {
    let membership = personal(&console, &viewer, &org).await?;
    let plan = parse_plan(&f.plan)?;
    let plans = console.billing.subscriptions();
    let now = crate::limits::now_us();
    let s = plans.get(viewer.user_id()).await?;
    let back = format!("/o/{org}/plan");
    let mut confirm = Confirm {
        frame: viewer.frame(&console, "Change plan", Some(&org)).await?,
        question: String::new(),
        detail: String::new(),
        action: format!("/o/{org}/plan/change"),
        button: String::new(),
        back,
        fields: vec![("plan", plan.as_str().to_string())],
        danger: false,
    };
    match s.filter(|s| s.status == Status::Active) {
        None => {
            let methods = plans.processor().methods();
            let Some(method) = methods.into_iter().find(|m| m.id == f.method) else {
                return show(&console, &viewer, membership, None, Some("Choose a payment method.".into())).await;
            };
            if method.kind != MethodKind::Recurring {
                let why = plan_error(PlanError::NotRecurring(method.id))?;
                return show(&console, &viewer, membership, None, Some(why)).await;
            }
            confirm.question = format!("Start the {} plan for {} a month?", plan_name(plan), usd(plan.price_micros()));
            confirm.detail = format!(
                "{} is charged {} now and every month from today. It includes {} of model usage a month at the \
                 live discounts, {} requests at a time. You can cancel at the end of any month.",
                method.label,
                usd(plan.price_micros()),
                usd(plan.included_micros()),
                plan.concurrency()
            );
            confirm.action = format!("/o/{org}/plan/start");
            confirm.button = format!("Pay {} and start", usd(plan.price_micros()));
            confirm.fields.push(("method", method.id));
        }
        Some(s) if plan > s.plan => {
            let quote = s.upgrade_quote(plan, now);
            confirm.question = format!("Upgrade to {} now for {}?", plan_name(plan), usd(quote.charged_micros));
            confirm.detail = format!(
                "The price difference ({} − {} a month) for the rest of this period, until {}: {} charged now \
                 (worked out again to the second when you confirm, so it can only be lower). Included usage becomes \
                 {} this period ({} × {} paid), of which {} is already spent. {}",
                usd(plan.price_micros()),
                usd(s.plan.price_micros()),
                when(s.period_end / 1_000_000),
                usd(quote.charged_micros),
                usd(quote.included_micros),
                format_args!("{}.{}", plan.multiplier_bp() / 10_000, plan.multiplier_bp() % 10_000 / 1_000),
                usd(quote.paid_micros),
                usd(s.spent_micros),
                match s.cancel_at {
                    Some(_) => format!("The plan is cancelled: it still ends on {}.", when(s.period_end / 1_000_000)),
                    None => format!(
                        "From {} the plan renews at {}.",
                        when(s.period_end / 1_000_000),
                        usd(plan.price_micros())
                    ),
                },
            );
            confirm.button = format!("Pay {} and upgrade", usd(quote.charged_micros));
            confirm.fields.extend(agreed_fields(&s, quote.charged_micros));
        }
        Some(s) if plan < s.plan => {
            confirm.question = format!("Downgrade to {} from {}?", plan_name(plan), when(s.period_end / 1_000_000));
            confirm.detail = format!(
                "You keep {} and what it includes until the period ends; then the plan renews as {} at {} a month. \
                 Nothing is charged now.",
                plan_name(s.plan),
                plan_name(plan),
                usd(plan.price_micros())
            );
            confirm.button = "Downgrade at renewal".into();
            confirm.fields.extend(agreed_fields(&s, 0));
        }
        Some(_) => return Err(ConsoleError::BadRequest("You are already on this plan.".into())),
    }
    Ok(render(StatusCode::OK, &confirm))
}

pub async fn start(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<PlanForm>,
) -> Result<Response> {
    let membership = personal(&console, &viewer, &org).await?;
    let plan = parse_plan(&f.plan)?;
    let plans = console.billing.subscriptions();
    match plans.start(viewer.user_id(), plan, &f.method, crate::limits::now_us()).await {
        Ok(_) => Ok(done(&format!("/o/{org}/plan"), "plan-started")),
        Err(e) => show(&console, &viewer, membership, None, Some(plan_error(e)?)).await,
    }
}

/// Upgrade, schedule a downgrade, or (asking for the current plan) call one off.
pub async fn change(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<PlanForm>,
) -> Result<Response> {
    let membership = personal(&console, &viewer, &org).await?;
    let plan = parse_plan(&f.plan)?;
    let plans = console.billing.subscriptions();
    use crate::billing::subscriptions::Change;
    let agreed = if f.sub.is_empty() {
        None
    } else {
        let number =
            |t: &str| t.parse::<i64>().map_err(|_| ConsoleError::BadRequest("Review the change again.".into()));
        Some(Agreed { id: f.sub.clone(), period: number(&f.period)?, max_charge_micros: number(&f.quoted)? })
    };
    match plans.change_agreed(viewer.user_id(), plan, crate::limits::now_us(), agreed).await {
        Ok(Change::Upgraded { .. }) => Ok(done(&format!("/o/{org}/plan"), "upgraded")),
        Ok(Change::DowngradeScheduled { .. }) => Ok(done(&format!("/o/{org}/plan"), "downgrade")),
        Ok(Change::DowngradeCancelled) => Ok(done(&format!("/o/{org}/plan"), "kept")),
        Err(e) => show(&console, &viewer, membership, None, Some(plan_error(e)?)).await,
    }
}

pub async fn confirm_cancel(Ctx(console): Ctx<State>, viewer: Viewer, Path(org): Path<String>) -> Result<Response> {
    personal(&console, &viewer, &org).await?;
    let s = console.billing.subscriptions().get(viewer.user_id()).await?;
    let Some(s) = s.filter(|s| s.status == Status::Active) else { return Err(ConsoleError::NotFound) };
    let page = Confirm {
        frame: viewer.frame(&console, "Cancel plan", Some(&org)).await?,
        question: format!("Cancel your {} plan?", plan_name(s.plan)),
        detail: format!(
            "It stays yours, with what it includes, until {}, and is not renewed or charged again. Subscription keys \
             stop working then unless they fall back to credits.",
            when(s.period_end / 1_000_000)
        ),
        action: format!("/o/{org}/plan/cancel"),
        button: "Cancel at the end of the period".into(),
        back: format!("/o/{org}/plan"),
        fields: Vec::new(),
        danger: true,
    };
    Ok(render(StatusCode::OK, &page))
}

pub async fn cancel(Ctx(console): Ctx<State>, viewer: Viewer, Path(org): Path<String>) -> Result<Response> {
    let membership = personal(&console, &viewer, &org).await?;
    match console.billing.subscriptions().cancel(viewer.user_id(), crate::limits::now_us()).await {
        Ok(_) => Ok(done(&format!("/o/{org}/plan"), "plan-cancelled")),
        Err(e) => show(&console, &viewer, membership, None, Some(plan_error(e)?)).await,
    }
}

pub async fn resume(Ctx(console): Ctx<State>, viewer: Viewer, Path(org): Path<String>) -> Result<Response> {
    let membership = personal(&console, &viewer, &org).await?;
    match console.billing.subscriptions().resume(viewer.user_id(), crate::limits::now_us()).await {
        Ok(()) => Ok(done(&format!("/o/{org}/plan"), "resumed")),
        Err(e) => show(&console, &viewer, membership, None, Some(plan_error(e)?)).await,
    }
}
