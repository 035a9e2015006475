//! Budget leases on both databases: control planes admitting one organization's
//! requests against slices of its credit keep the ledger exact (charges equal usage
//! records, no request charged twice, no balance below zero), let a small organization
//! spend its last cent, and give back what a dead control plane held — including one
//! SIGKILLed mid-batch, on PostgreSQL.

#[path = "support/postgres.rs"]
mod postgres;

use sqlx::Row;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;
use tessera_control_plane::billing::lease::{LeaseConfig, Leases};
use tessera_control_plane::billing::ledger::UsageRecord;
use tessera_control_plane::db::Db;

const CONFIG: LeaseConfig = LeaseConfig { seconds_of_spend: 2.0, idle: Duration::from_secs(3600) };

fn usage(request_id: &str, org: &str, cost: u64) -> UsageRecord {
    UsageRecord {
        key_id: "key_test".into(),
        model: "vendor-a/model-a".into(),
        prompt_tokens: 10,
        completion_tokens: 5,
        cost_micros: cost,
        finish_reason: "stop".into(),
        ..UsageRecord::unused(request_id, org)
    }
}

/// What the database says about an organization's money.
struct Books {
    balance: i64,
    revenue: i64,
    usage_cost: i64,
    usage_count: i64,
    charges: i64,
    twice_charged: i64,
    open_leases: i64,
}

async fn books(url: &str, org: &str) -> Books {
    let db = Db::open(url).await.unwrap();
    let pool = sqlx::AnyPool::connect(url).await.unwrap();
    let one = |sql: &'static str| {
        let pool = pool.clone();
        let org = org.to_string();
        async move { sqlx::query(sql).bind(org).fetch_one(&pool).await.unwrap().try_get::<i64, _>(0).unwrap() }
    };
    Books {
        balance: db.ledger().balance(org).await.unwrap(),
        revenue: one("SELECT COALESCE(MAX(balance), 0) FROM ledger_accounts WHERE id = 'revenue:' || $1").await,
        usage_cost: one("SELECT CAST(COALESCE(SUM(cost_micros), 0) AS BIGINT) FROM usage_records WHERE org_id = $1")
            .await,
        usage_count: one("SELECT COUNT(*) FROM usage_records WHERE org_id = $1").await,
        charges: one("SELECT CAST(COALESCE(SUM(amount), 0) AS BIGINT) FROM ledger_transfers WHERE kind = 'charge' \
             AND to_account = 'revenue:' || $1")
        .await,
        twice_charged: one("SELECT COUNT(*) FROM (SELECT request_id FROM ledger_transfers WHERE kind = 'charge' \
             AND to_account = 'revenue:' || $1 GROUP BY request_id HAVING COUNT(*) > 1) AS t")
        .await,
        open_leases: one("SELECT COUNT(*) FROM budget_leases WHERE org_id = $1 AND closed_at IS NULL").await,
    }
}

/// The ledger's invariants for an organization granted `granted`, once no lease is open.
async fn exact(url: &str, org: &str, granted: i64) -> Books {
    let b = books(url, org).await;
    assert_eq!(b.open_leases, 0);
    assert_eq!(b.revenue, b.usage_cost, "revenue equals the usage records' costs");
    assert_eq!(b.charges, b.usage_cost, "charges equal the usage records' costs");
    assert_eq!(b.twice_charged, 0, "no request charged twice");
    assert_eq!(b.balance + b.revenue, granted, "what is not charged is still the organization's");
    assert!(b.balance >= 0);
    Db::open(url).await.unwrap().ledger().audit().await.unwrap();
    b
}

/// Two control planes (two pools, two owners) admit 400 requests of one organization
/// at once against leases; the credit covers a fraction of their worst cases.
async fn two_control_planes_stay_exact(url: &str) {
    let (a, b) = (Db::open(url).await.unwrap(), Db::open(url).await.unwrap());
    let org = a.accounts().create_org("acme").await.unwrap().id;
    const GRANTED: i64 = 1_000_000;
    a.ledger().grant(&org, GRANTED as u64, "test").await.unwrap();
    let (la, lb) = (a.ledger().leases("cp_a", CONFIG), b.ledger().leases("cp_b", CONFIG));
    let mut tasks = Vec::new();
    for i in 0..400u64 {
        let leases = if i % 2 == 0 { la.clone() } else { lb.clone() };
        let org = org.clone();
        tasks.push(tokio::spawn(async move {
            let worst = 5_000 + (i * 7_919) % 10_000;
            match leases.hold(&org, worst).await.unwrap() {
                Ok(hold) => {
                    // Settled for a part of its worst case, up to all of it.
                    let written = leases.settle(hold, usage(&format!("r{i}"), &org, worst * (i % 5) / 4)).await;
                    (true, written)
                }
                Err(balance) => {
                    assert!(balance < worst as i64, "refused {worst} with {balance} left");
                    (false, false)
                }
            }
        }));
    }
    let (mut admitted, mut written) = (0, 0);
    for t in tasks {
        let (a, w) = t.await.unwrap();
        admitted += a as u32;
        written += w as u32;
    }
    assert!(admitted > 50 && admitted < 400, "{admitted} admitted: the credit covers some, not all");
    assert_eq!(written, admitted);
    la.close_all().await.unwrap();
    lb.close_all().await.unwrap();
    let books = exact(url, &org, GRANTED).await;
    assert_eq!(books.usage_count, admitted as i64);
}

/// One control plane, an organization with $0.001: requests until its last micro-dollar.
async fn a_small_organization_sees_its_last_cent(url: &str) {
    let db = Db::open(url).await.unwrap();
    let org = db.accounts().create_org("small").await.unwrap().id;
    db.ledger().grant(&org, 1_000, "test").await.unwrap();
    let (a, b) = (db.ledger().leases("cp_a", CONFIG), db.ledger().leases("cp_b", CONFIG));
    assert!(a.hold(&org, 0).await.is_err(), "a free request takes a hold of its own, not a lease");
    let mut spent = 0;
    for i in 0..3 {
        let hold = a.hold(&org, 300).await.unwrap().expect("300 of 1,000 is covered");
        assert!(a.settle(hold, usage(&format!("s{i}"), &org, 300)).await);
        spent += 300;
    }
    assert_eq!(a.hold(&org, 101).await.unwrap().err(), Some(100), "101 is refused, and 100 is what is left");
    // The other control plane finds the last 100 once the first returns its idle lease.
    a.return_idle(Duration::ZERO).await.unwrap();
    let hold = b.hold(&org, 100).await.unwrap().expect("the last 100 micro-dollars");
    assert!(b.settle(hold, usage("s3", &org, 100)).await);
    spent += 100;
    assert_eq!(b.hold(&org, 1).await.unwrap().err(), Some(0));
    b.close_all().await.unwrap();
    let books = exact(url, &org, 1_000).await;
    assert_eq!((books.balance, books.revenue), (1_000 - spent, spent));
}

/// A control plane that stops beating its heart: another expires its lease, returning
/// what it held (its unsettled requests included), and a settlement that arrives after
/// is refused rather than charged against credit already returned.
async fn a_dead_control_planes_lease_expires(url: &str) {
    let db = Db::open(url).await.unwrap();
    let ledger = db.ledger();
    let org = db.accounts().create_org("orphan").await.unwrap().id;
    ledger.grant(&org, 100_000, "test").await.unwrap();
    let dead = ledger.leases("cp_dead", CONFIG);
    ledger.heartbeat("cp_dead", 1_000).await.unwrap();
    ledger.heartbeat("cp_alive", 5_000).await.unwrap();
    let settled = dead.hold(&org, 10_000).await.unwrap().unwrap();
    assert!(dead.settle(settled, usage("d0", &org, 4_000)).await);
    let late = dead.hold(&org, 10_000).await.unwrap().unwrap();
    assert_eq!(books(url, &org).await.open_leases, 1);

    assert_eq!(ledger.release_orphaned(2_000).await.unwrap(), 1, "one lease expired");
    assert_eq!(ledger.release_orphaned(2_000).await.unwrap(), 0, "and only once");
    let books = exact(url, &org, 100_000).await;
    assert_eq!((books.balance, books.usage_count), (96_000, 1));
    assert!(!dead.settle(late, usage("d1", &org, 9_000)).await, "refused after its lease expired");
    let books = exact(url, &org, 100_000).await;
    assert_eq!((books.balance, books.usage_count), (96_000, 1), "and not charged");
    // Its next admission starts a new lease rather than spend the expired one.
    let hold = dead.hold(&org, 1_000).await.unwrap().unwrap();
    assert!(dead.settle(hold, usage("d2", &org, 1_000)).await);
    // A replay of a settled request (another hold under its id) is not charged again.
    let hold = dead.hold(&org, 500).await.unwrap().unwrap();
    dead.settle(hold, usage("d0", &org, 500)).await;
    dead.close_all().await.unwrap();
    let books = exact(url, &org, 100_000).await;
    assert_eq!((books.balance, books.usage_count), (95_000, 2));
}

#[tokio::test]
async fn leases_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    two_control_planes_stay_exact(&url).await;
    a_small_organization_sees_its_last_cent(&url).await;
    a_dead_control_planes_lease_expires(&url).await;
}

#[tokio::test]
async fn leases_on_postgresql() {
    let server = postgres::Server::start();
    two_control_planes_stay_exact(&server.url).await;
    a_small_organization_sees_its_last_cent(&server.url).await;
    a_dead_control_planes_lease_expires(&server.url).await;
}

/// The crash test: a control plane in another process admits and settles one
/// organization's requests against its lease on PostgreSQL, as fast as it can, and is
/// SIGKILLed mid-stream — holds in flight, a batch perhaps half written. Another
/// control plane then expires its lease, and the ledger is exact.
#[test]
fn a_sigkilled_control_plane_loses_and_doubles_nothing() {
    let server = postgres::Server::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    const GRANTED: i64 = 50_000_000;
    let org = rt.block_on(async {
        let db = Db::open(&server.url).await.unwrap();
        let org = db.accounts().create_org("crash").await.unwrap().id;
        db.ledger().grant(&org, GRANTED as u64, "test").await.unwrap();
        org
    });
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "lease_holder", "--nocapture", "--test-threads=1"])
        .env("TESSERA_LEASE_HOLDER", format!("{}\n{org}", server.url))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // It says when it has settled 2,000 requests, then goes on.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().contains("lease holder: settled 2000")), "the holder never got going");
    child.kill().unwrap();
    child.wait().unwrap();

    rt.block_on(async {
        let db = Db::open(&server.url).await.unwrap();
        let before = books(&server.url, &org).await;
        assert_eq!(before.open_leases, 1, "the killed process's lease is still open");
        // Nobody has beaten a heart since the kill: now it is dead.
        let ledger = db.ledger();
        ledger.heartbeat("cp_survivor", tessera_control_plane::limits::now_us()).await.unwrap();
        assert_eq!(ledger.release_orphaned(tessera_control_plane::limits::now_us() - 1).await.unwrap(), 1);
        let after = exact(&server.url, &org, GRANTED).await;
        assert!(after.usage_count >= 2_000, "{} settled", after.usage_count);
        assert!(after.balance > 0 && after.balance < GRANTED);
    });
}

/// The process the crash test kills (does nothing unless that test started it).
#[tokio::test]
async fn lease_holder() {
    let Ok(spec) = std::env::var("TESSERA_LEASE_HOLDER") else { return };
    let (url, org) = spec.split_once('\n').unwrap();
    let db = Db::open(url).await.unwrap();
    let owner = "cp_doomed";
    db.ledger().heartbeat(owner, tessera_control_plane::limits::now_us()).await.unwrap();
    let leases: Leases = db.ledger().leases(owner, CONFIG);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for worker in 0..16u64 {
        let (leases, org, tx) = (leases.clone(), org.to_string(), tx.clone());
        tokio::spawn(async move {
            for i in 0.. {
                let hold = leases.hold(&org, 1_000).await.unwrap().expect("credit for a long while");
                if leases.settle(hold, usage(&format!("w{worker}-{i}"), &org, 100 + i % 900)).await {
                    let _ = tx.send(());
                }
            }
        });
    }
    let mut settled = 0;
    while rx.recv().await.is_some() {
        settled += 1;
        if settled == 2_000 {
            println!("lease holder: settled 2000");
        }
    }
}
