//! The whole cluster read from etcd in one request (one revision): nodes, operators'
//! cordons and drains, deployments, assignments and replicas.

use super::leader::views;
use super::placement::ClusterState;
use etcd_client::{Client, GetOptions};
use tessera_proto::cluster::{self, Assignment, Deployment, NodeRecord, ReplicaRecord};

/// The state, and the etcd revision it was read at.
pub async fn read(client: &mut Client) -> Result<(ClusterState, i64), etcd_client::Error> {
    let resp = client.get(cluster::ROOT, Some(GetOptions::new().with_prefix())).await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let (mut nodes, mut cordoned, mut draining) = (Vec::new(), Vec::new(), Vec::new());
    let mut state = ClusterState::default();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        let value = kv.value();
        // A record that does not parse is skipped, and said so: one bad write must not
        // stop placement for everyone.
        let skip = |e: serde_json::Error| tracing::warn!("ignoring unreadable {key}: {e}");
        if cluster::name_in(&key, cluster::NODES).is_some() {
            cluster::decode::<NodeRecord>(value).map(|n| nodes.push(n)).unwrap_or_else(skip);
        } else if let Some(node) = cluster::name_in(&key, cluster::CORDONS) {
            cordoned.push(node.to_string());
        } else if let Some(node) = cluster::name_in(&key, cluster::DRAINS) {
            draining.push(node.to_string());
        } else if cluster::name_in(&key, cluster::DEPLOYMENTS).is_some() {
            cluster::decode::<Deployment>(value).map(|d| state.deployments.push(d)).unwrap_or_else(skip);
        } else if cluster::name_in(&key, cluster::ASSIGNMENTS).is_some() {
            cluster::decode::<Assignment>(value).map(|a| state.assignments.push(a)).unwrap_or_else(skip);
        } else if cluster::name_in(&key, cluster::REPLICAS).is_some() {
            cluster::decode::<ReplicaRecord>(value).map(|r| state.replicas.push(r)).unwrap_or_else(skip);
        }
    }
    state.nodes = views(nodes, &cordoned, &draining);
    Ok((state, revision))
}
