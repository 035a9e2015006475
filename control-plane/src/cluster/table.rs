//! The replicas the router may use, as etcd says: one read of every replica record, then
//! a watch from the revision after it. A broken watch (etcd restarted, unreachable)
//! resumes from the last revision applied, so no change is missed; if etcd compacted
//! past that revision, everything is read again. While etcd cannot be reached the last
//! table stays in use and `connected` says false, for /health and the metrics: routing
//! goes on with what was known (a replica that stops answering is dropped by the router
//! itself, from its load stream, not by waiting for etcd).

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use std::collections::BTreeMap;
use std::time::Duration;
use tessera_proto::cluster::{self, ReplicaRecord};
use tokio::sync::watch;

/// The table at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    /// Every replica record, by replica id.
    pub replicas: BTreeMap<String, ReplicaRecord>,
    /// The etcd revision the table reflects.
    pub revision: i64,
    /// Whether the watch is live; false from the first failure until etcd answers again.
    pub connected: bool,
    /// Full reads so far: the first, and one after each compaction that outran the table.
    pub reads: u64,
}

/// Follows the replica records in etcd until it and every receiver of `subscribe` are
/// gone.
pub struct ReplicaTable {
    rx: watch::Receiver<Table>,
}

impl ReplicaTable {
    /// Starts following; `retry` is the pause between attempts while etcd is away.
    pub fn spawn(client: Client, retry: Duration) -> Self {
        let (tx, rx) = watch::channel(Table::default());
        tokio::spawn(follow(client, tx, retry));
        Self { rx }
    }

    /// Receives every change of the table.
    pub fn subscribe(&self) -> watch::Receiver<Table> {
        self.rx.clone()
    }

    pub fn current(&self) -> Table {
        self.rx.borrow().clone()
    }
}

/// Why following stopped for now.
enum Broke {
    /// The watch's start revision was compacted away: read everything again.
    Compacted,
    /// etcd failed or went away: resume from the last revision once it answers.
    Unreachable(String),
}

async fn follow(mut client: Client, tx: watch::Sender<Table>, retry: Duration) {
    let mut reread = true;
    loop {
        if tx.is_closed() {
            return;
        }
        let outcome = if reread { read_all(&mut client, &tx).await } else { Ok(()) };
        let outcome = match outcome {
            Ok(()) => watch_changes(&mut client, &tx).await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(()) => return, // the table and its subscribers are gone
            Err(Broke::Compacted) => reread = true,
            Err(Broke::Unreachable(why)) => {
                if tx.borrow().connected {
                    tracing::warn!("replica table: etcd unreachable ({why}); routing on the last table");
                }
                tx.send_if_modified(|t| std::mem::replace(&mut t.connected, false));
                reread = tx.borrow().revision == 0;
                tokio::time::sleep(retry).await;
            }
        }
    }
}

async fn read_all(client: &mut Client, tx: &watch::Sender<Table>) -> Result<(), Broke> {
    let resp = client
        .get(cluster::REPLICAS, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| Broke::Unreachable(e.to_string()))?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let mut replicas = BTreeMap::new();
    for kv in resp.kvs() {
        if let Some((id, Some(r))) = parse(kv.key(), kv.value()) {
            replicas.insert(id, r);
        }
    }
    let reads = tx.borrow().reads + 1;
    tx.send_replace(Table { replicas, revision, connected: true, reads });
    Ok(())
}

/// Applies changes from the revision after the table's until the watch breaks; Ok once
/// nobody reads the table any more.
async fn watch_changes(client: &mut Client, tx: &watch::Sender<Table>) -> Result<(), Broke> {
    let from = tx.borrow().revision + 1;
    // Progress notices move the revision on while no replica changes, so that a later
    // resume rarely lands before a compaction.
    let options = WatchOptions::new().with_prefix().with_start_revision(from).with_progress_notify();
    let mut stream =
        client.watch(cluster::REPLICAS, Some(options)).await.map_err(|e| Broke::Unreachable(e.to_string()))?;
    let mut closed = Box::pin(tx.closed());
    loop {
        let message = tokio::select! {
            m = stream.message() => m,
            _ = &mut closed => return Ok(()),
        };
        let resp = match message {
            Ok(Some(resp)) => resp,
            Ok(None) => return Err(Broke::Unreachable("the watch ended".into())),
            Err(e) => return Err(Broke::Unreachable(e.to_string())),
        };
        if resp.canceled() {
            return Err(if resp.compact_revision() > 0 {
                Broke::Compacted
            } else {
                Broke::Unreachable(format!("the watch was cancelled: {}", resp.cancel_reason()))
            });
        }
        // The revision everything up to has been applied: the last event's. A response
        // replaying history carries the store's current revision in its header, so that
        // is trusted only from a progress notice (no events, not the creation notice).
        let events = resp.events();
        let applied = match events.last().and_then(|e| e.kv()) {
            Some(kv) => kv.mod_revision(),
            None if !resp.created() => resp.header().map_or(0, |h| h.revision()),
            None => 0,
        };
        tx.send_if_modified(|t| {
            let before = (t.connected, t.revision);
            for event in events {
                let Some(kv) = event.kv() else { continue };
                match (event.event_type(), parse(kv.key(), kv.value())) {
                    (EventType::Put, Some((id, Some(r)))) => {
                        t.replicas.insert(id, r);
                    }
                    // Deleted, or overwritten with something unreadable: no longer usable.
                    (_, Some((id, _))) => {
                        t.replicas.remove(&id);
                    }
                    (_, None) => {}
                }
            }
            // Any answer proves etcd is there.
            t.connected = true;
            t.revision = t.revision.max(applied);
            !events.is_empty() || before != (t.connected, t.revision)
        });
    }
}

/// The replica id a key names (None for other keys), and its record, None (said in the
/// log) for one that does not parse: one bad write must not take routing down. The id
/// is the key's, so that a put and a delete of one key always meet.
fn parse(key: &[u8], value: &[u8]) -> Option<(String, Option<ReplicaRecord>)> {
    let key = String::from_utf8_lossy(key);
    let id = cluster::name_in(&key, cluster::REPLICAS)?.to_string();
    if value.is_empty() {
        return Some((id, None)); // a delete event
    }
    let record = cluster::decode::<ReplicaRecord>(value).map_err(|e| tracing::warn!("ignoring unreadable {key}: {e}"));
    Some((id, record.ok()))
}
