//! The placement controller against a real etcd, with nodes registered as their agents
//! would (records under leases of their own): replicas are placed to fit exactly, a node
//! whose lease ends has its replicas moved, a cordon is honoured, and when the leading
//! control plane stops, a standby takes over within a lease period — never two
//! replicas on one device.

#[path = "../../tests/support/etcd.rs"]
mod etcd;

use etcd_client::{Client, GetOptions, PutOptions, WatchOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tessera_control_plane::cluster::leader::{self, LeaderConfig};
use tessera_proto::cluster::{self, Assignment, Deployment, Device, DeviceKind, NodeRecord, NodeState, Serving};
use tessera_proto::speculative::{SpecConfig, SpecMethod};
use tokio::sync::watch;

async fn register(client: &mut Client, id: &str, devices: u32) -> i64 {
    let lease = client.lease_grant(60, None).await.unwrap().id();
    let device = |index| Device { index, kind: DeviceKind::Cpu, name: "cpu".into(), memory_bytes: 1 << 30 };
    let node = NodeRecord {
        id: id.into(),
        host: "127.0.0.1".into(),
        devices: (0..devices).map(device).collect(),
        labels: BTreeMap::new(),
        state: NodeState::Ready,
        registered_at: 0,
    };
    client.put(cluster::node_key(id), cluster::encode(&node), Some(PutOptions::new().with_lease(lease))).await.unwrap();
    lease
}

async fn deploy(client: &mut Client, model: &str, replicas: u32, tp: u32) {
    let d = Deployment {
        model: model.into(),
        replicas,
        tensor_parallel: tp,
        constraints: Default::default(),
        prefill_replicas: 0,
        decode_replicas: 0,
    };
    client.put(cluster::deployment_key(model), cluster::encode(&d), None).await.unwrap();
}

async fn assignments(client: &mut Client) -> (Vec<Assignment>, i64) {
    let resp = client.get(cluster::ASSIGNMENTS, Some(GetOptions::new().with_prefix())).await.unwrap();
    let list = resp.kvs().iter().map(|kv| cluster::decode(kv.value()).unwrap()).collect();
    (list, resp.header().unwrap().revision())
}

/// Devices are never shared, in any state the assignments pass through.
fn no_device_twice(list: &[Assignment]) {
    let mut seen = BTreeSet::new();
    for a in list {
        for d in &a.devices {
            assert!(seen.insert((a.node.clone(), *d)), "device {d} of {} assigned twice: {list:?}", a.node);
        }
    }
}

/// Waits until the assignments satisfy `f`, checking every state they pass through.
async fn until(client: &mut Client, f: impl Fn(&[Assignment]) -> bool) -> Vec<Assignment> {
    let wait = async {
        loop {
            let (list, revision) = assignments(client).await;
            no_device_twice(&list);
            if f(&list) {
                return list;
            }
            let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
            let mut watch = client.watch(cluster::ASSIGNMENTS, Some(options)).await.unwrap();
            watch.message().await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), wait).await.expect("the assignments never settled")
}

fn count(list: &[Assignment], model: &str) -> usize {
    list.iter().filter(|a| a.model == model).count()
}

fn leader_config(id: &str) -> LeaderConfig {
    LeaderConfig {
        id: id.into(),
        lease_ttl_secs: 2,
        resync: Duration::from_secs(1),
        node_grace: Duration::from_secs(1),
    }
}

#[tokio::test]
async fn placement_fits_moves_and_fails_over() {
    let server = etcd::Etcd::start();
    let mut c = Client::connect([&server.endpoint], None).await.unwrap();
    let ngram = Some(SpecConfig { method: SpecMethod::Ngram, max_tokens: 4, draft: None });
    let weights: BTreeMap<String, Serving> =
        [("vendor-a/model-a", "w-a", ngram.clone()), ("vendor-c/model-c", "w-c", None)]
            .iter()
            .map(|(m, w, speculative)| {
                (m.to_string(), Serving { weights: w.to_string(), speculative: speculative.clone() })
            })
            .collect();
    let leases: Vec<i64> =
        vec![register(&mut c, "n1", 2).await, register(&mut c, "n2", 2).await, register(&mut c, "n3", 2).await];
    // Two control planes campaign; one leads.
    let (first_leads, first_leading) = watch::channel(false);
    let (second_leads, second_leading) = watch::channel(false);
    let first = tokio::spawn(leader::run(c.clone(), leader_config("cp-1"), weights.clone(), first_leads));
    let second = tokio::spawn(leader::run(c.clone(), leader_config("cp-2"), weights.clone(), second_leads));

    // A TP-2 model ×2 and a TP-1 model ×2 fill the 6 devices exactly.
    deploy(&mut c, "vendor-a/model-a", 2, 2).await;
    deploy(&mut c, "vendor-c/model-c", 2, 1).await;
    let placed = until(&mut c, |l| count(l, "vendor-a/model-a") == 2 && count(l, "vendor-c/model-c") == 2).await;
    assert!(
        placed.iter().filter(|a| a.model == "vendor-a/model-a").all(|a| a.devices.len() == 2 && a.weights == "w-a")
    );
    // Each assignment carries its model's speculation from the catalog.
    assert!(placed.iter().all(|a| a.speculative == if a.model == "vendor-a/model-a" { ngram.clone() } else { None }));
    assert_eq!(placed.iter().map(|a| a.devices.len()).sum::<usize>(), 6);

    // A node's lease ends (it died): its replicas move to the room a new node brings.
    let lost = placed[0].node.clone();
    let index = ["n1", "n2", "n3"].iter().position(|n| *n == lost).unwrap();
    register(&mut c, "n4", 2).await;
    c.lease_revoke(leases[index]).await.unwrap();
    let moved = until(&mut c, |l| {
        l.iter().all(|a| a.node != lost) && count(l, "vendor-a/model-a") == 2 && count(l, "vendor-c/model-c") == 2
    })
    .await;
    assert!(moved.iter().any(|a| a.node == "n4"));

    // A cordoned node takes nothing new.
    c.put(cluster::cordon_key("n4"), cluster::encode(&cluster::Cordon { at: 0 }), None).await.unwrap();
    register(&mut c, "n5", 1).await;
    deploy(&mut c, "vendor-c/model-c", 3, 1).await;
    let grown = until(&mut c, |l| count(l, "vendor-c/model-c") == 3).await;
    let newest: Vec<_> = grown.iter().filter(|a| !moved.contains(a)).collect();
    assert_eq!(newest.len(), 1);
    assert_eq!(newest[0].node, "n5");

    // The leader stops (its process dies: no more keep-alives). A standby leads within
    // a lease period (2 s) plus a reconcile, and what it writes carries its own, newer
    // election revision.
    let revision_before = grown.iter().map(|a| a.leader_revision).max().unwrap();
    let leading = current_leader(&mut c).await;
    assert_eq!((*first_leading.borrow(), *second_leading.borrow()), (leading == "cp-1", leading == "cp-2"));
    let (stopped, standby) = if leading == "cp-1" { (first, second) } else { (second, first) };
    stopped.abort();
    let _ = stopped.await;
    let t = Instant::now();
    register(&mut c, "n6", 1).await;
    deploy(&mut c, "vendor-c/model-c", 4, 1).await;
    let after = until(&mut c, |l| count(l, "vendor-c/model-c") == 4).await;
    assert!(t.elapsed() < Duration::from_secs(10), "failover took {:?}", t.elapsed());
    let added: Vec<_> = after.iter().filter(|a| !grown.contains(a)).collect();
    assert_eq!(added.len(), 1);
    assert_eq!(added[0].node, "n6");
    assert!(added[0].leader_revision > revision_before, "written by the new leader");
    let new_leader = current_leader(&mut c).await;
    assert_ne!(new_leader, leading);
    standby.abort();
}

/// The election's current leader, as its value says.
async fn current_leader(c: &mut Client) -> String {
    let resp = c.leader(cluster::PLACEMENT_ELECTION).await.expect("a placement leader");
    resp.kv().expect("a leader key").value_str().unwrap().to_string()
}

/// Runs `tessera ARGS --etcd ENDPOINT --json` and returns its JSON.
fn tessera(endpoint: &str, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .args(["--etcd", endpoint, "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "tessera {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn operator_commands_read_and_write_the_cluster() {
    let server = etcd::Etcd::start();
    let e = server.endpoint.as_str();
    let mut c = Client::connect([e], None).await.unwrap();
    register(&mut c, "n1", 2).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("deploy.toml");
    std::fs::write(
        &file,
        "[[deployment]]\nmodel = \"vendor-a/model-a\"\nreplicas = 2\ntensor_parallel = 2\n\n\
         [[deployment]]\nmodel = \"vendor-c/model-c\"\nreplicas = 1\n[deployment.constraints]\nlabels = { region = \"eu\" }\n",
    )
    .unwrap();
    let applied = tessera(e, &["deployments", "apply", file.to_str().unwrap()]);
    assert_eq!(applied.as_array().unwrap().len(), 2);
    let listed = tessera(e, &["deployments", "list"]);
    let models: Vec<&str> = listed.as_array().unwrap().iter().map(|d| d["model"].as_str().unwrap()).collect();
    assert_eq!(models, ["vendor-a/model-a", "vendor-c/model-c"]);
    assert_eq!(listed[1]["constraints"]["labels"]["region"], "eu");
    assert_eq!(tessera(e, &["deployments", "scale", "vendor-a/model-a", "3"])["replicas"], 3);

    tessera(e, &["nodes", "cordon", "n1"]);
    let nodes = tessera(e, &["nodes", "list"]);
    assert_eq!((nodes[0]["id"].as_str(), nodes[0]["cordoned"].as_bool()), (Some("n1"), Some(true)));
    tessera(e, &["nodes", "drain", "n1"]);
    assert_eq!(tessera(e, &["nodes", "list"])[0]["drain_requested"], true);
    tessera(e, &["nodes", "uncordon", "n1"]);
    let nodes = tessera(e, &["nodes", "list"]);
    assert_eq!((nodes[0]["cordoned"].as_bool(), nodes[0]["drain_requested"].as_bool()), (Some(false), Some(false)));
    assert_eq!(tessera(e, &["replicas", "list"]), serde_json::json!([]));

    // A file with a mistake is refused whole.
    std::fs::write(&file, "[[deployment]]\nmodel = \"model-a\"\nreplicas = 1\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["deployments", "apply", file.to_str().unwrap(), "--etcd", e])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("full id"));
}
