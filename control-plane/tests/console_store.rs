//! The console's part of the account store, on both databases: memberships and the
//! last-owner rule, invites (accepted once, by the invited address only, not after
//! expiry or cancellation; a resend replaces the code), sessions and their lifetimes,
//! one-time links, and what is stored of each secret (hashes only).

#[path = "support/postgres.rs"]
mod postgres;

use tessera_control_plane::accounts::{Acceptance, InviteState, Lifetimes, LinkPurpose, MemberChange, Role, keys};
use tessera_control_plane::capacity::{self, RequestStatus};
use tessera_control_plane::db::Db;

const LIVE: Lifetimes = Lifetimes { idle: 3600, absolute: 86_400 };

async fn suite(db: Db) {
    let store = db.accounts();
    let owner = store.create_user_with_password("Owner@Example.com", Some("$argon2id$fake")).await.unwrap();
    assert_eq!(owner.email, "owner@example.com", "addresses are kept in lower case");
    let personal = store.memberships(&owner.id).await.unwrap();
    assert_eq!(personal.len(), 1);
    assert!(personal[0].personal && personal[0].role == Role::Owner, "everyone owns their personal organization");
    let acme = store.create_org_owned_by("Acme", &owner.id).await.unwrap();
    let mine = store.memberships(&owner.id).await.unwrap();
    assert_eq!(
        mine.iter().map(|m| (m.org.name.as_str(), m.personal)).collect::<Vec<_>>(),
        [("owner@example.com", true), ("Acme", false)]
    );

    // Invites: refused for personal organizations and for members; one pending per address.
    assert!(store.create_invite(&owner.org_id, "x@example.com", Role::Member, &owner.id, 60).await.is_err());
    assert!(store.create_invite(&acme.id, "owner@example.com", Role::Member, &owner.id, 60).await.is_err());
    assert!(store.create_invite(&acme.id, "not an address", Role::Member, &owner.id, 60).await.is_err());
    let (invite, code) = store.create_invite(&acme.id, "Bea@Example.com", Role::Member, &owner.id, 60).await.unwrap();
    assert_eq!(invite.email, "bea@example.com");
    assert!(store.create_invite(&acme.id, "bea@example.com", Role::Owner, &owner.id, 60).await.is_err(), "pending");
    // Only the code's hash is stored, and a resend replaces it.
    assert!(store.invite_by_code(&keys::hash(&code)).await.unwrap().is_none());
    let (_, new_code) = store.resend_invite(&acme.id, &invite.id, 60).await.unwrap().unwrap();
    assert!(store.invite_by_code(&code).await.unwrap().is_none(), "the old code no longer opens it");

    let bea = store.create_user("bea@example.com").await.unwrap();
    let carl = store.create_user("carl@example.com").await.unwrap();
    assert_eq!(store.accept_invite(&new_code, &carl.id).await.unwrap(), Acceptance::OtherEmail);
    assert_eq!(store.accept_invite("nonsense", &bea.id).await.unwrap(), Acceptance::Unknown);
    assert!(
        matches!(store.accept_invite(&new_code, &bea.id).await.unwrap(), Acceptance::Joined(org) if org.id == acme.id)
    );
    assert_eq!(
        store.accept_invite(&new_code, &bea.id).await.unwrap(),
        Acceptance::NotPending(InviteState::Accepted),
        "single use"
    );
    assert_eq!(store.membership(&bea.id, &acme.id).await.unwrap().unwrap().role, Role::Member);
    assert!(store.membership(&carl.id, &acme.id).await.unwrap().is_none());

    // Expired and cancelled invites apply nothing.
    let (expired, code) = store.create_invite(&acme.id, "carl@example.com", Role::Owner, &owner.id, 0).await.unwrap();
    assert_eq!(store.accept_invite(&code, &carl.id).await.unwrap(), Acceptance::NotPending(InviteState::Expired));
    assert!(store.cancel_invite(&acme.id, &expired.id).await.unwrap());
    assert!(store.resend_invite(&acme.id, &expired.id, 60).await.unwrap().is_none(), "cancelled: not resent");
    let (dan, code) = store.create_invite(&acme.id, "carl@example.com", Role::Owner, &owner.id, 60).await.unwrap();
    assert!(store.cancel_invite(&acme.id, &dan.id).await.unwrap());
    assert!(!store.cancel_invite(&acme.id, &dan.id).await.unwrap(), "once");
    assert_eq!(store.accept_invite(&code, &carl.id).await.unwrap(), Acceptance::NotPending(InviteState::Cancelled));
    assert!(store.membership(&carl.id, &acme.id).await.unwrap().is_none());

    // The last owner stays.
    assert_eq!(store.set_role(&acme.id, &owner.id, Role::Member).await.unwrap(), MemberChange::LastOwner);
    assert_eq!(store.remove_member(&acme.id, &owner.id).await.unwrap(), MemberChange::LastOwner);
    assert_eq!(store.set_role(&acme.id, &bea.id, Role::Owner).await.unwrap(), MemberChange::Done);
    assert_eq!(store.set_role(&acme.id, &owner.id, Role::Member).await.unwrap(), MemberChange::Done);
    assert_eq!(store.owner_count(&acme.id).await.unwrap(), 1);
    assert_eq!(store.remove_member(&acme.id, &carl.id).await.unwrap(), MemberChange::NotAMember);
    assert_eq!(store.remove_member(&acme.id, &owner.id).await.unwrap(), MemberChange::Done);
    assert!(store.membership(&owner.id, &acme.id).await.unwrap().is_none());

    // Sessions: found by token while alive; ended by sign-out, by a password change, and by age.
    let token = store.start_session(&bea.id).await.unwrap();
    assert!(store.session(&keys::hash(&token), LIVE).await.unwrap().is_none(), "the stored hash is no token");
    assert_eq!(store.session(&token, LIVE).await.unwrap().unwrap().user.id, bea.id);
    store.end_session(&token).await.unwrap();
    assert!(store.session(&token, LIVE).await.unwrap().is_none());
    let (a, b) = (store.start_session(&bea.id).await.unwrap(), store.start_session(&bea.id).await.unwrap());
    store.set_password(&bea.id, "$argon2id$new").await.unwrap();
    assert!(store.session(&a, LIVE).await.unwrap().is_none() && store.session(&b, LIVE).await.unwrap().is_none());
    assert_eq!(store.user_with_password("BEA@example.com").await.unwrap().unwrap().1.as_deref(), Some("$argon2id$new"));
    let old = store.start_session(&bea.id).await.unwrap();
    assert!(store.session(&old, Lifetimes { idle: -1, absolute: 86_400 }).await.unwrap().is_none(), "idle");
    assert!(store.session(&old, LIVE).await.unwrap().is_none(), "ended for good");
    let old = store.start_session(&bea.id).await.unwrap();
    assert!(store.session(&old, Lifetimes { idle: 3600, absolute: -1 }).await.unwrap().is_none(), "absolute");

    // One-time links: a newer one replaces the older; each works once.
    let purpose = LinkPurpose::Owner { org_id: acme.id.clone() };
    let first = store.create_link(&purpose, 3600).await.unwrap();
    let second = store.create_link(&purpose, 3600).await.unwrap();
    assert_eq!(store.link(&first).await.unwrap(), None);
    assert_eq!(store.link(&second).await.unwrap(), Some(purpose));
    assert!(store.use_link(&second).await.unwrap());
    assert!(!store.use_link(&second).await.unwrap());
    let expired = store.create_link(&LinkPurpose::Password { user_id: carl.id.clone() }, 0).await.unwrap();
    assert_eq!(store.link(&expired).await.unwrap(), None);

    // Known devices are per account.
    let device = store.remember_device(&bea.id).await.unwrap();
    assert!(store.known_device(&device, "bea@example.com").await.unwrap());
    assert!(!store.known_device(&device, "carl@example.com").await.unwrap());

    // Capacity requests: stored as received, listed per organization, moved along.
    let form = capacity::Form {
        gpu_type: "H200 141GB SXM".into(),
        topology: "bare_metal".into(),
        nodes: "2".into(),
        region: "us-east".into(),
        start_date: "2099-01-01".into(),
        term_months: "6".into(),
        contact_name: "Bea".into(),
        contact_email: "bea@example.com".into(),
        ..Default::default()
    };
    let wanted = form.check(tessera_control_plane::calendar::days_from_civil(2098, 12, 1)).unwrap();
    let requests = db.capacity_requests();
    let made = requests.create(&acme.id, &bea.id, &wanted).await.unwrap();
    requests.create(&bea.org_id, &bea.id, &wanted).await.unwrap();
    let listed = requests.list(Some(&acme.id)).await.unwrap();
    assert_eq!(listed, std::slice::from_ref(&made), "one organization's only");
    assert_eq!(requests.list(None).await.unwrap().len(), 2);
    assert_eq!((made.wanted.gpus, made.status), (16, RequestStatus::Received));
    assert!(requests.set_status(&made.id, RequestStatus::Quoted).await.unwrap());
    assert!(!requests.set_status("cap_nope", RequestStatus::Closed).await.unwrap());
    assert_eq!(requests.get(&made.id).await.unwrap().unwrap().status, RequestStatus::Quoted);
}

#[tokio::test]
async fn the_console_store_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    suite(Db::open(&format!("sqlite://{}", dir.path().join("t.db").display())).await.unwrap()).await;
}

#[tokio::test]
async fn the_console_store_on_postgresql() {
    let server = postgres::Server::start();
    suite(Db::open(&server.url).await.unwrap()).await;
}

/// Two owners demoting each other at once, many times over, on PostgreSQL (where two
/// transactions really run side by side): the organization always keeps an owner.
#[tokio::test]
async fn concurrent_demotions_never_leave_an_organization_without_owner() {
    let server = postgres::Server::start();
    let store = Db::open(&server.url).await.unwrap().accounts();
    let a = store.create_user("a@example.com").await.unwrap();
    let b = store.create_user("b@example.com").await.unwrap();
    for round in 0..20 {
        let org = store.create_org_owned_by(&format!("org {round}"), &a.id).await.unwrap();
        store.add_owner(&org.id, &b.id).await.unwrap();
        let (x, y) =
            tokio::join!(store.set_role(&org.id, &a.id, Role::Member), store.set_role(&org.id, &b.id, Role::Member));
        let done = [x.unwrap(), y.unwrap()].iter().filter(|c| **c == MemberChange::Done).count();
        assert_eq!(done, 1, "round {round}");
        assert_eq!(store.owner_count(&org.id).await.unwrap(), 1, "round {round}");
    }
}
