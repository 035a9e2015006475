//! What billing costs a request: the hold taken at admission and the settlement at the
//! end, timed one by one (p50, p99) on SQLite and on PostgreSQL; then how many requests
//! one process admits per second for one organization — key check and rate limit, with
//! and without hold and settlement — side by side in the same run. Holds and
//! settlements of subscription requests are timed too. Then one organization's
//! admissions across 1 and `control_planes` control planes (each its own pool, limiter
//! and budget leases) sharing the database: per-request holds against leases, with the
//! database transactions the leases cost. Last, the most one personal plan's row
//! admits across the control planes with its concurrency taken by instant requests:
//! the ceiling its per-request holds put on a plan (not leased; docs/architecture.md).

#[path = "../../control-plane/tests/support/postgres.rs"]
mod postgres;

use crate::{percentile, round};
use anyhow::Result;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tessera_control_plane::accounts::{BillingMode, NewKey, Org};
use tessera_control_plane::billing::lease::{LeaseConfig, Leases};
use tessera_control_plane::billing::ledger::{NewHold, UsageRecord};
use tessera_control_plane::billing::payments::{DEV_CARD, DevProcessor};
use tessera_control_plane::billing::plans::Plan;
use tessera_control_plane::db::Db;
use tessera_control_plane::limits::{RateConfig, now_us};

#[derive(clap::Args)]
pub struct Args {
    /// Holds and settlements timed one at a time.
    #[arg(long, default_value_t = 1000)]
    iterations: usize,
    /// Concurrent admissions in the throughput runs.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seconds of each throughput run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// An empty PostgreSQL database; default: a throwaway local cluster.
    #[arg(long)]
    postgres: Option<String>,
    /// Control planes in the multi-control-plane admission runs.
    #[arg(long, default_value_t = 4)]
    control_planes: usize,
}

pub fn run(args: Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let dir = tempfile::tempdir()?;
    let sqlite = format!("sqlite://{}", dir.path().join("bench.db").display());
    rt.block_on(bench("sqlite", &sqlite, &args))?;
    let _server;
    let url = match &args.postgres {
        Some(url) => url.clone(),
        None => {
            _server = postgres::Server::start();
            _server.url.clone()
        }
    };
    rt.block_on(bench("postgresql", &url, &args))
}

/// An organization granted `micros` of credit, and the secret of a credits key of it.
pub(crate) async fn funded_org(db: &Db, name: &str, micros: u64) -> Result<(Org, String)> {
    let org = db.accounts().create_org(name).await?;
    let new = NewKey {
        org_id: &org.id,
        name: "bench",
        billing_mode: BillingMode::Credits,
        fallback_to_credits: false,
        created_by: None,
    };
    let (_, secret) = db.accounts().create_key(new).await?;
    db.ledger().grant(&org.id, micros, "benchmark").await?;
    Ok((org, secret))
}

fn usage(request_id: String, org: &str) -> UsageRecord {
    UsageRecord {
        key_id: "key_bench".into(),
        model: "vendor-a/model-a".into(),
        prompt_tokens: 200,
        cached_tokens: 100,
        completion_tokens: 100,
        cost_micros: 400,
        finish_reason: "stop".into(),
        ..UsageRecord::unused(&request_id, org)
    }
}

async fn bench(name: &str, url: &str, args: &Args) -> Result<()> {
    let db = Db::open(url).await?;
    let store = db.accounts();
    let (org, secret) = funded_org(&db, "bench", 1 << 50).await?;
    let ledger = db.ledger();
    let limiter = db.rate_limiter(RateConfig::default());
    limiter.set_org_rpm(&org.id, Some(u32::MAX)).await?;

    let (mut holds, mut settles) = (Vec::new(), Vec::new());
    for i in 0..args.iterations {
        let id = format!("one-{i}");
        let t = Instant::now();
        ledger.hold(&NewHold { request_id: id.clone(), org_id: org.id.clone(), amount: 5_000 }).await?;
        holds.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        ledger.settle(&usage(id, &org.id)).await?;
        settles.push(t.elapsed().as_secs_f64() * 1e6);
    }
    holds.sort_by(f64::total_cmp);
    settles.sort_by(f64::total_cmp);

    // The same for a personal key on a plan: its hold checks the month, both windows
    // and the plan's concurrency on the subscription's row.
    let user = store.create_user("bench@example.com").await?;
    let subscriptions = db.subscriptions(Arc::new(DevProcessor::default()));
    subscriptions.start(&user.id, Plan::Max, DEV_CARD, now_us()).await?;
    let (mut sub_holds, mut sub_settles) = (Vec::new(), Vec::new());
    for i in 0..args.iterations {
        let id = format!("sub-{i}");
        let t = Instant::now();
        let admitted = subscriptions.hold(&user.org_id, &id, 5_000, now_us()).await?;
        sub_holds.push(t.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(admitted.is_ok(), "the plan refused a benchmark request: {admitted:?}");
        let t = Instant::now();
        ledger.settle(&UsageRecord { funding: "subscription".into(), ..usage(id, &user.org_id) }).await?;
        sub_settles.push(t.elapsed().as_secs_f64() * 1e6);
    }
    sub_holds.sort_by(f64::total_cmp);
    sub_settles.sort_by(f64::total_cmp);

    let mut rates = Vec::new();
    for billing in [false, true] {
        let done = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
        let mut tasks = Vec::new();
        for w in 0..args.concurrency {
            let (store, ledger, limiter, done) = (store.clone(), ledger.clone(), limiter.clone(), done.clone());
            let (secret, org) = (secret.clone(), org.id.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    let key = store.authenticate(&secret).await?.expect("the bench key");
                    // The limit is set out of reach; the check's cost is what is measured.
                    limiter.check(&key.org_id).await?;
                    if billing {
                        let id = format!("run-{billing}-{w}-{i}");
                        ledger.hold(&NewHold { request_id: id.clone(), org_id: org.clone(), amount: 5_000 }).await?;
                        ledger.settle(&usage(id, &org)).await?;
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        rates.push(done.load(Ordering::Relaxed) as f64 / args.seconds);
    }
    ledger.audit().await?;
    for planes in [1, args.control_planes] {
        leased_admissions(name, url, planes, args).await?;
    }
    plan_row(name, url, args).await?;
    println!(
        "{}",
        json!({
            "bench": "billing",
            "db": name,
            "iterations": args.iterations,
            "hold_p50_us": round(percentile(&holds, 0.5)),
            "hold_p99_us": round(percentile(&holds, 0.99)),
            "settle_p50_us": round(percentile(&settles, 0.5)),
            "settle_p99_us": round(percentile(&settles, 0.99)),
            "subscription_hold_p50_us": round(percentile(&sub_holds, 0.5)),
            "subscription_hold_p99_us": round(percentile(&sub_holds, 0.99)),
            "subscription_settle_p50_us": round(percentile(&sub_settles, 0.5)),
            "subscription_settle_p99_us": round(percentile(&sub_settles, 0.99)),
            "concurrency": args.concurrency,
            "admitted_per_s_billing_off": round(rates[0]),
            "admitted_per_s_billing_on": round(rates[1]),
            "ratio": round(rates[1] / rates[0]),
        })
    );
    Ok(())
}

/// How each admission is billed in `admissions`.
#[derive(Clone, Copy, PartialEq)]
enum Holds {
    PerRequest,
    Leased,
}

/// One control plane of the multi-control-plane runs: its own pool and state.
struct Plane {
    store: tessera_control_plane::accounts::Store,
    ledger: tessera_control_plane::billing::Ledger,
    limiter: tessera_control_plane::limits::RateLimiter,
    leases: Leases,
}

/// One organization's admissions per second across `planes` control planes on `url`:
/// key check, rate limit (its limit out of reach: tokens leased in batches), hold
/// and settlement — per request, then against leases — `concurrency` at once on each.
async fn leased_admissions(name: &str, url: &str, planes: usize, args: &Args) -> Result<()> {
    let first = Db::open(url).await?;
    let (org, secret) = funded_org(&first, "leased", 1 << 50).await?;
    // The limit out of reach: 4 billion a minute, 1,000 at once.
    let limits = RateConfig { default_rpm: 200, burst: 1_000 };
    first.rate_limiter(limits).set_org_rpm(&org.id, Some(u32::MAX)).await?;
    let mut stack = Vec::new();
    for p in 0..planes {
        let db = Db::open(url).await?;
        let owner = format!("cp_bench_{name}_{planes}_{p}");
        stack.push(Arc::new(Plane {
            store: db.accounts(),
            ledger: db.ledger(),
            limiter: db.rate_limiter(limits),
            leases: db.ledger().leases(&owner, LeaseConfig::default()),
        }));
    }
    let mut rates = Vec::new();
    for holds in [Holds::PerRequest, Holds::Leased] {
        let done = Arc::new(AtomicU64::new(0));
        let checks_before: u64 = stack.iter().map(|p| p.limiter.database_checks()).sum();
        let start = Instant::now();
        let deadline = start + Duration::from_secs_f64(args.seconds);
        let mut tasks = Vec::new();
        for (p, plane) in stack.iter().enumerate() {
            for w in 0..args.concurrency {
                let (plane, done, secret, org) = (plane.clone(), done.clone(), secret.clone(), org.id.clone());
                let tag = if holds == Holds::Leased { "lease" } else { "hold" };
                tasks.push(tokio::spawn(async move {
                    let mut i = 0u64;
                    while Instant::now() < deadline {
                        let key = plane.store.authenticate(&secret).await?.expect("the bench key");
                        let d = plane.limiter.check(&key.org_id).await?;
                        anyhow::ensure!(d.allowed, "rate-limited: {d:?}");
                        let id = format!("{tag}-{planes}-{p}-{w}-{i}");
                        match holds {
                            Holds::PerRequest => {
                                let hold = NewHold { request_id: id.clone(), org_id: org.clone(), amount: 5_000 };
                                plane.ledger.hold(&hold).await?;
                                plane.ledger.settle(&usage(id, &org)).await?;
                            }
                            Holds::Leased => {
                                let hold = plane.leases.hold(&org, 5_000).await?.map_err(|b| anyhow::anyhow!("{b}"))?;
                                anyhow::ensure!(plane.leases.settle(hold, usage(id, &org)).await, "not settled");
                            }
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                    anyhow::Ok(())
                }));
            }
        }
        for t in tasks {
            t.await??;
        }
        let elapsed = start.elapsed().as_secs_f64();
        let checks: u64 = stack.iter().map(|p| p.limiter.database_checks()).sum::<u64>() - checks_before;
        rates.push((done.load(Ordering::Relaxed) as f64 / elapsed, checks as f64 / elapsed, elapsed));
    }
    let stats: Vec<_> = stack.iter().map(|p| p.leases.stats()).collect();
    for plane in &stack {
        plane.leases.close_all().await?;
    }
    first.ledger().audit().await?;
    let sum = |f: fn(&tessera_control_plane::billing::lease::LeaseStats) -> u64| stats.iter().map(f).sum::<u64>();
    let (renewals, batches, settlements) = (sum(|s| s.renewals), sum(|s| s.batches), sum(|s| s.settlements));
    let leased_s = rates[1].2;
    println!(
        "{}",
        json!({
            "bench": "billing_leases",
            "db": name,
            "control_planes": planes,
            "concurrency_each": args.concurrency,
            "admitted_per_s_per_request_holds": round(rates[0].0),
            "admitted_per_s_leased": round(rates[1].0),
            "ratio": round(rates[1].0 / rates[0].0),
            "lease_renewals_per_s": round(renewals as f64 / leased_s),
            "settlement_batches_per_s": round(batches as f64 / leased_s),
            "settlements_per_batch": round(settlements as f64 / batches.max(1) as f64),
            "rate_limit_db_checks_per_s_per_request_holds": round(rates[0].1),
            "rate_limit_db_checks_per_s_leased": round(rates[1].1),
            "write_transactions_per_s_leased": round((renewals + batches) as f64 / leased_s + rates[1].1),
            "write_transactions_per_s_per_request_holds": round(rates[0].0 * 2.0 + rates[0].1),
        })
    );
    Ok(())
}

/// The most requests one subscription's row admits a second, its plan's concurrency
/// taken by instant requests spread over `control_planes` control planes, each a
/// hold and a settlement on the row. A plan's concurrency caps its rate at
/// concurrency ÷ request time, so the row limits a plan only when its requests take
/// less than `row_bound_below_request_ms`.
async fn plan_row(name: &str, url: &str, args: &Args) -> Result<()> {
    let plan = Plan::Max;
    let first = Db::open(url).await?;
    let user = first.accounts().create_user(&format!("plan-row-{name}@example.com")).await?;
    first.subscriptions(Arc::new(DevProcessor::default())).start(&user.id, plan, DEV_CARD, now_us()).await?;
    let mut planes = Vec::new();
    for p in 0..args.control_planes {
        let db = Db::open(url).await?;
        let owner = format!("cp_plan_row_{name}_{p}");
        planes.push((db.subscriptions(Arc::new(DevProcessor::default())).owned_by(&owner), db.ledger()));
    }
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.seconds);
    let mut tasks = Vec::new();
    for w in 0..plan.concurrency() as usize {
        let (subscriptions, ledger) = planes[w % planes.len()].clone();
        let (done, org) = (done.clone(), user.org_id.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                let id = format!("plan-row-{w}-{i}");
                let admitted = subscriptions.hold(&org, &id, 5_000, now_us()).await?;
                anyhow::ensure!(admitted.is_ok(), "the plan refused a benchmark request: {admitted:?}");
                ledger.settle(&UsageRecord { funding: "subscription".into(), ..usage(id, &org) }).await?;
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    first.ledger().audit().await?;
    println!(
        "{}",
        json!({
            "bench": "billing_plan_row",
            "db": name,
            "control_planes": args.control_planes,
            "plan": plan.as_str(),
            "concurrency": plan.concurrency(),
            "admitted_per_s": round(rate),
            "row_bound_below_request_ms": round(plan.concurrency() as f64 / rate * 1e3),
        })
    );
    Ok(())
}
