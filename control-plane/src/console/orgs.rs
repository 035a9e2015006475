//! Organizations: the list a user belongs to (and switches between), creating one,
//! its overview page and its settings.

use super::authz::{Action, Offers, authorize};
use super::page::{Frame, Notice, Result, done, render, usd, when};
use super::session::{MaybeViewer, Viewer};
use super::{Console, State};
use crate::accounts::{Membership, StoreError};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

/// `/`: the personal organization of a signed-in user (or their first), else sign in.
pub async fn home(Ctx(console): Ctx<State>, viewer: MaybeViewer) -> Result<Response> {
    let Some(viewer) = viewer.0 else { return Ok(Redirect::to("/sign-in").into_response()) };
    let orgs = console.store.memberships(viewer.user_id()).await?;
    Ok(match orgs.first() {
        Some(m) => Redirect::to(&format!("/o/{}", m.org.id)).into_response(),
        None => Redirect::to("/orgs").into_response(),
    })
}

#[derive(Template)]
#[template(path = "orgs.html")]
struct OrgsPage {
    frame: Frame,
    orgs: Vec<Membership>,
    error: Option<String>,
}

pub async fn list(Ctx(console): Ctx<State>, viewer: Viewer) -> Result<Response> {
    orgs_page(&console, &viewer, StatusCode::OK, None).await
}

async fn orgs_page(console: &Console, viewer: &Viewer, status: StatusCode, error: Option<String>) -> Result<Response> {
    let frame = viewer.frame(console, "Organizations", None).await?;
    let orgs = frame.nav.as_ref().map(|n| n.orgs.clone()).unwrap_or_default();
    Ok(render(status, &OrgsPage { frame, orgs, error }))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Named {
    name: String,
}

/// Anyone signed in may create an organization; they become its owner.
pub async fn create(Ctx(console): Ctx<State>, viewer: Viewer, Form(f): Form<Named>) -> Result<Response> {
    match console.store.create_org_owned_by(&f.name, viewer.user_id()).await {
        Ok(org) => Ok(Redirect::to(&format!("/o/{}", org.id)).into_response()),
        Err(StoreError::Invalid(why)) => orgs_page(&console, &viewer, StatusCode::BAD_REQUEST, Some(why)).await,
        Err(e) => Err(e.into()),
    }
}

#[derive(Template)]
#[template(path = "dashboard.html")]
struct Dashboard {
    frame: Frame,
    membership: Membership,
    offers: Offers,
    members: usize,
    active_keys: usize,
    balance: String,
    created: String,
    done: Option<&'static str>,
    error: Option<String>,
}

pub async fn dashboard(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(notice): Query<Notice>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::View).await?;
    show_dashboard(&console, &viewer, membership, StatusCode::OK, notice.text(), None).await
}

async fn show_dashboard(
    console: &Console,
    viewer: &Viewer,
    membership: Membership,
    status: StatusCode,
    done: Option<&'static str>,
    error: Option<String>,
) -> Result<Response> {
    let org = membership.org.id.clone();
    let members = console.store.members(&org).await?.len();
    let active_keys = console.store.list_keys(&org).await?.iter().filter(|k| k.revoked_at.is_none()).count();
    let micros = console.billing.ledger().balance(&org).await?;
    let page = Dashboard {
        frame: viewer.frame(console, membership.org.name.clone(), Some(&org)).await?,
        offers: Offers::for_role(membership.role),
        created: when(membership.org.created_at),
        membership,
        members,
        active_keys,
        balance: usd(micros),
        done,
        error,
    };
    Ok(render(status, &page))
}

pub async fn rename(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<Named>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageSettings).await?;
    match console.store.rename_org(&org, &f.name).await {
        Ok(()) => Ok(done(&format!("/o/{org}"), "renamed")),
        Err(StoreError::Invalid(why)) => {
            show_dashboard(&console, &viewer, membership, StatusCode::BAD_REQUEST, None, Some(why)).await
        }
        Err(e) => Err(e.into()),
    }
}
