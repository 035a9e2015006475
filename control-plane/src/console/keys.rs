//! API keys: the list (never a secret), creating one (its secret shown once, on the
//! answer to the POST, with a copy button), and revoking with a confirmation. Keys made
//! here and with `tessera keys create` are the same rows.

use super::authz::{Action, Offers, authorize};
use super::page::{ConsoleError, Frame, Notice, Result, done, render, when};
use super::session::Viewer;
use super::{State, confirm};
use crate::accounts::{ApiKey, BillingMode, Membership, NewKey, StoreError};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

struct KeyRow {
    key: ApiKey,
    prefix: String,
    billing: &'static str,
    created_by: String,
    created: String,
    last_used: String,
}

#[derive(Template)]
#[template(path = "keys.html")]
struct KeysPage {
    frame: Frame,
    membership: Membership,
    offers: Offers,
    keys: Vec<KeyRow>,
    /// A key just created: its name and its secret, shown this once.
    created: Option<(String, String)>,
    balance_zero: bool,
    done: Option<&'static str>,
    error: Option<String>,
}

async fn show(
    console: &super::Console,
    viewer: &Viewer,
    membership: Membership,
    created: Option<(String, String)>,
    done: Option<&'static str>,
    error: Option<String>,
) -> Result<Response> {
    let org = membership.org.id.clone();
    let members = console.store.members(&org).await?;
    let keys = console
        .store
        .list_keys(&org)
        .await?
        .into_iter()
        .filter(|k| k.revoked_at.is_none())
        .map(|key| KeyRow {
            prefix: key.prefix.clone().map_or_else(|| "tsk_…".into(), |p| format!("{p}…")),
            billing: match (key.billing_mode, key.fallback_to_credits) {
                (BillingMode::Credits, _) => "credits",
                (BillingMode::Subscription, false) => "subscription",
                (BillingMode::Subscription, true) => "subscription, then credits",
            },
            created_by: match &key.created_by {
                Some(id) => {
                    members.iter().find(|m| &m.user_id == id).map_or("a former member".into(), |m| m.email.clone())
                }
                None => "operator (CLI)".into(),
            },
            created: when(key.created_at),
            last_used: key.last_used_at.map_or_else(|| "never".into(), when),
            key,
        })
        .collect();
    let balance = console.billing.ledger().balance(&org).await?;
    let status = match (&created, &error) {
        (Some(_), _) => StatusCode::CREATED,
        (None, Some(_)) => StatusCode::BAD_REQUEST,
        (None, None) => StatusCode::OK,
    };
    let page = KeysPage {
        frame: viewer.frame(console, format!("API keys · {}", membership.org.name), Some(&org)).await?,
        offers: Offers::for_role(membership.role),
        membership,
        keys,
        created,
        balance_zero: balance <= 0,
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
    show(&console, &viewer, membership, None, notice.text(), None).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct NewKeyForm {
    name: String,
    billing_mode: String,
    fallback: Option<String>,
}

pub async fn create(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<NewKeyForm>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageKeys).await?;
    let billing_mode = match f.billing_mode.as_str() {
        "" | "credits" => BillingMode::Credits,
        "subscription" => BillingMode::Subscription,
        _ => return Err(ConsoleError::BadRequest("Choose credits or subscription.".into())),
    };
    let name = f.name.trim();
    if name.chars().count() > 100 {
        let why = "A key's name has at most 100 characters.".to_string();
        return show(&console, &viewer, membership, None, None, Some(why)).await;
    }
    let new = NewKey {
        org_id: &org,
        name,
        billing_mode,
        fallback_to_credits: billing_mode == BillingMode::Subscription && f.fallback.is_some(),
        created_by: Some(viewer.user_id()),
    };
    match console.store.create_key(new).await {
        Ok((key, secret)) => show(&console, &viewer, membership, Some((key.name, secret)), None, None).await,
        Err(StoreError::Invalid(why)) => show(&console, &viewer, membership, None, None, Some(why)).await,
        Err(e) => Err(e.into()),
    }
}

/// The key `id` if it belongs to `org` and is active.
async fn key_of(console: &super::Console, org: &str, id: &str) -> Result<ApiKey> {
    match console.store.key(id).await? {
        Some(key) if key.org_id == org && key.revoked_at.is_none() => Ok(key),
        _ => Err(ConsoleError::NotFound),
    }
}

pub async fn confirm_revoke(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, id)): Path<(String, String)>,
) -> Result<Response> {
    authorize(&console, &viewer, &org, Action::ManageKeys).await?;
    let key = key_of(&console, &org, &id).await?;
    let page = confirm::Confirm {
        frame: viewer.frame(&console, "Revoke key", Some(&org)).await?,
        question: format!("Revoke the key {:?}?", key.name),
        detail: "Requests with it are refused from this moment on. This cannot be undone.".into(),
        action: format!("/o/{org}/keys/{id}/revoke"),
        button: "Revoke key".into(),
        back: format!("/o/{org}/keys"),
        fields: Vec::new(),
        danger: true,
    };
    Ok(render(StatusCode::OK, &page))
}

pub async fn revoke(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, id)): Path<(String, String)>,
) -> Result<Response> {
    authorize(&console, &viewer, &org, Action::ManageKeys).await?;
    let key = key_of(&console, &org, &id).await?;
    console.store.revoke_key(&key.id).await?;
    Ok(done(&format!("/o/{org}/keys"), "revoked"))
}
