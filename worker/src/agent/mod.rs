//! `tessera-worker agent`: a node of the cluster. It registers the node in etcd under a
//! lease kept alive for as long as the process lives, runs the engine replicas the
//! placement leader assigns to the node, publishes their endpoints under the same
//! lease, and leaves by draining on SIGTERM: the node and its replicas are marked
//! draining, running requests finish, then everything it registered is removed.
//!
//! A lease lost (etcd unreachable longer than its time to live, or expired under a long
//! pause) is replaced: the node and its replicas are registered again under a new one,
//! and running work is not touched.

pub mod replicas;

use anyhow::{Context, Result};
use etcd_client::{Client, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use replicas::{EngineTemplate, Replicas};
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tessera_proto::cluster::{self, Assignment, Device, DeviceKind, NodeRecord, NodeState, ReplicaRecord};
use tokio::sync::mpsc;

#[derive(Debug, Clone, clap::Args)]
pub struct AgentConfig {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "TESSERA_ETCD", value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    /// This node's name in the cluster.
    #[arg(long, env = "TESSERA_NODE_ID")]
    pub node_id: String,
    /// CPU device slots to offer (a CPU node, e.g. for tests); default: the machine's
    /// GPUs, each replica on the ones assigned to it.
    #[arg(long)]
    pub devices: Option<u32>,
    /// The address replicas listen on, as routers reach it.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Node labels, `key=value`, repeatable (e.g. region=eu).
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Seconds the node outlives its agent's silence.
    #[arg(long, default_value_t = 10)]
    pub lease_ttl_secs: i64,
    /// KV cache of each replica, in bytes (default: the worker's).
    #[arg(long)]
    pub kv_cache_bytes: Option<u64>,
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Each replica's pacing, as `tessera-worker serve --prompt-step-percent`: while
    /// others decode, a step with prompt chunks takes at most this percentage of a decode
    /// step's time; 0: only --max-num-batched-tokens bounds it (default: the worker's,
    /// by the replica's role).
    #[arg(long)]
    pub prompt_step_percent: Option<u32>,
    /// Each replica's fair sharing, as `tessera-worker serve --contended-batch`: while
    /// organizations contend, a step runs at most this many rows (default 8 on a CPU,
    /// --max-num-seqs on a GPU).
    #[arg(long)]
    pub contended_batch: Option<usize>,
    /// Each replica's second KV tier, as `tessera-worker serve`'s; `--kv-disk-path`
    /// holds a folder per replica, named after it.
    #[command(flatten)]
    pub kv_tier: crate::serve::KvTierArgs,
    /// Milliseconds a draining replica keeps accepting requests, for routers to learn
    /// that it drains.
    #[arg(long, default_value_t = 1000)]
    pub drain_grace_ms: u64,
    /// Seconds a drain waits for running requests before cutting them off.
    #[arg(long, default_value_t = 600)]
    pub drain_timeout_secs: u64,
}

fn parse_label(s: &str) -> anyhow::Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => anyhow::bail!("a label is key=value, not {s:?}"),
    }
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

/// The device slots this node offers.
fn devices(config: &AgentConfig) -> Result<(Vec<Device>, crate::device::Device)> {
    if let Some(n) = config.devices {
        anyhow::ensure!(n > 0, "--devices must be at least 1");
        let memory = available_memory().unwrap_or(0) / n as u64;
        let slot = |index| Device { index, kind: DeviceKind::Cpu, name: "cpu".into(), memory_bytes: memory };
        return Ok(((0..n).map(slot).collect(), crate::device::Device::Cpu));
    }
    let gpus = crate::device::gpus().context("a node without --devices offers its GPUs")?;
    let gpu = |(index, (name, memory_bytes)): (usize, (String, u64))| Device {
        index: index as u32,
        kind: DeviceKind::Cuda,
        name,
        memory_bytes,
    };
    Ok((gpus.into_iter().enumerate().map(gpu).collect(), crate::device::Device::Cuda))
}

fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The node's registration: its record and the lease everything it publishes hangs on.
struct Registration {
    client: Client,
    node: NodeRecord,
    ttl: i64,
    lease: i64,
}

impl Registration {
    async fn new(client: Client, node: NodeRecord, ttl: i64) -> Result<Self> {
        let mut r = Self { client, node, ttl, lease: 0 };
        r.register(&[]).await?;
        Ok(r)
    }

    /// A new lease, and everything registered again under it in one transaction: the
    /// placement leader never sees the node without the replicas it runs.
    async fn register(&mut self, replicas: &[ReplicaRecord]) -> Result<()> {
        let lease = self.client.lease_grant(self.ttl, None).await?.id();
        let with_lease = || Some(PutOptions::new().with_lease(lease));
        let mut ops = vec![TxnOp::put(cluster::node_key(&self.node.id), cluster::encode(&self.node), with_lease())];
        for r in replicas {
            ops.push(TxnOp::put(cluster::replica_key(&r.replica), cluster::encode(r), with_lease()));
        }
        self.client.txn(Txn::new().and_then(ops)).await?;
        self.lease = lease;
        Ok(())
    }

    fn options(&self) -> Option<PutOptions> {
        Some(PutOptions::new().with_lease(self.lease))
    }

    async fn put_node(&mut self) -> Result<()> {
        let (key, value) = (cluster::node_key(&self.node.id), cluster::encode(&self.node));
        let options = self.options();
        self.client.put(key, value, options).await?;
        Ok(())
    }

    async fn put_replica(&mut self, r: &ReplicaRecord) -> Result<()> {
        let options = self.options();
        self.client.put(cluster::replica_key(&r.replica), cluster::encode(r), options).await?;
        Ok(())
    }

    async fn delete_replica(&mut self, id: &str) -> Result<()> {
        self.client.delete(cluster::replica_key(id), None).await?;
        Ok(())
    }

    /// Removes everything registered: the lease's keys go with it.
    async fn leave(&mut self) -> Result<()> {
        self.client.lease_revoke(self.lease).await?;
        Ok(())
    }
}

/// This node's assignments, and the revision they were read at.
async fn assignments(client: &mut Client, node: &str) -> Result<(BTreeMap<String, Assignment>, i64)> {
    let prefix = cluster::node_assignments(node);
    let resp = client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let mut assigned = BTreeMap::new();
    for kv in resp.kvs() {
        match cluster::decode::<Assignment>(kv.value()) {
            Ok(a) => {
                assigned.insert(a.replica.clone(), a);
            }
            Err(e) => {
                tracing::warn!("ignoring an unreadable assignment at {:?}: {e}", String::from_utf8_lossy(kv.key()))
            }
        }
    }
    Ok((assigned, revision))
}

pub async fn run(config: AgentConfig) -> Result<()> {
    let client = Client::connect(&config.etcd, Some(tessera_proto::cluster::etcd_options()))
        .await
        .with_context(|| format!("connecting to etcd at {:?}", config.etcd))?;
    let (slots, device) = devices(&config)?;
    let node = NodeRecord {
        id: config.node_id.clone(),
        host: config.host.clone(),
        devices: slots,
        labels: config.labels.iter().cloned().collect(),
        state: NodeState::Ready,
        registered_at: now_us(),
    };
    let ttl = config.lease_ttl_secs.max(2);
    let mut reg = Registration::new(client.clone(), node, ttl).await?;
    tracing::info!("node {} registered ({} devices)", config.node_id, reg.node.devices.len());
    let (changes, mut changed) = mpsc::unbounded_channel();
    let template = EngineTemplate {
        device,
        kv_cache_bytes: config.kv_cache_bytes,
        max_num_seqs: config.max_num_seqs,
        max_num_batched_tokens: config.max_num_batched_tokens,
        prompt_step_percent: config.prompt_step_percent,
        contended_batch: config.contended_batch,
        kv_tier: config.kv_tier.clone(),
        drain_grace: Duration::from_millis(config.drain_grace_ms),
        drain_deadline: Duration::from_secs(config.drain_timeout_secs),
    };
    let mut replicas = Replicas::new(&config.host, template, changes);

    let mut watcher = client.clone();
    let (mut assigned, mut revision) = assignments(&mut watcher, &config.node_id).await?;
    replicas.reconcile(&assigned).await;
    let prefix = cluster::node_assignments(&config.node_id);
    let watch_options = |from: i64| Some(WatchOptions::new().with_prefix().with_start_revision(from));
    let mut watch = watcher.watch(prefix.clone(), watch_options(revision + 1)).await?;

    let (mut keeper, mut kept) = reg.client.lease_keep_alive(reg.lease).await?;
    let mut renew = tokio::time::interval(Duration::from_secs((ttl / 3).max(1) as u64));
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut leaving = false;
    // The lease is lost when etcd says so, or when no renewal was confirmed for a whole
    // time to live (a silent connection says nothing).
    let mut confirmed = Instant::now();
    loop {
        let mut lease_lost = false;
        tokio::select! {
            _ = renew.tick() => {
                lease_lost = keeper.keep_alive().await.is_err()
                    || confirmed.elapsed() > Duration::from_secs(ttl as u64);
            }
            answer = kept.message() => match answer {
                Ok(Some(r)) if r.ttl() > 0 => confirmed = Instant::now(),
                _ => lease_lost = true,
            },
            event = watch.message() => match event {
                // The watch's own notices (created, progress) change nothing.
                Ok(Some(resp)) if !resp.canceled() && resp.events().is_empty() => {}
                Ok(Some(resp)) if !resp.canceled() => {
                    if let Some(h) = resp.header() {
                        revision = revision.max(h.revision());
                    }
                    if !leaving {
                        match assignments(&mut watcher, &config.node_id).await {
                            Ok((now, at)) => (assigned, revision) = (now, revision.max(at)),
                            Err(e) => tracing::warn!("reading the node's assignments: {e:#}"),
                        }
                        replicas.reconcile(&assigned).await;
                    }
                }
                // The watch broke (etcd restarted or unreachable) or was cancelled
                // (compacted past): once etcd answers, read the assignments afresh and
                // watch on from there.
                _ => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if let Ok((now, at)) = assignments(&mut watcher, &config.node_id).await
                        && let Ok(w) = watcher.watch(prefix.clone(), watch_options(at + 1)).await
                    {
                        (assigned, revision, watch) = (now, at, w);
                        if !leaving {
                            replicas.reconcile(&assigned).await;
                        }
                    }
                }
            },
            change = changed.recv() => {
                let Some((id, record)) = change else { break };
                let published = match record {
                    Some(r) => {
                        replicas.update(&r);
                        match replicas.record(&id) {
                            Some(current) => reg.put_replica(&current).await,
                            None => Ok(()),
                        }
                    }
                    None => {
                        replicas.ended(&id);
                        reg.delete_replica(&id).await
                    }
                };
                if let Err(e) = published {
                    tracing::warn!("publishing replica {id}: {e:#}");
                }
                if leaving && replicas.is_empty() {
                    break;
                }
            }
            _ = terminate.recv(), if !leaving => {
                tracing::info!("draining node {}", config.node_id);
                leaving = true;
                reg.node.state = NodeState::Draining;
                if let Err(e) = reg.put_node().await {
                    tracing::warn!("marking the node draining: {e:#}");
                }
                replicas.drain_all();
                if replicas.is_empty() {
                    break;
                }
            }
        }
        if lease_lost {
            tracing::info!("the lease was lost; registering again");
            match reg.register(&replicas.records()).await {
                Ok(()) => match reg.client.lease_keep_alive(reg.lease).await {
                    Ok((k, s)) => {
                        (keeper, kept) = (k, s);
                        confirmed = Instant::now();
                    }
                    Err(e) => tracing::warn!("keeping the new lease alive: {e:#}"),
                },
                Err(e) => {
                    tracing::warn!("registering again: {e:#}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
    reg.leave().await?;
    tracing::info!("node {} left", config.node_id);
    Ok(())
}
