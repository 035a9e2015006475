//! GET /status's per-minute aggregates on both databases: two control planes adding to
//! the same minute's row are summed, windows sum their minutes, and old minutes go.

#[path = "support/postgres.rs"]
mod postgres;

use tessera_control_plane::db::Db;
use tessera_control_plane::status::Counts;

async fn suite(a: Db, b: Db) {
    let (a, b) = (a.status_minutes(), b.status_minutes());
    assert_eq!(a.newest().await.unwrap(), None, "nothing written yet");
    assert!(a.sums_since(0).await.unwrap().is_empty());
    let one = Counts {
        requests: 2,
        failures: 1,
        ttfb_samples: 2,
        ttfb_us: 300_000,
        tps_samples: 1,
        decode_tokens: 40,
        decode_us: 1_000_000,
    };
    a.add(100, "m", &one, 6_000_000_000).await.unwrap();
    b.add(100, "m", &one, 6_001_000_000).await.unwrap();
    a.add(90, "m", &one, 5_400_000_000).await.unwrap();
    // A late write to the same row (an older clock) does not move its time back.
    a.add(100, "m", &Counts::default(), 5_000_000_000).await.unwrap();
    a.add(100, "other", &Counts::default(), 5_000_000_000).await.unwrap();

    let mut two = one;
    two.add(&one);
    assert_eq!(b.sums_since(95).await.unwrap()["m"], two, "both processes' counts, in one row");
    let mut three = two;
    three.add(&one);
    let all = a.sums_since(0).await.unwrap();
    assert_eq!((all["m"], all["other"]), (three, Counts::default()));
    assert_eq!(a.newest().await.unwrap(), Some(6_001_000_000));

    assert_eq!(a.prune(95).await.unwrap(), 1);
    assert_eq!(b.sums_since(0).await.unwrap()["m"], two);
}

#[tokio::test]
async fn status_minutes_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    suite(Db::open(&url).await.unwrap(), Db::open(&url).await.unwrap()).await;
}

#[tokio::test]
async fn status_minutes_on_postgresql() {
    let server = postgres::Server::start();
    suite(Db::open(&server.url).await.unwrap(), Db::open(&server.url).await.unwrap()).await;
}
