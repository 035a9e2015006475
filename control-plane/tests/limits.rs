//! Request rate limits on both databases, with an injected clock: one limit however many
//! control planes share the database, the burst and the steady rate as configured, and a
//! retry after the advertised wait succeeds.

#[path = "support/postgres.rs"]
mod postgres;

use tessera_control_plane::db::Db;
use tessera_control_plane::limits::RateConfig;

const CONFIG: RateConfig = RateConfig { default_rpm: 200, burst: 20 };
const T0: i64 = 1_800_000_000_000_000;

async fn one_limit_across_processes(a: Db, b: Db) {
    let org = a.accounts().create_org("busy").await.unwrap();
    let (la, lb) = (a.rate_limiter(CONFIG), b.rate_limiter(CONFIG));
    // 1,000 requests over one minute, alternating between the two control planes.
    let mut allowed = 0;
    for i in 0..1000i64 {
        let limiter = if i % 2 == 0 { &la } else { &lb };
        let d = limiter.check_at(&org.id, T0 + i * 60_000).await.unwrap();
        if d.allowed {
            allowed += 1;
        } else {
            assert!(d.retry_after_us > 0 && d.retry_after_us <= 300_000, "{d:?}");
        }
        assert_eq!(d.limit, 200);
    }
    assert!((200..=200 + 20).contains(&allowed), "{allowed} admitted in a minute");

    // A burst from quiet: exactly `burst` at once, then a refusal whose wait is enough.
    let org = a.accounts().create_org("bursty").await.unwrap();
    let t = T0 + 3_600_000_000;
    for i in 0..20 {
        let d = la.check_at(&org.id, t).await.unwrap();
        assert!(d.allowed, "request {i} of the burst");
        assert_eq!(d.remaining, 19 - i);
    }
    let refused = lb.check_at(&org.id, t).await.unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.retry_after_us, 300_000, "one emission interval: 60 s / 200");
    assert!(!la.check_at(&org.id, t + refused.retry_after_us as i64 - 1).await.unwrap().allowed, "not before");
    assert!(lb.check_at(&org.id, t + refused.retry_after_us as i64).await.unwrap().allowed, "the retry passes");

    // An organization's own limit, seen by the other process at once.
    assert!(la.set_org_rpm(&org.id, Some(6)).await.unwrap());
    let d = lb.check_at(&org.id, t + 3_600_000_000).await.unwrap();
    assert_eq!((d.allowed, d.limit), (true, 6));
    assert!(la.set_org_rpm(&org.id, None).await.unwrap());
    assert_eq!(lb.check_at(&org.id, t + 7_200_000_000).await.unwrap().limit, 200);
}

#[tokio::test]
async fn rate_limits_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    one_limit_across_processes(Db::open(&url).await.unwrap(), Db::open(&url).await.unwrap()).await;
}

#[tokio::test]
async fn rate_limits_on_postgresql() {
    let server = postgres::Server::start();
    one_limit_across_processes(Db::open(&server.url).await.unwrap(), Db::open(&server.url).await.unwrap()).await;
}

/// An organization far above 1,200 rpm takes its tokens in batches (up to half the
/// burst, 10 here): below its limit, two control planes admit every request with a
/// tenth of the decisions going to the database; far above it, they admit within the
/// limit plus n − 1 each.
async fn fast_organizations_lease_tokens(a: Db, b: Db) {
    let org = a.accounts().create_org("fast").await.unwrap();
    let (la, lb) = (a.rate_limiter(CONFIG), b.rate_limiter(CONFIG));
    // 2,000 requests a second: one every 500 µs.
    assert!(la.set_org_rpm(&org.id, Some(120_000)).await.unwrap());
    // Arrivals for `seconds` at `per_sec`, alternating between the control planes,
    // from `t`: how many were admitted.
    let run = async |t: i64, seconds: i64, per_sec: i64| {
        let mut allowed = 0u32;
        for i in 0..seconds * per_sec {
            let limiter = if i % 2 == 0 { &la } else { &lb };
            let d = limiter.check_at(&org.id, t + i * 1_000_000 / per_sec).await.unwrap();
            allowed += d.allowed as u32;
            assert_eq!(d.limit, 120_000);
        }
        allowed
    };
    let t = T0 + 24 * 3_600_000_000;
    // Half the limit for two seconds: nobody refused.
    assert_eq!(run(t, 2, 1_000).await, 2_000, "a request refused below the limit");
    let checks = la.database_checks() + lb.database_checks();
    assert!(checks * 5 <= 2_000, "{checks} database decisions for 2,000 admissions");
    // Three times the limit for two seconds: the limit holds, within 9 per control plane.
    let allowed = run(t + 10_000_000, 2, 6_000).await;
    let bound = 2 * 2_000 + 20;
    assert!(allowed <= bound + 2 * 9, "{allowed} admitted in 2 s; the bound is {bound} + 2 × 9");
    assert!(allowed >= 3_900, "{allowed} admitted in 2 s: leased tokens lapsed unused");
}

#[tokio::test]
async fn token_leases_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    fast_organizations_lease_tokens(Db::open(&url).await.unwrap(), Db::open(&url).await.unwrap()).await;
}

#[tokio::test]
async fn token_leases_on_postgresql() {
    let server = postgres::Server::start();
    fast_organizations_lease_tokens(Db::open(&server.url).await.unwrap(), Db::open(&server.url).await.unwrap()).await;
}

/// The real clock's path, with the next lease taken in the background at half spent:
/// two control planes asking as fast as they can admit no more than the limit over the
/// time they took, plus the burst, plus fewer than 1.5 n (n = 10) each.
async fn leases_taken_ahead_hold_the_limit(a: Db, b: Db) {
    let org = a.accounts().create_org("ahead").await.unwrap();
    let (la, lb) = (a.rate_limiter(CONFIG), b.rate_limiter(CONFIG));
    assert!(la.set_org_rpm(&org.id, Some(120_000)).await.unwrap());
    let start = std::time::Instant::now();
    let mut allowed = 0u64;
    for i in 0..4_000 {
        let limiter = if i % 2 == 0 { &la } else { &lb };
        allowed += limiter.check(&org.id).await.unwrap().allowed as u64;
    }
    let elapsed = start.elapsed().as_secs_f64();
    // The TAT's start may lie up to one burst before the first request.
    let bound = (elapsed * 2_000.0).ceil() as u64 + 20 + 2 * 15;
    assert!(allowed <= bound, "{allowed} admitted in {elapsed:.3} s; the bound is {bound}");
    assert!(allowed >= 20, "{allowed} admitted: not even the burst");
}

#[tokio::test]
async fn leases_ahead_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    leases_taken_ahead_hold_the_limit(Db::open(&url).await.unwrap(), Db::open(&url).await.unwrap()).await;
}

#[tokio::test]
async fn leases_ahead_on_postgresql() {
    let server = postgres::Server::start();
    leases_taken_ahead_hold_the_limit(Db::open(&server.url).await.unwrap(), Db::open(&server.url).await.unwrap()).await;
}
