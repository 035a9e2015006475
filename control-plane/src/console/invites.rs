//! Invites: an owner invites an address with a role; the e-mail carries the accept
//! link; following it, the invitee signs in or signs up with that address and the
//! invite is applied in the same step. A code for another address, or one expired,
//! used or cancelled, gets a page that says so and applies nothing.

use super::authz::{Action, authorize};
use super::page::{ConsoleError, Frame, Refusal, Result, done, render, urlencode, when};
use super::session::{self, MaybeViewer, Viewer};
use super::{Console, State};
use crate::accounts::{Acceptance, Invite, InviteState, Membership, Role, StoreError};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct NewInvite {
    email: String,
    role: String,
}

pub async fn create(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(f): Form<NewInvite>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    let role = Role::parse(&f.role).ok_or_else(|| ConsoleError::BadRequest("Choose owner or member.".into()))?;
    let (invite, code) =
        match console.store.create_invite(&org, &f.email, role, viewer.user_id(), console.config.invite_ttl).await {
            Ok(made) => made,
            Err(StoreError::Invalid(why)) => return refused(&console, &viewer, membership, why).await,
            Err(e) => return Err(e.into()),
        };
    match send(&console, &invite, &code, &membership.org.name, &viewer.session.user.email).await {
        Ok(()) => Ok(done(&format!("/o/{org}/members"), "invited")),
        Err(why) => refused(&console, &viewer, membership, why.0).await,
    }
}

pub async fn resend(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, id)): Path<(String, String)>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    let Some((invite, code)) = console.store.resend_invite(&org, &id, console.config.invite_ttl).await? else {
        return Err(ConsoleError::NotFound);
    };
    match send(&console, &invite, &code, &membership.org.name, &viewer.session.user.email).await {
        Ok(()) => Ok(done(&format!("/o/{org}/members"), "resent")),
        Err(why) => refused(&console, &viewer, membership, why.0).await,
    }
}

pub async fn cancel(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, id)): Path<(String, String)>,
) -> Result<Response> {
    authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    if !console.store.cancel_invite(&org, &id).await? {
        return Err(ConsoleError::NotFound);
    }
    Ok(done(&format!("/o/{org}/members"), "cancelled"))
}

/// The members page saying why an invite was not made or sent.
async fn refused(console: &Console, viewer: &Viewer, membership: Membership, why: String) -> Result<Response> {
    super::members::show(console, viewer, membership, StatusCode::BAD_REQUEST, None, Some(why)).await
}

/// The invite e-mail: who invited, to what, with which role, until when, and the link.
async fn send(console: &Console, invite: &Invite, code: &str, org_name: &str, inviter: &str) -> Result<(), Refusal> {
    let link = format!("{}/accept-invite?invite_code={code}", console.config.console_url);
    let body = format!(
        "{inviter} invited you to join {org_name} on Tessera as {role}.\n\n\
         Accept the invite: {link}\n\n\
         Sign in, or create an account, with this address ({email}). The link works once, until {until}.\n\
         If you did not expect this, ignore this message.\n",
        role = invite.role.as_str(),
        email = invite.email,
        until = when(invite.expires_at),
    );
    let subject = format!("You are invited to {org_name} on Tessera");
    console.mail.send(&invite.email, &subject, body).await.map(|_| ()).map_err(|e| {
        tracing::warn!(error = %e, invite = %invite.id, "the invite e-mail was not sent");
        Refusal(format!("The invite was made but the e-mail was not sent ({e}). Resend it when mail works."))
    })
}

#[derive(Template)]
#[template(path = "accept.html")]
struct AcceptPage {
    frame: Frame,
    code: String,
    /// What the page says; None: a valid invite for the viewer (or a signed-out one).
    problem: Option<String>,
    org_name: String,
    role: String,
    email: String,
    signed_in: bool,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Code {
    invite_code: String,
}

/// The accept link. Nothing changes on a GET: signed out, the page offers sign-in and
/// sign-up forms that apply the invite; signed in as the invited address, a button.
pub async fn accept_page(
    Ctx(console): Ctx<State>,
    viewer: MaybeViewer,
    headers: HeaderMap,
    Query(q): Query<Code>,
) -> Result<Response> {
    let found = if q.invite_code.is_empty() { None } else { console.store.invite_by_code(&q.invite_code).await? };
    let now = crate::accounts::store::now();
    let mut page = AcceptPage {
        frame: Frame::signed_out("Invitation", session::csrf_for(&headers)),
        code: q.invite_code.clone(),
        problem: None,
        org_name: String::new(),
        role: String::new(),
        email: String::new(),
        signed_in: viewer.0.is_some(),
    };
    let status = match &found {
        None => {
            page.problem = Some("This invite link is not valid. Ask for a new invite.".into());
            StatusCode::NOT_FOUND
        }
        Some((invite, org)) => {
            page.org_name = org.name.clone();
            page.role = invite.role.as_str().into();
            page.email = invite.email.clone();
            page.problem = state_problem(invite.state(now));
            if let Some(v) = &viewer.0
                && page.problem.is_none()
                && v.session.user.email != invite.email
            {
                page.problem = Some(other_email(&invite.email, &v.session.user.email));
            }
            if page.problem.is_some() { StatusCode::GONE } else { StatusCode::OK }
        }
    };
    if let Some(v) = &viewer.0 {
        page.frame.nav = Some(v.nav(&console, None).await?);
    }
    let mut response = render(status, &page);
    // The code is in this page's address: it must not leak to other sites.
    response.headers_mut().insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    Ok(response)
}

fn state_problem(state: InviteState) -> Option<String> {
    match state {
        InviteState::Pending => None,
        InviteState::Accepted => Some("This invite has been used. Each invite works once.".into()),
        InviteState::Cancelled => Some("This invite was cancelled by the organization.".into()),
        InviteState::Expired => Some("This invite has expired. Ask an owner to resend it.".into()),
    }
}

fn other_email(invited: &str, signed_in: &str) -> String {
    format!(
        "This invite is for {invited}, and you are signed in as {signed_in}. \
         Sign out and sign in (or sign up) as {invited} to accept it."
    )
}

/// The signed-in invitee's button.
pub async fn accept(Ctx(console): Ctx<State>, viewer: Viewer, Form(q): Form<Code>) -> Result<Response> {
    let to = apply_after_sign_in(&console, &q.invite_code, viewer.user_id()).await?;
    Ok(Redirect::to(&to).into_response())
}

/// Applies an invite for a user who just signed in (or up, or pressed the button);
/// returns where to go: the organization, or the accept page saying why not.
pub async fn apply_after_sign_in(console: &Console, code: &str, user_id: &str) -> Result<String> {
    Ok(match console.store.accept_invite(code, user_id).await? {
        Acceptance::Joined(org) => format!("/o/{}?done=welcome", org.id),
        Acceptance::Unknown | Acceptance::OtherEmail | Acceptance::NotPending(_) => {
            format!("/accept-invite?invite_code={}", urlencode(code))
        }
    })
}
