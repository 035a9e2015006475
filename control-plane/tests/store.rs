//! The account store's suite, run against both databases it supports: a SQLite file
//! and a real PostgreSQL server (TESSERA_TEST_POSTGRES_URL, or a throwaway one started
//! here from the local PostgreSQL installation).

#[path = "support/postgres.rs"]
mod postgres;

use tessera_control_plane::accounts::{ApiKey, BillingMode, NewKey, StoreError, keys};
use tessera_control_plane::db::{Db, DbError};

async fn suite(db: Db) {
    let store = db.accounts();
    // Migrations ran: the store is empty and usable.
    assert_eq!(store.count_orgs().await.unwrap(), 0);
    let acme = store.create_org("acme").await.unwrap();
    assert!(acme.id.starts_with("org_"));
    let other = store.create_org("other").await.unwrap();
    assert_eq!(store.count_orgs().await.unwrap(), 2);
    assert_eq!(store.find_org("acme").await.unwrap(), acme, "by name");
    assert_eq!(store.find_org(&acme.id).await.unwrap(), acme, "by id");
    assert!(matches!(store.find_org("nobody").await, Err(StoreError::NoOrg(_))));
    assert!(matches!(store.create_org("  ").await, Err(StoreError::Invalid(_))));

    // Subscription billing is for personal accounts only.
    let sub = |org_id| NewKey {
        org_id,
        name: "ci",
        billing_mode: BillingMode::Subscription,
        fallback_to_credits: true,
        created_by: None,
    };
    assert!(matches!(store.create_key(sub("acme")).await, Err(StoreError::Invalid(_))));
    let ada = store.create_user("ada@example.com").await.unwrap();
    assert_eq!(store.find_user("ada@example.com").await.unwrap(), ada);
    assert_eq!(store.find_user(&ada.id).await.unwrap(), ada);
    assert!(matches!(store.create_user("ada@example.com").await, Err(StoreError::Invalid(_))), "one per address");
    assert!(matches!(store.create_user("not an address").await, Err(StoreError::Invalid(_))));
    assert!(matches!(store.find_user("bob@example.com").await, Err(StoreError::NoUser(_))));
    let (personal, _) = store.create_key(sub(&ada.org_id)).await.unwrap();
    assert_eq!((personal.billing_mode, personal.fallback_to_credits), (BillingMode::Subscription, true));
    let credits_with_fallback = NewKey {
        org_id: "acme",
        name: "x",
        billing_mode: BillingMode::Credits,
        fallback_to_credits: true,
        created_by: None,
    };
    assert!(matches!(store.create_key(credits_with_fallback).await, Err(StoreError::Invalid(_))));

    let new = NewKey {
        org_id: "acme",
        name: "ci",
        billing_mode: BillingMode::Credits,
        fallback_to_credits: false,
        created_by: None,
    };
    let (key, secret) = store.create_key(new).await.unwrap();
    assert!(keys::well_formed(&secret));
    assert_eq!((key.org_id.as_str(), key.billing_mode), (acme.id.as_str(), BillingMode::Credits));
    let (other_key, other_secret) = store
        .create_key(NewKey {
            org_id: &other.id,
            name: "x",
            billing_mode: BillingMode::Credits,
            fallback_to_credits: false,
            created_by: None,
        })
        .await
        .unwrap();

    // The secret authenticates its own key, and only that key.
    assert_eq!(store.authenticate(&secret).await.unwrap().unwrap(), key);
    assert_eq!(store.authenticate(&other_secret).await.unwrap().unwrap().id, other_key.id);
    assert_eq!(store.authenticate(&keys::generate().secret).await.unwrap(), None, "unknown well-formed key");
    assert_eq!(store.authenticate("tsk_short").await.unwrap(), None);

    // Listing shows the key and never anything from which to rebuild its secret.
    let listed = store.list_keys(&acme.id).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(listed[0].last_used_at.is_some(), "authenticating records the key's use");
    assert_eq!(ApiKey { last_used_at: None, ..listed[0].clone() }, key);
    assert!(!serde_json::to_string(&listed).unwrap().contains(&secret[4..]));

    // Revocation takes effect on the very next lookup.
    assert!(store.revoke_key(&key.id).await.unwrap());
    assert_eq!(store.authenticate(&secret).await.unwrap(), None);
    assert!(!store.revoke_key(&key.id).await.unwrap(), "already revoked");
    assert!(store.list_keys("acme").await.unwrap()[0].revoked_at.is_some());
    assert!(matches!(store.revoke_key("key_missing").await, Err(StoreError::NoKey(_))));
    assert!(store.authenticate(&other_secret).await.unwrap().is_some(), "other keys unaffected");
}

#[tokio::test]
async fn the_store_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    suite(Db::open(&url).await.unwrap()).await;
    // Reopening runs no migration twice and keeps the data.
    let again = Db::open(&url).await.unwrap();
    assert_eq!(again.accounts().count_orgs().await.unwrap(), 3, "acme, other and ada's own");
}

#[tokio::test]
async fn the_store_on_postgresql() {
    let server = postgres::Server::start();
    suite(Db::open(&server.url).await.unwrap()).await;
    let again = Db::open(&server.url).await.unwrap();
    assert_eq!(again.accounts().count_orgs().await.unwrap(), 3, "acme, other and ada's own");
}

/// Two stores on one database stand for two control-plane processes: a key revoked
/// through one is refused by the other on its very next lookup (no cache to go stale).
async fn revocation_reaches_every_process(a: Db, b: Db) {
    let (a, b) = (a.accounts(), b.accounts());
    a.create_org("shared").await.unwrap();
    let new = NewKey {
        org_id: "shared",
        name: "k",
        billing_mode: BillingMode::Credits,
        fallback_to_credits: false,
        created_by: None,
    };
    let (key, secret) = a.create_key(new).await.unwrap();
    assert!(b.authenticate(&secret).await.unwrap().is_some());
    assert!(a.revoke_key(&key.id).await.unwrap());
    assert_eq!(b.authenticate(&secret).await.unwrap(), None);
    assert_eq!(a.authenticate(&secret).await.unwrap(), None);
}

#[tokio::test]
async fn revocation_across_processes_on_sqlite_and_postgresql() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("t.db").display());
    revocation_reaches_every_process(Db::open(&url).await.unwrap(), Db::open(&url).await.unwrap()).await;
    let server = postgres::Server::start();
    revocation_reaches_every_process(Db::open(&server.url).await.unwrap(), Db::open(&server.url).await.unwrap()).await;
}

#[tokio::test]
async fn unsupported_database_urls_are_refused() {
    assert!(matches!(Db::open("mysql://x").await, Err(DbError::Url(_))));
}
