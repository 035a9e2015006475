//! The console's authorization table: every route × {owner, member, a user of another
//! organization, signed out}, each against a fresh database, with the answer each must
//! get, and no trace of the organization's data in any refusal. Then the forms'
//! defences (anti-forgery token, same-origin evidence), the security headers, and the
//! session rules (new token at sign-in, sign-out and password change end sessions on
//! the server, a removed member loses access on the next request).
//!
//! Requests go to the console's router in process (no listener), as a browser would
//! send them: the session cookie, `Sec-Fetch-Site`, the form's token.

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use std::sync::Arc;
use tessera_control_plane::accounts::{BillingMode, Lifetimes, NewKey, Role, Store};
use tessera_control_plane::billing::payments::DevProcessor;
use tessera_control_plane::billing::plans::Plan;
use tessera_control_plane::console::session::{SESSION_COOKIE, csrf_token};
use tessera_control_plane::console::{self, Console, ConsoleConfig, mail::Mailer, password};
use tessera_control_plane::db::Db;
use tessera_control_plane::limits::now_us;
use tower::ServiceExt;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Who {
    Owner,
    Member,
    Outsider,
    SignedOut,
}
use Who::*;

const WHO: [Who; 4] = [Owner, Member, Outsider, SignedOut];
const PASSWORD: &str = "a long and unusual passphrase";

/// One organization (Acme: an owner, a member, a key, a pending invite) and a user of
/// another (Globex).
struct World {
    router: axum::Router,
    store: Store,
    db: Db,
    _dir: tempfile::TempDir,
    org: String,
    owner: String,
    member: String,
    key: String,
    invite: String,
    /// Globex's key, invite and owner, which no Acme path may reach.
    other_key: String,
    other_invite: String,
    outsider: String,
    /// The owner's personal organization (where plans live); the member is not in it.
    personal: String,
    tokens: [(Who, String); 3],
}

impl World {
    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open("sqlite::memory:").await.unwrap();
        let store = db.accounts();
        let hash = password::hash(PASSWORD);
        let owner = store.create_user_with_password("owner@acme.test", Some(&hash)).await.unwrap();
        let member = store.create_user_with_password("member@acme.test", Some(&hash)).await.unwrap();
        let outsider = store.create_user_with_password("someone@globex.test", Some(&hash)).await.unwrap();
        let org = store.create_org_owned_by("Acme Secret Projects", &owner.id).await.unwrap();
        let globex = store.create_org_owned_by("Globex", &outsider.id).await.unwrap();
        let (other_invite, _) =
            store.create_invite(&globex.id, "x@globex.test", Role::Member, &outsider.id, 3600).await.unwrap();
        let new = NewKey {
            org_id: &globex.id,
            name: "globex-key",
            billing_mode: BillingMode::Credits,
            fallback_to_credits: false,
            created_by: Some(&outsider.id),
        };
        let (other_key, _) = store.create_key(new).await.unwrap();
        let (_, code) = store.create_invite(&org.id, "member@acme.test", Role::Member, &owner.id, 60).await.unwrap();
        store.accept_invite(&code, &member.id).await.unwrap();
        let (invite, _) =
            store.create_invite(&org.id, "pending@acme.test", Role::Member, &owner.id, 3600).await.unwrap();
        let new = NewKey {
            org_id: &org.id,
            name: "acme-production-key",
            billing_mode: BillingMode::Credits,
            fallback_to_credits: false,
            created_by: Some(&owner.id),
        };
        let (key, _) = store.create_key(new).await.unwrap();
        let tokens = [
            (Owner, store.start_session(&owner.id).await.unwrap()),
            (Member, store.start_session(&member.id).await.unwrap()),
            (Outsider, store.start_session(&outsider.id).await.unwrap()),
        ];
        // The owner's personal organization, on the Basic plan.
        let billing = db.billing(Arc::new(DevProcessor::default()));
        billing.subscriptions().start(&owner.id, Plan::Basic, "pm_dev_card", now_us()).await.unwrap();
        let console = Console {
            store: store.clone(),
            billing,
            capacity: db.capacity_requests(),
            api: None,
            mail: Mailer::new(None, "Tessera <noreply@localhost>", dir.path().join("outbox")).unwrap(),
            config: ConsoleConfig {
                capacity_requests_to: Some("capacity@operator.test".into()),
                ..ConsoleConfig::at("http://console.test")
            },
        };
        Self {
            router: console::router(Arc::new(console)),
            store,
            db,
            _dir: dir,
            org: org.id,
            owner: owner.id,
            member: member.id,
            key: key.id,
            invite: invite.id,
            other_key: other_key.id,
            other_invite: other_invite.id,
            outsider: outsider.id,
            personal: owner.org_id,
            tokens,
        }
    }

    fn token(&self, who: Who) -> Option<&str> {
        self.tokens.iter().find(|(w, _)| *w == who).map(|(_, t)| t.as_str())
    }

    fn path(&self, template: &str) -> String {
        template
            .replace("{org}", &self.org)
            .replace("{member}", &self.member)
            .replace("{owner}", &self.owner)
            .replace("{key}", &self.key)
            .replace("{invite}", &self.invite)
            .replace("{other_key}", &self.other_key)
            .replace("{other_invite}", &self.other_invite)
            .replace("{outsider}", &self.outsider)
            .replace("{personal}", &self.personal)
            .replace("{tomorrow}", &tessera_control_plane::calendar::date(now_us() + 86_400_000_000))
    }

    /// A request as the browser of `who` sends it: its cookie, and for a POST the
    /// same-origin header and the form's anti-forgery token.
    async fn send(
        &self,
        who: Who,
        method: &str,
        path: &str,
        form: &str,
    ) -> (StatusCode, String, axum::http::HeaderMap) {
        let mut request = Request::builder().method(method).uri(path).header(header::HOST, "console.test");
        let mut body = form.to_string();
        if let Some(token) = self.token(who) {
            request = request.header(header::COOKIE, format!("{SESSION_COOKIE}={token}"));
            if method == "POST" {
                body = format!("csrf={}&{form}", csrf_token(token));
            }
        }
        if method == "POST" {
            request = request
                .header("sec-fetch-site", "same-origin")
                .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
        }
        self.raw(request.body(Body::from(body)).unwrap()).await
    }

    async fn raw(&self, request: Request<Body>) -> (StatusCode, String, axum::http::HeaderMap) {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        (parts.status, String::from_utf8_lossy(&bytes).into_owned(), parts.headers)
    }
}

/// What a route must answer.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    Status(u16),
    /// A redirect to a path starting with this.
    To(&'static str),
}
use Expect::*;

/// Every console route, with what each of owner, member, outsider and signed-out
/// browser must get.
const TABLE: &[(&str, &str, &str, [Expect; 4])] = &[
    // Organization pages: members see, outsiders get a 404, signed-out browsers sign in.
    ("GET", "/o/{org}", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    ("GET", "/o/{org}/members", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    ("GET", "/o/{org}/keys", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    // Owners' actions: members get a 403.
    ("POST", "/o/{org}/settings", "name=Renamed", [To("/o/"), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{org}/members/{member}/role", "role=owner", [To("/o/"), Status(403), Status(404), To("/sign-in")]),
    ("GET", "/o/{org}/members/{member}/remove", "", [Status(200), Status(403), Status(404), To("/sign-in?next=/o/")]),
    ("POST", "/o/{org}/members/{member}/remove", "", [To("/o/"), Status(403), Status(404), To("/sign-in")]),
    (
        "POST",
        "/o/{org}/invites",
        "email=new%40acme.test&role=member",
        [To("/o/"), Status(403), Status(404), To("/sign-in")],
    ),
    ("POST", "/o/{org}/invites/{invite}/resend", "", [To("/o/"), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{org}/invites/{invite}/cancel", "", [To("/o/"), Status(403), Status(404), To("/sign-in")]),
    (
        "POST",
        "/o/{org}/keys",
        "name=new-key&billing_mode=credits",
        [Status(201), Status(403), Status(404), To("/sign-in")],
    ),
    ("GET", "/o/{org}/keys/{key}/revoke", "", [Status(200), Status(403), Status(404), To("/sign-in?next=/o/")]),
    ("POST", "/o/{org}/keys/{key}/revoke", "", [To("/o/"), Status(403), Status(404), To("/sign-in")]),
    // Another organization's things named under this one's path: not found, and untouched.
    ("GET", "/o/{org}/keys/{other_key}/revoke", "", [Status(404), Status(403), Status(404), To("/sign-in?next=/o/")]),
    ("POST", "/o/{org}/keys/{other_key}/revoke", "", [Status(404), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{org}/invites/{other_invite}/cancel", "", [Status(404), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{org}/invites/{other_invite}/resend", "", [Status(404), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{org}/members/{outsider}/remove", "", [Status(404), Status(403), Status(404), To("/sign-in")]),
    (
        "POST",
        "/o/{org}/members/{outsider}/role",
        "role=member",
        [Status(404), Status(403), Status(404), To("/sign-in")],
    ),
    // Billing: members see it, owners buy (a review page, then the purchase).
    ("GET", "/o/{org}/billing", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    (
        "POST",
        "/o/{org}/billing/buy",
        "amount=25&method=pm_dev_card",
        [Status(200), Status(403), Status(404), To("/sign-in")],
    ),
    (
        "POST",
        "/o/{org}/billing/buy/confirm",
        "amount=25&method=pm_dev_card&purchase=p1",
        [To("/o/"), Status(403), Status(404), To("/sign-in")],
    ),
    // Usage: every member reads it.
    ("GET", "/o/{org}/usage", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    ("GET", "/o/{org}/usage.json", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    ("GET", "/o/{org}/usage.csv", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    // Plans: shown to every member; changed only in one's own personal organization,
    // and a shared organization's owner is told plans are personal (400).
    ("GET", "/o/{org}/plan", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    ("GET", "/o/{personal}/plan", "", [Status(200), Status(404), Status(404), To("/sign-in?next=/o/")]),
    ("POST", "/o/{org}/plan/review", "plan=pro", [Status(400), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{personal}/plan/review", "plan=pro", [Status(200), Status(404), Status(404), To("/sign-in")]),
    (
        "POST",
        "/o/{org}/plan/start",
        "plan=pro&method=pm_dev_card",
        [Status(400), Status(403), Status(404), To("/sign-in")],
    ),
    (
        "POST",
        "/o/{personal}/plan/start",
        "plan=pro&method=pm_dev_card",
        [Status(400), Status(404), Status(404), To("/sign-in")],
    ),
    ("POST", "/o/{org}/plan/change", "plan=pro", [Status(400), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{personal}/plan/change", "plan=pro", [To("/o/"), Status(404), Status(404), To("/sign-in")]),
    ("GET", "/o/{org}/plan/cancel", "", [Status(400), Status(403), Status(404), To("/sign-in?next=/o/")]),
    ("GET", "/o/{personal}/plan/cancel", "", [Status(200), Status(404), Status(404), To("/sign-in?next=/o/")]),
    ("POST", "/o/{org}/plan/cancel", "", [Status(400), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{personal}/plan/cancel", "", [To("/o/"), Status(404), Status(404), To("/sign-in")]),
    ("POST", "/o/{org}/plan/resume", "", [Status(400), Status(403), Status(404), To("/sign-in")]),
    ("POST", "/o/{personal}/plan/resume", "", [To("/o/"), Status(404), Status(404), To("/sign-in")]),
    // Dedicated capacity: members see the organization's requests, owners send them.
    ("GET", "/o/{org}/capacity", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    (
        "POST",
        "/o/{org}/capacity",
        "gpu_type=H100+80GB+SXM&topology=vm&gpus=8&region=eu-west&start_date=2099-01-01&term_months=12&contact_name=A&contact_email=a%40acme.test",
        [Status(400), Status(403), Status(404), To("/sign-in")],
    ),
    (
        "POST",
        "/o/{org}/capacity",
        "gpu_type=H100+80GB+SXM&topology=vm&gpus=8&region=eu-west&start_date={tomorrow}&term_months=12&contact_name=A&contact_email=a%40acme.test",
        [To("/o/"), Status(403), Status(404), To("/sign-in")],
    ),
    // The playground: every member may use the organization's keys.
    ("GET", "/o/{org}/playground", "", [Status(200), Status(200), Status(404), To("/sign-in?next=/o/")]),
    (
        "POST",
        "/o/{org}/playground/chat",
        "key={key}&model=vendor-a%2Fmodel-a&messages=%5B%5D",
        [Status(503), Status(503), Status(404), To("/sign-in")],
    ),
    ("GET", "/o/{org}/requests/req_none", "", [Status(404), Status(404), Status(404), To("/sign-in?next=/o/")]),
    // A user's own pages.
    ("GET", "/", "", [To("/o/"), To("/o/"), To("/o/"), To("/sign-in")]),
    ("GET", "/orgs", "", [Status(200), Status(200), Status(200), To("/sign-in?next=/orgs")]),
    ("POST", "/orgs", "name=Fresh", [To("/o/"), To("/o/"), To("/o/"), To("/sign-in")]),
    ("GET", "/account", "", [Status(200), Status(200), Status(200), To("/sign-in?next=/account")]),
    ("POST", "/account", "current=wrong&password=x&confirm=x", [Status(400), Status(400), Status(400), To("/sign-in")]),
    // Public pages and flows.
    ("GET", "/sign-in", "", [To("/"), To("/"), To("/"), Status(200)]),
    (
        "POST",
        "/sign-in",
        "email=owner%40acme.test&password=wrong",
        [Status(401), Status(401), Status(401), Status(401)],
    ),
    ("GET", "/sign-up", "", [To("/"), To("/"), To("/"), Status(200)]),
    (
        "POST",
        "/sign-up",
        "email=n%40x.test&password=password1&confirm=password1",
        [Status(400), Status(400), Status(400), Status(400)],
    ),
    ("POST", "/sign-out", "", [To("/sign-in"), To("/sign-in"), To("/sign-in"), To("/sign-in")]),
    ("GET", "/setup?token=nope", "", [Status(410), Status(410), Status(410), Status(410)]),
    ("POST", "/setup", "token=nope&password=x", [Status(410), Status(410), Status(410), Status(410)]),
    ("GET", "/accept-invite?invite_code=nope", "", [Status(404), Status(404), Status(404), Status(404)]),
    (
        "POST",
        "/accept-invite",
        "invite_code=nope",
        [To("/accept-invite"), To("/accept-invite"), To("/accept-invite"), To("/sign-in")],
    ),
    ("GET", "/assets/console.css", "", [Status(200), Status(200), Status(200), Status(200)]),
    ("GET", "/assets/uPlot.iife.min.js", "", [Status(200), Status(200), Status(200), Status(200)]),
];

/// Acme's name, its key, its member and its pending invite.
const SECRETS: [&str; 4] = ["Acme Secret Projects", "acme-production-key", "member@acme.test", "pending@acme.test"];

#[tokio::test]
async fn every_route_answers_each_role_as_the_table_says() {
    let mut failures = Vec::new();
    for (method, template, form, expected) in TABLE {
        for (who, expect) in WHO.iter().zip(expected) {
            let world = World::new().await;
            let path = world.path(template);
            let (status, body, headers) = world.send(*who, method, &path, &world.path(form)).await;
            let location = headers.get(header::LOCATION).and_then(|l| l.to_str().ok()).unwrap_or("");
            let ok = match expect {
                Status(code) => status.as_u16() == *code,
                To(prefix) => status == StatusCode::SEE_OTHER && location.starts_with(prefix),
            };
            if !ok {
                failures.push(format!("{method} {template} as {who:?}: {status} {location:?}, expected {expect:?}"));
            }
            // Outsiders and signed-out browsers never see anything of Acme; a member
            // refused an owner's action sees none of what it would have shown.
            let hidden: &[&str] = match (who, status) {
                (Outsider | SignedOut, _) => &SECRETS,
                (Member, StatusCode::FORBIDDEN) => &SECRETS[1..],
                _ => &[],
            };
            for secret in hidden.iter().filter(|s| body.contains(**s)) {
                failures.push(format!("{method} {template} as {who:?}: the answer shows {secret:?}"));
            }
            // What owners may do has happened for them only.
            if *method == "POST" && template.ends_with("/keys/{key}/revoke") {
                let revoked = world.store.key(&world.key).await.unwrap().unwrap().revoked_at.is_some();
                assert_eq!(revoked, *who == Owner, "{who:?} revoking");
            }
            let globex_key = world.store.key(&world.other_key).await.unwrap().unwrap();
            assert!(globex_key.revoked_at.is_none(), "{method} {template} as {who:?} touched Globex's key");
            let globex_invites = world.store.invites(&globex_key.org_id).await.unwrap();
            assert!(globex_invites.iter().all(|i| i.cancelled_at.is_none() && i.expires_at == i.created_at + 3600));
            if *method == "POST" && template.ends_with("/capacity") {
                let stored = world.db.capacity_requests().list(Some(&world.org)).await.unwrap().len();
                let good = form.contains("{tomorrow}");
                assert_eq!(stored, usize::from(good && *who == Owner), "{who:?} requesting capacity");
            }
            if *method == "POST" && template.ends_with("/billing/buy/confirm") {
                let balance = world.db.ledger().balance(&world.org).await.unwrap();
                assert_eq!(balance, if *who == Owner { 25_000_000 } else { 0 }, "{who:?} buying credits");
            }
            if *method == "POST" && template.starts_with("/o/{personal}/plan/change") {
                let plan = world.db.subscriptions(Arc::new(DevProcessor::default())).get(&world.owner).await;
                assert_eq!(plan.unwrap().unwrap().plan == Plan::Pro, *who == Owner, "{who:?} upgrading");
            }
            if *method == "POST" && template.ends_with("{member}/role") {
                let role = world.store.membership(&world.member, &world.org).await.unwrap().unwrap().role;
                assert_eq!(role == Role::Owner, *who == Owner, "{who:?} promoting");
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), TABLE.len() * 4, failures.join("\n"));
}

#[tokio::test]
async fn notices_are_fixed_sentences_never_text_from_the_address() {
    let world = World::new().await;
    let (_, body, _) = world.send(Owner, "GET", &world.path("/o/{org}/keys?done=revoked"), "").await;
    assert!(body.contains("Key revoked"), "a known code reads as its sentence");
    let forged = "/o/{org}/keys?done=Your+account+is+suspended.+Call+555&error=Pay+now";
    let (status, body, _) = world.send(Owner, "GET", &world.path(forged), "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(!body.contains("suspended") && !body.contains("Pay now"), "nothing from the address is shown");
}

#[tokio::test]
async fn members_do_not_see_owner_controls_nor_invites() {
    let world = World::new().await;
    let (_, keys, _) = world.send(Member, "GET", &world.path("/o/{org}/keys"), "").await;
    assert!(keys.contains("acme-production-key"), "members see the keys' names");
    assert!(!keys.contains("create-key") && !keys.contains("/revoke"), "but no controls");
    let (_, members, _) = world.send(Member, "GET", &world.path("/o/{org}/members"), "").await;
    assert!(!members.contains("pending@acme.test") && !members.contains("invite-form"), "{members}");
    let (_, owners, _) = world.send(Owner, "GET", &world.path("/o/{org}/members"), "").await;
    assert!(owners.contains("pending@acme.test") && owners.contains("invite-form"));
    // Billing and capacity: members read them, with no control to buy or request.
    for (page, control) in [("billing", "buy-credits"), ("capacity", "capacity-form")] {
        let (_, member, _) = world.send(Member, "GET", &world.path(&format!("/o/{{org}}/{page}")), "").await;
        let (_, owner, _) = world.send(Owner, "GET", &world.path(&format!("/o/{{org}}/{page}")), "").await;
        assert!(!member.contains(control) && member.contains("member-note"), "{page} as a member");
        assert!(owner.contains(control), "{page} as the owner");
    }
    // Plans are personal: a shared organization's plan page says so and offers none.
    let (_, shared, _) = world.send(Owner, "GET", &world.path("/o/{org}/plan"), "").await;
    assert!(shared.contains("personal-only") && !shared.contains("plan/review"), "{shared}");
    let (_, personal, _) = world.send(Owner, "GET", &world.path("/o/{personal}/plan"), "").await;
    assert!(personal.contains("plan/review") && personal.contains("current-plan"));
}

#[tokio::test]
async fn capacity_requests_are_limited_per_organization_and_day() {
    let world = World::new().await;
    let form = world.path(
        "gpu_type=L40S+48GB&topology=vm&gpus=1&region=any&start_date={tomorrow}&term_months=1&contact_name=A&contact_email=a%40acme.test",
    );
    let path = world.path("/o/{org}/capacity");
    for _ in 0..tessera_control_plane::capacity::PER_ORG_PER_DAY {
        assert_eq!(world.send(Owner, "POST", &path, &form).await.0, StatusCode::SEE_OTHER);
    }
    let (status, page, _) = world.send(Owner, "POST", &path, &form).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(page.contains("in the last 24 hours"), "{page}");
    let stored = world.db.capacity_requests().list(Some(&world.org)).await.unwrap().len() as i64;
    assert_eq!(stored, tessera_control_plane::capacity::PER_ORG_PER_DAY);
}

#[tokio::test]
async fn a_past_due_plan_says_what_to_do() {
    let world = World::new().await;
    let subs = world.db.subscriptions(Arc::new(DevProcessor::default()));
    subs.set_payment_method(&world.owner, "pm_dev_card_declined").await.unwrap();
    let end = subs.get(&world.owner).await.unwrap().unwrap().period_end;
    subs.renew_due(end).await.unwrap();
    let (_, page, _) = world.send(Owner, "GET", &world.path("/o/{personal}/plan"), "").await;
    assert!(page.contains("id=\"past-due\"") && page.contains("Start a plan again"), "{page}");
    assert!(page.contains("Start Basic"), "a plan can be started again from the page");
}

#[tokio::test]
async fn forms_need_the_token_of_their_session_and_our_own_origin() {
    let world = World::new().await;
    let owner = world.token(Owner).unwrap().to_string();
    let member = world.token(Member).unwrap().to_string();
    let path = world.path("/o/{org}/keys");
    let post = |csrf: Option<String>, site: Option<&'static str>, origin: Option<&'static str>| {
        let mut r = Request::builder()
            .method("POST")
            .uri(&path)
            .header(header::HOST, "console.test")
            .header(header::COOKIE, format!("{SESSION_COOKIE}={owner}"))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
        if let Some(site) = site {
            r = r.header("sec-fetch-site", site);
        }
        if let Some(origin) = origin {
            r = r.header(header::ORIGIN, origin);
        }
        let body = match csrf {
            Some(t) => format!("csrf={t}&name=forged"),
            None => "name=forged".into(),
        };
        r.body(Body::from(body)).unwrap()
    };
    let right = Some(csrf_token(&owner));
    for (case, request) in [
        ("no token", post(None, Some("same-origin"), None)),
        ("a wrong token", post(Some("0".repeat(40)), Some("same-origin"), None)),
        ("another session's token", post(Some(csrf_token(&member)), Some("same-origin"), None)),
        ("from another site", post(right.clone(), Some("cross-site"), Some("https://evil.test"))),
        ("from another origin (no fetch metadata)", post(right.clone(), None, Some("https://evil.test"))),
        ("with no evidence of origin", post(right.clone(), None, None)),
    ] {
        let (status, body, _) = world.raw(request).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{case}");
        assert!(body.contains("cannot be accepted"), "{case}: {body}");
    }
    assert!(world.store.list_keys(&world.org).await.unwrap().iter().all(|k| k.name != "forged"), "nothing made");
    let (status, _, _) = world.raw(post(right.clone(), None, Some("http://console.test"))).await;
    assert_eq!(status, StatusCode::CREATED, "the right token and our origin");
    let (status, _, _) = world.raw(post(right, Some("same-origin"), None)).await;
    assert_eq!(status, StatusCode::CREATED);
}

#[tokio::test]
async fn pages_carry_the_security_headers() {
    let world = World::new().await;
    for (who, path) in [(Owner, "/o/{org}/keys"), (SignedOut, "/sign-in"), (SignedOut, "/accept-invite?invite_code=x")]
    {
        let (_, body, h) = world.send(who, "GET", &world.path(path), "").await;
        let csp = h.get(header::CONTENT_SECURITY_POLICY).unwrap().to_str().unwrap();
        for part in ["default-src 'self'", "object-src 'none'", "base-uri 'none'", "frame-ancestors 'none'"] {
            assert!(csp.contains(part), "{path}: {csp}");
        }
        assert!(!csp.contains("unsafe-inline"));
        assert!(!body.contains("<script>") && !body.contains("style="), "{path}: no inline script or style");
        assert_eq!(h.get(header::X_CONTENT_TYPE_OPTIONS).unwrap(), "nosniff");
        assert_eq!(h.get(header::CACHE_CONTROL).unwrap(), "no-store");
        let referrer = h.get(header::REFERRER_POLICY).unwrap();
        assert_eq!(referrer, if path.starts_with("/accept") { "no-referrer" } else { "same-origin" }, "{path}");
    }
}

/// The Set-Cookie of a response, if it sets the session cookie.
fn session_set(h: &axum::http::HeaderMap) -> Option<String> {
    h.get_all(header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with(SESSION_COOKIE))
        .map(str::to_string)
}

#[tokio::test]
async fn sessions_are_new_at_sign_in_and_end_on_the_server() {
    let world = World::new().await;
    // Signing in while holding an old session gives a new token, with the cookie's flags.
    let form = format!("email=OWNER%40acme.test&password={}&next=%2Fo%2F{}", PASSWORD.replace(' ', "+"), world.org);
    let (status, _, h) = world.send(Owner, "POST", "/sign-in", &form).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(h.get(header::LOCATION).unwrap().to_str().unwrap(), format!("/o/{}", world.org));
    let set = session_set(&h).expect("a session cookie");
    for flag in ["Path=/", "Secure", "HttpOnly", "SameSite=Lax"] {
        assert!(set.contains(flag), "{set}");
    }
    let fresh = set.split(';').next().unwrap().split_once('=').unwrap().1.to_string();
    assert_ne!(fresh, world.token(Owner).unwrap(), "a new token at sign-in");
    let live = Lifetimes { idle: 60, absolute: 60 };
    assert!(world.store.session(&fresh, live).await.unwrap().is_some());
    assert!(world.store.session(world.token(Owner).unwrap(), live).await.unwrap().is_none(), "the old one ended");

    // Unknown address and wrong password: the same answer.
    let (a, body_a, _) = world.send(SignedOut, "POST", "/sign-in", "email=nobody%40acme.test&password=whatever1").await;
    let (b, body_b, _) = world.send(SignedOut, "POST", "/sign-in", "email=owner%40acme.test&password=whatever1").await;
    assert_eq!((a, b), (StatusCode::UNAUTHORIZED, StatusCode::UNAUTHORIZED));
    let strip = |s: &str| s.replace("nobody@acme.test", "").replace("owner@acme.test", "");
    assert_eq!(strip(&body_a), strip(&body_b), "the same page but for the address typed");

    // A redirect after sign-in never leaves the site.
    let form = format!("email=owner%40acme.test&password={}&next=https%3A%2F%2Fevil.test", PASSWORD.replace(' ', "+"));
    let (_, _, h) = world.send(SignedOut, "POST", "/sign-in", &form).await;
    assert_eq!(h.get(header::LOCATION).unwrap(), "/");

    // Sign-out ends the session on the server: the old cookie no longer works.
    let (status, _, h) = world.send(Member, "POST", "/sign-out", "").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(session_set(&h).unwrap().contains("Max-Age=0"));
    let (status, _, h) = world.send(Member, "GET", &world.path("/o/{org}"), "").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(h.get(header::LOCATION).unwrap().to_str().unwrap().starts_with("/sign-in"));
}

#[tokio::test]
async fn a_password_change_ends_every_other_session() {
    let world = World::new().await;
    let other = world.store.start_session(&world.owner).await.unwrap();
    let new = "another long passphrase";
    let form = format!(
        "current={}&password={}&confirm={}",
        PASSWORD.replace(' ', "+"),
        new.replace(' ', "+"),
        new.replace(' ', "+")
    );
    let (status, _, h) = world.send(Owner, "POST", "/account", &form).await;
    assert_eq!(status, StatusCode::SEE_OTHER, "changed");
    assert!(session_set(&h).is_some(), "this browser gets a new session");
    let live = Lifetimes { idle: 60, absolute: 60 };
    assert!(world.store.session(&other, live).await.unwrap().is_none());
    assert!(world.store.session(world.token(Owner).unwrap(), live).await.unwrap().is_none());
    // Too short, common, or mismatched: refused with the reason.
    for (password, confirm, reason) in [
        ("short", "short", "at least 8"),
        ("iloveyou123", "iloveyou123", "common"),
        ("long enough one", "different", "differ"),
    ] {
        let token = world.store.start_session(&world.owner).await.unwrap();
        let form = format!(
            "csrf={}&current={}&password={password}&confirm={confirm}",
            csrf_token(&token),
            new.replace(' ', "+")
        );
        let request = Request::builder()
            .method("POST")
            .uri("/account")
            .header(header::COOKIE, format!("{SESSION_COOKIE}={token}"))
            .header("sec-fetch-site", "same-origin")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Body::from(form.replace(' ', "+")))
            .unwrap();
        let (status, body, _) = world.raw(request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{password}");
        assert!(body.contains(reason), "{password}: {body}");
    }
}

#[tokio::test]
async fn a_removed_member_loses_access_on_the_next_request() {
    let world = World::new().await;
    let (status, _, _) = world.send(Member, "GET", &world.path("/o/{org}/keys"), "").await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = world.send(Owner, "POST", &world.path("/o/{org}/members/{member}/remove"), "").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let (status, body, _) = world.send(Member, "GET", &world.path("/o/{org}/keys"), "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(!body.contains("acme-production-key"));
    // The last owner cannot be removed or demoted.
    let (status, body, _) = world.send(Owner, "POST", &world.path("/o/{org}/members/{owner}/remove"), "").await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(body.contains("keeps at least one owner"), "{body}");
    assert_eq!(world.store.owner_count(&world.org).await.unwrap(), 1);
}

#[tokio::test]
async fn an_invite_is_mailed_and_its_link_joins_the_invited_address_once() {
    let world = World::new().await;
    let (status, _, _) =
        world.send(Owner, "POST", &world.path("/o/{org}/invites"), "email=Newbie%40acme.test&role=member").await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let outbox = world._dir.path().join("outbox");
    let message = std::fs::read_dir(&outbox).unwrap().next().unwrap().unwrap().path();
    let text = quoted_printable(&std::fs::read_to_string(message).unwrap());
    let start = text.find("http://console.test/accept-invite?invite_code=").expect("the link");
    let link = &text[start..];
    let code: String = link["http://console.test/accept-invite?invite_code=".len()..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    assert_eq!(code.len(), 43, "{text}");
    // The outsider (another address) is told it is not theirs; nothing is applied.
    let (status, body, _) = world.send(Outsider, "GET", &format!("/accept-invite?invite_code={code}"), "").await;
    assert_eq!(status, StatusCode::GONE);
    assert!(body.contains("This invite is for newbie@acme.test"), "{body}");
    // Signing up through the link with the invited address joins at once.
    let form =
        format!("email=newbie%40acme.test&password={p}&confirm={p}&invite_code={code}", p = PASSWORD.replace(' ', "+"));
    let (status, _, h) = world.send(SignedOut, "POST", "/sign-up", &form).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(h.get(header::LOCATION).unwrap().to_str().unwrap().starts_with(&format!("/o/{}", world.org)));
    let newbie = world.store.find_user("newbie@acme.test").await.unwrap();
    assert_eq!(world.store.membership(&newbie.id, &world.org).await.unwrap().unwrap().role, Role::Member);
    // The code is used up.
    let (status, body, _) = world.send(SignedOut, "GET", &format!("/accept-invite?invite_code={code}"), "").await;
    assert_eq!(status, StatusCode::GONE);
    assert!(body.contains("has been used"), "{body}");
}

/// The text of a quoted-printable body (what a mail client shows).
fn quoted_printable(raw: &str) -> String {
    let joined = raw.replace("=\r\n", "").replace("=\n", "");
    let mut out = Vec::new();
    let bytes = joined.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match joined.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(b) if bytes[i] == b'=' => {
                out.push(b);
                i += 3;
            }
            _ => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
