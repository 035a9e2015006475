//! The usage page's figures against the records themselves, on SQLite and PostgreSQL:
//! for several ranges and filters (one crossing a month, one with no usage, single
//! days, by key, by model, by hour), the chart data, the table and the CSV each equal
//! the sums of the usage records computed here, bucket by bucket, with records on the
//! very edges of UTC days falling in the day they belong to and none outside the range.

#[path = "support/postgres.rs"]
mod postgres;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use std::collections::BTreeMap;
use std::sync::Arc;
use tessera_control_plane::accounts::{BillingMode, NewKey};
use tessera_control_plane::billing::payments::DevProcessor;
use tessera_control_plane::calendar::days_from_civil;
use tessera_control_plane::console::session::SESSION_COOKIE;
use tessera_control_plane::console::{self, Console, ConsoleConfig, mail::Mailer};
use tessera_control_plane::db::Db;
use tower::ServiceExt;

const HOUR: i64 = 3_600_000_000;
const DAY: i64 = 24 * HOUR;
const MODELS: [&str; 3] = ["vendor-a/model-a", "vendor-c/model-c", "vendor-d/model-d"];

#[derive(Debug, Clone)]
struct Rec {
    at: i64,
    key: String,
    model: &'static str,
    funding: &'static str,
    /// input, cached, output, reasoning, cost
    n: [i64; 5],
}

/// Sums per (bucket, model): requests, input, cached, output, reasoning, cost.
type Expected = BTreeMap<(i64, String), [i64; 6]>;

fn expected(records: &[Rec], start: i64, end: i64, step: i64, key: Option<&str>, model: Option<&str>) -> Expected {
    let mut out = Expected::new();
    for r in records
        .iter()
        .filter(|r| r.at >= start && r.at < end && key.is_none_or(|k| k == r.key) && model.is_none_or(|m| m == r.model))
    {
        let e = out.entry((r.at.div_euclid(step) * step, r.model.to_string())).or_default();
        e[0] += 1;
        for i in 0..5 {
            e[i + 1] += r.n[i];
        }
    }
    out
}

fn at(y: i64, m: u32, d: u32) -> i64 {
    days_from_civil(y, m, d) * DAY
}

struct World {
    router: axum::Router,
    token: String,
    org: String,
    keys: [String; 2],
    records: Vec<Rec>,
    _dir: tempfile::TempDir,
}

async fn world(url: &str) -> World {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(url).await.unwrap();
    let store = db.accounts();
    let owner = store.create_user_with_password("owner@usage.test", Some("$argon2id$fake")).await.unwrap();
    let org = store.create_org_owned_by("Usage Co", &owner.id).await.unwrap();
    let mut keys = Vec::new();
    for name in ["alpha", "beta"] {
        let new = NewKey {
            org_id: &org.id,
            name,
            billing_mode: BillingMode::Credits,
            fallback_to_credits: false,
            created_by: Some(&owner.id),
        };
        keys.push(store.create_key(new).await.unwrap().0.id);
    }
    let keys: [String; 2] = keys.try_into().unwrap();

    // Records spread over late October to early December 2026 and the last 48 hours,
    // from a fixed sequence, plus some on the edges of days.
    let now = tessera_control_plane::limits::now_us();
    let mut seed: u64 = 0x5eed_cafe;
    let mut next = |n: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 11) % n
    };
    let (from, span) = (at(2026, 10, 20), at(2026, 12, 6) - at(2026, 10, 20));
    let mut records = Vec::new();
    for i in 0..360 {
        let when =
            if i % 4 == 0 { now - 60 * HOUR + next(60 * HOUR as u64) as i64 } else { from + next(span as u64) as i64 };
        let input = 1 + next(5000) as i64;
        let output = next(800) as i64;
        records.push(Rec {
            at: when,
            key: keys[next(2) as usize].clone(),
            model: MODELS[next(3) as usize],
            funding: if next(3) == 0 { "subscription" } else { "credits" },
            n: [input, next(input as u64) as i64, output, next(output as u64 + 1) as i64, next(90_000) as i64],
        });
    }
    for edge in [at(2026, 11, 1) - 1, at(2026, 11, 1), at(2026, 10, 31), at(2026, 12, 1) - 1] {
        records.push(Rec {
            at: edge,
            key: keys[0].clone(),
            model: MODELS[0],
            funding: "credits",
            n: [7, 3, 5, 1, 1234],
        });
    }

    // Written as the ledger writes them (a settled hold, then its record), with chosen times.
    let pool = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(url).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    for (i, r) in records.iter().enumerate() {
        let id = format!("req_{i}");
        sqlx::query("INSERT INTO holds (request_id, org_id, amount, created_at, settled_at) VALUES ($1, $2, 0, 0, 0)")
            .bind(&id)
            .bind(&org.id)
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO usage_records (request_id, org_id, key_id, model, endpoint, prompt_tokens, cached_tokens, \
             completion_tokens, reasoning_tokens, cost_micros, funding, multiplier_bp, finish_reason, created_at) \
             VALUES ($1, $2, $3, $4, 'chat.completions', $5, $6, $7, $8, $9, $10, 10000, 'stop', $11)",
        )
        .bind(&id)
        .bind(&org.id)
        .bind(&r.key)
        .bind(r.model)
        .bind(r.n[0])
        .bind(r.n[1])
        .bind(r.n[2])
        .bind(r.n[3])
        .bind(r.n[4])
        .bind(r.funding)
        .bind(r.at)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    pool.close().await;

    let token = store.start_session(&owner.id).await.unwrap();
    let console = Console {
        store: store.clone(),
        billing: db.billing(Arc::new(DevProcessor::default())),
        capacity: db.capacity_requests(),
        api: None,
        mail: Mailer::new(None, "Tessera <noreply@localhost>", dir.path().join("outbox")).unwrap(),
        config: ConsoleConfig::at("http://console.test"),
    };
    World { router: console::router(Arc::new(console)), token, org: org.id, keys, records, _dir: dir }
}

impl World {
    async fn get(&self, path: &str) -> (StatusCode, String) {
        let request = Request::get(path)
            .header(header::HOST, "console.test")
            .header(header::COOKIE, format!("{SESSION_COOKIE}={}", self.token))
            .body(Body::empty())
            .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 64 << 20).await.unwrap();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }
}

const METRICS: [&str; 6] =
    ["requests", "input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens", "cost_micros"];

fn from_chart(json: &str) -> Expected {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["time_zone"], "UTC");
    let buckets: Vec<i64> = v["buckets"].as_array().unwrap().iter().map(|b| b.as_i64().unwrap() * 1_000_000).collect();
    let mut out = Expected::new();
    for (m, metric) in METRICS.iter().enumerate() {
        for (model, values) in v["series"][metric].as_object().unwrap() {
            let values = values.as_array().unwrap();
            assert_eq!(values.len(), buckets.len(), "one value per bucket");
            for (bucket, value) in buckets.iter().zip(values) {
                let value = value.as_i64().unwrap();
                if value != 0 || out.contains_key(&(*bucket, model.clone())) {
                    out.entry((*bucket, model.clone())).or_default()[m] = value;
                }
            }
        }
    }
    // A bucket whose requests are zero has no records: drop it, as the SQL does.
    out.retain(|_, v| v[0] > 0);
    out
}

fn micros(dollars: &str) -> i64 {
    let (whole, frac) = dollars.trim_start_matches('$').split_once('.').unwrap();
    whole.parse::<i64>().unwrap() * 1_000_000 + format!("{frac:0<6}").parse::<i64>().unwrap()
}

fn from_csv(csv: &str) -> Expected {
    let mut lines = csv.lines();
    assert_eq!(
        lines.next().unwrap(),
        "bucket_start_utc,model,requests,input_tokens,cached_input_tokens,output_tokens,reasoning_tokens,cost_usd"
    );
    let mut out = Expected::new();
    for line in lines {
        let f: Vec<&str> = line.split(',').collect();
        let bucket = parse_rfc3339(f[0]);
        let mut v = [0i64; 6];
        for i in 0..5 {
            v[i] = f[2 + i].parse().unwrap();
        }
        v[5] = micros(f[7]);
        assert!(out.insert((bucket, f[1].to_string()), v).is_none(), "one line per bucket and model");
    }
    out
}

fn parse_rfc3339(s: &str) -> i64 {
    // 2026-11-01T00:00:00Z
    let (y, m, d) = (s[0..4].parse().unwrap(), s[5..7].parse().unwrap(), s[8..10].parse().unwrap());
    let (h, min, sec): (i64, i64, i64) =
        (s[11..13].parse().unwrap(), s[14..16].parse().unwrap(), s[17..19].parse().unwrap());
    days_from_civil(y, m, d) * DAY + (h * 3600 + min * 60 + sec) * 1_000_000
}

/// The table's body rows and its footer's totals, read from the page.
fn from_table(html: &str, hourly: bool) -> (Expected, [i64; 6]) {
    let table = &html[html.find("id=\"usage-table\"").expect("the table")..];
    let body = &table[table.find("<tbody>").unwrap()..table.find("</tbody>").unwrap()];
    let cells = |row: &str| -> Vec<String> {
        row.split("<td").skip(1).map(|c| c[c.find('>').unwrap() + 1..c.find("</td>").unwrap()].to_string()).collect()
    };
    let mut out = Expected::new();
    for row in body.split("<tr>").skip(1).filter(|r| !r.contains("no-usage")) {
        let c = cells(row);
        let bucket = if hourly {
            parse_rfc3339(&format!("{}T{}:00Z", &c[0][..10], &c[0][11..16]))
        } else {
            parse_rfc3339(&format!("{}T00:00:00Z", c[0]))
        };
        let mut v = [0i64; 6];
        for i in 0..5 {
            v[i] = c[2 + i].parse().unwrap();
        }
        v[5] = micros(&c[7]);
        out.insert((bucket, c[1].clone()), v);
    }
    let foot = &table[table.find("<tfoot>").unwrap()..];
    let totals: Vec<String> =
        foot.split("<th class=\"num\">").skip(1).map(|c| c[..c.find("</th>").unwrap()].to_string()).collect();
    let mut t = [0i64; 6];
    for i in 0..5 {
        t[i] = totals[i].parse().unwrap();
    }
    t[5] = micros(&totals[5]);
    (out, t)
}

fn sum(e: &Expected) -> [i64; 6] {
    let mut t = [0i64; 6];
    for v in e.values() {
        for i in 0..6 {
            t[i] += v[i];
        }
    }
    t
}

/// A query, and what it must sum: `[start, end)`, the bucket, the key, the model.
type Case<'a> = (String, i64, i64, i64, Option<&'a str>, Option<&'a str>);

async fn suite(url: &str) {
    let w = world(url).await;
    let now = tessera_control_plane::limits::now_us();
    let hour_end = (now.div_euclid(HOUR) + 1) * HOUR;
    let (k0, k1) = (w.keys[0].as_str(), w.keys[1].as_str());
    let cases: Vec<Case> = vec![
        ("from=2026-10-25&to=2026-11-05".into(), at(2026, 10, 25), at(2026, 11, 6), DAY, None, None),
        ("from=2026-11-01&to=2026-11-01".into(), at(2026, 11, 1), at(2026, 11, 2), DAY, None, None),
        ("from=2026-10-31&to=2026-10-31".into(), at(2026, 10, 31), at(2026, 11, 1), DAY, None, None),
        ("from=2026-01-01&to=2026-01-31".into(), at(2026, 1, 1), at(2026, 2, 1), DAY, None, None),
        (format!("from=2026-10-20&to=2026-12-05&key={k1}"), at(2026, 10, 20), at(2026, 12, 6), DAY, Some(k1), None),
        (
            format!("from=2026-11-10&to=2026-12-03&model=vendor-c%2Fmodel-c&key={k0}"),
            at(2026, 11, 10),
            at(2026, 12, 4),
            DAY,
            Some(k0),
            Some("vendor-c/model-c"),
        ),
        (
            "from=2026-10-01&to=2026-12-31&model=vendor-d/model-d".into(),
            at(2026, 10, 1),
            at(2027, 1, 1),
            DAY,
            None,
            Some("vendor-d/model-d"),
        ),
        ("by=hour".into(), hour_end - 48 * HOUR, hour_end, HOUR, None, None),
        (format!("by=hour&key={k0}"), hour_end - 48 * HOUR, hour_end, HOUR, Some(k0), None),
    ];
    let mut nonempty = 0;
    for (query, start, end, step, key, model) in &cases {
        let want = expected(&w.records, *start, *end, *step, *key, *model);
        nonempty += !want.is_empty() as u32;
        let (status, json) = w.get(&format!("/o/{}/usage.json?{query}", w.org)).await;
        assert_eq!(status, StatusCode::OK, "{query}: {json}");
        let chart = from_chart(&json);
        assert_eq!(chart, want, "{query}: chart data");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let buckets = v["buckets"].as_array().unwrap();
        assert_eq!(buckets.len() as i64, (end - start) / step, "{query}: every bucket of the range, no padding");
        assert_eq!(buckets[0].as_i64().unwrap() * 1_000_000, *start, "{query}: starts on the first day");
        let (status, csv) = w.get(&format!("/o/{}/usage.csv?{query}", w.org)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(from_csv(&csv), want, "{query}: CSV");
        let (status, html) = w.get(&format!("/o/{}/usage?{query}", w.org)).await;
        assert_eq!(status, StatusCode::OK);
        let (table, totals) = from_table(&html, *step == HOUR);
        assert_eq!(table, want, "{query}: table");
        assert_eq!(totals, sum(&want), "{query}: totals");
        assert!(html.contains("UTC"), "labelled in UTC");
    }
    assert_eq!(nonempty, 8, "the cases exercise real data ({nonempty} with usage)");
    let edge = expected(&w.records, at(2026, 11, 1), at(2026, 11, 2), DAY, None, None);
    assert!(edge.values().map(|v| v[0]).sum::<i64>() >= 1, "midnight belongs to the day it starts");

    // Bad filters are a 400 with the reason, not an empty chart.
    for bad in [
        "from=2026-11-05&to=2026-11-01",
        "from=2026-02-30",
        "from=2024-01-01&to=2026-01-01",
        "by=week",
        "key=key_elsewhere",
    ] {
        let (status, body) = w.get(&format!("/o/{}/usage.json?{bad}", w.org)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
        let (status, _) = w.get(&format!("/o/{}/usage?{bad}", w.org)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
    }
}

#[tokio::test]
async fn usage_figures_equal_the_records_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    suite(&format!("sqlite://{}", dir.path().join("usage.db").display())).await;
}

#[tokio::test]
async fn usage_figures_equal_the_records_on_postgres() {
    let server = postgres::Server::start();
    suite(&server.url).await;
}
