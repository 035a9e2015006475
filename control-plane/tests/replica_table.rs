//! The router's replica table against a real etcd: it reads the records, follows puts
//! and deletes, keeps its last table and says it is disconnected while etcd is down,
//! and after etcd returns catches up on what changed meanwhile — also when etcd
//! compacted away the revision it would resume from.

#[path = "../../tests/support/etcd.rs"]
mod etcd;

use etcd_client::{Client, CompactionOptions};
use std::time::Duration;
use tessera_control_plane::cluster::table::{ReplicaTable, Table};
use tessera_proto::cluster::{self, ReplicaRecord, ReplicaState, etcd_options};
use tokio::sync::watch;

fn record(id: &str, state: ReplicaState) -> ReplicaRecord {
    ReplicaRecord {
        replica: id.into(),
        model: "m".into(),
        node: "n1".into(),
        devices: vec![0],
        addr: "127.0.0.1:1".into(),
        state,
        block_size: 16,
    }
}

async fn put(client: &mut Client, r: &ReplicaRecord) -> i64 {
    let resp = client.put(cluster::replica_key(&r.replica), cluster::encode(r), None).await.unwrap();
    resp.header().unwrap().revision()
}

/// Waits (up to 30 s) for the table to satisfy `f`.
async fn until(rx: &mut watch::Receiver<Table>, what: &str, f: impl Fn(&Table) -> bool) -> Table {
    let wait = async {
        loop {
            if f(&rx.borrow_and_update()) {
                return rx.borrow().clone();
            }
            rx.changed().await.expect("the table stopped");
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait).await.unwrap_or_else(|_| panic!("never: {what}"))
}

fn ids(t: &Table) -> Vec<&str> {
    t.replicas.keys().map(String::as_str).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_follows_etcd_and_survives_its_outage() {
    let mut server = etcd::Etcd::start();
    let endpoint = server.endpoint.clone();
    let connect = || Client::connect([endpoint.clone()], Some(etcd_options()));
    let mut client = connect().await.unwrap();
    put(&mut client, &record("r1", ReplicaState::Ready)).await;
    put(&mut client, &record("r2", ReplicaState::Loading)).await;
    client.put(cluster::replica_key("bad"), "not json", None).await.unwrap();

    // Retries 3 s apart: etcd restarts, and the writes and compaction below land, before
    // the table's next attempt, so it resumes from a compacted revision.
    let table = ReplicaTable::spawn(connect().await.unwrap(), Duration::from_secs(3));
    let mut rx = table.subscribe();
    let t = until(&mut rx, "the first read", |t| t.connected && t.replicas.len() == 2).await;
    assert_eq!(ids(&t), ["r1", "r2"], "the unreadable record is skipped");
    assert_eq!(t.reads, 1);

    // Changes arrive through the watch.
    put(&mut client, &record("r2", ReplicaState::Ready)).await;
    let at = put(&mut client, &record("r3", ReplicaState::Ready)).await;
    client.delete(cluster::replica_key("r1"), None).await.unwrap();
    // A record overwritten with garbage is no longer routable.
    client.put(cluster::replica_key("r5"), cluster::encode(&record("r5", ReplicaState::Ready)), None).await.unwrap();
    client.put(cluster::replica_key("r5"), "garbage", None).await.unwrap();
    let t = until(&mut rx, "r3 in, r1 out, r5 unreadable", |t| t.revision >= at + 3).await;
    assert_eq!(ids(&t), ["r2", "r3"]);
    assert_eq!(t.replicas["r2"].state, ReplicaState::Ready);

    // etcd goes away: the last table stays, marked disconnected.
    server.stop();
    let t = until(&mut rx, "disconnected", |t| !t.connected).await;
    assert_eq!(ids(&t), ["r2", "r3"], "routing keeps the last known table");

    // It comes back; what changed meanwhile arrives, even with the revision the table
    // would resume from compacted away.
    server.resume();
    let mut client = connect().await.unwrap();
    put(&mut client, &record("r4", ReplicaState::Ready)).await;
    client.delete(cluster::replica_key("r2"), None).await.unwrap();
    let last = put(&mut client, &record("r3", ReplicaState::Draining)).await;
    client.compact(last, Some(CompactionOptions::new().with_physical())).await.unwrap();
    let t = until(&mut rx, "caught up", |t| t.connected && t.revision >= last).await;
    assert_eq!(ids(&t), ["r3", "r4"]);
    assert_eq!(t.reads, 2, "read again after the compaction");
    assert_eq!(t.replicas["r3"].state, ReplicaState::Draining);
    assert_eq!(table.current(), t);
}
