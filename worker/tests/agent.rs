//! The node agent against a real etcd: it registers its node under a lease, serves the
//! replicas assigned to it and stops the ones unassigned, registers again without
//! dropping work when its lease is lost, drains on SIGTERM (running requests finish,
//! then the node leaves), and disappears with its lease when killed.

mod common;
#[path = "../../tests/support/etcd.rs"]
mod etcd;
mod tiny_models;

use etcd_client::{Client, GetOptions, KeyValue, WatchOptions};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tessera_proto::cluster::{self, Assignment, DeviceKind, NodeRecord, NodeState, ReplicaRecord, ReplicaState};
use tessera_proto::speculative::{SpecConfig, SpecMethod};
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};

/// Waits (up to two minutes) until the keys under `prefix` satisfy `f`, re-reading them
/// at each change etcd reports.
async fn until<T>(client: &mut Client, prefix: &str, f: impl Fn(&[KeyValue]) -> Option<T>) -> T {
    let wait = async {
        loop {
            let resp = client.get(prefix, Some(GetOptions::new().with_prefix())).await.unwrap();
            if let Some(t) = f(resp.kvs()) {
                return t;
            }
            let from = resp.header().unwrap().revision() + 1;
            let mut watch =
                client.watch(prefix, Some(WatchOptions::new().with_prefix().with_start_revision(from))).await.unwrap();
            watch.message().await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(120), wait).await.unwrap_or_else(|_| panic!("waiting on {prefix}"))
}

fn replica(kvs: &[KeyValue], id: &str, state: ReplicaState) -> Option<ReplicaRecord> {
    let r: ReplicaRecord =
        kvs.iter().find_map(|kv| cluster::decode(kv.value()).ok().filter(|r: &ReplicaRecord| r.replica == id))?;
    (r.state == state).then_some(r)
}

fn node(kvs: &[KeyValue]) -> Option<(NodeRecord, i64)> {
    kvs.first().map(|kv| (cluster::decode(kv.value()).unwrap(), kv.lease()))
}

/// An agent process, killed when dropped: a test that fails leaves no node behind.
struct Agent(Option<Child>);

impl Agent {
    fn start(endpoint: &str, node: &str, extra: &[&str]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_tessera-worker"))
            .args(["agent", "--etcd", endpoint, "--node-id", node, "--lease-ttl-secs", "2"])
            .args(["--kv-cache-bytes", "33554432"])
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        Self(Some(child))
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("running")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A CPU node of two device slots.
fn agent(endpoint: &str, node: &str) -> Agent {
    Agent::start(endpoint, node, &["--devices", "2", "--label", "region=test"])
}

fn signal(agent: &mut Agent, sig: &str) {
    let ok = Command::new("kill").args([sig, &agent.child().id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig}");
}

async fn assign(client: &mut Client, node: &str, replica: &str) {
    let a = Assignment {
        replica: replica.into(),
        model: "vendor-c/model-c".into(),
        weights: common::smollm2_path().display().to_string(),
        node: node.into(),
        devices: vec![0],
        leader_revision: 1,
        // Replicas speculate as their assignment says (outputs do not change).
        speculative: Some(SpecConfig { method: SpecMethod::Ngram, max_tokens: 4, draft: None }),
        role: Default::default(),
    };
    client.put(cluster::assignment_key(node, replica), cluster::encode(&a), None).await.unwrap();
}

/// A generation of `n` tokens, started; read it with `finish`.
async fn generate(addr: &str, n: u32) -> tonic::Streaming<pb::GenerateResponse> {
    let mut worker = WorkerClient::connect(format!("http://{addr}")).await.unwrap();
    let request = pb::GenerateRequest {
        request_id: format!("t-{n}"),
        prompt_token_ids: vec![1, 2, 3, 4],
        sampling: Some(pb::SamplingParams::default()),
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };
    worker.generate(request).await.unwrap().into_inner()
}

/// Reads a generation to its end: its token count and finish reason.
async fn finish(mut stream: tonic::Streaming<pb::GenerateResponse>) -> (usize, i32) {
    let (mut tokens, mut reason) = (0, 0);
    while let Some(r) = stream.message().await.expect("the stream ends cleanly") {
        tokens += r.tokens.len();
        reason = r.finish_reason;
    }
    (tokens, reason)
}

#[tokio::test]
async fn a_node_serves_its_assignments_and_drains_on_sigterm() {
    let server = etcd::Etcd::start();
    let mut etcd = Client::connect([&server.endpoint], None).await.unwrap();
    let mut child = agent(&server.endpoint, "n1");
    let nodes = cluster::node_key("n1");
    let (record, _) = until(&mut etcd, &nodes, node).await;
    assert_eq!((record.devices.len(), record.state), (2, NodeState::Ready));
    assert_eq!(record.labels.get("region").map(String::as_str), Some("test"));

    // An assignment becomes a replica: loading, then ready and answering.
    assign(&mut etcd, "n1", "r1").await;
    let ready = until(&mut etcd, cluster::REPLICAS, |kvs| replica(kvs, "r1", ReplicaState::Ready)).await;
    assert_eq!((ready.node.as_str(), ready.devices.as_slice()), ("n1", &[0][..]));
    let mut worker = WorkerClient::connect(format!("http://{}", ready.addr)).await.unwrap();
    let card = worker.get_model_card(pb::ModelCardRequest {}).await.unwrap().into_inner();
    assert_eq!(card.kv_block_size, ready.block_size);

    // The lease is lost (revoked here): the node and its replica come back under a new
    // one, and a generation running meanwhile is not disturbed.
    let running = generate(&ready.addr, 48).await;
    let (_, lease) = until(&mut etcd, &nodes, node).await;
    etcd.lease_revoke(lease).await.unwrap();
    let (_, new_lease) = until(&mut etcd, &nodes, |kvs| node(kvs).filter(|(_, l)| *l != lease)).await;
    assert_ne!(new_lease, lease);
    let again = until(&mut etcd, cluster::REPLICAS, |kvs| replica(kvs, "r1", ReplicaState::Ready)).await;
    assert_eq!(again.addr, ready.addr, "the same replica, still serving");
    assert_eq!(finish(running).await, (48, pb::FinishReason::Length as i32));

    // Unassigned: the replica drains and is gone.
    etcd.delete(cluster::assignment_key("n1", "r1"), None).await.unwrap();
    until(&mut etcd, cluster::REPLICAS, |kvs| kvs.is_empty().then_some(())).await;

    // SIGTERM with a request running: the node drains, the request finishes whole,
    // then the node leaves and the agent exits cleanly.
    assign(&mut etcd, "n1", "r2").await;
    let r2 = until(&mut etcd, cluster::REPLICAS, |kvs| replica(kvs, "r2", ReplicaState::Ready)).await;
    let running = generate(&r2.addr, 64).await;
    // A router watching the replica's load does not hold the drain open.
    let mut router = WorkerClient::connect(format!("http://{}", r2.addr)).await.unwrap();
    let mut load = router.watch_load(pb::WatchLoadRequest::default()).await.unwrap().into_inner();
    assert!(load.message().await.unwrap().unwrap().snapshot);
    signal(&mut child, "-TERM");
    let (draining, _) = until(&mut etcd, &nodes, |kvs| node(kvs).filter(|(n, _)| n.state == NodeState::Draining)).await;
    assert_eq!(draining.id, "n1");
    assert_eq!(finish(running).await, (64, pb::FinishReason::Length as i32));
    let mut process = child.0.take().unwrap();
    let status = tokio::task::spawn_blocking(move || process.wait().unwrap()).await.unwrap();
    while let Ok(Some(_)) = load.message().await {}
    assert!(status.success(), "the agent exits cleanly after draining: {status}");
    let left = etcd.get(cluster::ROOT, Some(GetOptions::new().with_prefix())).await.unwrap();
    let keys: Vec<String> = left.kvs().iter().map(|kv| kv.key_str().unwrap().to_string()).collect();
    assert!(keys.iter().all(|k| k.starts_with(cluster::ASSIGNMENTS)), "the node and its replica left: {keys:?}");
}

#[tokio::test]
async fn a_killed_node_disappears_with_its_lease() {
    let server = etcd::Etcd::start();
    let mut etcd = Client::connect([&server.endpoint], None).await.unwrap();
    let mut child = agent(&server.endpoint, "n2");
    let nodes = cluster::node_key("n2");
    until(&mut etcd, &nodes, node).await;
    signal(&mut child, "-KILL");
    let _ = child.child().wait();
    // Nothing removes it but the lease's expiry (2 s).
    until(&mut etcd, &nodes, |kvs| kvs.is_empty().then_some(())).await;
}

/// On a GPU machine a node offers its GPUs (no `--devices`), each with its name and
/// memory, and a replica assigned to one of them runs there (a tiny random model: the
/// GPU machines of CI reach no model hub). Skipped where no GPU can be seen, unless
/// `TESSERA_GPU_TESTS=1`.
#[tokio::test]
async fn a_gpu_node_offers_its_gpus_and_serves_on_the_one_assigned() {
    let gpus = match tessera_worker::device::gpus() {
        Ok(gpus) => gpus,
        Err(e) => {
            assert!(std::env::var("TESSERA_GPU_TESTS").as_deref() != Ok("1"), "TESSERA_GPU_TESTS=1 but {e:#}");
            eprintln!("skipped: {e:#}");
            return;
        }
    };
    let server = etcd::Etcd::start();
    let mut etcd = Client::connect([&server.endpoint], None).await.unwrap();
    let _agent = Agent::start(&server.endpoint, "g1", &[]);
    let (record, _) = until(&mut etcd, &cluster::node_key("g1"), node).await;
    assert_eq!(record.devices.len(), gpus.len());
    for (d, (name, memory)) in record.devices.iter().zip(&gpus) {
        assert_eq!((d.kind, &d.name, d.memory_bytes), (DeviceKind::Cuda, name, *memory));
    }
    eprintln!("node g1 offers {:?}", record.devices);

    let dir = tiny_models::temp_root("agent-gpu").join("wide");
    let mut rng = tiny_models::seeded_rng();
    tiny_models::write_dir(
        &dir,
        &tiny_models::wide().config,
        &tiny_models::random_weights(&tiny_models::wide().config, &mut rng),
    );
    tiny_models::write_byte_tokenizer(&dir);
    let gpu = record.devices.last().unwrap().index;
    let a = Assignment {
        replica: "g1-r1".into(),
        model: "tiny/wide".into(),
        weights: dir.display().to_string(),
        node: "g1".into(),
        devices: vec![gpu],
        leader_revision: 1,
        speculative: None,
        role: Default::default(),
    };
    etcd.put(cluster::assignment_key("g1", "g1-r1"), cluster::encode(&a), None).await.unwrap();
    let started = until(&mut etcd, cluster::REPLICAS, |kvs| {
        [ReplicaState::Ready, ReplicaState::Failed].into_iter().find_map(|s| replica(kvs, "g1-r1", s))
    })
    .await;
    assert_eq!((started.state, started.devices.as_slice()), (ReplicaState::Ready, &[gpu][..]));
    assert_eq!(finish(generate(&started.addr, 8).await).await, (8, pb::FinishReason::Length as i32));
}
