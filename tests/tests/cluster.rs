//! A cluster on loopback, every part real: etcd, `tessera control-plane` with its SQLite
//! database, three `tessera-worker agent` nodes of one CPU device each serving the real
//! model, the operator commands, and the official `openai` Python SDK as the client.
//! A deployment of two replicas is placed on two nodes and served; then one of those
//! nodes is killed (SIGKILL): its replica moves to the spare node, and requests sent
//! throughout all succeed. Then etcd goes away: the control plane says so in /health and
//! keeps serving on its last table, and says connected again once etcd is back.

#[path = "../support/etcd.rs"]
mod etcd;

use serde_json::Value;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tessera_e2e::binary;

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `tessera ARGS --json`, parsed.
fn tessera(args: &[&str]) -> Value {
    let out = Command::new(binary("tessera-control-plane", "tessera")).args(args).arg("--json").output().unwrap();
    assert!(out.status.success(), "tessera {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn agent(etcd: &str, node: &str) -> Process {
    let child = Command::new(binary("tessera-worker", "tessera-worker"))
        .args(["agent", "--etcd", etcd, "--node-id", node, "--devices", "1", "--lease-ttl-secs", "3"])
        .args(["--kv-cache-bytes", "67108864"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Process(child)
}

/// The nodes holding a ready replica of the model.
fn ready_nodes(etcd: &str) -> Vec<String> {
    let list = tessera(&["replicas", "list", "--etcd", etcd]);
    let mut nodes: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["state"] == "ready")
        .map(|r| r["node"].as_str().unwrap().to_string())
        .collect();
    nodes.sort();
    nodes
}

/// Waits (up to `secs`) for `f`; the cluster converges through leases and watches.
fn until<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs the SDK client: waits for the model, then sends `count` chat completions one
/// after another, each of which must succeed; prints how many did.
fn chat(base: &str, key: &str, count: u32) -> u32 {
    let script = r#"
import os, sys, time, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
deadline = time.time() + 120
while "vendor-a/model-a" not in [m.id for m in c.models.list().data]:
    assert time.time() < deadline, "the model never appeared"
    time.sleep(0.2)
done = 0
for i in range(int(os.environ["COUNT"])):
    r = c.chat.completions.create(model="vendor-a/model-a", max_tokens=4,
        messages=[{"role": "user", "content": f"Count to {i}"}])
    assert r.choices[0].finish_reason in ("length", "stop"), r
    done += 1
print(done)
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .env("BASE", base)
        .env("KEY", key)
        .env("COUNT", count.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "the SDK client failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn a_deployment_is_placed_served_and_moved_off_a_killed_node() {
    assert!(
        Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success()),
        "this test drives the API with the official SDK: pip install openai (`.ci/run` does)"
    );
    let mut server = etcd::Etcd::start();
    let endpoint = server.endpoint.clone();
    let e = endpoint.as_str();
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().to_str().unwrap();
    let org = tessera(&["orgs", "create", "acme", "--data-dir", dir]);
    let org = org["id"].as_str().unwrap();
    let grant = Command::new(binary("tessera-control-plane", "tessera"))
        .args(["credits", "grant", "--org", org, "--usd", "10", "--data-dir", dir])
        .output()
        .unwrap();
    assert!(grant.status.success());
    let key = tessera(&["keys", "create", "--org", org, "--name", "k", "--data-dir", dir]);
    let key = key["secret"].as_str().unwrap().to_string();

    let port = free_port();
    let _control_plane = Process(
        Command::new(binary("tessera-control-plane", "tessera"))
            .args(["control-plane", "--etcd", e, "--data-dir", dir, "--listen", &format!("127.0.0.1:{port}")])
            .args(["--lease-ttl-secs", "2", "--node-grace-secs", "1", "--rate-limit-rpm", "100000"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut nodes: Vec<Option<Process>> = ["n1", "n2", "n3"].iter().map(|n| Some(agent(e, n))).collect();
    let file = data.path().join("deployments.toml");
    std::fs::write(&file, "[[deployment]]\nmodel = \"vendor-a/model-a\"\nreplicas = 2\ntensor_parallel = 1\n").unwrap();
    tessera(&["deployments", "apply", file.to_str().unwrap(), "--etcd", e]);

    let placed = until(120, "two ready replicas", || Some(ready_nodes(e)).filter(|n| n.len() == 2));
    let base = format!("http://127.0.0.1:{port}/v1");
    assert_eq!(chat(&base, &key, 4), 4);

    // Kill a node holding a replica; the SDK client keeps sending meanwhile.
    let victim = placed[0].clone();
    let index = ["n1", "n2", "n3"].iter().position(|n| *n == victim).unwrap();
    let killed = nodes[index].take();
    drop(killed);
    let (base2, key2) = (base.clone(), key.clone());
    let traffic = std::thread::spawn(move || chat(&base2, &key2, 20));
    let moved = until(120, "the replica moved off the killed node", || {
        Some(ready_nodes(e)).filter(|n| n.len() == 2 && !n.contains(&victim))
    });
    assert_eq!(traffic.join().unwrap(), 20, "every request during the move succeeded");
    assert!(moved.iter().all(|n| n != &victim), "{moved:?}");
    assert_eq!(chat(&base, &key, 4), 4, "served on the new placement");

    // etcd goes away and comes back.
    let health_url = format!("http://127.0.0.1:{port}/health");
    assert_eq!(health(&health_url)["status"], "ok");
    server.stop();
    until(30, "/health says etcd is unreachable", || {
        let h = health(&health_url);
        (h["status"] == "degraded" && h["etcd"]["connected"] == false).then_some(())
    });
    assert_eq!(chat(&base, &key, 4), 4, "served on the last known table without etcd");
    server.resume();
    until(30, "/health says etcd is back", || (health(&health_url)["status"] == "ok").then_some(()));
    assert_eq!(health(&health_url)["ready_replicas"], 2);
}

/// GET `url` (no API key: load balancers ask), as JSON.
fn health(url: &str) -> Value {
    let script = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())";
    let out = Command::new("python3").args(["-c", script, url]).output().unwrap();
    assert!(out.status.success(), "GET {url}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}
