//! What the console's browser tests share: chromium through chromedriver, an SMTP
//! server writing a maildir, and small steps on pages (fill and submit a form, wait for
//! an element, POST from the page as a script could, screenshots for docs/console.md).

#![allow(dead_code)]

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tessera_e2e::{Process, free_port, get, until};

pub const PASSWORD: &str = "tessera console test passphrase";

/// chromedriver on a free port, and a headless chromium session through it.
pub async fn browser() -> (Process, Client) {
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
pub fn smtp(maildir: &Path) -> (Process, u16) {
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
pub fn delivered_to(maildir: &Path, to: &str) -> Option<String> {
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

pub struct Shots(pub Option<PathBuf>);

impl Shots {
    pub async fn take(&self, client: &Client, name: &str) {
        if let Some(dir) = &self.0 {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(format!("{name}.png")), client.screenshot().await.unwrap()).unwrap();
        }
    }
}

/// Fills the form `form` with `fields` and submits it; then waits for `then` (a CSS
/// selector on the next page).
pub async fn submit(client: &Client, form: &str, fields: &[(&str, &str)], then: &str) {
    let f = client.form(Locator::Css(form)).await.unwrap_or_else(|e| panic!("form {form}: {e}"));
    for (name, value) in fields {
        f.set_by_name(name, value).await.unwrap();
    }
    f.submit().await.unwrap();
    wait_for(client, then).await;
}

pub async fn wait_for(client: &Client, css: &str) -> fantoccini::elements::Element {
    let found = client.wait().at_most(std::time::Duration::from_secs(30)).for_element(Locator::Css(css)).await;
    match found {
        Ok(e) => e,
        Err(e) => panic!("{css} never appeared ({e}); the page:\n{}", client.source().await.unwrap_or_default()),
    }
}

pub async fn text(client: &Client, css: &str) -> String {
    wait_for(client, css).await.text().await.unwrap()
}

/// POSTs a form from the page with `fetch`, as a script on it could; the status.
pub async fn post_from_page(client: &Client, path: &str, body: Value) -> u64 {
    let script = "const [path, body, done] = arguments;\n\
                  fetch(path, {method: 'POST', body: new URLSearchParams(body), redirect: 'manual'})\n\
                  .then(r => done(r.status), e => done(String(e)));";
    let status = client.execute_async(script, vec![json!(path), body]).await.unwrap();
    status.as_u64().unwrap_or_else(|| panic!("fetch failed: {status}"))
}

pub async fn csrf_of_page(client: &Client) -> String {
    let input = client.find(Locator::Css("input[name=csrf]")).await.unwrap();
    input.attr("value").await.unwrap().unwrap()
}

/// The organization id in a console address (`…/o/<id>…`).
pub fn org_of(url: &str) -> String {
    let rest = url.split("/o/").nth(1).unwrap_or_else(|| panic!("not an organization page: {url}"));
    rest.split(['/', '?']).next().unwrap().to_string()
}
