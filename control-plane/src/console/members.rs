//! An organization's members and its invites: everyone in it sees the list; owners
//! invite, change roles and remove. The last owner can be neither demoted nor removed.

use super::authz::{Action, Offers, authorize};
use super::orgs::Flash;
use super::page::{ConsoleError, Frame, Result, render, urlencode, when};
use super::session::Viewer;
use super::{State, confirm};
use crate::accounts::{Member, MemberChange, Membership, Role};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

struct InviteRow {
    id: String,
    email: String,
    role: &'static str,
    state: &'static str,
    sent: String,
    expires: String,
    /// Not used or cancelled: can be resent (an expired one too) or cancelled.
    open: bool,
}

struct MemberRow {
    member: Member,
    since: String,
    is_me: bool,
}

#[derive(Template)]
#[template(path = "members.html")]
struct MembersPage {
    frame: Frame,
    membership: Membership,
    offers: Offers,
    members: Vec<MemberRow>,
    invites: Vec<InviteRow>,
    invite_days: i64,
    done: Option<String>,
    error: Option<String>,
}

pub async fn page(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(flash): Query<Flash>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::View).await?;
    let offers = Offers::for_role(membership.role);
    let now = crate::accounts::store::now();
    let members = console
        .store
        .members(&org)
        .await?
        .into_iter()
        .map(|m| MemberRow { since: when(m.since), is_me: m.user_id == viewer.user_id(), member: m })
        .collect();
    // Who was invited is for those who manage members.
    let invites = if offers.manage_members {
        console
            .store
            .invites(&org)
            .await?
            .into_iter()
            .map(|i| {
                let state = i.state(now);
                InviteRow {
                    open: i.accepted_at.is_none() && i.cancelled_at.is_none(),
                    state: match state {
                        crate::accounts::InviteState::Pending => "waiting",
                        crate::accounts::InviteState::Accepted => "accepted",
                        crate::accounts::InviteState::Cancelled => "cancelled",
                        crate::accounts::InviteState::Expired => "expired",
                    },
                    sent: when(i.sent_at),
                    expires: when(i.expires_at),
                    role: i.role.as_str(),
                    id: i.id,
                    email: i.email,
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let page = MembersPage {
        frame: viewer.frame(&console, format!("Members · {}", membership.org.name), Some(&org)).await?,
        membership,
        offers,
        members,
        invites,
        invite_days: console.config.invite_ttl / 86_400,
        done: flash.done,
        error: flash.error,
    };
    Ok(render(StatusCode::OK, &page))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct NewRole {
    role: String,
}

pub async fn set_role(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, user)): Path<(String, String)>,
    Form(f): Form<NewRole>,
) -> Result<Response> {
    authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    let role = Role::parse(&f.role).ok_or_else(|| ConsoleError::BadRequest("Choose owner or member.".into()))?;
    outcome(&org, console.store.set_role(&org, &user, role).await?, "Role changed.")
}

pub async fn confirm_remove(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, user)): Path<(String, String)>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    let member = console.store.members(&org).await?.into_iter().find(|m| m.user_id == user);
    let member = member.ok_or(ConsoleError::NotFound)?;
    let page = confirm::Confirm {
        frame: viewer.frame(&console, "Remove member", Some(&org)).await?,
        question: format!("Remove {} from {}?", member.email, membership.org.name),
        detail: "They lose access at once, including to this organization's keys in the console. Keys keep working."
            .into(),
        action: format!("/o/{org}/members/{user}/remove"),
        button: "Remove member".into(),
        back: format!("/o/{org}/members"),
    };
    Ok(render(StatusCode::OK, &page))
}

pub async fn remove(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, user)): Path<(String, String)>,
) -> Result<Response> {
    authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    outcome(&org, console.store.remove_member(&org, &user).await?, "Member removed.")
}

fn outcome(org: &str, change: MemberChange, done: &str) -> Result<Response> {
    let (kind, message) = match change {
        MemberChange::Done => ("done", done),
        MemberChange::NotAMember => return Err(ConsoleError::NotFound),
        MemberChange::LastOwner => {
            ("error", "An organization keeps at least one owner: make someone else owner first.")
        }
    };
    Ok(Redirect::to(&format!("/o/{org}/members?{kind}={}", urlencode(message))).into_response())
}
