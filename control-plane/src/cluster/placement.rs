//! Where replicas go: the placement leader's decision, as a plain function of the
//! cluster's state (live nodes, operator cordons and drains, deployments, current
//! assignments, running replicas) to the assignments to add and remove. Running it
//! again on its own result changes nothing, so the leader can reconcile after any
//! change and at start-up.
//!
//! Rules:
//! - A replica's tensor-parallel shards share one node: it needs `tensor_parallel`
//!   free devices there, of the deployment's kind and memory, on a node carrying its
//!   labels.
//! - A device is free when no assignment names it and no replica still running on it
//!   (a draining one, say) does: two replicas never share a device.
//! - New replicas go where they fit most tightly (best fit: fewest devices left free),
//!   preferring nodes with fewer replicas of the same model, then by node id.
//! - Cordoned nodes, draining nodes and nodes an operator is draining take nothing new.
//!   Assignments on nodes that are gone (past the leader's grace) are dropped and placed
//!   again; so are those whose replica failed. Assignments on a draining node go one by
//!   one as ready replicas stand elsewhere to replace them (all at once when the node
//!   itself is leaving), so that a drain never leaves a model short of replicas.
//! - Replicas above a deployment's count, and those of models no longer deployed, are
//!   removed (the most recently placed first).

use std::collections::{BTreeMap, BTreeSet};
use tessera_proto::cluster::{
    Assignment, Deployment, DeviceKind, NodeRecord, NodeState, ReplicaRecord, ReplicaState, Role,
};

/// A live node and what operators said about it.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub record: NodeRecord,
    pub cordoned: bool,
    pub drain_requested: bool,
}

impl NodeView {
    /// May take new replicas.
    fn schedulable(&self) -> bool {
        !self.cordoned && !self.leaving()
    }

    /// Its replicas are to move elsewhere.
    fn leaving(&self) -> bool {
        self.drain_requested || self.record.state == NodeState::Draining
    }
}

/// The cluster as the leader sees it.
#[derive(Debug, Clone, Default)]
pub struct ClusterState {
    pub nodes: Vec<NodeView>,
    pub deployments: Vec<Deployment>,
    pub assignments: Vec<Assignment>,
    pub replicas: Vec<ReplicaRecord>,
    /// Nodes missing for less than the leader's grace (an agent re-registering after
    /// a lost lease): their assignments are left as they are for now.
    pub recently_lost: BTreeSet<String>,
}

/// What to change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub add: Vec<Assignment>,
    /// Assignments to delete, as (node, replica).
    pub remove: Vec<(String, String)>,
    /// Replicas that could not be placed, by model: no node has room.
    pub unplaced: BTreeMap<String, u32>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.remove.is_empty()
    }
}

/// Decides the changes. `weights` names the weights of a model (None: not in the
/// catalog, so it cannot be placed); `new_id` names new replicas; `leader_revision` is
/// stamped on what this leader writes.
pub fn plan(
    state: &ClusterState,
    weights: impl Fn(&str) -> Option<String>,
    mut new_id: impl FnMut(&str) -> String,
    leader_revision: i64,
) -> Plan {
    let mut out = Plan::default();
    let nodes: BTreeMap<&str, &NodeView> = state.nodes.iter().map(|n| (n.record.id.as_str(), n)).collect();
    let ready: BTreeSet<&str> =
        state.replicas.iter().filter(|r| r.state == ReplicaState::Ready).map(|r| r.replica.as_str()).collect();

    // Devices taken on each node, by assignments and by replicas still running.
    let mut taken: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    for a in &state.assignments {
        taken.entry(a.node.clone()).or_default().extend(&a.devices);
    }
    for r in &state.replicas {
        taken.entry(r.node.clone()).or_default().extend(&r.devices);
    }

    let deployed: BTreeMap<&str, &Deployment> = state.deployments.iter().map(|d| (d.model.as_str(), d)).collect();
    let mut by_model: BTreeMap<&str, Vec<&Assignment>> = BTreeMap::new();
    let failed: BTreeSet<&str> =
        state.replicas.iter().filter(|r| r.state == ReplicaState::Failed).map(|r| r.replica.as_str()).collect();
    for a in &state.assignments {
        if !nodes.contains_key(a.node.as_str()) && state.recently_lost.contains(&a.node) {
            // Perhaps back in a moment: keep it, devices and all.
            by_model.entry(a.model.as_str()).or_default().push(a);
        } else if !nodes.contains_key(a.node.as_str()) {
            // The node is gone: so is the replica. Placed again below.
            out.remove.push((a.node.clone(), a.replica.clone()));
            if let Some(t) = taken.get_mut(&a.node) {
                a.devices.iter().for_each(|d| {
                    t.remove(d);
                });
            }
        } else if !deployed.contains_key(a.model.as_str()) || failed.contains(a.replica.as_str()) {
            // Not wanted, or failed: removed (the agent drops it and its devices free
            // up once its record goes); a failed one is placed again.
            out.remove.push((a.node.clone(), a.replica.clone()));
        } else {
            by_model.entry(a.model.as_str()).or_default().push(a);
        }
    }

    // Replicas of each model per node, for the spreading preference.
    let mut per_node_model: BTreeMap<(String, String), u32> = BTreeMap::new();
    for list in by_model.values() {
        for a in list {
            *per_node_model.entry((a.node.clone(), a.model.clone())).or_default() += 1;
        }
    }

    for (d, role) in state.deployments.iter().flat_map(|d| Role::ALL.map(|role| (d, role))) {
        // Each role's replicas are counted and replaced on their own.
        let current: Vec<&Assignment> = by_model
            .get(d.model.as_str())
            .map(|list| list.iter().copied().filter(|a| a.role == role).collect())
            .unwrap_or_default();
        let (staying, leaving): (Vec<&Assignment>, Vec<&Assignment>) =
            current.into_iter().partition(|a| nodes.get(a.node.as_str()).is_none_or(|n| !n.leaving()));
        let want = d.wanted(role) as usize;
        // Too many where they may stay: the latest placed go first.
        if staying.len() > want {
            let mut extra = staying.clone();
            extra.sort_by(|a, b| (b.leader_revision, &b.replica).cmp(&(a.leader_revision, &a.replica)));
            for a in extra.iter().take(staying.len() - want) {
                out.remove.push((a.node.clone(), a.replica.clone()));
            }
        }
        // Leaving replicas go as ready ones stand elsewhere: never fewer serving than
        // wanted. A node that is itself leaving (SIGTERM) drains whatever happens.
        let ready_staying = staying.iter().filter(|a| ready.contains(a.replica.as_str())).count();
        let mut removable = (ready_staying + leaving.len()).saturating_sub(want);
        for a in &leaving {
            let node_leaving = nodes.get(a.node.as_str()).is_some_and(|n| n.record.state == NodeState::Draining);
            if node_leaving || removable > 0 {
                removable = removable.saturating_sub(1);
                out.remove.push((a.node.clone(), a.replica.clone()));
            }
        }
        let missing = want.saturating_sub(staying.len());
        let Some(weights) = weights(&d.model) else {
            *out.unplaced.entry(d.model.clone()).or_default() += missing as u32;
            continue;
        };
        for _ in 0..missing {
            match fit(d, &state.nodes, &taken, &per_node_model) {
                Some((node, devices)) => {
                    taken.entry(node.clone()).or_default().extend(&devices);
                    *per_node_model.entry((node.clone(), d.model.clone())).or_default() += 1;
                    out.add.push(Assignment {
                        replica: new_id(&d.model),
                        model: d.model.clone(),
                        weights: weights.clone(),
                        node,
                        devices,
                        leader_revision,
                        // The leader stamps the catalog's setting.
                        speculative: None,
                        role,
                    });
                }
                None => {
                    *out.unplaced.entry(d.model.clone()).or_default() += 1;
                }
            }
        }
    }
    out
}

/// The best-fitting node for one replica of `d`, and the devices it gets there.
fn fit(
    d: &Deployment,
    nodes: &[NodeView],
    taken: &BTreeMap<String, BTreeSet<u32>>,
    per_node_model: &BTreeMap<(String, String), u32>,
) -> Option<(String, Vec<u32>)> {
    let need = d.tensor_parallel.max(1) as usize;
    let c = &d.constraints;
    let mut best: Option<((usize, u32, String), Vec<u32>)> = None;
    for n in nodes.iter().filter(|n| n.schedulable()) {
        if !c.labels.iter().all(|(k, v)| n.record.labels.get(k) == Some(v)) {
            continue;
        }
        let used = taken.get(&n.record.id);
        let free: Vec<u32> = n
            .record
            .devices
            .iter()
            .filter(|dev| used.is_none_or(|u| !u.contains(&dev.index)))
            .filter(|dev| c.device_kind.is_none_or(|k: DeviceKind| dev.kind == k))
            .filter(|dev| c.min_device_memory_bytes.is_none_or(|m| dev.memory_bytes >= m))
            .map(|dev| dev.index)
            .collect();
        if free.len() < need {
            continue;
        }
        let same = per_node_model.get(&(n.record.id.clone(), d.model.clone())).copied().unwrap_or(0);
        let rank = (free.len() - need, same, n.record.id.clone());
        if best.as_ref().is_none_or(|(b, _)| rank < *b) {
            best = Some((rank, free[..need].to_vec()));
        }
    }
    best.map(|((_, _, node), devices)| (node, devices))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_proto::cluster::{Constraints, Device};

    fn node(id: &str, devices: u32) -> NodeView {
        let device = |index| Device { index, kind: DeviceKind::Cpu, name: "cpu".into(), memory_bytes: 1 << 30 };
        NodeView {
            record: NodeRecord {
                id: id.into(),
                host: "127.0.0.1".into(),
                devices: (0..devices).map(device).collect(),
                labels: BTreeMap::new(),
                state: NodeState::Ready,
                registered_at: 0,
            },
            cordoned: false,
            drain_requested: false,
        }
    }

    fn deployment(model: &str, replicas: u32, tp: u32) -> Deployment {
        Deployment {
            model: model.into(),
            replicas,
            tensor_parallel: tp,
            constraints: Constraints::default(),
            prefill_replicas: 0,
            decode_replicas: 0,
        }
    }

    /// Nodes a and b of one device each, and one replica of model m placed on one of them.
    fn one_replica_on_two_nodes() -> ClusterState {
        let mut s = ClusterState {
            nodes: vec![node("a", 1), node("b", 1)],
            deployments: vec![deployment("m", 1, 1)],
            ..Default::default()
        };
        let p = run(&s);
        apply(&mut s, &p);
        s
    }

    fn run(state: &ClusterState) -> Plan {
        // Unique across runs, as the leader's random ids are.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let id = |m: &str| format!("{m}-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        plan(state, |m| Some(format!("w-{m}")), id, 7)
    }

    /// The record an agent publishes for an assignment's replica.
    fn replica_of(a: &Assignment, state: ReplicaState) -> ReplicaRecord {
        ReplicaRecord {
            replica: a.replica.clone(),
            model: a.model.clone(),
            node: a.node.clone(),
            devices: a.devices.clone(),
            addr: String::new(),
            state,
            block_size: 16,
        }
    }

    /// Applies a plan as the leader and agents would: assignments written, replicas
    /// ready where assigned.
    fn apply(state: &mut ClusterState, p: &Plan) {
        state.assignments.retain(|a| !p.remove.contains(&(a.node.clone(), a.replica.clone())));
        state.assignments.extend(p.add.iter().cloned());
        state.replicas = state.assignments.iter().map(|a| replica_of(a, ReplicaState::Ready)).collect();
    }

    fn devices_used_once(state: &ClusterState) {
        let mut seen = BTreeSet::new();
        for a in &state.assignments {
            for d in &a.devices {
                assert!(seen.insert((a.node.clone(), *d)), "device {d} of {} assigned twice", a.node);
            }
        }
    }

    #[test]
    fn replicas_fill_the_nodes_exactly_and_a_second_pass_changes_nothing() {
        // 3 nodes × 2 devices; a TP-2 model ×1 and a TP-1 model ×4 fill all 6.
        let mut s = ClusterState {
            nodes: vec![node("a", 2), node("b", 2), node("c", 2)],
            deployments: vec![deployment("big", 1, 2), deployment("small", 4, 1)],
            ..Default::default()
        };
        let p = run(&s);
        assert_eq!((p.add.len(), p.unplaced.len()), (5, 0), "{p:?}");
        let big = p.add.iter().find(|a| a.model == "big").unwrap();
        assert_eq!(big.devices.len(), 2, "both shards on one node");
        assert!(p.add.iter().all(|a| a.weights == format!("w-{}", a.model) && a.leader_revision == 7));
        apply(&mut s, &p);
        devices_used_once(&s);
        assert!(run(&s).is_empty(), "idempotent");
        // One more replica has nowhere to go.
        s.deployments[1].replicas = 5;
        let p = run(&s);
        assert_eq!((p.add.len(), p.unplaced.get("small")), (0, Some(&1)));
    }

    #[test]
    fn a_lost_node_s_replicas_move_and_cordoned_nodes_take_nothing() {
        let mut s = ClusterState {
            nodes: vec![node("a", 2), node("b", 2), node("c", 2)],
            deployments: vec![deployment("m", 2, 1)],
            ..Default::default()
        };
        s.nodes[2].cordoned = true;
        let p = run(&s);
        assert!(p.add.iter().all(|a| a.node != "c"), "cordoned: {p:?}");
        apply(&mut s, &p);
        // Best fit packs both onto one node; that node dies.
        let lost = s.assignments[0].node.clone();
        s.nodes.retain(|n| n.record.id != lost);
        s.replicas.retain(|r| r.node != lost);
        let p = run(&s);
        let gone: Vec<_> =
            s.assignments.iter().filter(|a| a.node == lost).map(|a| (a.node.clone(), a.replica.clone())).collect();
        assert!(gone.iter().all(|g| p.remove.contains(g)));
        assert_eq!(p.add.len(), gone.len());
        assert!(p.add.iter().all(|a| a.node != lost && a.node != "c"));
        apply(&mut s, &p);
        devices_used_once(&s);
        assert_eq!(s.assignments.len(), 2);
    }

    #[test]
    fn a_drained_node_keeps_its_replicas_until_replacements_are_ready() {
        let mut s = one_replica_on_two_nodes();
        let first = s.assignments[0].clone();
        let other = if first.node == "a" { 1 } else { 0 };
        let index = 1 - other;
        s.nodes[index].drain_requested = true;
        // A replacement is placed on the other node; the drained one stays meanwhile.
        let p = run(&s);
        assert_eq!(p.add.len(), 1);
        assert_eq!(p.add[0].node, s.nodes[other].record.id);
        assert!(p.remove.is_empty(), "kept until the replacement is ready: {p:?}");
        s.assignments.extend(p.add.iter().cloned());
        // Loading: still kept.
        let mut loading = replica_of(&p.add[0], ReplicaState::Loading);
        s.replicas.push(loading.clone());
        let p = run(&s);
        assert!(p.is_empty(), "{p:?}");
        // Ready: the drained node's replica goes.
        loading.state = ReplicaState::Ready;
        s.replicas.retain(|r| r.replica != loading.replica);
        s.replicas.push(loading);
        let p = run(&s);
        assert_eq!(p.remove, vec![(first.node.clone(), first.replica.clone())]);
        assert!(p.add.is_empty());
    }

    #[test]
    fn a_vanished_node_keeps_its_replicas_through_the_grace_and_failed_ones_move() {
        let mut s = one_replica_on_two_nodes();
        let placed = s.assignments[0].clone();
        // Its node's key is gone for a moment (a lease being replaced): nothing moves.
        s.nodes.retain(|n| n.record.id != placed.node);
        s.recently_lost.insert(placed.node.clone());
        assert!(run(&s).is_empty());
        // Back: still nothing to do. Failed: removed and placed again on free devices.
        s.recently_lost.clear();
        s.nodes = vec![node("a", 1), node("b", 1)];
        s.replicas[0].state = ReplicaState::Failed;
        let p = run(&s);
        assert_eq!(p.remove, vec![(placed.node.clone(), placed.replica.clone())]);
        assert_eq!(p.add.len(), 1);
        assert_ne!(p.add[0].node, placed.node, "its devices are busy until the failed replica's record goes");
    }

    #[test]
    fn a_drain_releases_one_replica_per_ready_replacement() {
        let mut s = ClusterState {
            nodes: vec![node("a", 2), node("b", 2)],
            deployments: vec![deployment("m", 2, 1)],
            ..Default::default()
        };
        s.nodes[1].cordoned = true;
        let p = run(&s);
        apply(&mut s, &p);
        assert!(s.assignments.iter().all(|a| a.node == "a"));
        s.nodes[1].cordoned = false;
        s.nodes[0].drain_requested = true;
        let p = run(&s);
        assert_eq!((p.add.len(), p.remove.len()), (2, 0));
        s.assignments.extend(p.add.iter().cloned());
        // One replacement ready: one drained replica may go, not both.
        let mut ready = s.replicas[0].clone();
        ready.replica = p.add[0].replica.clone();
        ready.node = "b".into();
        s.replicas.push(ready);
        assert_eq!(run(&s).remove.len(), 1);
    }

    #[test]
    fn scaling_down_and_undeploying_remove_replicas() {
        let mut s = ClusterState {
            nodes: vec![node("a", 4)],
            deployments: vec![deployment("m", 3, 1), deployment("x", 1, 1)],
            ..Default::default()
        };
        let p = run(&s);
        apply(&mut s, &p);
        s.deployments = vec![deployment("m", 1, 1)];
        let p = run(&s);
        assert_eq!(p.remove.len(), 3, "two extra m and the x: {p:?}");
        apply(&mut s, &p);
        assert_eq!(s.assignments.len(), 1);
        assert!(run(&s).is_empty());
    }

    #[test]
    fn prefill_and_decode_pools_are_placed_and_scaled_each_on_its_own() {
        let pools = |prefill, decode| Deployment {
            prefill_replicas: prefill,
            decode_replicas: decode,
            ..deployment("m", 0, 1)
        };
        let mut s = ClusterState { nodes: vec![node("a", 4)], deployments: vec![pools(1, 2)], ..Default::default() };
        let p = run(&s);
        let roles = |s: &ClusterState| {
            let mut r: Vec<Role> = s.assignments.iter().map(|a| a.role).collect();
            r.sort();
            r
        };
        apply(&mut s, &p);
        assert_eq!(roles(&s), [Role::Prefill, Role::Decode, Role::Decode]);
        assert!(run(&s).is_empty());
        // One decode replica fewer: only a decode replica goes; one aggregated more.
        s.deployments = vec![Deployment { replicas: 1, ..pools(1, 1) }];
        let p = run(&s);
        assert_eq!(p.remove.len(), 1);
        let removed = s.assignments.iter().find(|a| a.replica == p.remove[0].1).unwrap();
        assert_eq!(removed.role, Role::Decode);
        assert_eq!(p.add.iter().map(|a| a.role).collect::<Vec<_>>(), [Role::None]);
        apply(&mut s, &p);
        assert_eq!(roles(&s), [Role::None, Role::Prefill, Role::Decode]);
    }

    #[test]
    fn constraints_pick_the_nodes() {
        let mut eu = node("eu-1", 2);
        eu.record.labels.insert("region".into(), "eu".into());
        let s = ClusterState {
            nodes: vec![node("us-1", 2), eu],
            deployments: vec![Deployment {
                constraints: Constraints { labels: [("region".into(), "eu".into())].into(), ..Default::default() },
                ..deployment("m", 2, 1)
            }],
            ..Default::default()
        };
        let p = run(&s);
        assert_eq!(p.add.iter().map(|a| a.node.as_str()).collect::<Vec<_>>(), ["eu-1", "eu-1"]);
        let cuda_only = ClusterState {
            deployments: vec![Deployment {
                constraints: Constraints { device_kind: Some(DeviceKind::Cuda), ..Default::default() },
                ..deployment("m", 1, 1)
            }],
            ..s
        };
        assert_eq!(run(&cuda_only).unplaced.get("m"), Some(&1));
    }
}
