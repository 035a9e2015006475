//! Sessions in the browser: the `__Host-` cookie, the anti-forgery token derived from
//! it, the `Viewer` extractor, and `guard`, which every POST passes.
//!
//! The anti-forgery token is the SHA-256 of the session token under a label: stateless,
//! different from what the database keeps (the plain SHA-256), and useless without
//! the cookie, which scripts cannot read (HttpOnly).

use super::page::{ConsoleError, Nav};
use super::{Console, State, body_limit};
use crate::accounts::{Session, keys};
use axum::body::Body;
use axum::extract::{ConnectInfo, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::net::SocketAddr;

pub const SESSION_COOKIE: &str = "__Host-tessera_session";
pub const DEVICE_COOKIE: &str = "__Host-tessera_device";
/// How long a browser is remembered as one that signed in (for the throttle).
const DEVICE_SECS: i64 = 365 * 86_400;

/// The value of cookie `name` in a request's headers.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
        .filter(|v| !v.is_empty() && v.len() <= 128)
}

/// `Set-Cookie` for a session token: Secure and HttpOnly, Lax, the whole site, for the
/// absolute lifetime. `__Host-` makes browsers refuse it without Secure or with a Domain.
pub fn session_cookie(token: &str, max_age: i64) -> HeaderValue {
    let v = format!("{SESSION_COOKIE}={token}; Path=/; Secure; HttpOnly; SameSite=Lax; Max-Age={max_age}");
    HeaderValue::from_str(&v).expect("tokens are base62")
}

pub fn clear_session_cookie() -> HeaderValue {
    HeaderValue::from_static("__Host-tessera_session=; Path=/; Secure; HttpOnly; SameSite=Lax; Max-Age=0")
}

pub fn device_cookie(token: &str) -> HeaderValue {
    let v = format!("{DEVICE_COOKIE}={token}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age={DEVICE_SECS}");
    HeaderValue::from_str(&v).expect("tokens are base62")
}

/// The anti-forgery token for forms shown with this session token.
pub fn csrf_token(session_token: &str) -> String {
    keys::hex(&Sha256::digest(format!("tessera console forms\0{session_token}").as_bytes())[..20])
}

/// The token a page's forms carry: derived from the session cookie the browser sent,
/// or empty without one.
pub fn csrf_for(headers: &HeaderMap) -> String {
    cookie(headers, SESSION_COOKIE).map(csrf_token).unwrap_or_default()
}

/// Compares without stopping at the first difference.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the browser says the request comes from one of our own pages: Fetch
/// Metadata where sent, else an `Origin` naming this host. Neither: refused.
pub fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        return matches!(site.to_str(), Ok("same-origin" | "none"));
    }
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    match headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()) {
        Some(origin) if origin != "null" => {
            let authority = origin.split_once("://").map_or("", |(_, rest)| rest);
            host.is_some_and(|h| h.eq_ignore_ascii_case(authority))
        }
        _ => false,
    }
}

/// Every POST: from our own pages, and, when a session cookie comes with it, carrying
/// the anti-forgery token derived from that cookie. GETs change nothing and pass.
pub async fn guard(request: Request, next: Next) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    if !same_origin(request.headers()) {
        return ConsoleError::Forgery.into_response();
    }
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, body_limit(parts.uri.path())).await else {
        return ConsoleError::TooLarge.into_response();
    };
    if let Some(token) = cookie(&parts.headers, SESSION_COOKIE) {
        let sent = serde_urlencoded::from_bytes::<Vec<(String, String)>>(&bytes)
            .ok()
            .and_then(|fields| fields.into_iter().find(|(k, _)| k == "csrf").map(|(_, v)| v));
        if !sent.is_some_and(|sent| same(&sent, &csrf_token(token))) {
            return ConsoleError::Forgery.into_response();
        }
    }
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// The signed-in user of a request. Extracting it from a signed-out request answers
/// with a redirect to the sign-in page, which comes back here afterwards.
pub struct Viewer {
    pub session: Session,
    /// The forms' anti-forgery token.
    pub csrf: String,
    /// The path of the page asked for (the navigation marks it).
    pub path: String,
}

impl Viewer {
    pub fn user_id(&self) -> &str {
        &self.session.user.id
    }

    /// The frame of a signed-in page titled `title` about `current` (an organization id).
    pub async fn frame(
        &self,
        console: &Console,
        title: impl Into<String>,
        current: Option<&str>,
    ) -> Result<super::page::Frame, ConsoleError> {
        Ok(super::page::Frame {
            title: title.into(),
            nav: Some(self.nav(console, current).await?),
            csrf: self.csrf.clone(),
        })
    }

    /// The navigation for a page about `current` (an organization id), if any.
    pub async fn nav(&self, console: &Console, current: Option<&str>) -> Result<Nav, ConsoleError> {
        Ok(Nav {
            email: self.session.user.email.clone(),
            orgs: console.store.memberships(self.user_id()).await?,
            current: current.map(str::to_string),
            tabs: current.map(|org| super::page::tabs(org, &self.path)).unwrap_or_default(),
        })
    }
}

impl FromRequestParts<State> for Viewer {
    type Rejection = ConsoleError;

    async fn from_request_parts(parts: &mut Parts, console: &State) -> Result<Self, ConsoleError> {
        match MaybeViewer::from_request_parts(parts, console).await? {
            MaybeViewer(Some(viewer)) => Ok(viewer),
            MaybeViewer(None) => {
                let next = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                // After a POST, come back to the page rather than repeat the action.
                let next = if parts.method == Method::GET { next } else { "/" };
                Err(ConsoleError::SignIn { next: next.to_string() })
            }
        }
    }
}

/// The signed-in user, if any.
pub struct MaybeViewer(pub Option<Viewer>);

impl FromRequestParts<State> for MaybeViewer {
    type Rejection = ConsoleError;

    async fn from_request_parts(parts: &mut Parts, console: &State) -> Result<Self, ConsoleError> {
        let Some(token) = cookie(&parts.headers, SESSION_COOKIE) else { return Ok(Self(None)) };
        let session = console.store.session(token, console.config.lifetimes).await?;
        let path = parts.uri.path().to_string();
        Ok(Self(session.map(|session| Viewer { session, csrf: csrf_token(token), path })))
    }
}

/// The client's address, for the sign-in throttle: the peer of the connection, or,
/// with `--trust-forwarded-for` (a reverse proxy in front that appends it), the last
/// `X-Forwarded-For` entry, the one that proxy wrote.
pub fn client_address(parts: &Parts, trust_forwarded_for: bool) -> String {
    if trust_forwarded_for
        && let Some(last) = parts
            .headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .rfind(|a| !a.is_empty())
    {
        return last.to_string();
    }
    parts.extensions.get::<ConnectInfo<SocketAddr>>().map_or_else(|| "unknown".into(), |c| c.0.ip().to_string())
}

/// The client address as an extractor.
pub struct ClientAddress(pub String);

impl FromRequestParts<State> for ClientAddress {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, console: &State) -> Result<Self, Self::Rejection> {
        Ok(Self(client_address(parts, console.config.trust_forwarded_for)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(header::HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_session_cookie_is_read_by_its_exact_name() {
        let h = headers(&[("cookie", "a=1; __Host-tessera_session=abc; __Host-tessera_sessionX=no")]);
        assert_eq!(cookie(&h, SESSION_COOKIE), Some("abc"));
        assert_eq!(cookie(&headers(&[("cookie", "__Host-tessera_session=")]), SESSION_COOKIE), None);
        assert_eq!(cookie(&HeaderMap::new(), SESSION_COOKIE), None);
    }

    #[test]
    fn cookies_carry_the_flags_browsers_need_to_keep_them_safe() {
        let c = session_cookie("t", 60);
        let c = c.to_str().unwrap();
        for flag in ["__Host-", "Path=/", "Secure", "HttpOnly", "SameSite=Lax", "Max-Age=60"] {
            assert!(c.contains(flag), "{c}");
        }
        assert!(!c.contains("Domain"), "{c}");
    }

    #[test]
    fn anti_forgery_tokens_depend_on_the_session_and_are_not_its_stored_hash() {
        let (a, b) = (keys::token(), keys::token());
        assert_eq!(csrf_token(&a), csrf_token(&a));
        assert_ne!(csrf_token(&a), csrf_token(&b));
        assert!(!keys::hash(&a).contains(&csrf_token(&a)));
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
    }

    #[test]
    fn the_client_address_is_the_peer_unless_a_trusted_proxy_names_it() {
        let request = axum::http::Request::builder()
            .header("x-forwarded-for", "6.6.6.6, 10.0.0.1")
            .header("x-forwarded-for", "203.0.113.7")
            .body(())
            .unwrap();
        let (mut parts, ()) = request.into_parts();
        parts.extensions.insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 5000))));
        assert_eq!(client_address(&parts, false), "127.0.0.1", "a client's own header is not believed");
        assert_eq!(client_address(&parts, true), "203.0.113.7", "the entry the proxy appended");
    }

    #[test]
    fn only_our_own_pages_may_post() {
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-origin")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "cross-site"), ("origin", "http://h"), ("host", "h")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "same-site")])));
        assert!(same_origin(&headers(&[("origin", "https://console.example"), ("host", "console.example")])));
        assert!(!same_origin(&headers(&[("origin", "https://evil.example"), ("host", "console.example")])));
        assert!(!same_origin(&headers(&[("origin", "null"), ("host", "console.example")])));
        assert!(!same_origin(&headers(&[("host", "console.example")])), "no evidence at all");
    }
}
