//! The console in a real browser: Debian's chromium, driven through chromedriver,
//! against a real `tessera serve` that sends its e-mail to a real SMTP server
//! (Python's aiosmtpd, writing a maildir). The people-and-keys story end to end: the
//! first owner from the printed link, sign-up, an organization, an invite read out of
//! the delivered message, the invitee joining through it as a member who sees no key
//! controls and whose forged POST is refused, the owner's key used by the `openai`
//! SDK and then revoked (the next call is a 401), forms without the right token
//! refused, the session cookie's flags, and CLI-made accounts signing in once
//! `tessera users set-password` has given them a password.
//!
//! With TESSERA_SCREENSHOTS=<folder> it also saves a screenshot of each page there
//! (`scripts/console-screenshots.sh`, for README).

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tessera_e2e::{Process, Serve, binary, free_port, get, python, until};

const PASSWORD: &str = "tessera console test passphrase";

/// chromedriver on a free port, and a headless chromium session through it.
async fn browser() -> (Process, Client) {
    let port = free_port();
    let driver = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver (Debian: apt-get install chromium-driver; .ci/run installs it)");
    let driver = Process(driver);
    until(30, "chromedriver answers", || get(&format!("http://127.0.0.1:{port}/status")));
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({"args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--window-size=1280,860", "--no-first-run"]}),
    );
    let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a chromium session");
    (driver, client)
}

/// aiosmtpd on a free port, delivering into a maildir.
fn smtp(maildir: &Path) -> (Process, u16) {
    let port = free_port();
    let server = Command::new("python3")
        .args(["-m", "aiosmtpd", "-n", "-l", &format!("127.0.0.1:{port}"), "-c", "aiosmtpd.handlers.Mailbox"])
        .arg(maildir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 -m aiosmtpd (pip install aiosmtpd; .ci/run installs it)");
    let server = Process(server);
    until(30, "the SMTP server listens", || std::net::TcpStream::connect(("127.0.0.1", port)).ok());
    (server, port)
}

/// The body of the one message in the maildir addressed to `to`, as a mail client
/// shows it (decoded by Python's email package).
fn delivered_to(maildir: &Path, to: &str) -> Option<String> {
    let new = maildir.join("new");
    for entry in std::fs::read_dir(new).ok()? {
        let path = entry.ok()?.path();
        let script = "import email, sys\nm = email.message_from_binary_file(open(sys.argv[1], 'rb'))\n\
                      print(m['To']); print(m.get_payload(decode=True).decode())";
        let out = Command::new("python3").args(["-c", script]).arg(&path).output().ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        if text.lines().next() == Some(to) {
            return Some(text);
        }
    }
    None
}

struct Shots(Option<PathBuf>);

impl Shots {
    async fn take(&self, client: &Client, name: &str) {
        if let Some(dir) = &self.0 {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(format!("{name}.png")), client.screenshot().await.unwrap()).unwrap();
        }
    }
}

/// Fills the form `form` with `fields` and submits it; then waits for `then` (a CSS
/// selector on the next page).
async fn submit(client: &Client, form: &str, fields: &[(&str, &str)], then: &str) {
    let f = client.form(Locator::Css(form)).await.unwrap_or_else(|e| panic!("form {form}: {e}"));
    for (name, value) in fields {
        f.set_by_name(name, value).await.unwrap();
    }
    f.submit().await.unwrap();
    wait_for(client, then).await;
}

async fn wait_for(client: &Client, css: &str) -> fantoccini::elements::Element {
    let found = client.wait().at_most(std::time::Duration::from_secs(30)).for_element(Locator::Css(css)).await;
    match found {
        Ok(e) => e,
        Err(e) => panic!("{css} never appeared ({e}); the page:\n{}", client.source().await.unwrap_or_default()),
    }
}

async fn text(client: &Client, css: &str) -> String {
    wait_for(client, css).await.text().await.unwrap()
}

/// POSTs a form from the page with `fetch`, as a script on it could; the status.
async fn post_from_page(client: &Client, path: &str, body: Value) -> u64 {
    let script = "const [path, body, done] = arguments;\n\
                  fetch(path, {method: 'POST', body: new URLSearchParams(body), redirect: 'manual'})\n\
                  .then(r => done(r.status), e => done(String(e)));";
    let status = client.execute_async(script, vec![json!(path), body]).await.unwrap();
    status.as_u64().unwrap_or_else(|| panic!("fetch failed: {status}"))
}

async fn csrf_of_page(client: &Client) -> String {
    let input = client.find(Locator::Css("input[name=csrf]")).await.unwrap();
    input.attr("value").await.unwrap().unwrap()
}

/// The SDK's view of one chat call with `key`: "ok" or the error's status.
fn sdk_call(serve: &Serve, key: &str) -> String {
    let script = r#"
import os, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
try:
    c.chat.completions.create(model="vendor-c/model-c", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    print("ok")
except openai.APIStatusError as e:
    print(e.status_code)
"#;
    let out = python(script, &serve.base_url(), key, &[]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The organization id in a console address (`…/o/<id>…`).
fn org_of(url: &str) -> String {
    let rest = url.split("/o/").nth(1).unwrap_or_else(|| panic!("not an organization page: {url}"));
    rest.split(['/', '?']).next().unwrap().to_string()
}

#[tokio::test]
async fn people_and_keys_in_a_real_browser() {
    let data = tempfile::tempdir().unwrap();
    let maildir = data.path().join("mail");
    let (_smtp, smtp_port) = smtp(&maildir);
    let smtp_url = format!("smtp://127.0.0.1:{smtp_port}");
    let serve = Serve::start(data.path(), &["--smtp-url", &smtp_url], &[]);
    let site = format!("http://127.0.0.1:{}", serve.port);
    let (_driver, client) = browser().await;
    let shots = Shots(std::env::var_os("TESSERA_SCREENSHOTS").map(PathBuf::from));

    // First start printed (and saved) a one-time link that makes the bootstrap
    // organization's first owner.
    let link = std::fs::read_to_string(data.path().join("owner-link")).unwrap().trim().to_string();
    assert!(link.starts_with(&format!("{site}/setup?token=")), "{link}");
    client.goto(&link).await.unwrap();
    shots.take(&client, "setup").await;
    submit(
        &client,
        "#setup-form",
        &[("email", "ops@acme.test"), ("password", PASSWORD), ("confirm", PASSWORD)],
        "#org-name",
    )
    .await;
    assert_eq!(text(&client, "#org-name").await, "default");
    assert_eq!(text(&client, "#my-role").await, "owner");
    client.find(Locator::Css("#sign-out")).await.unwrap().click().await.unwrap();
    wait_for(&client, "#sign-in-form").await;
    client.goto(&link).await.unwrap();
    assert!(client.source().await.unwrap().contains("This link has been used"), "the link works once");

    // Sign up; create an organization.
    client.goto(&format!("{site}/sign-up")).await.unwrap();
    shots.take(&client, "sign-up").await;
    submit(
        &client,
        "#sign-up-form",
        &[("email", "owner@acme.test"), ("password", PASSWORD), ("confirm", PASSWORD)],
        "#org-name",
    )
    .await;
    assert_eq!(text(&client, "#org-name").await, "owner@acme.test", "lands in the personal organization");
    client.goto(&format!("{site}/orgs")).await.unwrap();
    submit(&client, "#create-org", &[("name", "Acme Research")], "#org-name").await;
    assert_eq!(text(&client, "#org-name").await, "Acme Research");
    let acme = org_of(client.current_url().await.unwrap().as_str());
    shots.take(&client, "dashboard").await;
    client.goto(&format!("{site}/orgs")).await.unwrap();
    shots.take(&client, "organizations").await;

    // Invite a second person; the message arrives over SMTP with the accept link.
    client.goto(&format!("{site}/o/{acme}/members")).await.unwrap();
    submit(&client, "#invite-form", &[("email", "bea@acme.test"), ("role", "member")], ".done").await;
    assert!(text(&client, "#invite-list").await.contains("bea@acme.test"));
    shots.take(&client, "members").await;
    let message = until(30, "the invite is delivered", || delivered_to(&maildir, "bea@acme.test"));
    let prefix = format!("{site}/accept-invite?invite_code=");
    let at = message.find(&prefix).unwrap_or_else(|| panic!("no accept link in:\n{message}"));
    let accept: String = message[at..].chars().take_while(|c| !c.is_whitespace()).collect();
    assert!(message.contains("Acme Research") && message.contains("as member"), "{message}");

    // The invitee, signed out, follows it and signs up with the invited address.
    client.find(Locator::Css("#sign-out")).await.unwrap().click().await.unwrap();
    wait_for(&client, "#sign-in-form").await;
    shots.take(&client, "sign-in").await;
    client.goto(&accept).await.unwrap();
    shots.take(&client, "accept-invite").await;
    submit(&client, "#sign-up-form", &[("password", PASSWORD), ("confirm", PASSWORD)], "#org-name").await;
    assert_eq!(text(&client, "#org-name").await, "Acme Research", "lands in the organization");
    assert_eq!(text(&client, "#my-role").await, "member");

    // A member sees the keys but no control to create or revoke one, and a forged
    // POST (with the member's own valid token) is refused.
    client.goto(&format!("{site}/o/{acme}/keys")).await.unwrap();
    wait_for(&client, "#member-note").await;
    assert!(client.find(Locator::Css("#create-key")).await.is_err(), "no key creation control");
    let token = csrf_of_page(&client).await;
    let status = post_from_page(&client, &format!("/o/{acme}/keys"), json!({"csrf": token, "name": "forged"})).await;
    assert_eq!(status, 403, "a member's forged POST");
    client.goto(&accept).await.unwrap();
    assert!(client.source().await.unwrap().contains("has been used"), "the invite works once");

    // The owner signs in and creates a key (credit granted by the operator first).
    client.find(Locator::Css("#sign-out")).await.unwrap().click().await.unwrap();
    wait_for(&client, "#sign-in-form").await;
    submit(&client, "#sign-in-form", &[("email", "owner@acme.test"), ("password", PASSWORD)], "#org-name").await;
    let grant = Command::new(binary("tessera-control-plane", "tessera"))
        .args(["credits", "grant", "--org", &acme, "--usd", "5", "--data-dir"])
        .arg(data.path())
        .output()
        .unwrap();
    assert!(grant.status.success(), "{}", String::from_utf8_lossy(&grant.stderr));
    client.goto(&format!("{site}/o/{acme}/keys")).await.unwrap();
    submit(&client, "#create-key", &[("name", "sdk-test")], "#new-key-secret").await;
    let secret = text(&client, "#new-key-secret").await;
    assert!(secret.starts_with("tsk_") && secret.len() == 50, "{secret}");
    shots.take(&client, "new-key").await;
    client.goto(&format!("{site}/o/{acme}/keys")).await.unwrap();
    let listed = text(&client, "#key-list").await;
    assert!(listed.contains("sdk-test") && listed.contains(&secret[..8]), "{listed}");
    assert!(!client.source().await.unwrap().contains(&secret[8..]), "the secret is shown once, never again");

    // The openai SDK works with it.
    assert_eq!(sdk_call(&serve, &secret), "ok");

    // Forms without the right token are refused, and nothing is made.
    let path = format!("/o/{acme}/keys");
    assert_eq!(post_from_page(&client, &path, json!({"name": "no-token"})).await, 403);
    assert_eq!(post_from_page(&client, &path, json!({"csrf": "0".repeat(40), "name": "bad-token"})).await, 403);
    client.goto(&format!("{site}/o/{acme}/keys")).await.unwrap();
    let listed = text(&client, "#key-list").await;
    assert!(!listed.contains("no-token") && !listed.contains("bad-token"), "{listed}");

    // The session cookie: __Host-, Secure, HttpOnly, SameSite=Lax, the whole site.
    let cookies = client.get_all_cookies().await.unwrap();
    let session = cookies.iter().find(|c| c.name() == "__Host-tessera_session").expect("the session cookie");
    assert_eq!(session.secure(), Some(true));
    assert_eq!(session.http_only(), Some(true));
    assert_eq!(format!("{:?}", session.same_site()), "Some(Lax)");
    assert_eq!(session.path(), Some("/"));
    assert_eq!(session.domain(), Some("127.0.0.1"), "host-only");

    // Revoke with confirmation; the next SDK call is a 401.
    client.find(Locator::Css("#key-list a.danger")).await.unwrap().click().await.unwrap();
    wait_for(&client, "#confirm").await;
    shots.take(&client, "revoke").await;
    client.find(Locator::Css("#confirm")).await.unwrap().click().await.unwrap();
    assert!(text(&client, ".done").await.contains("Key revoked"));
    assert_eq!(sdk_call(&serve, &secret), "401");

    client.goto(&format!("{site}/account")).await.unwrap();
    wait_for(&client, "#password-form").await;
    shots.take(&client, "account").await;

    // Accounts made by the operator's CLI sign in once a password is set: through the
    // one-time link `tessera users set-password` prints, or from standard input.
    let cli = |args: &[&str], stdin: Option<&str>| {
        use std::io::Write;
        let mut child = Command::new(binary("tessera-control-plane", "tessera"))
            .args(args)
            .arg("--data-dir")
            .arg(data.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(stdin.unwrap_or("").as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "tessera {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    cli(&["users", "create", "carl@acme.test"], None);
    let printed = cli(&["users", "set-password", "carl@acme.test", "--console-url", &site], None);
    let link = printed.lines().find(|l| l.starts_with(&format!("{site}/setup?token="))).expect("a link");
    client.find(Locator::Css("#sign-out")).await.unwrap().click().await.unwrap();
    wait_for(&client, "#sign-in-form").await;
    client.goto(link).await.unwrap();
    submit(&client, "#setup-form", &[("password", PASSWORD), ("confirm", PASSWORD)], "#org-name").await;
    assert_eq!(text(&client, "#org-name").await, "carl@acme.test", "signed in to the personal organization");
    cli(&["users", "create", "dan@acme.test"], None);
    cli(&["users", "set-password", "dan@acme.test", "--password-stdin"], Some(&format!("{PASSWORD}\n")));
    client.find(Locator::Css("#sign-out")).await.unwrap().click().await.unwrap();
    wait_for(&client, "#sign-in-form").await;
    submit(&client, "#sign-in-form", &[("email", "dan@acme.test"), ("password", PASSWORD)], "#org-name").await;
    assert_eq!(text(&client, "#org-name").await, "dan@acme.test");
    client.close().await.unwrap();
}
