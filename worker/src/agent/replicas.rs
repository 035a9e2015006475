//! The engine replicas a node runs, in this process: each one loads its weights, serves
//! worker.proto on a port of its own, and is drained — no new requests, the running
//! ones finished — before it stops. Running them in the agent's process means that a
//! node that dies takes its replicas with it, as a machine would.

use crate::device::Device;
use crate::serve::{self, ServeConfig};
use std::collections::BTreeMap;
use std::time::Duration;
use tessera_proto::block_hash::BLOCK_TOKENS;
use tessera_proto::cluster::{Assignment, ReplicaRecord, ReplicaState};
use tokio::sync::{mpsc, watch};

/// How each replica's engine is sized (the model and devices come from its assignment),
/// and how it drains.
#[derive(Debug, Clone)]
pub struct EngineTemplate {
    pub device: Device,
    pub kv_cache_bytes: Option<u64>,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub prompt_step_percent: Option<u32>,
    pub contended_batch: Option<usize>,
    /// The second KV tier; its folder holds one per replica, named after it.
    pub kv_tier: crate::serve::KvTierArgs,
    /// Between saying "draining" and refusing new requests: time for routers to hear.
    pub drain_grace: Duration,
    /// The longest a drain waits for running requests before they are cut off.
    pub drain_deadline: Duration,
}

/// A replica's record changed (or, None, it stopped): the agent publishes it.
pub type Changes = mpsc::UnboundedSender<(String, Option<ReplicaRecord>)>;

struct Running {
    record: ReplicaRecord,
    /// Set when draining begins.
    stop: watch::Sender<bool>,
}

/// The replicas of this node, by id.
pub struct Replicas {
    host: String,
    template: EngineTemplate,
    changes: Changes,
    running: BTreeMap<String, Running>,
}

impl Replicas {
    pub fn new(host: &str, template: EngineTemplate, changes: Changes) -> Self {
        Self { host: host.into(), template, changes, running: BTreeMap::new() }
    }

    /// The records of every replica this node runs.
    pub fn records(&self) -> Vec<ReplicaRecord> {
        self.running.values().map(|r| r.record.clone()).collect()
    }

    /// Notes a state reported by a replica's task (a draining replica stays draining
    /// unless it fails).
    pub fn update(&mut self, record: &ReplicaRecord) {
        if let Some(r) = self.running.get_mut(&record.replica)
            && (r.record.state != ReplicaState::Draining || record.state == ReplicaState::Failed)
        {
            r.record = record.clone();
        }
    }

    /// Starts what is assigned and not running; begins draining what runs and is no
    /// longer assigned (it leaves the table when its task reports it stopped).
    pub async fn reconcile(&mut self, assigned: &BTreeMap<String, Assignment>) {
        let gone: Vec<String> = self.running.keys().filter(|id| !assigned.contains_key(*id)).cloned().collect();
        for id in gone {
            self.begin_drain(&id);
        }
        for (id, a) in assigned {
            if !self.running.contains_key(id) {
                self.start(a).await;
            }
        }
    }

    /// Begins draining every replica, for the node to leave.
    pub fn drain_all(&mut self) {
        let ids: Vec<String> = self.running.keys().cloned().collect();
        for id in ids {
            self.begin_drain(&id);
        }
    }

    pub fn record(&self, id: &str) -> Option<ReplicaRecord> {
        self.running.get(id).map(|r| r.record.clone())
    }

    /// A replica's task ended (drained, or failed to load).
    pub fn ended(&mut self, id: &str) {
        self.running.remove(id);
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    async fn start(&mut self, a: &Assignment) {
        let listener = match tokio::net::TcpListener::bind((self.host.as_str(), 0)).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("replica {}: cannot listen on {}: {e}", a.replica, self.host);
                return;
            }
        };
        let addr = match listener.local_addr() {
            Ok(addr) => addr.to_string(),
            Err(e) => {
                tracing::warn!("replica {}: {e}", a.replica);
                return;
            }
        };
        let record = ReplicaRecord {
            replica: a.replica.clone(),
            model: a.model.clone(),
            node: a.node.clone(),
            devices: a.devices.clone(),
            addr,
            state: ReplicaState::Loading,
            block_size: BLOCK_TOKENS as u32,
        };
        let _ = self.changes.send((record.replica.clone(), Some(record.clone())));
        let config = ServeConfig {
            model: a.weights.clone(),
            listen: record.addr.clone(),
            kv_cache_bytes: self.template.kv_cache_bytes,
            kv_cache_fraction: 0.2,
            device: self.template.device,
            // The assigned GPUs (on a CPU node these are slots, and unused).
            cuda_devices: match self.template.device {
                crate::device::Device::Cuda => a.devices.iter().map(|&d| d as usize).collect(),
                _ => Vec::new(),
            },
            tensor_parallel_size: a.devices.len().max(1),
            gpu_memory_fraction: 0.9,
            cuda_graph_sizes: crate::engine::core::DEFAULT_GRAPH_BATCH_SIZES.to_vec(),
            enforce_eager: false,
            replica_id: a.replica.clone(),
            no_metrics: false,
            max_num_seqs: self.template.max_num_seqs,
            max_num_batched_tokens: self.template.max_num_batched_tokens,
            prompt_step_percent: self.template.prompt_step_percent,
            contended_batch: self.template.contended_batch,
            kv_tier: crate::serve::KvTierArgs {
                kv_disk_path: self.template.kv_tier.kv_disk_path.as_ref().map(|root| root.join(&a.replica)),
                ..self.template.kv_tier.clone()
            },
            encoder_cache_mb: 256,
            disaggregation_mode: a.role,
            speculative: a.speculative.as_ref().map(|s| s.method),
            speculative_tokens: a
                .speculative
                .as_ref()
                .map_or(crate::engine::speculate::DEFAULT_SPEC_TOKENS, |s| s.max_tokens),
            speculative_draft: a.speculative.as_ref().and_then(|s| s.draft.clone()),
        };
        let (stop, stopped) = watch::channel(false);
        let drain = (self.template.drain_grace, self.template.drain_deadline);
        tokio::spawn(run(record.clone(), config, listener, stopped, drain, self.changes.clone()));
        self.running.insert(record.replica.clone(), Running { record, stop });
    }

    /// Marks a replica draining (routers stop sending to it) and tells it to finish: it
    /// stops accepting after the grace, serves its running requests to their end (or
    /// the deadline), and its task then reports it stopped. A failed replica just goes.
    fn begin_drain(&mut self, id: &str) {
        let Some(r) = self.running.get_mut(id) else { return };
        if r.record.state == ReplicaState::Failed {
            self.running.remove(id);
            let _ = self.changes.send((id.to_string(), None));
            return;
        }
        if *r.stop.borrow() {
            return;
        }
        r.record.state = ReplicaState::Draining;
        let _ = self.changes.send((id.to_string(), Some(r.record.clone())));
        let _ = r.stop.send(true);
    }
}

/// One replica's life: load (off the async threads), serve until told to stop, then
/// report it gone; or, if it cannot load or serve, report it failed (it stays so until
/// its assignment goes).
async fn run(
    mut record: ReplicaRecord,
    config: ServeConfig,
    listener: tokio::net::TcpListener,
    stop: watch::Receiver<bool>,
    (grace, deadline): (Duration, Duration),
    changes: Changes,
) {
    let id = record.replica.clone();
    let built = tokio::task::spawn_blocking(move || serve::build_service(&config)).await;
    let failure = match built {
        Ok(Ok(service)) => {
            record.state = ReplicaState::Ready;
            let _ = changes.send((id.clone(), Some(record.clone())));
            let mut told = stop.clone();
            let shutdown = async move {
                let _ = told.wait_for(|s| *s).await;
                tokio::time::sleep(grace).await;
            };
            let mut told = stop.clone();
            let cut_off = async move {
                let _ = told.wait_for(|s| *s).await;
                tokio::time::sleep(grace + deadline).await;
            };
            tokio::select! {
                served = serve::serve(service, listener, shutdown) => served.err().map(|e| format!("{e:#}")),
                _ = cut_off => {
                    tracing::warn!("replica {id}: drain deadline passed; cutting off its requests");
                    None
                }
            }
        }
        Ok(Err(e)) => Some(format!("loading failed: {e:#}")),
        Err(e) => Some(format!("loading panicked: {e}")),
    };
    match failure {
        Some(why) if !*stop.borrow() => {
            tracing::warn!("replica {id}: {why}");
            record.state = ReplicaState::Failed;
            let _ = changes.send((id, Some(record)));
        }
        _ => {
            let _ = changes.send((id, None));
        }
    }
}
