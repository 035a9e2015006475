//! `tessera control-plane`: one control plane of a cluster. It campaigns for placement
//! leadership (the leader writes assignments; the others stand by), follows the replica
//! records in etcd, and serves the API over the ready replicas: a model appears once a
//! replica of it is ready, each ready replica joins its model's pool, and one that stops
//! being ready (draining, failed, gone) leaves it. Several control planes may run against
//! one etcd and one database.

use super::ClusterView;
use super::leader::{self, LeaderConfig};
use super::table::{ReplicaTable, Table};
use crate::catalog::Catalog;
use crate::config::ClusterConfig;
use crate::router::choice::Routing;
use crate::router::{Models, Pool, Replica, ServedModel};
use anyhow::{Context, Result};
use etcd_client::Client;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tessera_proto::block_hash::BLOCK_TOKENS;
use tessera_proto::cluster::{ReplicaState, Serving, etcd_options};
use tokio::sync::watch;

pub async fn run(config: ClusterConfig) -> Result<()> {
    let data_dir = &config.store.data_dir;
    std::fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let db = crate::db::Db::open(&config.store.database_url()).await.context("opening the database")?;
    let catalog = Catalog::load(config.api.catalog.as_deref())?.default_thinking_budget(config.api.thinking_budget);
    let client = Client::connect([config.etcd.clone()], Some(etcd_options()))
        .await
        .with_context(|| format!("connecting to etcd at {}", config.etcd))?;

    let weights = catalog
        .models
        .iter()
        .map(|m| (m.id.clone(), Serving { weights: m.weights.clone(), speculative: m.speculative.clone() }))
        .collect();
    let leader = LeaderConfig {
        id: crate::api::new_id("cp-"),
        lease_ttl_secs: config.lease_ttl_secs,
        resync: Duration::from_secs(5),
        node_grace: Duration::from_secs(config.node_grace_secs),
    };
    let (leading, leading_rx) = watch::channel(false);
    tokio::spawn(leader::run(client.clone(), leader, weights, leading));

    let table = ReplicaTable::spawn(client, Duration::from_secs(1));
    let models = Arc::new(Models::expecting(catalog.models.iter().map(|m| (m.id.clone(), m.name.clone()))));
    let pools = (config.api.routing, config.api.disaggregation_min_prompt_tokens);
    tokio::spawn(feed(table.subscribe(), catalog, models.clone(), pools));
    let view = ClusterView { table: table.subscribe(), leading: leading_rx };
    crate::serve::serve_api(db, models, Some(view), &config.api, &config.store.data_dir).await?;
    Ok(())
}

/// How long joining a replica (connecting, reading its model card) may take.
const CONNECT: Duration = Duration::from_secs(10);

/// Keeps the models' pools equal to the ready replicas in the table; a replica that
/// cannot be reached yet is tried again every two seconds.
/// `pools`: how each new pool routes, and the prompts it hands over.
async fn feed(mut rx: watch::Receiver<Table>, catalog: Catalog, models: Arc<Models>, pools: (Routing, usize)) {
    let (routing, handoff_min_tokens) = pools;
    let mut pools: BTreeMap<String, Arc<Pool>> = BTreeMap::new();
    // Replica id → (model, address) of the replicas in a pool.
    let mut joined: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut retry = tokio::time::interval(Duration::from_secs(2));
    loop {
        let table = rx.borrow_and_update().clone();
        let ready: BTreeMap<&String, _> = table
            .replicas
            .iter()
            .filter(|(_, r)| r.state == ReplicaState::Ready && catalog.get(&r.model).is_some())
            .collect();
        joined.retain(|id, (model, addr)| {
            let keep = ready.get(id).is_some_and(|r| &r.model == model && &r.addr == addr);
            if !keep && let Some(pool) = pools.get(model) {
                pool.remove(id);
            }
            keep
        });
        for (id, r) in ready {
            if joined.contains_key(id) {
                continue;
            }
            if r.block_size as usize != BLOCK_TOKENS {
                // Its cache events could not be matched to prompts; said once per change.
                tracing::warn!(
                    "replica {id} uses KV blocks of {} tokens, not {BLOCK_TOKENS}: not routed",
                    r.block_size
                );
                continue;
            }
            // Bounded, so that one worker that accepts and never answers cannot hold up
            // every other change.
            let replica = match tokio::time::timeout(CONNECT, Replica::connect(&r.addr)).await {
                Ok(Ok(replica)) => Arc::new(replica),
                Ok(Err(e)) => {
                    tracing::warn!("replica {id}: {e}; trying again");
                    continue;
                }
                Err(_) => {
                    tracing::warn!("replica {id} at {} did not answer in {CONNECT:?}; trying again", r.addr);
                    continue;
                }
            };
            let pool = pools
                .entry(r.model.clone())
                .or_insert_with(|| {
                    Arc::new(Pool::new(&replica.card.model, routing).handing_over_from(handoff_min_tokens))
                })
                .clone();
            if let Err(e) = pool.add(id, replica.clone()) {
                tracing::warn!("replica {id} left out of routing: {e}");
                continue;
            }
            joined.insert(id.clone(), (r.model.clone(), r.addr.clone()));
            if models.get(&r.model).is_none() {
                let entry = catalog.get(&r.model).expect("filtered to catalog models").clone();
                match ServedModel::new(entry, replica, pool) {
                    Ok(served) => models.insert(served),
                    Err(e) => tracing::error!("{e}"),
                }
            }
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            _ = retry.tick() => {}
        }
    }
}
