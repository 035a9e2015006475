//! The router's pool over two real workers serving the real model: tenants, each with a
//! long prompt prefix of its own, spread over both replicas when they arrive together,
//! and each tenant's later requests go to the replica that caches its prefix (known from
//! the replicas' own cache events); a replica that dies leaves routing at once.

use std::sync::Arc;
use std::time::Duration;
use tessera_control_plane::router::choice::Weights;
use tessera_control_plane::router::{Dispatch, Pool, Replica};
use tessera_e2e::serve_worker;
use tessera_proto::block_hash::BLOCK_TOKENS;
use tessera_proto::worker::{self as pb};

/// Tenant `t`'s prefix (20 blocks) and a request-specific tail.
fn prompt(t: u32, request: u32) -> Vec<u32> {
    let prefix = (0..20 * BLOCK_TOKENS as u32).map(|i| 1000 + (t * 7919 + i * 31) % 40_000);
    prefix.chain([200 + request, 300 + t]).collect()
}

/// Runs one request to its end on `replica`.
async fn generate(replica: &Replica, prompt: Vec<u32>) {
    let request = pb::GenerateRequest {
        request_id: format!("routing-{}", prompt.last().unwrap() * 1000 + prompt[prompt.len() - 2]),
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams { temperature: 0.0, ..Default::default() }),
        max_tokens: 2,
        ..Default::default()
    };
    let mut stream = replica.client.clone().generate(request).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
}

/// Waits (up to 30 s) for `f` to hold.
async fn until(what: &str, f: impl Fn() -> bool) {
    let wait = async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait).await.unwrap_or_else(|_| panic!("never: {what}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_stick_to_the_replica_caching_their_prefix_and_a_dead_one_leaves() {
    let (w1, a1) = serve_worker();
    let (w2, a2) = serve_worker();
    let r1 = Arc::new(Replica::connect(&a1).await.unwrap());
    let r2 = Arc::new(Replica::connect(&a2).await.unwrap());
    let pool = Pool::new(&r1.card.model, Weights::default());
    pool.add("w1", r1).unwrap();
    pool.add("w2", r2).unwrap();
    until("both replicas report their load", || pool.loads().len() == 2).await;

    // Four tenants arrive together: load counted at dispatch (until each worker answers)
    // spreads them.
    let first: Vec<Dispatch> = (0..4).map(|t| pool.choose(&pool.blocks(&prompt(t, 0)), &[]).unwrap()).collect();
    let homes: Vec<String> = first.iter().map(|d| d.id().to_string()).collect();
    assert_eq!(homes.iter().filter(|h| *h == "w1").count(), 2, "two tenants each: {homes:?}");
    for (t, d) in first.iter().enumerate() {
        generate(d.replica(), prompt(t as u32, 0)).await;
    }
    drop(first);
    // Each replica's cache events arrive: 2 tenants × 20 blocks each.
    until("both replicas report their cached prefixes", || {
        pool.cached_blocks("w1") >= 40 && pool.cached_blocks("w2") >= 40
    })
    .await;

    // Later requests of each tenant go home.
    for round in 1..4 {
        let chosen: Vec<Dispatch> =
            (0..4).map(|t| pool.choose(&pool.blocks(&prompt(t, round)), &[]).unwrap()).collect();
        for (t, d) in chosen.iter().enumerate() {
            assert_eq!(d.id(), homes[t], "round {round}: tenant {t} left the replica holding its prefix");
        }
        for (t, d) in chosen.iter().enumerate() {
            generate(d.replica(), prompt(t as u32, round)).await;
        }
    }

    // A replica that dies leaves routing as soon as its load stream breaks; its tenants
    // go to the other one.
    let dead = if homes[0] == "w1" { w1 } else { w2 };
    drop(dead);
    until("the dead replica is out of routing", || pool.loads().len() == 1).await;
    for t in 0..4 {
        let d = pool.choose(&pool.blocks(&prompt(t, 9)), &[]).unwrap();
        assert_ne!(d.id(), homes[0], "tenant {t} was sent to the dead replica");
    }
}
