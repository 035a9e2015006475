//! An organization's members and its invites: everyone in it sees the list; owners
//! invite, change roles and remove. The last owner can be neither demoted nor removed.

use super::authz::{Action, Offers, authorize};
use super::page::{ConsoleError, Frame, Notice, Result, done, render, when};
use super::session::Viewer;
use super::{Console, State, confirm};
use crate::accounts::{Member, MemberChange, Membership, Role};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::StatusCode;
use axum::response::Response;
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
    /// The organization's only owner: neither demoted nor removed (the store refuses
    /// both), so neither is offered.
    sole_owner: bool,
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
    done: Option<&'static str>,
    error: Option<String>,
}

pub async fn page(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(notice): Query<Notice>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::View).await?;
    show(&console, &viewer, membership, StatusCode::OK, notice.text(), None).await
}

/// The members page, with what an action just did or why it did not.
pub async fn show(
    console: &Console,
    viewer: &Viewer,
    membership: Membership,
    status: StatusCode,
    done: Option<&'static str>,
    error: Option<String>,
) -> Result<Response> {
    let org = membership.org.id.clone();
    let offers = Offers::for_role(membership.role);
    let now = crate::accounts::store::now();
    let members = console.store.members(&org).await?;
    let owners = members.iter().filter(|m| m.role == Role::Owner).count();
    let members = members
        .into_iter()
        .map(|m| MemberRow {
            since: when(m.since),
            is_me: m.user_id == viewer.user_id(),
            sole_owner: m.role == Role::Owner && owners == 1,
            member: m,
        })
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
        frame: viewer.frame(console, format!("Members · {}", membership.org.name), Some(&org)).await?,
        membership,
        offers,
        members,
        invites,
        invite_days: console.config.invite_ttl / 86_400,
        done,
        error,
    };
    Ok(render(status, &page))
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
    let membership = authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    let role = Role::parse(&f.role).ok_or_else(|| ConsoleError::BadRequest("Choose owner or member.".into()))?;
    let change = console.store.set_role(&org, &user, role).await?;
    outcome(&console, &viewer, membership, change, "role").await
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
        fields: Vec::new(),
        danger: true,
    };
    Ok(render(StatusCode::OK, &page))
}

pub async fn remove(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path((org, user)): Path<(String, String)>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageMembers).await?;
    let change = console.store.remove_member(&org, &user).await?;
    outcome(&console, &viewer, membership, change, "removed").await
}

async fn outcome(
    console: &Console,
    viewer: &Viewer,
    membership: Membership,
    change: MemberChange,
    code: &str,
) -> Result<Response> {
    match change {
        MemberChange::Done => Ok(done(&format!("/o/{}/members", membership.org.id), code)),
        MemberChange::NotAMember => Err(ConsoleError::NotFound),
        MemberChange::LastOwner => {
            let why = "An organization keeps at least one owner: make someone else owner first.".to_string();
            show(console, viewer, membership, StatusCode::CONFLICT, None, Some(why)).await
        }
    }
}
