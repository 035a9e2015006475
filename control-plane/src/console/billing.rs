//! Credits: the balance and what requests in flight hold of it, the history of credit
//! added and charged (charges summed per day and model, each linking to the usage
//! it was for), and buying credits through the payment processor — the amount checked,
//! shown on a review page, and bought once however often that page is submitted.

use super::authz::{Action, Offers, authorize};
use super::confirm::Confirm;
use super::page::{ConsoleError, Frame, Notice, Refusal, Result, done, parse_dollars, render, usd, when};
use super::session::Viewer;
use super::{Console, State};
use crate::accounts::Membership;
use crate::billing::LedgerError;
use crate::billing::payments::{Method, PaymentError};
use crate::billing::usage::{DAY_US, Filter, Granularity};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

/// The smallest and largest purchase, in micro-dollars.
pub const MIN_PURCHASE: i64 = 1_000_000;
pub const MAX_PURCHASE: i64 = 10_000_000_000;
/// How far back the history lists charges.
const HISTORY_DAYS: i64 = 90;

struct Entry {
    date: String,
    what: String,
    /// Signed: credit added is positive, charges negative.
    amount: String,
    /// The usage view of a day's charges.
    link: Option<String>,
}

#[derive(Template)]
#[template(path = "billing.html")]
struct BillingPage {
    frame: Frame,
    membership: Membership,
    offers: Offers,
    balance: String,
    held: String,
    balance_zero: bool,
    methods: Vec<Method>,
    history: Vec<Entry>,
    history_days: i64,
    /// The amount typed, kept when it is refused.
    amount: String,
    done: Option<&'static str>,
    error: Option<String>,
}

async fn show(
    console: &Console,
    viewer: &Viewer,
    membership: Membership,
    amount: String,
    done: Option<&'static str>,
    error: Option<String>,
) -> Result<Response> {
    let org = membership.org.id.clone();
    let ledger = console.billing.ledger();
    let (balance, held) = (ledger.balance(&org).await?, ledger.held(&org).await?);
    let mut dated: Vec<(i64, Entry)> = ledger
        .credits_added(&org, 200)
        .await?
        .into_iter()
        .map(|(secs, micros, memo)| {
            let what = match memo.strip_prefix("purchase ") {
                Some(reference) => format!("Credits bought (payment {reference})"),
                None if memo.is_empty() => "Credits granted".to_string(),
                None => format!("Credits granted: {memo}"),
            };
            (secs * 1_000_000, Entry { date: when(secs), what, amount: format!("+{}", usd(micros)), link: None })
        })
        .collect();
    // Charges to credits, per UTC day and model (plan usage is not paid from credit).
    let today = crate::limits::now_us().div_euclid(DAY_US) * DAY_US;
    let since = today - (HISTORY_DAYS - 1) * DAY_US;
    let filter = Filter { funding: Some("credits".into()), ..Filter::default() };
    let charges = console.billing.usage().sums(&org, since, today + DAY_US, Granularity::Day, &filter).await?;
    for c in charges.into_iter().filter(|c| c.cost_micros > 0) {
        let day = crate::calendar::date(c.bucket);
        let link = format!("/o/{org}/usage?from={day}&to={day}&model={}", super::page::urlencode(&c.model));
        let what = format!("{} requests to {}", c.requests, c.model);
        // A day's charges sort after the credit added that day, at its end.
        let entry = Entry { date: day, what, amount: format!("−{}", usd(c.cost_micros)), link: Some(link) };
        dated.push((c.bucket + DAY_US - 1, entry));
    }
    dated.sort_by_key(|e| std::cmp::Reverse(e.0));
    let status = if error.is_some() { StatusCode::BAD_REQUEST } else { StatusCode::OK };
    let page = BillingPage {
        frame: viewer.frame(console, format!("Billing · {}", membership.org.name), Some(&org)).await?,
        offers: Offers::for_role(membership.role),
        membership,
        balance: usd(balance),
        held: usd(held),
        balance_zero: balance <= 0,
        methods: console.billing.subscriptions().processor().methods(),
        history: dated.into_iter().map(|(_, e)| e).collect(),
        history_days: HISTORY_DAYS,
        amount,
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
    show(&console, &viewer, membership, String::new(), notice.text(), None).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct BuyForm {
    amount: String,
    method: String,
    /// The review page's name for this purchase (its idempotency key).
    purchase: String,
}

/// The amount and method of a purchase form, or what is wrong with them.
fn checked(console: &Console, f: &BuyForm) -> std::result::Result<(i64, Method), Refusal> {
    let micros = parse_dollars(&f.amount).ok_or_else(|| {
        format!("Enter an amount in dollars and cents, like 25 or 25.50 (you entered {:?}).", f.amount.trim())
    })?;
    if !(MIN_PURCHASE..=MAX_PURCHASE).contains(&micros) {
        return Err(
            format!("You can buy from {} to {} of credit at a time.", usd(MIN_PURCHASE), usd(MAX_PURCHASE)).into()
        );
    }
    let method = console.billing.subscriptions().processor().methods().into_iter().find(|m| m.id == f.method);
    let method = method.ok_or("Choose a payment method.")?;
    Ok((micros, method))
}

/// The review page: the amount and method as they will be charged, named `purchase`
/// (an earlier attempt's name when it is asked again), with `note` before the button.
async fn review_page(
    console: &Console,
    viewer: &Viewer,
    membership: &Membership,
    (micros, method): (i64, Method),
    purchase: String,
    note: Option<&str>,
) -> Result<Response> {
    let org = &membership.org.id;
    let detail = format!(
        "{} will be charged {} now, and {} added to {}'s balance. Credit does not expire and is not refunded.",
        method.label,
        usd(micros),
        usd(micros),
        membership.org.name
    );
    let page = Confirm {
        frame: viewer.frame(console, "Buy credits", Some(org)).await?,
        question: format!("Buy {} of credit?", usd(micros)),
        detail: match note {
            Some(note) => format!("{note} {detail}"),
            None => detail,
        },
        action: format!("/o/{org}/billing/buy/confirm"),
        button: format!("Pay {}", usd(micros)),
        back: format!("/o/{org}/billing"),
        fields: vec![("amount", usd(micros)), ("method", method.id), ("purchase", purchase)],
        danger: false,
    };
    Ok(render(StatusCode::OK, &page))
}

pub async fn review(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<BuyForm>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageBilling).await?;
    match checked(&console, &f) {
        Ok(reviewed) => {
            let purchase = crate::accounts::keys::random_id("");
            review_page(&console, &viewer, &membership, reviewed, purchase, None).await
        }
        Err(why) => show(&console, &viewer, membership, f.amount, None, Some(why.0)).await,
    }
}

/// Pays for reviewed credit. The review page's purchase name makes the charge and
/// the grant happen once, even when the button is pressed twice; when the processor
/// does not answer, the same review comes back, so that paying again reuses the name.
pub async fn buy(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<BuyForm>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageBilling).await?;
    let (micros, method) = match checked(&console, &f) {
        Ok(ok) => ok,
        Err(why) => return show(&console, &viewer, membership, f.amount, None, Some(why.0)).await,
    };
    let name = f.purchase.trim();
    if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(ConsoleError::BadRequest("This purchase was not reviewed: start again from Billing.".into()));
    }
    let key = format!("credits:{org}:{name}");
    let ledger = console.billing.ledger();
    let processor = console.billing.subscriptions().processor();
    match ledger.purchase_once(processor, &org, micros as u64, &method.id, &key).await {
        Ok(_) => Ok(done(&format!("/o/{org}/billing"), "purchased")),
        Err(LedgerError::Payment(PaymentError::Unavailable(_))) => {
            let note = "The payment processor did not answer, so this payment may or may not have gone through. \
                        Paying again here is safe: this purchase is charged at most once.";
            review_page(&console, &viewer, &membership, (micros, method), name.to_string(), Some(note)).await
        }
        Err(LedgerError::Payment(e)) => {
            let why = format!("The payment did not go through: {e}.");
            show(&console, &viewer, membership, f.amount, None, Some(why)).await
        }
        Err(LedgerError::Invalid(why)) => {
            let why = format!("That purchase cannot be made: {why}.");
            show(&console, &viewer, membership, f.amount, None, Some(why)).await
        }
        Err(e) => Err(e.into()),
    }
}
