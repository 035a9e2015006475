//! The router's pool over four real workers serving the real model, and eight tenants,
//! each with a long prompt prefix of its own: they spread over the replicas when they
//! arrive together, each tenant's later requests go to the replica that caches its
//! prefix (known from the replicas' own cache events) — a prefix hit rate of at least
//! 0.8, no replica over 1.5× its fair share — and a replica that dies leaves routing at
//! once.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tessera_control_plane::router::choice::Routing;
use tessera_control_plane::router::{Dispatch, Pool, Replica};
use tessera_e2e::serve_worker;
use tessera_proto::block_hash::BLOCK_TOKENS;
use tessera_proto::worker::{self as pb};

/// Tenant `t`'s prefix (20 blocks) and a request-specific tail.
fn prompt(t: u32, request: u32) -> Vec<u32> {
    let prefix = (0..20 * BLOCK_TOKENS as u32).map(|i| 1000 + (t * 7919 + i * 31) % 40_000);
    prefix.chain([200 + request, 300 + t]).collect()
}

/// Runs one request to its end on `replica`: its prompt tokens, and how many of them
/// the replica's prefix cache supplied.
async fn generate(replica: Arc<Replica>, prompt: Vec<u32>) -> (u32, u32) {
    let request = pb::GenerateRequest {
        request_id: format!("routing-{}", prompt.last().unwrap() * 1000 + prompt[prompt.len() - 2]),
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams { temperature: 0.0, ..Default::default() }),
        max_tokens: 1,
        ..Default::default()
    };
    let mut stream = replica.client.clone().generate(request).await.unwrap().into_inner();
    let mut counts = (0, 0);
    while let Some(r) = stream.message().await.unwrap() {
        counts = (r.prompt_tokens, r.cached_prompt_tokens);
    }
    counts
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

const REPLICAS: usize = 4;
const TENANTS: u32 = 8;
const ROUNDS: u32 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_stick_to_the_replica_caching_their_prefix_fairly_and_a_dead_one_leaves() {
    let mut workers = Vec::new();
    let pool = OnceLock::new();
    for i in 1..=REPLICAS {
        let (worker, addr) = serve_worker();
        let replica = Arc::new(Replica::connect(&addr).await.unwrap());
        let pool = pool.get_or_init(|| Pool::new(&replica.card.model, Routing::CacheAware));
        pool.add(&format!("w{i}"), replica).unwrap();
        workers.push(Some(worker));
    }
    let pool = pool.get().unwrap();
    until("every replica reports its load", || pool.loads().len() == REPLICAS).await;

    // Each round, every tenant sends one request at once. Load counted at dispatch
    // (before any worker answers) spreads the first round; later rounds go home.
    let mut homes: Vec<String> = Vec::new();
    let mut served: BTreeMap<String, u32> = BTreeMap::new();
    let (mut prompt_tokens, mut cached_tokens) = (0, 0);
    for round in 0..ROUNDS {
        let chosen: Vec<Dispatch> =
            (0..TENANTS).map(|t| pool.choose(&pool.blocks(&prompt(t, round), &[]), &[]).unwrap()).collect();
        let ids: Vec<String> = chosen.iter().map(|d| d.id().to_string()).collect();
        let runs: Vec<_> = chosen
            .iter()
            .enumerate()
            .map(|(t, d)| tokio::spawn(generate(d.replica().clone(), prompt(t as u32, round))))
            .collect();
        for run in runs {
            let (prompt, cached) = run.await.unwrap();
            prompt_tokens += prompt;
            cached_tokens += cached;
        }
        drop(chosen);
        for id in &ids {
            *served.entry(id.clone()).or_default() += 1;
        }
        if round == 0 {
            homes = ids;
            for i in 1..=REPLICAS {
                let on_i = homes.iter().filter(|h| **h == format!("w{i}")).count();
                assert_eq!(on_i, TENANTS as usize / REPLICAS, "tenants spread evenly at first: {homes:?}");
            }
            // Each replica's cache events arrive: 2 tenants × 20 blocks each.
            until("every replica reports its cached prefixes", || {
                (1..=REPLICAS).all(|i| pool.cached_blocks(&format!("w{i}")) >= 40)
            })
            .await;
        } else {
            assert_eq!(ids, homes, "round {round}: a tenant left the replica holding its prefix");
        }
    }
    let hit_rate = cached_tokens as f64 / prompt_tokens as f64;
    assert!(hit_rate >= 0.8, "prefix hit rate {hit_rate:.3} < 0.8");
    let fair = (TENANTS * ROUNDS) as f64 / REPLICAS as f64;
    for (id, n) in &served {
        assert!(
            *n as f64 <= 1.5 * fair,
            "replica {id} served {n} of {} requests: over 1.5× its share",
            TENANTS * ROUNDS
        );
    }

    // A replica that dies leaves routing as soon as its load stream breaks; its tenants
    // go to the others.
    let dead: usize = homes[0][1..].parse().unwrap();
    drop(workers[dead - 1].take());
    until("the dead replica is out of routing", || pool.loads().len() == REPLICAS - 1).await;
    for t in 0..TENANTS {
        let d = pool.choose(&pool.blocks(&prompt(t, 99), &[]), &[]).unwrap();
        assert_ne!(d.id(), homes[0], "tenant {t} was sent to the dead replica");
    }
}
