//! GET /status end to end: public, a window's snapshot, a 400 naming the allowed
//! windows, figures after real requests (sent with the official SDK), and the same
//! figures after a restart, read back from the database.

use serde_json::Value;
use std::process::Command;
use tessera_e2e::{Serve, python, until};

const MODEL: &str = "vendor-a/model-a";

/// GET `url` without a key: the status and the body as JSON.
fn fetch(url: &str) -> (u16, Value) {
    let script = r#"
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
"#;
    let out = Command::new("python3").args(["-c", script, url]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = String::from_utf8(out.stdout).unwrap();
    let (status, body) = out.split_once('\n').unwrap();
    (status.parse().unwrap(), serde_json::from_str(body).unwrap())
}

/// GET `url` without a key, as a browser asking for HTML: the status, content type and body.
fn fetch_page(url: &str, accept: &str) -> (u16, String, String) {
    let script = r#"
import sys, urllib.request
r = urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers={"Accept": sys.argv[2]}), timeout=5)
print(r.status); print(r.headers["content-type"] + "; vary=" + str(r.headers["vary"])); print(r.read().decode())
"#;
    let out = Command::new("python3").args(["-c", script, url, accept]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = String::from_utf8(out.stdout).unwrap();
    let mut parts = out.splitn(3, '\n');
    let status = parts.next().unwrap().parse().unwrap();
    (status, parts.next().unwrap().to_string(), parts.next().unwrap().to_string())
}

fn status(serve: &Serve, query: &str) -> (u16, Value) {
    fetch(&format!("http://127.0.0.1:{}/status{query}", serve.port))
}

/// The snapshot's entry for `MODEL`.
fn model_a(snapshot: &Value) -> Value {
    snapshot["models"].as_array().unwrap().iter().find(|m| m["id"] == MODEL).cloned().expect("model A listed")
}

#[test]
fn status_reports_real_requests_and_keeps_them_across_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let serve = Serve::start(data.path(), &["--status-refresh-secs", "1"], &[]);

    // No key, the default window, nothing measured yet.
    let (code, fresh) = status(&serve, "");
    assert_eq!(code, 200, "{fresh}");
    assert_eq!((fresh["window"].as_str(), fresh["window_secs"].as_i64()), (Some("1h"), Some(3600)));
    assert_eq!(fresh["stale"], false);
    assert!(fresh["updated_at"].as_str().unwrap().ends_with('Z'));
    let a = model_a(&fresh);
    assert_eq!(
        (a["name"].as_str(), &a["tps"], &a["ttfb_seconds"], &a["uptime_pct"]),
        (Some("Model A"), &Value::Null, &Value::Null, &Value::Null)
    );
    assert_eq!(a["current_subscription_supply_state"], "low");
    assert_eq!(a["current_subscription_discount_percent"], 0);
    assert_eq!(a["current_subscription_credit_multiplier"], 1.0);
    assert!(fresh.as_object().unwrap().contains_key("current_subscription_supply_updated_at"));

    let (code, error) = status(&serve, "?window=2h");
    assert_eq!(code, 400);
    assert_eq!(error["error"]["param"], "window");
    assert_eq!(error["error"]["message"], "Invalid window \"2h\": expected one of 5m, 1h, 24h, 30d.");

    // Three generations, streamed and not.
    let script = r#"
import os, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
for i in range(3):
    messages = [{"role": "user", "content": f"Count from {i} to 20"}]
    if i == 1:
        chunks = list(c.chat.completions.create(model="vendor-a/model-a", max_tokens=8, messages=messages, stream=True))
        assert chunks
    else:
        r = c.chat.completions.create(model="vendor-a/model-a", max_tokens=8, messages=messages)
        assert r.usage.completion_tokens >= 2, r
"#;
    let out = python(script, &serve.base_url(), &serve.key, &[]).output().unwrap();
    assert!(out.status.success(), "the SDK client failed: {}", String::from_utf8_lossy(&out.stderr));

    // The figures reach the database and the snapshot within a refresh or two.
    let measured = until(30, "model A's figures in the 5-minute window", || {
        let (_, s) = status(&serve, "?window=5m");
        Some(model_a(&s)).filter(|a| !a["tps"].is_null())
    });
    let ttfb = measured["ttfb_seconds"].as_f64().unwrap();
    assert!(ttfb > 0.0 && ttfb < 60.0, "{measured}");
    assert!(measured["tps"].as_f64().unwrap() > 0.0, "{measured}");
    assert_eq!(measured["uptime_pct"], 100.0);
    // A model nobody asked for has too little data.
    let (_, five) = status(&serve, "?window=5m");
    let b = five["models"].as_array().unwrap().iter().find(|m| m["id"] == "vendor-b/model-b").unwrap().clone();
    assert_eq!((&b["tps"], &b["uptime_pct"]), (&Value::Null, &Value::Null));

    // People read the same figures on the page, from a browser or at /status-page.
    let browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8";
    let base = format!("http://127.0.0.1:{}", serve.port);
    for (path, accept) in [("/status", browser), ("/status-page", "*/*")] {
        let (code, kind, html) = fetch_page(&format!("{base}{path}"), accept);
        assert_eq!((code, kind.starts_with("text/html")), (200, true), "{path}: {kind}");
        let (_, five) = status(&serve, "?window=5m");
        let a = model_a(&five);
        let section = &html[html.find("Model A").expect("model A on the page")..];
        let section = &section[..section.find("</section>").unwrap()];
        let tps = format!("{:.1}", a["tps"].as_f64().unwrap());
        assert!(section.contains(&format!("<td>5m</td><td class=\"num\">{tps}</td>")), "{path}: {section}");
        assert!(section.contains("100.00%") && section.contains(">low<"), "{path}: {section}");
        for window in ["5m", "1h", "24h", "30d"] {
            assert!(section.contains(&format!("<td>{window}</td>")), "{path}: the {window} window");
        }
    }
    let (_, kind, _) = fetch_page(&format!("{base}/status"), "application/json");
    assert!(kind.starts_with("application/json"), "clients still get JSON: {kind}");
    assert!(kind.ends_with("vary=accept"), "caches keep the two apart: {kind}");

    // Killed and started again over the same database: the month still holds them.
    drop(serve);
    let serve = Serve::start(data.path(), &["--status-refresh-secs", "1"], &[]);
    let (code, month) = status(&serve, "?window=30d");
    assert_eq!(code, 200);
    assert_eq!((month["window"].as_str(), month["stale"].as_bool()), (Some("30d"), Some(false)));
    let after = model_a(&month);
    assert_eq!(
        (&after["tps"], &after["ttfb_seconds"], &after["uptime_pct"]),
        (&measured["tps"], &measured["ttfb_seconds"], &measured["uptime_pct"])
    );
}
