//! The signed-in user's own account: changing the password, which ends every session
//! (this browser gets a new one).

use super::page::{ConsoleError, Frame, Notice, Result, done, render};
use super::session::{self, Viewer};
use super::{State, password, throttle};
use askama::Template;
use axum::Form;
use axum::extract::{Query, State as Ctx};
use axum::http::{StatusCode, header};
use axum::response::Response;
use serde::Deserialize;

#[derive(Template)]
#[template(path = "account.html")]
struct AccountPage {
    frame: Frame,
    email: String,
    done: Option<&'static str>,
    error: Option<String>,
}

async fn show(
    console: &super::Console,
    viewer: &Viewer,
    status: StatusCode,
    done: Option<&'static str>,
    error: Option<String>,
) -> Result<Response> {
    let page = AccountPage {
        frame: viewer.frame(console, "Account", None).await?,
        email: viewer.session.user.email.clone(),
        done,
        error,
    };
    Ok(render(status, &page))
}

pub async fn page(Ctx(console): Ctx<State>, viewer: Viewer, Query(notice): Query<Notice>) -> Result<Response> {
    show(&console, &viewer, StatusCode::OK, notice.text(), None).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct Change {
    current: String,
    password: String,
    confirm: String,
}

pub async fn change_password(Ctx(console): Ctx<State>, viewer: Viewer, Form(f): Form<Change>) -> Result<Response> {
    let refuse = |why: &str| Some(why.to_string());
    let user = &viewer.session.user;
    // Each check of the current password costs a hash: a stolen session gets no
    // unlimited guesses either.
    if let Some(retry_after) =
        throttle::check_address(&console.store, console.config.throttle, "password-change", &user.id).await?
    {
        return Err(ConsoleError::Throttled { retry_after });
    }
    let phc = console.store.user_with_password(&user.email).await?.and_then(|(_, phc)| phc);
    if !password::verify_off_thread(f.current.clone(), phc).await {
        return show(&console, &viewer, StatusCode::BAD_REQUEST, None, refuse("The current password is wrong.")).await;
    }
    if let Some(problem) = password::problem(&f.password, &user.email) {
        return show(&console, &viewer, StatusCode::BAD_REQUEST, None, refuse(&problem)).await;
    }
    if f.password != f.confirm {
        return show(&console, &viewer, StatusCode::BAD_REQUEST, None, refuse("The two new passwords differ.")).await;
    }
    let hash = password::hash_off_thread(f.password).await;
    console.store.set_password(&user.id, &hash).await?;
    let token = console.store.start_session(&user.id).await?;
    let mut response = done("/account", "password");
    response
        .headers_mut()
        .append(header::SET_COOKIE, session::session_cookie(&token, console.config.lifetimes.absolute));
    Ok(response)
}
