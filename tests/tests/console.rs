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
//! (`scripts/console-screenshots.sh`, for docs/console.md).

#[path = "support/browser.rs"]
mod browser;

use browser::*;
use fantoccini::Locator;
use serde_json::json;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use tessera_e2e::{Serve, binary, python, until};

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
    assert_eq!(text(&client, "nav.tabs a[aria-current=page]").await, "Members");
    // The only owner is offered neither a demotion nor a removal the store would refuse.
    let me = text(&client, "#member-list").await;
    assert!(me.contains("the only owner") && !me.contains("Make member") && !me.contains("Remove"), "{me}");
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
    // The password manager's username hint stays hidden (as on the setup page).
    let hint = client.find(Locator::Css("#password-form input[name=username]")).await.unwrap();
    assert!(!hint.is_displayed().await.unwrap(), "the hidden username field is not shown");
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
    let hint = wait_for(&client, "#setup-form input[name=username]").await;
    assert!(!hint.is_displayed().await.unwrap(), "the hidden username field is not shown");
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
