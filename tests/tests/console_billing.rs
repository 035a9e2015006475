//! The console's money pages in a real browser (chromium through chromedriver) against
//! a real `tessera serve` mailing through a real SMTP server (aiosmtpd): buying credits
//! moves the balance; a plan is refused a one-time method, started with a card, and
//! upgraded at the pro-rated charge of the plans' formula; a subscription key used by the
//! `openai` SDK shows up in the usage chart at its discounted cost; the playground
//! streams an answer (reasoning apart) whose cost lands in Usage; a dedicated-capacity
//! request sends both e-mails and appears in `tessera capacity list`; the public status
//! page; and a shared organization's member sees what members may, and no more.
//!
//! With TESSERA_SCREENSHOTS=<folder> it saves a screenshot of each page there.

#[path = "support/browser.rs"]
mod browser;

use browser::*;
use fantoccini::{Client, Locator};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use tessera_e2e::{Serve, binary, python, until};

const EMAIL: &str = "pat@example.test";
const OPERATORS: &str = "capacity@tessera.test";
/// Model C: its supply state is read from /status before the subscription call.
const MODEL: &str = "vendor-c/model-c";

/// `tessera <args> --data-dir <data> --json`, parsed.
fn cli(data: &Path, args: &[&str]) -> Value {
    let out = Command::new(binary("tessera-control-plane", "tessera"))
        .args(args)
        .args(["--json", "--data-dir"])
        .arg(data)
        .output()
        .unwrap();
    assert!(out.status.success(), "tessera {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("tessera {args:?}: {e}"))
}

/// A console dollar figure (`$1.2345`, `$20.00`) in micro-dollars, exactly.
fn micros(text: &str) -> i64 {
    let t = text.trim().trim_start_matches('$').replace(',', "");
    let (whole, frac) = t.split_once('.').unwrap_or((&t, ""));
    whole.parse::<i64>().unwrap() * 1_000_000 + format!("{frac:0<6}").parse::<i64>().unwrap()
}

/// GETs a JSON path as the page's own scripts would (the session cookie rides along).
async fn fetch_json(client: &Client, path: &str) -> Value {
    let script = "const [path, done] = arguments;\n\
                  fetch(path, {credentials: 'same-origin'}).then(r => r.json()).then(done, e => done(String(e)));";
    client.execute_async(script, vec![json!(path)]).await.unwrap()
}

/// One chat call with `key` through the SDK: the request id from the response headers.
fn sdk_request(serve: &Serve, key: &str) -> String {
    let script = r#"
import os, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
r = c.chat.completions.with_raw_response.create(
    model="vendor-c/model-c", max_tokens=8, messages=[{"role": "user", "content": "Say hello"}])
r.parse()
print(r.headers["x-request-id"])
"#;
    let out = python(script, &serve.base_url(), key, &[]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The usage record of request `id` of organization `org`, from the operator's CLI.
fn record(data: &Path, org: &str, id: &str) -> Value {
    let records = cli(data, &["usage", "list", "--org", org]);
    records.as_array().unwrap().iter().find(|r| r["request_id"] == id).cloned().expect("the request's usage record")
}

/// The cost chart's value for `model` on the last day of the range (today).
async fn charted_cost(client: &Client, org: &str, model: &str) -> i64 {
    let data = fetch_json(client, &format!("/o/{org}/usage.json")).await;
    let values = data["series"]["cost_micros"][model].as_array().cloned().unwrap_or_default();
    values.last().and_then(Value::as_i64).unwrap_or(0)
}

/// Chooses the playground's key named `name`.
async fn select_key(client: &Client, name: &str) {
    for option in client.find_all(Locator::Css("#pg-key option")).await.unwrap() {
        if option.text().await.unwrap().starts_with(name) {
            option.click().await.unwrap();
            return;
        }
    }
    panic!("no key {name} in the playground");
}

/// The pro-rated upgrade charge at `now` (µs), to the nearest micro-dollar.
fn pro_rated(difference: i64, start: i64, end: i64, now: i64) -> i64 {
    let (length, rest) = ((end - start) as i128, (end - now).max(0) as i128);
    ((difference as i128 * rest + length / 2) / length) as i64
}

#[tokio::test]
async fn credits_plans_usage_playground_and_capacity_in_a_real_browser() {
    let data = tempfile::tempdir().unwrap();
    let maildir = data.path().join("mail");
    let (_smtp, smtp_port) = smtp(&maildir);
    let smtp_url = format!("smtp://127.0.0.1:{smtp_port}");
    let args = ["--smtp-url", &smtp_url, "--capacity-requests-to", OPERATORS, "--supply-refresh-secs", "1"];
    let serve = Serve::start(data.path(), &args, &[]);
    let site = format!("http://127.0.0.1:{}", serve.port);
    let (_driver, client) = browser().await;
    let shots = Shots(std::env::var_os("TESSERA_SCREENSHOTS").map(PathBuf::from));

    client.goto(&format!("{site}/sign-up")).await.unwrap();
    submit(&client, "#sign-up-form", &[("email", EMAIL), ("password", PASSWORD), ("confirm", PASSWORD)], "#org-name")
        .await;
    let org = org_of(client.current_url().await.unwrap().as_str());

    // Credits: a bad amount is refused beside the form; a good one is shown for review,
    // then bought, and the balance moves by exactly that.
    client.goto(&format!("{site}/o/{org}/billing")).await.unwrap();
    assert_eq!(micros(&text(&client, "#balance").await), 0);
    let zero = text(&client, "#zero-balance").await;
    assert!(
        zero.contains("429") && zero.contains("insufficient_quota"),
        "a zero balance is explained as the API answers: {zero}"
    );
    client.goto(&format!("{site}/o/{org}/keys")).await.unwrap();
    assert!(text(&client, "#zero-balance").await.contains("insufficient_quota"));
    let add = client.find(Locator::Css("#zero-balance a#add-credits")).await.unwrap();
    assert_eq!(add.attr("href").await.unwrap().as_deref(), Some(format!("/o/{org}/billing").as_str()));
    add.click().await.unwrap();
    wait_for(&client, "#buy-credits").await;
    assert_eq!(text(&client, "nav.tabs a[aria-current=page]").await, "Billing", "the page shown is marked");
    submit(&client, "#buy-credits", &[("amount", "12.345"), ("method", "pm_dev_card")], "#billing-error").await;
    assert!(text(&client, "#billing-error").await.contains("dollars and cents"));
    submit(&client, "#buy-credits", &[("amount", "20"), ("method", "pm_dev_card")], "#confirm").await;
    shots.take(&client, "buy-credits").await;
    assert!(text(&client, "h1").await.contains("$20.00"), "the amount is shown before paying");
    let mut reviewed = serde_json::Map::new();
    for input in client.find_all(Locator::Css("#confirm-form input[type=hidden]")).await.unwrap() {
        let (name, value) = (input.attr("name").await.unwrap().unwrap(), input.attr("value").await.unwrap().unwrap());
        reviewed.insert(name, json!(value));
    }
    client.find(Locator::Css("#confirm")).await.unwrap().click().await.unwrap();
    assert!(text(&client, ".done").await.contains("Payment received"));
    assert_eq!(micros(&text(&client, "#balance").await), 20_000_000);
    assert!(text(&client, "#history").await.contains("Credits bought"));
    shots.take(&client, "billing").await;
    // The reviewed purchase sent again (a double click, a resubmitted page) buys nothing more.
    reviewed.insert("csrf".into(), json!(csrf_of_page(&client).await));
    post_from_page(&client, &format!("/o/{org}/billing/buy/confirm"), Value::Object(reviewed)).await;
    client.goto(&format!("{site}/o/{org}/billing")).await.unwrap();
    assert_eq!(micros(&text(&client, "#balance").await), 20_000_000, "bought once");

    // Without a plan, a subscription key that may fall back to credits works through the
    // SDK (on credits), while the playground refuses it: it never falls back on its own.
    client.goto(&format!("{site}/o/{org}/keys")).await.unwrap();
    client.find(Locator::Css("#create-key input[name=fallback]")).await.unwrap().click().await.unwrap();
    submit(&client, "#create-key", &[("name", "fallback-key"), ("billing_mode", "subscription")], "#new-key-secret")
        .await;
    assert!(text(&client, "#key-list").await.contains("subscription, then credits"));
    let fallback_key = text(&client, "#new-key-secret").await;
    let id = sdk_request(&serve, &fallback_key);
    assert_eq!(record(data.path(), &org, &id)["funding"], "credits", "the API falls back");
    client.goto(&format!("{site}/o/{org}/playground")).await.unwrap();
    select_key(&client, "fallback-key").await;
    client.find(Locator::Css("#pg-message")).await.unwrap().send_keys("Hello").await.unwrap();
    client.find(Locator::Css("#pg-send")).await.unwrap().click().await.unwrap();
    let refused = wait_for(&client, ".turn.assistant.failed[data-done]").await.text().await.unwrap();
    assert!(refused.contains("plan"), "the playground does not fall back: {refused}");

    // Plans: a one-time method is refused with its reason; Pro with a card.
    client.goto(&format!("{site}/o/{org}/plan")).await.unwrap();
    submit(&client, "#plan-pro", &[("method", "pm_dev_crypto")], "#plan-error").await;
    assert!(text(&client, "#plan-error").await.contains("recurring payment method"));
    submit(&client, "#plan-pro", &[("method", "pm_dev_card")], "#confirm").await;
    assert!(text(&client, "h1").await.contains("$30.00"));
    client.find(Locator::Css("#confirm")).await.unwrap().click().await.unwrap();
    assert!(text(&client, ".done").await.contains("plan has started"));
    assert_eq!(text(&client, "#plan-name").await, "Pro");
    assert_eq!(micros(&text(&client, "#included").await), 75_000_000);

    // Upgrade to Max: the review shows the charge; the charge is the formula's.
    submit(&client, "#plan-max", &[], "#confirm").await;
    shots.take(&client, "upgrade").await;
    let quoted = text(&client, "h1").await;
    let quoted = micros(quoted.rsplit("for ").next().unwrap().trim_end_matches('?'));
    let s = cli(data.path(), &["plans", "show", "--user", EMAIL]);
    let (start, end) = (s["period_start"].as_i64().unwrap(), s["period_end"].as_i64().unwrap());
    let before = tessera_control_plane::limits::now_us();
    client.find(Locator::Css("#confirm")).await.unwrap().click().await.unwrap();
    assert!(text(&client, ".done").await.contains("Upgraded"));
    let after = tessera_control_plane::limits::now_us();
    let s = cli(data.path(), &["plans", "show", "--user", EMAIL]);
    let charged = s["paid_micros"].as_i64().unwrap() - 30_000_000;
    let (most, least) = (pro_rated(70_000_000, start, end, before), pro_rated(70_000_000, start, end, after));
    assert!((least..=most).contains(&charged), "charged {charged}, the formula gives {least}..={most}");
    assert!(quoted >= charged && quoted - charged < 1_000_000, "quoted {quoted}, charged {charged}");
    assert_eq!(s["included_micros"].as_i64().unwrap(), (30_000_000 + charged) * 3, "3 × everything paid");
    assert_eq!(text(&client, "#plan-name").await, "Max");
    assert_eq!(micros(&text(&client, "#included").await), (30_000_000 + charged) * 3);
    shots.take(&client, "plan").await;

    // A subscription key through the SDK, at the model's live discount, in the chart.
    let state = until(60, "model C's supply state to settle on surplus (an idle worker)", || {
        let status: Value = serde_json::from_str(&serve.get("/status?window=5m")?).ok()?;
        let m = status["models"].as_array()?.iter().find(|m| m["id"] == MODEL)?.clone();
        (m["current_subscription_supply_state"] == "surplus").then_some(m)
    });
    assert_eq!(state["current_subscription_discount_percent"], 75);
    client.goto(&format!("{site}/o/{org}/keys")).await.unwrap();
    submit(&client, "#create-key", &[("name", "plan-key"), ("billing_mode", "subscription")], "#new-key-secret").await;
    let plan_key = text(&client, "#new-key-secret").await;
    let before_chart = charted_cost(&client, &org, MODEL).await;
    let id = sdk_request(&serve, &plan_key);
    let r = record(data.path(), &org, &id);
    assert_eq!((r["funding"].as_str(), r["multiplier_bp"].as_i64()), (Some("subscription"), Some(2_500)), "{r}");
    let cost = r["cost_micros"].as_i64().unwrap();
    assert!(cost > 0, "{r}");
    assert_eq!(charted_cost(&client, &org, MODEL).await - before_chart, cost, "the chart adds the discounted cost");
    client.goto(&format!("{site}/o/{org}/usage")).await.unwrap();
    wait_for(&client, "body[data-charts-ready] #cost-chart canvas").await;
    assert!(text(&client, "#usage-range").await.contains("UTC"));
    assert!(text(&client, "#usage-table").await.contains(MODEL));
    assert_eq!(text(&client, "nav.tabs a[aria-current=page]").await, "Usage");
    shots.take(&client, "usage").await;
    // The date filters are typed as every date on the page is written.
    for name in ["from", "to"] {
        let input = client.find(Locator::Css(&format!("#usage-filters input[name={name}]"))).await.unwrap();
        assert_eq!(input.attr("type").await.unwrap().as_deref(), Some("text"), "not the browser's locale date");
        assert_eq!(input.attr("placeholder").await.unwrap().as_deref(), Some("YYYY-MM-DD"));
    }
    // The token axis steps in whole tokens: a day of 13 tokens is labelled 0, 2, 4, …,
    // not 0, 3, 5, 8 (2.5 rounded).
    let labels = client
        .execute(
            r#"const el = document.getElementById("token-chart");
               draw(el, {models: ["m"], buckets: [1764460800], series: {input_tokens: {m: [13]}}}, "input_tokens");
               return el.dataset.yLabels;"#,
            vec![],
        )
        .await
        .unwrap();
    let ticks: Vec<i64> = labels.as_str().unwrap().split('|').map(|l| l.replace(',', "").parse().unwrap()).collect();
    assert!(ticks.len() >= 3 && ticks.windows(2).all(|w| w[1] - w[0] == ticks[1] - ticks[0]), "{labels}");
    let s = cli(data.path(), &["plans", "show", "--user", EMAIL]);
    assert_eq!(s["spent_micros"].as_i64().unwrap(), cost, "spent from the plan, not credits");

    // The playground: a credits key, model A (which reasons), streamed; its cost in Usage.
    client.goto(&format!("{site}/o/{org}/keys")).await.unwrap();
    submit(&client, "#create-key", &[("name", "playground-key"), ("billing_mode", "credits")], "#new-key-secret").await;
    client.goto(&format!("{site}/o/{org}/playground")).await.unwrap();
    let form = client.form(Locator::Css("#playground")).await.unwrap();
    form.set_by_name("model", "vendor-a/model-a").await.unwrap();
    select_key(&client, "playground-key").await;
    form.set_by_name("max_tokens", "300").await.unwrap();
    client.find(Locator::Css("#pg-message")).await.unwrap().send_keys("What is the capital of France?").await.unwrap();
    client.find(Locator::Css("#pg-send")).await.unwrap().click().await.unwrap();
    let turn = wait_for(&client, ".turn.assistant[data-done]").await;
    shots.take(&client, "playground").await;
    let class = turn.attr("class").await.unwrap().unwrap_or_default();
    assert!(!class.contains("failed"), "{}", turn.text().await.unwrap());
    let answer = client.find(Locator::Css(".turn.assistant .answer")).await.unwrap().text().await.unwrap();
    assert!(!answer.trim().is_empty(), "an answer");
    let reasoning = client.find(Locator::Css(".turn.assistant .reasoning-text")).await.unwrap();
    assert!(!reasoning.prop("textContent").await.unwrap().unwrap_or_default().trim().is_empty(), "reasoning apart");
    let usage_line = client.find(Locator::Css(".turn.assistant .usage")).await.unwrap().text().await.unwrap();
    let id = usage_line.rsplit(" · ").next().unwrap().to_string();
    let r = record(data.path(), &org, &id);
    assert_eq!(r["funding"], "credits");
    let shown = turn.attr("data-cost").await.unwrap().expect("the turn's cost");
    assert_eq!(micros(&shown), r["cost_micros"].as_i64().unwrap(), "the cost shown is the one billed");
    let balance = cli(data.path(), &["credits", "show", "--org", &org]);
    let spent: i64 = cli(data.path(), &["usage", "list", "--org", &org])
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["funding"] == "credits")
        .map(|r| r["cost_micros"].as_i64().unwrap())
        .sum();
    assert_eq!(balance["balance_micros"].as_i64().unwrap(), 20_000_000 - spent, "credits paid for these calls only");
    let data_json = fetch_json(&client, &format!("/o/{org}/usage.json?model=vendor-a%2Fmodel-a")).await;
    assert_eq!(data_json["total"]["cost_micros"], r["cost_micros"], "in Usage");

    // Dedicated capacity: a past start date is refused beside its field; a good request
    // is stored, mailed to the requester and to the operators, and listed by the CLI.
    client.goto(&format!("{site}/o/{org}/capacity")).await.unwrap();
    assert!(text(&client, "#manual-note").await.contains("not instant"));
    let fields = [
        ("gpu_type", "H200 141GB SXM"),
        ("topology", "cluster"),
        ("nodes", "4"),
        ("region", "eu-west"),
        ("start_date", "2020-01-01"),
        ("term_months", "12"),
        ("contact_name", "Pat Doe"),
        ("contact_email", EMAIL),
        ("notes", "Fine-tuning runs"),
    ];
    submit(&client, "#capacity-form", &fields, "#start_date-error").await;
    assert!(text(&client, "#start_date-error").await.contains("in the past"));
    let start_date =
        tessera_control_plane::calendar::date(tessera_control_plane::limits::now_us() + 30 * 86_400_000_000);
    let mut good = fields;
    good[4].1 = &start_date;
    submit(&client, "#capacity-form", &good, ".done").await;
    shots.take(&client, "capacity").await;
    assert!(text(&client, "#capacity-requests").await.contains("32 × H200 141GB SXM"));
    let copy = until(30, "the requester's copy", || delivered_to(&maildir, EMAIL));
    assert!(copy.contains("not instant") && copy.contains("not a quote"), "{copy}");
    let notice = until(30, "the operators' notice", || delivered_to(&maildir, OPERATORS));
    assert!(notice.contains("Pat Doe") && notice.contains("eu-west"), "{notice}");
    let listed = cli(data.path(), &["capacity", "list"]);
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0]["status"].as_str(), listed[0]["gpus"].as_i64()), (Some("received"), Some(32)));

    // The public status page, signed out.
    client.find(Locator::Css("#sign-out")).await.unwrap().click().await.unwrap();
    wait_for(&client, "#sign-in-form").await;
    client.goto(&format!("{site}/status")).await.unwrap();
    assert!(text(&client, "h1").await.contains("status"));
    assert!(client.source().await.unwrap().contains(MODEL));
    let times = text(&client, "#status-times").await;
    assert!(times.contains("supply states measured") && times.contains(" UTC"), "{times}");
    assert!(!times.contains("T0") && !times.contains("T1") && !times.contains("T2"), "no raw timestamp: {times}");
    let body = text(&client, "main").await;
    assert!(!body.contains("multiplier") && !body.contains("never"), "{body}");
    assert!(body.contains("plan usage 75% off") || body.contains("standard price"), "{body}");
    shots.take(&client, "status").await;
    client.close().await.unwrap();
}
