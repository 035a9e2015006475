//! The credit ledger on both databases: holds never overdraw an organization however
//! many control planes admit requests at once, each hold settles exactly once, and the
//! books always balance to zero.

#[path = "support/postgres.rs"]
mod postgres;

use tessera_control_plane::billing::ledger::{Admission, NewHold, UsageRecord};
use tessera_control_plane::db::Db;

fn usage(request_id: &str, cost: u64) -> UsageRecord {
    UsageRecord {
        key_id: "key_test".into(),
        model: "vendor-a/model-a".into(),
        prompt_tokens: 10,
        completion_tokens: 5,
        cost_micros: cost,
        finish_reason: "stop".into(),
        ..UsageRecord::unused(request_id, "")
    }
}

fn hold(request_id: &str, org: &str, amount: u64) -> NewHold {
    NewHold { request_id: request_id.into(), org_id: org.into(), amount }
}

async fn settles_exactly_once(db: Db) {
    let store = db.accounts();
    let ledger = db.ledger();
    let org = store.create_org("acme").await.unwrap();
    assert_eq!(ledger.balance(&org.id).await.unwrap(), 0);
    assert_eq!(ledger.hold(&hold("r0", &org.id, 1)).await.unwrap(), Admission::Insufficient { balance: 0 });
    ledger.grant(&org.id, 1_000, "test").await.unwrap();
    assert_eq!(ledger.hold(&hold("r1", &org.id, 600)).await.unwrap(), Admission::Held);
    assert_eq!((ledger.balance(&org.id).await.unwrap(), ledger.held(&org.id).await.unwrap()), (400, 600));
    assert_eq!(ledger.hold(&hold("r2", &org.id, 401)).await.unwrap(), Admission::Insufficient { balance: 400 });

    // Settled to its exact cost, once: a replay changes nothing.
    assert!(ledger.settle(&usage("r1", 250)).await.unwrap());
    assert!(!ledger.settle(&usage("r1", 250)).await.unwrap());
    assert!(!ledger.settle(&usage("r1", 10)).await.unwrap(), "not even with other numbers");
    assert_eq!((ledger.balance(&org.id).await.unwrap(), ledger.held(&org.id).await.unwrap()), (750, 0));
    let records = ledger.usage(&org.id, 10).await.unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!((records[0].cost_micros, records[0].org_id.as_str()), (250, org.id.as_str()));

    // A cost above the hold (which a correct worst case never allows) is capped by it.
    ledger.hold(&hold("r3", &org.id, 100)).await.unwrap();
    ledger.settle(&usage("r3", 5_000)).await.unwrap();
    assert_eq!(ledger.balance(&org.id).await.unwrap(), 650);

    // A hold its control plane never settled goes back to the organization.
    ledger.hold(&hold("r4", &org.id, 300)).await.unwrap();
    assert_eq!(ledger.release_stale(3600).await.unwrap(), 0, "too young to be stale");
    assert_eq!(ledger.release_stale(-1).await.unwrap(), 1);
    assert_eq!(ledger.balance(&org.id).await.unwrap(), 650);
    assert!(!ledger.settle(&usage("r4", 1)).await.unwrap(), "released is settled");
    ledger.audit().await.unwrap();
}

/// Two stores on one database stand for two control-plane processes: separate
/// connection pools, one set of rows.
async fn never_overdraws_under_concurrent_admission(a: Db, b: Db) {
    const WORST: u64 = 7_777;
    let org = a.accounts().create_org("burst").await.unwrap();
    a.ledger().grant(&org.id, 50 * WORST + WORST / 2, "covers 50 worst cases").await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let ledger = if i % 2 == 0 { a.ledger() } else { b.ledger() };
        let org = org.id.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("burst-{i}");
            (id.clone(), ledger.hold(&hold(&id, &org, WORST)).await.unwrap())
        }));
    }
    let mut admitted = Vec::new();
    for t in tasks {
        let (id, admission) = t.await.unwrap();
        if admission == Admission::Held {
            admitted.push(id);
        }
    }
    assert_eq!(admitted.len(), 50, "exactly the 50 the balance covers");
    let ledger = b.ledger();
    assert_eq!(ledger.balance(&org.id).await.unwrap(), (WORST / 2) as i64, "never below zero");
    // Each settles to part of its hold, from either process, some twice.
    for (i, id) in admitted.iter().enumerate() {
        let settler = if i % 3 == 0 { a.ledger() } else { b.ledger() };
        assert!(settler.settle(&usage(id, 1_000 + i as u64)).await.unwrap());
        assert!(!ledger.settle(&usage(id, 1)).await.unwrap());
    }
    let spent: u64 = (0..50).map(|i| 1_000 + i as u64).sum();
    let expected = (50 * WORST + WORST / 2 - spent) as i64;
    assert_eq!((ledger.balance(&org.id).await.unwrap(), ledger.held(&org.id).await.unwrap()), (expected, 0));
    assert_eq!(ledger.usage(&org.id, 1000).await.unwrap().len(), 50, "one usage record per request");
    ledger.audit().await.unwrap();
}

/// A purchase named by a key is charged and granted once: asked again, even through a
/// processor that has forgotten the key (a restart, an expired key), it takes nothing
/// more; the same name with another amount is refused; a processor that does not
/// answer grants nothing, and the retry under the same name then buys once.
async fn purchases_happen_once(db: Db) {
    let store = db.accounts();
    use tessera_control_plane::billing::LedgerError;
    use tessera_control_plane::billing::payments::{DEV_CARD, DEV_CARD_UNREACHABLE, DevProcessor, PaymentError};
    let ledger = db.ledger();
    let org = store.create_org("buyer").await.unwrap();
    let first = ledger.purchase_once(&DevProcessor::default(), &org.id, 5_000_000, DEV_CARD, "p:1").await.unwrap();
    let again = ledger.purchase_once(&DevProcessor::default(), &org.id, 5_000_000, DEV_CARD, "p:1").await.unwrap();
    assert_eq!(again, first, "the recorded purchase, not a new charge");
    assert_eq!(ledger.balance(&org.id).await.unwrap(), 5_000_000);
    let other = ledger.purchase_once(&DevProcessor::default(), &org.id, 6_000_000, DEV_CARD, "p:1").await;
    assert!(matches!(other, Err(LedgerError::Invalid(_))), "{other:?}");
    let lost = ledger.purchase_once(&DevProcessor::default(), &org.id, 1_000_000, DEV_CARD_UNREACHABLE, "p:2").await;
    assert!(matches!(lost, Err(LedgerError::Payment(PaymentError::Unavailable(_)))), "{lost:?}");
    assert_eq!(ledger.balance(&org.id).await.unwrap(), 5_000_000, "nothing granted without a payment");
    ledger.audit().await.unwrap();
}

#[tokio::test]
async fn the_ledger_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    settles_exactly_once(Db::open(&url).await.unwrap()).await;
    purchases_happen_once(Db::open(&url).await.unwrap()).await;
    never_overdraws_under_concurrent_admission(Db::open(&url).await.unwrap(), Db::open(&url).await.unwrap()).await;
}

#[tokio::test]
async fn the_ledger_on_postgresql() {
    let server = postgres::Server::start();
    settles_exactly_once(Db::open(&server.url).await.unwrap()).await;
    purchases_happen_once(Db::open(&server.url).await.unwrap()).await;
    never_overdraws_under_concurrent_admission(
        Db::open(&server.url).await.unwrap(),
        Db::open(&server.url).await.unwrap(),
    )
    .await;
}
