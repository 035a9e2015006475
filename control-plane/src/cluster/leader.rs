//! The placement controller: control-plane processes campaign in an etcd election; the
//! leader reads the cluster's state, plans (`placement::plan`) and writes the changed
//! assignments, after every change it is told of and at least every few seconds. Its
//! writes are a transaction conditional on still holding the election key, so a
//! leader that lost its lease (and perhaps its successor already wrote) writes nothing.
//! A standby's campaign completes when the leader's lease ends: within one lease period.

use super::placement::{self, ClusterState, NodeView};
use super::state;
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, WatchOptions};
use std::collections::BTreeMap;
use std::time::Duration;
use tessera_proto::cluster::{self, Serving};
use tokio::sync::watch;

/// How the leader campaigns and how often it reconciles when nothing changes.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// This process, as shown to the other candidates.
    pub id: String,
    pub lease_ttl_secs: i64,
    pub resync: Duration,
    /// How long a vanished node's replicas wait for it to come back before moving.
    pub node_grace: Duration,
}

/// Campaigns, leads while it can, campaigns again; runs until the process ends.
/// `leading` says whether this process holds the election now.
pub async fn run(
    client: Client,
    config: LeaderConfig,
    weights: BTreeMap<String, Serving>,
    leading: watch::Sender<bool>,
) {
    let mut lost = LostNodes::default();
    loop {
        let mut c = client.clone();
        let lease = match c.lease_grant(config.lease_ttl_secs.max(2), None).await {
            Ok(l) => l.id(),
            Err(e) => {
                tracing::warn!("placement: {e}; campaigning again");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(e) = lead(c.clone(), &config, &weights, lease, &mut lost, &leading).await {
            tracing::warn!("placement: {e}; campaigning again");
        }
        leading.send_replace(false);
        // Whatever ended the term, its election key goes now rather than at the
        // lease's expiry, so that a standby (or this process) leads again at once.
        let _ = c.lease_revoke(lease).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// When the leader first saw each node missing that still has assignments: a node is
/// given `node_grace` to come back (its agent re-registering after a lost lease) before
/// its replicas are placed elsewhere.
#[derive(Default)]
struct LostNodes(BTreeMap<String, std::time::Instant>);

impl LostNodes {
    /// Updates the record from the state read, and marks the nodes still within their
    /// grace in it.
    fn mark(&mut self, state: &mut ClusterState, grace: Duration) {
        let live: std::collections::BTreeSet<&str> = state.nodes.iter().map(|n| n.record.id.as_str()).collect();
        let missing: std::collections::BTreeSet<String> =
            state.assignments.iter().filter(|a| !live.contains(a.node.as_str())).map(|a| a.node.clone()).collect();
        self.0.retain(|node, _| missing.contains(node));
        let now = std::time::Instant::now();
        for node in missing {
            let since = *self.0.entry(node.clone()).or_insert(now);
            if now.duration_since(since) < grace {
                state.recently_lost.insert(node);
            }
        }
    }
}

/// One term: campaign, then reconcile until leadership is lost.
async fn lead(
    mut client: Client,
    config: &LeaderConfig,
    weights: &BTreeMap<String, Serving>,
    lease: i64,
    lost: &mut LostNodes,
    leading: &watch::Sender<bool>,
) -> Result<(), etcd_client::Error> {
    let (mut keeper, mut kept) = client.lease_keep_alive(lease).await?;
    // Keep the lease alive while campaigning too: a campaign can wait for long.
    let renew_every = Duration::from_secs((config.lease_ttl_secs / 3).max(1) as u64);
    let mut campaigner = client.clone();
    let campaign = campaigner.campaign(cluster::PLACEMENT_ELECTION, config.id.as_bytes(), lease);
    tokio::pin!(campaign);
    let mut renew = tokio::time::interval(renew_every);
    let won = loop {
        tokio::select! {
            won = &mut campaign => break won?,
            _ = renew.tick() => keeper.keep_alive().await?,
            answer = kept.message() => if !matches!(answer, Ok(Some(ref r)) if r.ttl() > 0) {
                return Err(etcd_client::Error::LeaseKeepAliveError("lease lost while campaigning".into()));
            },
        }
    };
    let leader = won.leader().cloned().ok_or_else(|| etcd_client::Error::ElectError("no leader key".into()))?;
    let (key, revision) = (leader.key().to_vec(), leader.rev());
    tracing::warn!("placement: {} leads (election revision {revision})", config.id);
    leading.send_replace(true);

    let mut resync = tokio::time::interval(config.resync);
    // A lease whose renewals go unanswered for a whole time to live may be gone (a
    // partition can leave the stream open and silent): stop leading then, not later.
    let ttl = Duration::from_secs(config.lease_ttl_secs.max(2) as u64);
    let mut confirmed = std::time::Instant::now();
    loop {
        let (mut state, at) = state::read(&mut client).await?;
        lost.mark(&mut state, config.node_grace);
        if !reconcile(&mut client, &state, weights, &key, revision).await? {
            return Err(etcd_client::Error::ElectError("leadership lost".into()));
        }
        let options = WatchOptions::new().with_prefix().with_start_revision(at + 1);
        let mut watch = client.watch(cluster::ROOT, Some(options)).await?;
        // Until something changes (or the resync timer fires), keeping the lease.
        loop {
            tokio::select! {
                _ = resync.tick() => break,
                event = watch.message() => match event? {
                    // Created and progress notices change nothing; a cancelled watch
                    // (compacted past) or a closed one is read afresh.
                    Some(resp) if !resp.canceled() && resp.events().is_empty() => {}
                    _ => break,
                },
                _ = renew.tick() => {
                    if confirmed.elapsed() > ttl {
                        return Err(etcd_client::Error::LeaseKeepAliveError("leader lease unconfirmed".into()));
                    }
                    keeper.keep_alive().await?;
                }
                answer = kept.message() => match answer {
                    Ok(Some(r)) if r.ttl() > 0 => confirmed = std::time::Instant::now(),
                    _ => return Err(etcd_client::Error::LeaseKeepAliveError("leader lease lost".into())),
                },
            }
        }
    }
}

/// Plans and writes the changes, if still the leader; false if not.
async fn reconcile(
    client: &mut Client,
    state: &ClusterState,
    weights: &BTreeMap<String, Serving>,
    key: &[u8],
    revision: i64,
) -> Result<bool, etcd_client::Error> {
    let mut plan = placement::plan(state, |m| weights.get(m).map(|s| s.weights.clone()), new_replica_id, revision);
    for a in &mut plan.add {
        a.speculative = weights.get(&a.model).and_then(|s| s.speculative.clone());
    }
    for (model, n) in &plan.unplaced {
        tracing::warn!("placement: {n} replica(s) of {model} fit on no node");
    }
    if plan.is_empty() {
        return Ok(true);
    }
    let mut ops: Vec<TxnOp> =
        plan.remove.iter().map(|(node, replica)| TxnOp::delete(cluster::assignment_key(node, replica), None)).collect();
    for a in &plan.add {
        ops.push(TxnOp::put(cluster::assignment_key(&a.node, &a.replica), cluster::encode(a), None));
    }
    let txn = Txn::new().when([Compare::create_revision(key.to_vec(), CompareOp::Equal, revision)]).and_then(ops);
    let done = client.txn(txn).await?;
    if done.succeeded() {
        tracing::info!("placement: {} assigned, {} removed", plan.add.len(), plan.remove.len());
    }
    Ok(done.succeeded())
}

/// `vendor-a/model-a` → `model-a-3f9a1c0d5e7b` (48 random bits).
fn new_replica_id(model: &str) -> String {
    let short = model.rsplit('/').next().unwrap_or(model);
    let suffix = crate::accounts::keys::random_id("");
    format!("{short}-{}", &suffix[..12])
}

/// Node views from the records (a helper for `state::read`).
pub(super) fn views(nodes: Vec<cluster::NodeRecord>, cordoned: &[String], draining: &[String]) -> Vec<NodeView> {
    nodes
        .into_iter()
        .map(|record| NodeView {
            cordoned: cordoned.contains(&record.id),
            drain_requested: draining.contains(&record.id),
            record,
        })
        .collect()
}
