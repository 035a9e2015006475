//! One-time links printed by the server: the first owner of the bootstrap
//! organization (`tessera serve` on first start), and setting a password for an
//! account made with `tessera users create` (`tessera users set-password`).

use super::page::{Frame, Result, render};
use super::session;
use super::{State, password, signin};
use crate::accounts::LinkPurpose;
use askama::Template;
use axum::Form;
use axum::extract::{Query, State as Ctx};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use serde::Deserialize;

#[derive(Template)]
#[template(path = "setup.html")]
struct SetupPage {
    frame: Frame,
    token: String,
    /// None: the link is not valid (any more).
    purpose: Option<&'static str>,
    email: String,
    error: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Token {
    token: String,
}

async fn purpose(console: &super::Console, token: &str) -> Result<Option<LinkPurpose>> {
    Ok(if token.is_empty() { None } else { console.store.link(token).await? })
}

fn page(
    headers: &HeaderMap,
    token: String,
    purpose: Option<&LinkPurpose>,
    email: String,
    error: Option<String>,
) -> Response {
    let (title, kind) = match purpose {
        Some(LinkPurpose::Owner { .. }) => ("Create the first owner", Some("owner")),
        Some(LinkPurpose::Password { .. }) => ("Set your password", Some("password")),
        None => ("Link not valid", None),
    };
    let status = match (kind, &error) {
        (None, _) => StatusCode::GONE,
        (_, Some(_)) => StatusCode::BAD_REQUEST,
        _ => StatusCode::OK,
    };
    let mut response = render(
        status,
        &SetupPage { frame: Frame::signed_out(title, session::csrf_for(headers)), token, purpose: kind, email, error },
    );
    response.headers_mut().insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    response
}

pub async fn form(Ctx(console): Ctx<State>, headers: HeaderMap, Query(q): Query<Token>) -> Result<Response> {
    let purpose = purpose(&console, &q.token).await?;
    let email = match &purpose {
        Some(LinkPurpose::Password { user_id }) => console.store.find_user(user_id).await?.email,
        _ => String::new(),
    };
    Ok(page(&headers, q.token, purpose.as_ref(), email, None))
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Submitted {
    token: String,
    email: String,
    password: String,
    confirm: String,
}

pub async fn submit(Ctx(console): Ctx<State>, headers: HeaderMap, Form(f): Form<Submitted>) -> Result<Response> {
    let Some(purpose) = purpose(&console, &f.token).await? else {
        return Ok(page(&headers, f.token, None, f.email, None));
    };
    let email = match &purpose {
        LinkPurpose::Password { user_id } => console.store.find_user(user_id).await?.email,
        LinkPurpose::Owner { .. } => f.email.clone(),
    };
    let problem = if !crate::accounts::store::well_formed_email(&crate::accounts::store::normalize_email(&email)) {
        Some("Enter an e-mail address.".to_string())
    } else if let Some(problem) = password::problem(&f.password, &email) {
        Some(problem)
    } else if f.password != f.confirm {
        Some("The two passwords differ.".into())
    } else if matches!(purpose, LinkPurpose::Owner { .. }) && console.store.user_with_password(&email).await?.is_some()
    {
        Some("An account with this address exists: choose another address for the owner.".into())
    } else {
        None
    };
    if let Some(problem) = problem {
        return Ok(page(&headers, f.token, Some(&purpose), email, Some(problem)));
    }
    let hash = password::hash_off_thread(f.password).await;
    // The link is used once: whoever gets here second sees it as invalid.
    if !console.store.use_link(&f.token).await? {
        return Ok(page(&headers, f.token, None, email, None));
    }
    let (user, next) = match purpose {
        LinkPurpose::Owner { org_id } => {
            let user = match console.store.create_user_with_password(&email, Some(&hash)).await {
                Ok(user) => user,
                // Taken since the check above: the link is spent; a restart prints another.
                Err(crate::accounts::StoreError::Invalid(why)) => {
                    return Ok(page(&headers, f.token, None, email, Some(why)));
                }
                Err(e) => return Err(e.into()),
            };
            console.store.add_owner(&org_id, &user.id).await?;
            (user, format!("/o/{org_id}"))
        }
        LinkPurpose::Password { user_id } => {
            console.store.set_password(&user_id, &hash).await?;
            (console.store.find_user(&user_id).await?, "/".to_string())
        }
    };
    signin::begin(&console, &user, "", &next, false).await
}
