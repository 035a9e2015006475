//! The cluster's state in etcd: every key and the JSON record under it, in one place, so
//! that node agents, the placement leader, routers and operator commands agree.
//!
//! ```text
//! /tessera/nodes/{node}                  NodeRecord      leased by the node's agent
//! /tessera/cordons/{node}                Cordon          operator: place nothing new there
//! /tessera/drains/{node}                 Drain           operator: move everything off, then stop
//! /tessera/deployments/{model}           Deployment      desired replicas of a model
//! /tessera/assignments/{node}/{replica}  Assignment      written by the placement leader
//! /tessera/replicas/{replica}            ReplicaRecord   leased by the agent serving it
//! /tessera/supply/{model}                SupplyRecord    the model's subscription supply state
//! /tessera/election/placement            (etcd election) the placement leader
//! ```
//!
//! Model ids contain a slash (`vendor-a/model-a`); they are used verbatim as the last
//! part of a key, which etcd treats as an opaque byte string.

use crate::speculative::SpecConfig;
use etcd_client::ConnectOptions;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// How every Tessera process talks to etcd: each request bounded (an unreachable etcd is
/// an error, not a hang), and a connection that goes silent noticed by HTTP/2 pings.
/// Streams (watches, lease keep-alives) are bounded only until they open.
pub fn etcd_options() -> ConnectOptions {
    ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(5))
        .with_keep_alive(Duration::from_secs(5), Duration::from_secs(5))
        .with_keep_alive_while_idle(true)
}

pub const ROOT: &str = "/tessera/";
pub const NODES: &str = "/tessera/nodes/";
pub const CORDONS: &str = "/tessera/cordons/";
pub const DRAINS: &str = "/tessera/drains/";
pub const DEPLOYMENTS: &str = "/tessera/deployments/";
pub const ASSIGNMENTS: &str = "/tessera/assignments/";
pub const REPLICAS: &str = "/tessera/replicas/";
pub const SUPPLY: &str = "/tessera/supply/";
pub const PLACEMENT_ELECTION: &str = "/tessera/election/placement";

pub fn node_key(node: &str) -> String {
    format!("{NODES}{node}")
}

pub fn cordon_key(node: &str) -> String {
    format!("{CORDONS}{node}")
}

pub fn drain_key(node: &str) -> String {
    format!("{DRAINS}{node}")
}

pub fn deployment_key(model: &str) -> String {
    format!("{DEPLOYMENTS}{model}")
}

/// The prefix of every assignment of one node (what its agent watches).
pub fn node_assignments(node: &str) -> String {
    format!("{ASSIGNMENTS}{node}/")
}

pub fn assignment_key(node: &str, replica: &str) -> String {
    format!("{ASSIGNMENTS}{node}/{replica}")
}

pub fn replica_key(replica: &str) -> String {
    format!("{REPLICAS}{replica}")
}

pub fn supply_key(model: &str) -> String {
    format!("{SUPPLY}{model}")
}

/// The part of `key` after `prefix`, if it has that prefix.
pub fn name_in<'a>(key: &'a str, prefix: &str) -> Option<&'a str> {
    key.strip_prefix(prefix).filter(|rest| !rest.is_empty())
}

/// What kind of device a slot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// One device slot of a node: a GPU, or on a CPU node a share of its cores.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    pub index: u32,
    pub kind: DeviceKind,
    /// e.g. "NVIDIA H100 80GB HBM3", or "cpu".
    pub name: String,
    pub memory_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Ready,
    /// Taking no new replicas and finishing what runs, then leaving.
    Draining,
}

/// A node as its agent describes it, under the agent's lease: the key disappears when
/// the agent stops renewing it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    /// Host the node's replicas listen on.
    pub host: String,
    pub devices: Vec<Device>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub state: NodeState,
    /// µs since the epoch.
    pub registered_at: i64,
}

/// An operator's instruction to place nothing new on a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cordon {
    pub at: i64,
}

/// An operator's instruction to move everything off a node; its agent then drains.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drain {
    pub at: i64,
}

/// Where a deployment's replicas may go.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Constraints {
    /// Devices of this kind only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_kind: Option<DeviceKind>,
    /// Devices with at least this much memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_device_memory_bytes: Option<u64>,
    /// Nodes carrying every one of these labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// The desired state of one model: how many replicas, each over how many devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    pub model: String,
    /// Replicas that prefill and decode (aggregated serving).
    pub replicas: u32,
    #[serde(default = "one")]
    pub tensor_parallel: u32,
    #[serde(default)]
    pub constraints: Constraints,
    /// Disaggregated serving: replicas that only compute prompts, and replicas that
    /// take the requests they hand over (both 0: none; either alone serves whole
    /// requests).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prefill_replicas: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub decode_replicas: u32,
}

impl Deployment {
    /// Replicas wanted in `role`.
    pub fn wanted(&self, role: Role) -> u32 {
        match role {
            Role::None => self.replicas,
            Role::Prefill => self.prefill_replicas,
            Role::Decode => self.decode_replicas,
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What a replica does in disaggregated serving (a worker's `--disaggregation-mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode both.
    #[default]
    None,
    Prefill,
    Decode,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::None, Role::Prefill, Role::Decode];

    pub fn is_none(&self) -> bool {
        *self == Role::None
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::None => "none",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// As a worker's card says it.
    pub fn proto(self) -> crate::worker::ServingRole {
        match self {
            Role::None => crate::worker::ServingRole::Aggregated,
            Role::Prefill => crate::worker::ServingRole::Prefill,
            Role::Decode => crate::worker::ServingRole::Decode,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| format!("{s:?}: none, prefill or decode"))
    }
}

fn one() -> u32 {
    1
}

/// One replica placed on one node: its tensor-parallel ranks on `devices` (rank i on
/// devices[i]), all on that node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub replica: String,
    pub model: String,
    /// The weights to load (the catalog's name for them).
    pub weights: String,
    pub node: String,
    pub devices: Vec<u32>,
    /// The placement leader's election revision when it wrote this: a newer leader's
    /// assignments supersede an older one's.
    pub leader_revision: i64,
    /// Speculative decoding as the catalog sets it for the model (absent: off, as in
    /// records written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpecConfig>,
    /// Its part in disaggregated serving (absent: none).
    #[serde(default, skip_serializing_if = "Role::is_none")]
    pub role: Role,
}

/// How the catalog has a model served: the weights to load, and its speculation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serving {
    pub weights: String,
    pub speculative: Option<SpecConfig>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaState {
    Loading,
    Ready,
    /// Finishing its requests; route nothing new to it.
    Draining,
    /// It could not load or serve; the placement leader places it again.
    Failed,
}

/// A replica as the agent serving it reports it, under the agent's lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub replica: String,
    pub model: String,
    pub node: String,
    pub devices: Vec<u32>,
    /// The worker's gRPC address, `host:port`.
    pub addr: String,
    pub state: ReplicaState,
    /// Tokens per KV block of its prefix-cache events (checked by routers).
    pub block_size: u32,
}

/// A model's subscription supply state, as the control planes last decided it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SupplyRecord {
    pub model: String,
    /// low, medium, high or surplus.
    pub state: String,
    pub updated_at: i64,
}

/// A record as stored: compact JSON.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(record).expect("records serialize")
}

pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_nest_under_their_prefixes_and_give_their_names_back() {
        assert_eq!(node_key("n1"), "/tessera/nodes/n1");
        assert_eq!(deployment_key("vendor-a/model-a"), "/tessera/deployments/vendor-a/model-a");
        assert_eq!(name_in(&deployment_key("vendor-a/model-a"), DEPLOYMENTS), Some("vendor-a/model-a"));
        assert_eq!(assignment_key("n1", "r7"), "/tessera/assignments/n1/r7");
        assert!(assignment_key("n1", "r7").starts_with(&node_assignments("n1")));
        assert!(!assignment_key("n10", "r7").starts_with(&node_assignments("n1")), "n1 is not a prefix of n10");
        assert_eq!(name_in(NODES, NODES), None);
        for key in [node_key("a"), cordon_key("a"), replica_key("a"), supply_key("m/x"), PLACEMENT_ELECTION.into()] {
            assert!(key.starts_with(ROOT));
        }
    }

    #[test]
    fn records_round_trip_and_deployments_default_to_one_device() {
        let node = NodeRecord {
            id: "n1".into(),
            host: "127.0.0.1".into(),
            devices: vec![Device { index: 0, kind: DeviceKind::Cuda, name: "H100".into(), memory_bytes: 80 << 30 }],
            labels: [("region".to_string(), "eu".to_string())].into(),
            state: NodeState::Ready,
            registered_at: 1,
        };
        assert_eq!(decode::<NodeRecord>(&encode(&node)).unwrap(), node);
        let d: Deployment = decode(br#"{"model":"vendor-a/model-a","replicas":2}"#).unwrap();
        assert_eq!((d.tensor_parallel, d.constraints), (1, Constraints::default()));
        assert!(decode::<Deployment>(br#"{"model":"m","replicas":1,"gpus":2}"#).is_err(), "unknown fields refused");
        let r = ReplicaRecord {
            replica: "r1".into(),
            model: "m".into(),
            node: "n1".into(),
            devices: vec![0, 1],
            addr: "127.0.0.1:5000".into(),
            state: ReplicaState::Loading,
            block_size: 16,
        };
        let json = String::from_utf8(encode(&r)).unwrap();
        assert!(json.contains(r#""state":"loading""#), "{json}");
        assert_eq!(decode::<ReplicaRecord>(json.as_bytes()).unwrap(), r);
    }
}
