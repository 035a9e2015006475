//! The console's costs: argon2id hashing and verifying at the parameters it uses
//! (m = 19 MiB, t = 2, p = 1; build with --release for the figure that matters), and
//! page render times — session lookup, authorization, queries and template — with 50
//! signed-in users asking for their organization's pages at once, against one user
//! alone; and the usage views (page, chart data, CSV; by day, by key, by hour) of an
//! organization with 100,000 usage records over the last 30 days. In process, on a
//! SQLite file as `tessera serve` keeps it: no network in the figure.

use crate::{percentile, round};
use anyhow::Result;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;
use tessera_control_plane::accounts::{BillingMode, NewKey, Role};
use tessera_control_plane::console::session::SESSION_COOKIE;
use tessera_control_plane::console::{self, Console, ConsoleConfig, mail::Mailer, password};
use tessera_control_plane::db::Db;
use tower::ServiceExt;

#[derive(clap::Args)]
pub struct Args {
    /// Signed-in users asking at once.
    #[arg(long, default_value_t = 50)]
    users: usize,
    /// Pages each user asks for.
    #[arg(long, default_value_t = 40)]
    pages: usize,
    /// Hashes (and verifications) to time.
    #[arg(long, default_value_t = 20)]
    hashes: usize,
    /// Usage records of the organization whose usage views are timed.
    #[arg(long, default_value_t = 100_000)]
    usage_records: usize,
    /// Times each usage view is asked for.
    #[arg(long, default_value_t = 30)]
    usage_views: usize,
}

pub fn run(args: Args) -> Result<()> {
    let mut hash_ms = Vec::new();
    let mut verify_ms = Vec::new();
    for i in 0..args.hashes {
        let pw = format!("a passphrase for timing number {i}");
        let began = Instant::now();
        let phc = password::hash(&pw);
        hash_ms.push(began.elapsed().as_secs_f64() * 1e3);
        let began = Instant::now();
        assert!(password::verify(&pw, Some(&phc)));
        verify_ms.push(began.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "{}",
        json!({"bench": "console_argon2id", "m_kib": 19456, "t": 2, "p": 1, "release": !cfg!(debug_assertions),
               "hash_p50_ms": round(percentile(&hash_ms, 0.5)), "verify_p50_ms": round(percentile(&verify_ms, 0.5)),
               "verify_p99_ms": round(percentile(&verify_ms, 0.99))})
    );

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(pages(args))
}

async fn pages(args: Args) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let db = Db::open(&url).await?;
    let store = db.accounts();
    let owner = store.create_user("owner@bench.test").await?;
    let org = store.create_org_owned_by("Bench Org", &owner.id).await?;
    for k in 0..20 {
        let name = format!("key-{k}");
        let new = NewKey {
            org_id: &org.id,
            name: &name,
            billing_mode: BillingMode::Credits,
            fallback_to_credits: false,
            created_by: Some(&owner.id),
        };
        store.create_key(new).await?;
    }
    let mut tokens = Vec::new();
    for u in 0..args.users {
        let user = store.create_user(&format!("user{u}@bench.test")).await?;
        let (_, code) = store.create_invite(&org.id, &user.email, Role::Member, &owner.id, 3600).await?;
        store.accept_invite(&code, &user.id).await?;
        tokens.push(store.start_session(&user.id).await?);
    }
    let console = Console {
        store: store.clone(),
        billing: db.billing(Arc::new(tessera_control_plane::billing::payments::DevProcessor::default())),
        capacity: db.capacity_requests(),
        api: None,
        mail: Mailer::new(None, "Tessera <noreply@localhost>", dir.path().join("outbox"))?,
        config: ConsoleConfig::at("http://bench.test"),
    };
    let router = console::router(Arc::new(console));
    let paths = [format!("/o/{}/keys", org.id), format!("/o/{}/members", org.id), format!("/o/{}", org.id)];

    let page = |router: axum::Router, token: String, path: String| async move {
        let request =
            Request::get(&path).header(header::COOKIE, format!("{SESSION_COOKIE}={token}")).body(Body::empty())?;
        let began = Instant::now();
        let response = router.oneshot(request).await?;
        let status = response.status();
        axum::body::to_bytes(response.into_body(), 1 << 22).await?;
        anyhow::ensure!(status == StatusCode::OK, "{path}: {status}");
        anyhow::Ok(began.elapsed().as_secs_f64() * 1e3)
    };
    // Warm: templates, the connection pool, SQLite's page cache.
    for p in &paths {
        page(router.clone(), tokens[0].clone(), p.clone()).await?;
    }
    let mut alone = Vec::new();
    for i in 0..args.pages {
        alone.push(page(router.clone(), tokens[0].clone(), paths[i % paths.len()].clone()).await?);
    }
    let began = Instant::now();
    let mut tasks = Vec::new();
    for token in tokens.clone() {
        let (router, paths, pages) = (router.clone(), paths.clone(), args.pages);
        tasks.push(tokio::spawn(async move {
            let mut ms = Vec::new();
            for i in 0..pages {
                ms.push(page(router.clone(), token.clone(), paths[i % paths.len()].clone()).await?);
            }
            anyhow::Ok(ms)
        }));
    }
    let mut together = Vec::new();
    for t in tasks {
        together.extend(t.await??);
    }
    let secs = began.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({"bench": "console_pages", "users": args.users, "pages": together.len(), "keys_listed": 20,
               "members": args.users + 1, "alone_p50_ms": round(percentile(&alone, 0.5)),
               "concurrent_p50_ms": round(percentile(&together, 0.5)),
               "concurrent_p99_ms": round(percentile(&together, 0.99)),
               "pages_per_s": round(together.len() as f64 / secs)})
    );

    // The usage views of an organization with many records.
    let keys: Vec<String> = store.list_keys(&org.id).await?.into_iter().map(|k| k.id).collect();
    let began = Instant::now();
    write_usage(&url, &org.id, &keys, args.usage_records).await?;
    let write_s = began.elapsed().as_secs_f64();
    let views = [
        ("page_30_days", format!("/o/{}/usage", org.id)),
        ("chart_data_30_days", format!("/o/{}/usage.json", org.id)),
        ("csv_30_days", format!("/o/{}/usage.csv", org.id)),
        ("page_one_key", format!("/o/{}/usage?key={}", org.id, keys[3])),
        ("page_48_hours", format!("/o/{}/usage?by=hour", org.id)),
    ];
    let mut figures = serde_json::Map::new();
    for (name, path) in views {
        page(router.clone(), tokens[0].clone(), path.clone()).await?;
        let mut ms = Vec::new();
        for _ in 0..args.usage_views {
            ms.push(page(router.clone(), tokens[0].clone(), path.clone()).await?);
        }
        figures.insert(format!("{name}_p50_ms"), json!(round(percentile(&ms, 0.5))));
        figures.insert(format!("{name}_p99_ms"), json!(round(percentile(&ms, 0.99))));
    }
    let mut line = json!({"bench": "console_usage", "usage_records": args.usage_records, "models": 4,
                          "keys": keys.len(), "days": 30, "views_each": args.usage_views,
                          "records_written_s": round(write_s)});
    line.as_object_mut().unwrap().extend(figures);
    println!("{line}");
    Ok(())
}

/// `n` usage records (and their settled holds) spread evenly over the last 30 days,
/// across four models and the organization's keys, written as the ledger writes them.
async fn write_usage(db: &str, org: &str, keys: &[String], n: usize) -> Result<()> {
    const MODELS: [&str; 4] = ["vendor-a/model-a", "vendor-b/model-b", "vendor-c/model-c", "vendor-d/model-d"];
    let pool = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(db).await?;
    let now = tessera_control_plane::limits::now_us();
    let span = 30 * 86_400_000_000i64;
    let mut tx = pool.begin().await?;
    for i in 0..n {
        let id = format!("bench_{i}");
        let at = now - span + (span / n as i64) * i as i64;
        sqlx::query("INSERT INTO holds (request_id, org_id, amount, created_at, settled_at) VALUES ($1, $2, 0, 0, 0)")
            .bind(&id)
            .bind(org)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO usage_records (request_id, org_id, key_id, model, endpoint, prompt_tokens, cached_tokens, \
             completion_tokens, reasoning_tokens, cost_micros, funding, multiplier_bp, finish_reason, created_at) \
             VALUES ($1, $2, $3, $4, 'chat.completions', $5, $6, $7, $8, $9, 'credits', 10000, 'stop', $10)",
        )
        .bind(&id)
        .bind(org)
        .bind(&keys[i % keys.len()])
        .bind(MODELS[i % MODELS.len()])
        .bind(200 + (i % 700) as i64)
        .bind((i % 3 * 64) as i64)
        .bind(50 + (i % 300) as i64)
        .bind((i % 5 * 10) as i64)
        .bind(30 + (i % 90) as i64)
        .bind(at)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    pool.close().await;
    Ok(())
}
