//! Signing up: an e-mail address and a password make an account with a personal
//! organization it owns. With an invite code, the invite is applied at once.

use super::page::{ConsoleError, Frame, Result, render, safe_next};
use super::session::{self, ClientAddress, MaybeViewer};
use super::{State, password, signin, throttle};
use crate::accounts::StoreError;
use askama::Template;
use axum::Form;
use axum::extract::{Query, State as Ctx};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

#[derive(Template)]
#[template(path = "signup.html")]
struct SignUp {
    frame: Frame,
    email: String,
    invite_code: String,
    error: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Params {
    invite_code: Option<String>,
    email: Option<String>,
}

pub async fn form(viewer: MaybeViewer, headers: HeaderMap, Query(q): Query<Params>) -> Response {
    if viewer.0.is_some() {
        return Redirect::to("/").into_response();
    }
    let page = SignUp {
        frame: Frame::signed_out("Create an account", session::csrf_for(&headers)),
        email: q.email.unwrap_or_default(),
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
    confirm: String,
    invite_code: String,
}

pub async fn submit(
    Ctx(console): Ctx<State>,
    ClientAddress(address): ClientAddress,
    headers: HeaderMap,
    Form(f): Form<Submitted>,
) -> Result<Response> {
    if let Some(retry_after) =
        throttle::check_address(&console.store, console.config.throttle, "sign-up", &address).await?
    {
        return Err(ConsoleError::Throttled { retry_after });
    }
    let refuse = |error: String, f: Submitted| {
        let page = SignUp {
            frame: Frame::signed_out("Create an account", session::csrf_for(&headers)),
            email: f.email,
            invite_code: f.invite_code,
            error: Some(error),
        };
        Ok(render(StatusCode::BAD_REQUEST, &page))
    };
    if !crate::accounts::store::well_formed_email(&crate::accounts::store::normalize_email(&f.email)) {
        return refuse("Enter an e-mail address.".into(), f);
    }
    if let Some(problem) = password::problem(&f.password, &f.email) {
        return refuse(problem, f);
    }
    if f.password != f.confirm {
        return refuse("The two passwords differ.".into(), f);
    }
    let hash = password::hash_off_thread(f.password.clone()).await;
    let user = match console.store.create_user_with_password(&f.email, Some(&hash)).await {
        Ok(user) => user,
        Err(StoreError::Invalid(_)) => {
            return refuse("An account with this e-mail address exists: sign in instead.".into(), f);
        }
        Err(e) => return Err(e.into()),
    };
    signin::end_previous(&console, &headers).await?;
    signin::begin(&console, &user, &f.invite_code, &safe_next(None), false).await
}
