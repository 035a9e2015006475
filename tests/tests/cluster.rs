//! A cluster's placement through what goes wrong, on loopback with every part real
//! (see `support/cluster.rs`): two control planes, three nodes, a deployment of two
//! replicas served through either control plane. The leading control plane is killed:
//! the standby leads within a lease period. A node holding a replica is killed: the new
//! leader moves its replica to the spare node while requests keep succeeding. Then etcd
//! is down for 30 seconds: requests keep succeeding on the last known table, /health says
//! degraded (and so do its metrics), and once etcd is back everything converges. Throughout, no device is ever
//! given to two replicas.

#[path = "../support/cluster.rs"]
mod cluster;

use cluster::{Cluster, LEASE_TTL_SECS, Process, chat, python, tessera, until};
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// Every placed replica (started or not) has devices no other replica has, and an id of
/// its own; returns how many there are.
fn assert_no_double_assignment(c: &Cluster) -> usize {
    let replicas = c.replicas();
    let mut devices = BTreeSet::new();
    let mut ids = BTreeSet::new();
    for r in &replicas {
        assert!(ids.insert(r["id"].as_str().unwrap().to_string()), "replica listed twice: {replicas:?}");
        for d in r["devices"].as_array().unwrap() {
            let slot = (r["node"].as_str().unwrap().to_string(), d.as_u64().unwrap());
            assert!(devices.insert(slot.clone()), "device {slot:?} given to two replicas: {replicas:?}");
        }
    }
    replicas.len()
}

/// Which control planes say they lead placement (those that answer).
fn leaders(cps: &[Option<cluster::ControlPlane>]) -> Vec<usize> {
    (0..cps.len())
        .filter(|&i| {
            cps[i].as_ref().and_then(|cp| cp.health()).is_some_and(|h| h["placement"]["leader"] == Value::Bool(true))
        })
        .collect()
}

#[test]
fn placement_survives_a_killed_leader_a_killed_node_and_an_etcd_outage() {
    let mut c = Cluster::start();
    let mut cps = vec![Some(c.control_plane()), Some(c.control_plane())];
    let names = ["n1", "n2", "n3"];
    let mut nodes: Vec<Option<Process>> = names.iter().map(|n| Some(c.agent(n, &[]))).collect();
    c.deploy(2);
    let placed = until(120, "two ready replicas", || Some(c.ready_nodes()).filter(|n| n.len() == 2));
    for cp in cps.iter().flatten() {
        assert_eq!(chat(&cp.base_url(), &c.key, 2), 2, "both control planes serve");
    }
    assert_eq!(assert_no_double_assignment(&c), 2);

    // The leading control plane dies; the standby leads within one lease period (its
    // last renewal was at most a third of one before the kill; add etcd's expiry tick
    // and this poll, a Python process each), and what was placed stays placed once.
    let leader = until(30, "exactly one leader", || Some(leaders(&cps)).filter(|l| l.len() == 1))[0];
    let standby = 1 - leader;
    let killed_at = Instant::now();
    drop(cps[leader].take());
    until(15, "the standby leads", || (leaders(&cps) == [standby]).then_some(()));
    let took = killed_at.elapsed();
    eprintln!("placement failover took {took:?}");
    assert!(took <= Duration::from_millis(LEASE_TTL_SECS * 1000 + 2500), "failover took {took:?}");
    assert_eq!(assert_no_double_assignment(&c), 2);
    let cp = cps[standby].take().unwrap();
    let base = cp.base_url();

    // A node holding a replica dies (SIGKILL): the new leader moves its replica to the
    // spare node while the SDK client keeps sending.
    let victim = placed[0].clone();
    drop(nodes[names.iter().position(|n| *n == victim).unwrap()].take());
    let (base2, key2) = (base.clone(), c.key.clone());
    let traffic = std::thread::spawn(move || chat(&base2, &key2, 20));
    let moved = until(120, "the replica moved off the killed node", || {
        assert_no_double_assignment(&c);
        Some(c.ready_nodes()).filter(|n| n.len() == 2 && !n.contains(&victim))
    });
    assert_eq!(traffic.join().unwrap(), 20, "every request during the move succeeded");
    until(30, "the dead node's assignment is gone", || (assert_no_double_assignment(&c) == 2).then_some(()));

    // etcd goes away for 30 s: the control plane says so (in /health and its metrics),
    // and serves on its last table.
    assert_eq!(cp.health().unwrap()["status"], "ok");
    let metrics = cp.metrics().unwrap();
    for line in [
        "tessera_etcd_connected 1",
        "tessera_etcd_revision ",
        "tessera_placement_leader 1",
        "tessera_ready_replicas{model=\"vendor-a/model-a\"} 2",
        "tessera_http_requests_total{route=\"/v1/chat/completions\",status=\"200\",model=\"vendor-a/model-a\"}",
    ] {
        assert!(metrics.lines().any(|l| l.starts_with(line)), "no {line} in\n{metrics}");
    }
    c.etcd.stop();
    let down_at = Instant::now();
    until(30, "/health says etcd is unreachable", || {
        let h = cp.health()?;
        (h["status"] == "degraded" && h["etcd"]["connected"] == false).then_some(())
    });
    assert!(cp.metrics().unwrap().lines().any(|l| l == "tessera_etcd_connected 0"));
    let outage = r#"
import os, time, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
end = time.time() + float(os.environ["SECONDS"])
done = 0
while time.time() < end:
    r = c.chat.completions.create(model="vendor-a/model-a", max_tokens=4,
        messages=[{"role": "user", "content": f"Say {done}"}])
    assert r.choices[0].finish_reason in ("length", "stop"), r
    done += 1
print(done)
"#;
    let left = Duration::from_secs(30).saturating_sub(down_at.elapsed());
    let out = python(outage, &base, &c.key, &[("SECONDS", left.as_secs_f64().to_string())]).output().unwrap();
    assert!(out.status.success(), "a request failed while etcd was down: {}", String::from_utf8_lossy(&out.stderr));
    let served: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(served > 0, "no request was served while etcd was down");

    // etcd returns: the control plane reconnects, the nodes and replicas are as before
    // (or placed anew, once), and a leader leads.
    c.etcd.resume();
    until(60, "the cluster converged after the outage", || {
        let h = cp.health()?;
        let ready = h["status"] == "ok" && h["ready_replicas"] == 2 && h["placement"]["leader"] == true;
        (ready && c.ready_nodes() == moved && assert_no_double_assignment(&c) == 2).then_some(())
    });
    let live: Vec<Value> = tessera(&["nodes", "list", "--etcd", &c.endpoint()]).as_array().unwrap().clone();
    assert_eq!(live.len(), 2, "the two live nodes registered, the dead one gone: {live:?}");
    assert!(live.iter().all(|n| n["state"] == "ready"), "{live:?}");
    assert_eq!(chat(&base, &c.key, 4), 4, "served after the outage");
}
