//! What every page shares: the frame around it (title, navigation, the anti-forgery
//! token for its forms), the error pages, the security headers, and small formatting.

use crate::accounts::{Membership, StoreError};
use askama::Template;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};

/// The navigation of a signed-in page.
pub struct Nav {
    pub email: String,
    pub orgs: Vec<Membership>,
    /// The organization the page is about, if any.
    pub current: Option<String>,
    /// That organization's pages, the one shown marked.
    pub tabs: Vec<Tab>,
}

/// One page of an organization in the navigation.
pub struct Tab {
    pub label: &'static str,
    pub href: String,
    /// The page shown is this one, or one of its own (a key's revocation is under
    /// API keys).
    pub current: bool,
}

/// An organization's pages: label, and the paths below `/o/{org}` that show it (its
/// own first; a form's action renders the page it was posted from).
const TABS: [(&str, &[&str]); 8] = [
    ("Overview", &["", "/settings"]),
    ("API keys", &["/keys"]),
    ("Members", &["/members", "/invites"]),
    ("Playground", &["/playground", "/requests"]),
    ("Usage", &["/usage"]),
    ("Billing", &["/billing"]),
    ("Plan", &["/plan"]),
    ("Capacity", &["/capacity"]),
];

/// The tabs of organization `org` for a page at `path`: the one with the longest path
/// that the page's is, or lies under, is current.
pub fn tabs(org: &str, path: &str) -> Vec<Tab> {
    let base = format!("/o/{org}");
    let rest = path.strip_prefix(&base).filter(|r| r.is_empty() || r.starts_with('/'));
    let under =
        |tail: &str| rest.is_some_and(|r| r == tail || r.strip_prefix(tail).is_some_and(|r| r.starts_with('/')));
    let best = TABS
        .iter()
        .enumerate()
        .flat_map(|(i, (_, tails))| tails.iter().filter(|t| under(t)).map(move |t| (t.len(), i)))
        .max()
        .map(|(_, i)| i);
    TABS.iter()
        .enumerate()
        .map(|(i, (label, tails))| Tab { label, href: format!("{base}{}", tails[0]), current: best == Some(i) })
        .collect()
}

/// Around every page.
pub struct Frame {
    pub title: String,
    pub nav: Option<Nav>,
    /// The anti-forgery token the page's forms carry ("" without a session cookie).
    pub csrf: String,
}

impl Frame {
    pub fn signed_out(title: &str, csrf: String) -> Self {
        Self { title: title.to_string(), nav: None, csrf }
    }
}

/// Renders a template as an HTML response with `status`.
pub fn render(status: StatusCode, template: &impl Template) -> Response {
    match template.render() {
        Ok(html) => (status, Html(html)).into_response(),
        Err(e) => {
            tracing::error!(error = %e, "console template failed");
            (StatusCode::INTERNAL_SERVER_ERROR, Html("<h1>Something went wrong</h1>".to_string())).into_response()
        }
    }
}

#[derive(Template)]
#[template(path = "error.html")]
struct ErrorPage<'a> {
    frame: Frame,
    heading: &'a str,
    detail: &'a str,
}

/// What a person is told is wrong with what they sent, on the page they sent it from:
/// a refusal of their input (or of what it asked, such as mail that could not go),
/// never our own failure, which is a `ConsoleError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

impl From<&str> for Refusal {
    fn from(why: &str) -> Self {
        Self(why.to_string())
    }
}

impl From<String> for Refusal {
    fn from(why: String) -> Self {
        Self(why)
    }
}

/// Why a console request did not get its page. Each maps once to a status and page.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// Signed out (or the session ended): sign in, then come back to `next`.
    #[error("sign in first")]
    SignIn { next: String },
    /// No such thing, or one the viewer may not know exists (another organization's).
    #[error("not found")]
    NotFound,
    /// A member asking for what only owners may do.
    #[error("forbidden")]
    Forbidden,
    /// A state change without a valid anti-forgery token or from another site.
    #[error("forgery")]
    Forgery,
    #[error("{0}")]
    BadRequest(String),
    /// A form larger than the page could have sent.
    #[error("too large")]
    TooLarge,
    #[error("too many attempts")]
    Throttled { retry_after: i64 },
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Internal(String),
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let (status, heading, detail) = match &self {
            Self::SignIn { next } => {
                return Redirect::to(&format!("/sign-in?next={}", urlencode(next))).into_response();
            }
            Self::NotFound => (StatusCode::NOT_FOUND, "Not found", "There is nothing here, or it is not yours to see."),
            Self::Forbidden => (
                StatusCode::FORBIDDEN,
                "Not allowed",
                "Your role in this organization does not allow this. An owner can do it, or make you one.",
            ),
            Self::Forgery => (
                StatusCode::FORBIDDEN,
                "This form cannot be accepted",
                "It came from another site or an old page. Go back, reload the page and try again.",
            ),
            Self::BadRequest(why) => (StatusCode::BAD_REQUEST, "That did not work", why.as_str()),
            Self::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "Too much at once",
                "That form carried more than this page accepts. Shorten it and try again.",
            ),
            Self::Throttled { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "Too many attempts",
                "Too many attempts from here. Wait a few minutes and try again.",
            ),
            Self::Store(_) | Self::Internal(_) => {
                tracing::error!(error = %self, "console request failed");
                (StatusCode::INTERNAL_SERVER_ERROR, "Something went wrong", "Please try again in a moment.")
            }
        };
        let mut response =
            render(status, &ErrorPage { frame: Frame::signed_out(heading, String::new()), heading, detail });
        if let Self::Throttled { retry_after } = self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(retry_after.max(1)));
        }
        response
    }
}

impl From<sqlx::Error> for ConsoleError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(e.into())
    }
}

/// Billing's errors that reach a page unhandled are ours, not the viewer's: a 500.
impl From<crate::billing::LedgerError> for ConsoleError {
    fn from(e: crate::billing::LedgerError) -> Self {
        Self::Internal(e.to_string())
    }
}

impl From<crate::billing::subscriptions::PlanError> for ConsoleError {
    fn from(e: crate::billing::subscriptions::PlanError) -> Self {
        Self::Internal(e.to_string())
    }
}

pub type Result<T, E = ConsoleError> = std::result::Result<T, E>;

/// The headers every console response carries: no script but our own files, no
/// framing, no sniffing, no caching of signed-in pages. A page may set a stricter
/// Referrer-Policy of its own (the invite page sends none).
pub async fn headers(request: Request, next: Next) -> Response {
    secured(next.run(request).await)
}

/// A response with those headers (pages served outside the console's router too).
pub fn secured(mut response: Response) -> Response {
    let h = response.headers_mut();
    let set = |h: &mut axum::http::HeaderMap, name: header::HeaderName, value: &'static str| {
        if !h.contains_key(&name) {
            h.insert(name, HeaderValue::from_static(value));
        }
    };
    set(
        h,
        header::CONTENT_SECURITY_POLICY,
        "default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    );
    set(h, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(h, header::REFERRER_POLICY, "same-origin");
    set(h, header::X_FRAME_OPTIONS, "DENY");
    set(h, header::HeaderName::from_static("cross-origin-opener-policy"), "same-origin");
    set(h, header::CACHE_CONTROL, "no-store");
    response
}

/// What a page says after an action redirected to it: a code in the address, read as
/// one of these fixed sentences (never text from the address itself, which anyone can
/// put in a link). Errors are rendered by the action's own answer instead.
#[derive(serde::Deserialize, Default)]
#[serde(default)]
pub struct Notice {
    done: Option<String>,
}

impl Notice {
    pub fn text(&self) -> Option<&'static str> {
        Some(match self.done.as_deref()? {
            "invited" => "Invite sent.",
            "resent" => "A new link was sent; the old one no longer works.",
            "cancelled" => "Invite cancelled: its link no longer works.",
            "renamed" => "Renamed.",
            "role" => "Role changed.",
            "removed" => "Member removed.",
            "revoked" => "Key revoked: requests with it are refused from now on.",
            "welcome" => "Welcome: you have joined this organization.",
            "password" => "Password changed. Every other session has been signed out.",
            "purchased" => "Payment received: the credit is in your balance.",
            "plan-started" => "Your plan has started: subscription keys draw on it from now on.",
            "upgraded" => "Upgraded: the new plan and its included usage apply now.",
            "downgrade" => "Downgrade scheduled for the next period.",
            "kept" => "Downgrade called off: your plan stays as it is.",
            "plan-cancelled" => "Cancelled: the plan ends with this period and is not charged again.",
            "resumed" => "Your plan will renew as usual.",
            "capacity" => "Request received: we have e-mailed you a copy, and will reply by e-mail.",
            "capacity-unmailed" => {
                "Request received, but its confirmation e-mail could not be sent; we will still reply."
            }
            _ => return None,
        })
    }
}

/// A redirect to `path` that says `done` there (one of `Notice`'s codes).
pub fn done(path: &str, code: &str) -> Response {
    Redirect::to(&format!("{path}?done={code}")).into_response()
}

/// Where to go after signing in: a path on this site, never another site (`//host`,
/// `/\host` and absolute URLs are dropped).
pub fn safe_next(next: Option<&str>) -> String {
    match next {
        Some(n)
            if n.starts_with('/')
                && !n.starts_with("//")
                && !n.starts_with("/\\")
                && !n.chars().any(|c| c.is_control() || c == '\\') =>
        {
            n.to_string()
        }
        _ => "/".to_string(),
    }
}

/// Percent-encodes a query value.
pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Micro-dollars as billing writes them (`cost::usd`), trimmed of trailing zeros down
/// to cents: `$100.00`, `$1.2345`.
pub fn usd(micros: i64) -> String {
    let full = crate::billing::cost::usd(micros);
    let (whole, frac) = full.split_once('.').expect("cost::usd always has a point");
    format!("{whole}.{:0<2}", frac.trim_end_matches('0'))
}

/// Dollars as typed in a form (`25`, `25.5`, `$1,000.00`) in micro-dollars: whole
/// cents only, nothing but digits, one point and thousands commas.
pub fn parse_dollars(text: &str) -> Option<i64> {
    let t = text.trim();
    let t = t.strip_prefix('$').unwrap_or(t).replace(',', "");
    let (whole, cents) = t.split_once('.').unwrap_or((&t, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || whole.len() > 9 || cents.len() > 2 || !digits(whole) || !digits(cents) {
        return None;
    }
    let cents: i64 = format!("{cents:0<2}").parse().ok()?;
    Some(whole.parse::<i64>().ok()? * 1_000_000 + cents * 10_000)
}

/// A Unix time as `2026-11-24 09:40 UTC`.
pub fn when(secs: i64) -> String {
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = crate::calendar::civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rest / 3600, rest % 3600 / 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_shown_marks_its_tab() {
        let current = |path: &str| -> Vec<&str> {
            tabs("org_1", path).into_iter().filter(|t| t.current).map(|t| t.label).collect()
        };
        assert_eq!(current("/o/org_1"), ["Overview"]);
        assert_eq!(current("/o/org_1/keys"), ["API keys"]);
        assert_eq!(current("/o/org_1/keys/key_9/revoke"), ["API keys"]);
        assert_eq!(current("/o/org_1/billing/buy"), ["Billing"]);
        assert_eq!(current("/o/org_1/plan"), ["Plan"]);
        assert_eq!(current("/o/org_1/invites"), ["Members"], "a refused invite shows the members page");
        assert_eq!(current("/o/org_1/settings"), ["Overview"]);
        assert!(current("/o/org_12/keys").is_empty(), "another organization's page");
        assert!(current("/account").is_empty());
    }

    #[test]
    fn only_paths_on_this_site_are_followed_after_sign_in() {
        assert_eq!(safe_next(Some("/o/org_1/keys?x=1")), "/o/org_1/keys?x=1");
        for bad in ["https://evil.example/", "//evil.example/", "/\\evil.example", "evil", "", "/a\r\nSet-Cookie: x"] {
            assert_eq!(safe_next(Some(bad)), "/", "{bad:?}");
        }
        assert_eq!(safe_next(None), "/");
    }

    #[test]
    fn dollars_read_as_dollars() {
        assert_eq!(usd(100_000_000), "$100.00");
        assert_eq!(usd(1_234_500), "$1.2345");
        assert_eq!(usd(-50_000), "-$0.05");
        assert_eq!(parse_dollars("25"), Some(25_000_000));
        assert_eq!(parse_dollars(" $1,000.5 "), Some(1_000_500_000));
        assert_eq!(parse_dollars("0.07"), Some(70_000));
        for bad in ["", "$", ".5", "1.234", "-5", "1e3", "12,a", "1.2.3", "9999999999"] {
            assert_eq!(parse_dollars(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn times_read_in_utc() {
        assert_eq!(when(0), "1970-01-01 00:00 UTC");
        assert_eq!(when(1_795_513_200), "2026-11-24 09:40 UTC");
        assert_eq!(urlencode("/o/x?a=b c"), "/o/x%3Fa%3Db%20c");
    }
}
