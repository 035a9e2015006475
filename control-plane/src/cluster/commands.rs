//! Operator commands on the cluster, straight in etcd: nodes (list, cordon, uncordon,
//! drain), deployments (apply a TOML file, list, scale) and replicas (list, with each
//! ready replica's live load and prefix-cache size). JSON with `--json`.

use super::state;
use crate::config::{DeploymentsCommand, EtcdArgs, NodesCommand, ReplicasCommand};
use crate::limits::now_us;
use crate::ops::print;
use anyhow::{Context, Result};
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use serde::Deserialize;
use serde_json::json;
use std::time::Duration;
use tessera_proto::cluster::{self, Cordon, Deployment, Drain, etcd_options};
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};

async fn connect(etcd: &EtcdArgs) -> Result<Client> {
    Client::connect(&etcd.etcd, Some(etcd_options()))
        .await
        .with_context(|| format!("connecting to etcd at {:?}", etcd.etcd))
}

pub async fn nodes(cmd: NodesCommand) -> Result<()> {
    match cmd {
        NodesCommand::List { etcd, json } => {
            let (state, _) = state::read(&mut connect(&etcd).await?).await?;
            let rows: Vec<_> = state
                .nodes
                .iter()
                .map(|n| {
                    let replicas = state.assignments.iter().filter(|a| a.node == n.record.id).count();
                    json!({
                        "id": n.record.id,
                        "host": n.record.host,
                        "state": n.record.state,
                        "cordoned": n.cordoned,
                        "drain_requested": n.drain_requested,
                        "devices": n.record.devices,
                        "labels": n.record.labels,
                        "replicas": replicas,
                    })
                })
                .collect();
            let human = state
                .nodes
                .iter()
                .map(|n| {
                    let flags = match (n.cordoned, n.drain_requested) {
                        (_, true) => " (draining)",
                        (true, false) => " (cordoned)",
                        _ => "",
                    };
                    format!("{}  {:?}{flags}  {} devices", n.record.id, n.record.state, n.record.devices.len())
                })
                .collect::<Vec<_>>()
                .join("\n");
            print(json, json!(rows), human);
        }
        NodesCommand::Cordon { node, etcd, json } => {
            let mut c = connect(&etcd).await?;
            c.put(cluster::cordon_key(&node), cluster::encode(&Cordon { at: now_us() }), None).await?;
            print(json, json!({"node": node, "cordoned": true}), format!("{node} cordoned: nothing new goes there"));
        }
        NodesCommand::Uncordon { node, etcd, json } => {
            let mut c = connect(&etcd).await?;
            c.delete(cluster::cordon_key(&node), None).await?;
            c.delete(cluster::drain_key(&node), None).await?;
            print(json, json!({"node": node, "cordoned": false}), format!("{node} takes replicas again"));
        }
        NodesCommand::Drain { node, etcd, json } => {
            let mut c = connect(&etcd).await?;
            c.put(cluster::drain_key(&node), cluster::encode(&Drain { at: now_us() }), None).await?;
            let human =
                format!("{node} draining: its replicas move elsewhere, each leaving once its replacement is ready");
            print(json, json!({"node": node, "drain_requested": true}), human);
        }
    }
    Ok(())
}

/// A deployment file: `[[deployment]]` tables.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeploymentFile {
    #[serde(default)]
    deployment: Vec<Deployment>,
}

pub async fn deployments(cmd: DeploymentsCommand) -> Result<()> {
    match cmd {
        DeploymentsCommand::Apply { file, etcd, json } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            let parsed: DeploymentFile =
                toml::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
            for d in &parsed.deployment {
                anyhow::ensure!(d.model.contains('/'), "{}: a model is named by its full id, vendor/model", d.model);
                anyhow::ensure!(d.tensor_parallel >= 1, "{}: tensor_parallel must be at least 1", d.model);
            }
            let mut c = connect(&etcd).await?;
            for d in &parsed.deployment {
                c.put(cluster::deployment_key(&d.model), cluster::encode(d), None).await?;
            }
            let human = format!("applied {} deployment(s) from {}", parsed.deployment.len(), file.display());
            print(json, json!(parsed.deployment), human);
        }
        DeploymentsCommand::List { etcd, json } => {
            let (state, _) = state::read(&mut connect(&etcd).await?).await?;
            let human = state
                .deployments
                .iter()
                .map(|d| {
                    let ready = state
                        .replicas
                        .iter()
                        .filter(|r| r.model == d.model && r.state == cluster::ReplicaState::Ready)
                        .count();
                    let pools = match (d.prefill_replicas, d.decode_replicas) {
                        (0, 0) => String::new(),
                        (p, dec) => format!("  prefill {p}  decode {dec}"),
                    };
                    let wanted = d.replicas + d.prefill_replicas + d.decode_replicas;
                    format!("{}  {ready}/{wanted} ready  tp {}{pools}", d.model, d.tensor_parallel)
                })
                .collect::<Vec<_>>()
                .join("\n");
            print(json, json!(state.deployments), human);
        }
        DeploymentsCommand::Scale { model, replicas, prefill, decode, etcd, json } => {
            let mut c = connect(&etcd).await?;
            let key = cluster::deployment_key(&model);
            let found = c.get(key.clone(), None).await?;
            let kv = found.kvs().first().with_context(|| format!("no deployment of {model}"))?;
            let mut d: Deployment = cluster::decode(kv.value())?;
            d.replicas = replicas;
            d.prefill_replicas = prefill.unwrap_or(d.prefill_replicas);
            d.decode_replicas = decode.unwrap_or(d.decode_replicas);
            // Only over the version read: a concurrent change is not undone.
            let unchanged = Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision());
            let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(key, cluster::encode(&d), None)]);
            anyhow::ensure!(c.txn(txn).await?.succeeded(), "{model}'s deployment changed meanwhile; try again");
            print(json, json!(d), format!("{model}: {replicas} replica(s)"));
        }
    }
    Ok(())
}

pub async fn replicas(cmd: ReplicasCommand) -> Result<()> {
    match cmd {
        ReplicasCommand::List { etcd, json } => {
            let (state, _) = state::read(&mut connect(&etcd).await?).await?;
            let mut rows = Vec::new();
            let mut human = Vec::new();
            for r in &state.replicas {
                let (cached, load) = match r.state {
                    cluster::ReplicaState::Ready => load_of(&r.addr).await.unzip(),
                    _ => (None, None),
                };
                human.push(format!(
                    "{}  {}  {}  {:?}  devices {:?}{}",
                    r.replica,
                    r.model,
                    r.node,
                    r.state,
                    r.devices,
                    load.as_ref().map_or(String::new(), |l| format!("  running {} waiting {}", l.running, l.waiting))
                ));
                rows.push(json!({
                    "id": r.replica,
                    "model": r.model,
                    "node": r.node,
                    "state": r.state,
                    "devices": r.devices,
                    "addr": r.addr,
                    "load": load.as_ref().map(|l| json!({
                        "running": l.running,
                        "waiting": l.waiting,
                        "kv_blocks_used": l.kv_blocks_used,
                        "kv_blocks_total": l.kv_blocks_total,
                    })),
                    "cached_blocks": cached,
                }));
            }
            // Assigned and not started yet (or on a node that is gone): the operator sees
            // every device the placement has given out.
            for a in state.assignments.iter().filter(|a| !state.replicas.iter().any(|r| r.replica == a.replica)) {
                human.push(format!("{}  {}  {}  assigned  devices {:?}", a.replica, a.model, a.node, a.devices));
                rows.push(json!({
                    "id": a.replica,
                    "model": a.model,
                    "node": a.node,
                    "state": "assigned",
                    "devices": a.devices,
                    "addr": null,
                    "load": null,
                    "cached_blocks": null,
                }));
            }
            print(json, json!(rows), human.join("\n"));
        }
    }
    Ok(())
}

/// A replica's prefix cache (its opening snapshot) and first load report, if it answers
/// within two seconds.
async fn load_of(addr: &str) -> Option<(usize, pb::LoadReport)> {
    let ask = async {
        let client = WorkerClient::connect(format!("http://{addr}")).await.ok()?;
        let mut client = client.max_decoding_message_size(tessera_proto::MAX_MESSAGE_BYTES);
        let mut stream = client.watch_load(pb::WatchLoadRequest { interval_ms: 100 }).await.ok()?.into_inner();
        let snapshot = stream.message().await.ok().flatten().filter(|r| r.snapshot)?;
        let report = stream.message().await.ok().flatten()?;
        Some((snapshot.stored_block_hashes.len(), report))
    };
    tokio::time::timeout(Duration::from_secs(2), ask).await.ok().flatten()
}
