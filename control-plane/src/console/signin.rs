//! Signing in and out. Unknown addresses, accounts without a password and wrong
//! passwords get the same answer after the same work (a dummy hash is verified); the
//! throttle counts failures per address and per account.

use super::page::{ConsoleError, Frame, Result, render, safe_next};
use super::session::{self, ClientAddress, DEVICE_COOKIE, MaybeViewer};
use super::{State, invites, password, throttle};
use crate::accounts::User;
use askama::Template;
use axum::Form;
use axum::extract::{Query, State as Ctx};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

#[derive(Template)]
#[template(path = "signin.html")]
struct SignIn {
    frame: Frame,
    email: String,
    next: String,
    invite_code: String,
    error: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Params {
    next: Option<String>,
    invite_code: Option<String>,
}

pub async fn form(Ctx(_): Ctx<State>, viewer: MaybeViewer, headers: HeaderMap, Query(q): Query<Params>) -> Response {
    if viewer.0.is_some() {
        return Redirect::to(&safe_next(q.next.as_deref())).into_response();
    }
    let page = SignIn {
        frame: Frame::signed_out("Sign in", session::csrf_for(&headers)),
        email: String::new(),
        next: safe_next(q.next.as_deref()),
        invite_code: q.invite_code.unwrap_or_default(),
        error: None,
    };
    render(StatusCode::OK, &page)
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Submitted {
    email: String,
    password: String,
    next: String,
    invite_code: String,
}

pub async fn submit(
    Ctx(console): Ctx<State>,
    ClientAddress(address): ClientAddress,
    headers: HeaderMap,
    Form(f): Form<Submitted>,
) -> Result<Response> {
    let store = &console.store;
    let limits = console.config.throttle;
    let known = match session::cookie(&headers, DEVICE_COOKIE) {
        Some(device) => store.known_device(device, &f.email).await?,
        None => false,
    };
    if let Some(retry_after) = throttle::check(store, limits, &f.email, &address, known).await? {
        return Err(ConsoleError::Throttled { retry_after });
    }
    let found = store.user_with_password(&f.email).await?;
    let phc = found.as_ref().and_then(|(_, phc)| phc.clone());
    let ok = password::verify_off_thread(f.password.clone(), phc).await;
    let user = match (ok, found) {
        (true, Some((user, _))) => user,
        _ => {
            throttle::failed(store, limits, &f.email, &address).await?;
            let page = SignIn {
                frame: Frame::signed_out("Sign in", session::csrf_for(&headers)),
                email: f.email,
                next: safe_next(Some(&f.next)),
                invite_code: f.invite_code,
                error: Some("The e-mail address or the password is wrong.".into()),
            };
            return Ok(render(StatusCode::UNAUTHORIZED, &page));
        }
    };
    end_previous(&console, &headers).await?;
    begin(&console, &user, &f.invite_code, &f.next, known).await
}

/// Ends the session a browser brought to a sign-in or sign-up, so that signing in as
/// someone else leaves nothing of the previous one alive on the server.
pub async fn end_previous(console: &super::Console, headers: &HeaderMap) -> Result<()> {
    if let Some(token) = session::cookie(headers, session::SESSION_COOKIE) {
        console.store.end_session(token).await?;
    }
    Ok(())
}

/// Signs `user` in: a new session (never one the browser brought along), the device
/// remembered, the invite applied if one came with the form, then on to `next`.
pub async fn begin(
    console: &super::Console,
    user: &User,
    invite_code: &str,
    next: &str,
    known_device: bool,
) -> Result<Response> {
    let token = console.store.start_session(&user.id).await?;
    let mut to = safe_next(Some(next));
    if !invite_code.is_empty() {
        to = invites::apply_after_sign_in(console, invite_code, &user.id).await?;
    }
    let mut response = Redirect::to(&to).into_response();
    let h = response.headers_mut();
    h.append(header::SET_COOKIE, session::session_cookie(&token, console.config.lifetimes.absolute));
    if !known_device {
        let device = console.store.remember_device(&user.id).await?;
        h.append(header::SET_COOKIE, session::device_cookie(&device));
    }
    Ok(response)
}

/// Ends the session on the server and in the browser.
pub async fn sign_out(Ctx(console): Ctx<State>, headers: HeaderMap) -> Result<Response> {
    end_previous(&console, &headers).await?;
    let mut response = Redirect::to("/sign-in").into_response();
    response.headers_mut().append(header::SET_COOKIE, session::clear_session_cookie());
    Ok(response)
}
