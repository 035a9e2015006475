//! The web console: server-rendered pages for accounts, organizations, members,
//! invites, API keys, billing, plans and usage, served by the API's own listener at `/`.
//!
//! A request's path: `guard` (every POST: same-origin headers and, with a session
//! cookie, the anti-forgery token) → the page's handler, which takes a `Viewer` (the
//! signed-in user; signed-out browsers are sent to sign in) and asks `authz::authorize`
//! before touching an organization → a template → `headers` (CSP and friends).
//! One module per page or flow; the templates sit beside them.

pub mod account;
pub mod assets;
pub mod authz;
pub mod billing;
pub mod capacity;
pub mod confirm;
pub mod invites;
pub mod keys;
pub mod mail;
pub mod members;
pub mod orgs;
pub mod page;
pub mod password;
pub mod plan;
pub mod playground;
pub mod session;
pub mod setup;
pub mod signin;
pub mod signup;
pub mod status_page;
pub mod throttle;
pub mod usage;

use crate::accounts::{Lifetimes, Store};
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{get, post};
use std::sync::Arc;

/// The console's settings (`ConsoleArgs` on the command line).
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// What e-mails link to, without a trailing slash.
    pub console_url: String,
    /// How long an invite's code works, in seconds.
    pub invite_ttl: i64,
    pub lifetimes: Lifetimes,
    pub throttle: throttle::Limits,
    /// Read the client address from the last `X-Forwarded-For` entry (behind a proxy).
    pub trust_forwarded_for: bool,
    /// Where new dedicated-capacity requests are e-mailed (the operators).
    pub capacity_requests_to: Option<String>,
}

impl ConsoleConfig {
    /// A console at `console_url` with the defaults: invites for a week, sessions
    /// ended by an hour idle or a day in all, the default throttle, no proxy in front,
    /// no operators' address.
    pub fn at(console_url: &str) -> Self {
        Self {
            console_url: console_url.trim_end_matches('/').to_string(),
            invite_ttl: 7 * 86_400,
            lifetimes: Lifetimes { idle: 3600, absolute: 86_400 },
            throttle: throttle::Limits::default(),
            trust_forwarded_for: false,
            capacity_requests_to: None,
        }
    }
}

pub struct Console {
    pub store: Store,
    /// Credits, plans and their payment processor, supply, usage sums: the same the
    /// API bills with.
    pub billing: crate::billing::Billing,
    /// Requests for dedicated capacity.
    pub capacity: crate::capacity::CapacityRequests,
    pub mail: mail::Mailer,
    pub config: ConsoleConfig,
    /// The API this process serves, which the playground calls (None: a console
    /// without it, as in the router's own tests).
    pub api: Option<crate::api::App>,
}

pub type State = Arc<Console>;

/// Forms are small; anything larger is refused before it is read.
const MAX_FORM_BYTES: usize = 64 << 10;
/// Except a playground turn, which carries the conversation so far.
const MAX_PLAYGROUND_BYTES: usize = 1 << 20;

/// The most a POST to `path` may carry.
fn body_limit(path: &str) -> usize {
    if path.ends_with("/playground/chat") { MAX_PLAYGROUND_BYTES } else { MAX_FORM_BYTES }
}

pub fn router(console: State) -> Router {
    Router::new()
        .route("/", get(orgs::home))
        .route("/sign-up", get(signup::form).post(signup::submit))
        .route("/sign-in", get(signin::form).post(signin::submit))
        .route("/sign-out", post(signin::sign_out))
        .route("/account", get(account::page).post(account::change_password))
        .route("/setup", get(setup::form).post(setup::submit))
        .route("/accept-invite", get(invites::accept_page).post(invites::accept))
        .route("/orgs", get(orgs::list).post(orgs::create))
        .route("/o/{org}", get(orgs::dashboard))
        .route("/o/{org}/settings", post(orgs::rename))
        .route("/o/{org}/members", get(members::page))
        .route("/o/{org}/members/{user}/role", post(members::set_role))
        .route("/o/{org}/members/{user}/remove", get(members::confirm_remove).post(members::remove))
        .route("/o/{org}/invites", post(invites::create))
        .route("/o/{org}/invites/{id}/resend", post(invites::resend))
        .route("/o/{org}/invites/{id}/cancel", post(invites::cancel))
        .route("/o/{org}/keys", get(keys::page).post(keys::create))
        .route("/o/{org}/keys/{id}/revoke", get(keys::confirm_revoke).post(keys::revoke))
        .route("/o/{org}/billing", get(billing::page))
        .route("/o/{org}/billing/buy", post(billing::review))
        .route("/o/{org}/billing/buy/confirm", post(billing::buy))
        .route("/o/{org}/plan", get(plan::page))
        .route("/o/{org}/plan/review", post(plan::review))
        .route("/o/{org}/plan/start", post(plan::start))
        .route("/o/{org}/plan/change", post(plan::change))
        .route("/o/{org}/plan/cancel", get(plan::confirm_cancel).post(plan::cancel))
        .route("/o/{org}/plan/resume", post(plan::resume))
        .route("/o/{org}/capacity", get(capacity::page).post(capacity::submit))
        .route("/o/{org}/playground", get(playground::page))
        .route("/o/{org}/playground/chat", post(playground::chat))
        .route("/o/{org}/requests/{id}", get(playground::request_cost))
        .route("/o/{org}/usage", get(usage::page))
        .route("/o/{org}/usage.json", get(usage::data))
        .route("/o/{org}/usage.csv", get(usage::csv))
        .route("/assets/{file}", get(assets::serve))
        .layer(middleware::from_fn(session::guard))
        .layer(DefaultBodyLimit::max(MAX_PLAYGROUND_BYTES))
        .layer(middleware::from_fn(page::headers))
        .with_state(console)
        .layer(middleware::from_fn(crate::keep_alive::settle_unread))
}
