//! Nodes leaving a cluster under traffic, on loopback with every part real (see
//! `support/cluster.rs`): one control plane, three nodes whose replicas run at most two
//! sequences at once, a deployment of two replicas.
//!
//! - A node drained (`tessera nodes drain`) while four SDK clients send requests
//!   without pause: its replica moves to the spare node and not one request fails.
//! - A node killed (SIGKILL) while eight streams run: the streams it had started end
//!   with an error event in the stream, after their first tokens; the requests it had
//!   queued (no token yet) are served by the other replica; and every request is billed
//!   exactly once — for what it generated — under the id its response carried.

#[path = "../support/cluster.rs"]
mod cluster;

use cluster::{Cluster, Process, STEADY, STREAMS, python, read_until, tessera, until};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};

#[test]
fn draining_and_killed_nodes_lose_no_request_and_bill_each_once() {
    let c = Cluster::start();
    let cp = c.control_plane();
    let names = ["n1", "n2", "n3"];
    let mut nodes: Vec<Option<Process>> =
        names.iter().map(|n| Some(c.agent(n, &["--max-num-seqs", "2", "--drain-grace-ms", "500"]))).collect();
    c.deploy(2);
    let placed = until(120, "two ready replicas", || Some(c.ready_nodes()).filter(|n| n.len() == 2));
    assert_eq!(cluster::chat(&cp.base_url(), &c.key, 2), 2);

    // Drain a node under steady load.
    let stop = c.data_dir().to_string() + "/stop";
    let mut steady = Process(
        python(STEADY, &cp.base_url(), &c.key, &[("THREADS", "4".into()), ("STOP", stop.clone())]).spawn().unwrap(),
    );
    let mut lines = BufReader::new(steady.0.stdout.take().unwrap()).lines();
    read_until(&mut lines, "ok", 4);
    let drained = placed[0].clone();
    tessera(&["nodes", "drain", &drained, "--etcd", &c.endpoint()]);
    let after_drain = until(120, "the drained node's replica moved", || {
        Some(c.ready_nodes()).filter(|n| n.len() == 2 && !n.contains(&drained))
    });
    until(60, "the drained node holds nothing", || {
        let on_it = c.replicas().iter().filter(|r| r["node"] == drained.as_str()).count();
        (on_it == 0).then_some(())
    });
    // A few more after the move, then stop.
    read_until(&mut lines, "ok", 4);
    std::fs::write(&stop, "").unwrap();
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(steady.0.wait().unwrap().success());
    let failures: Vec<&String> = rest.iter().filter(|l| l.starts_with("failure")).collect();
    assert!(failures.is_empty(), "requests failed during the drain: {failures:?}");
    let summary = rest.iter().find(|l| l.starts_with("done ")).expect("the clients' summary");
    eprintln!("drain under load: {summary}");

    // Kill a node while eight streams run: each replica runs two and queues two.
    let billed_before = c.usage().len();
    let mut streams = Process(python(STREAMS, &cp.base_url(), &c.key, &[("N", "8".into())]).spawn().unwrap());
    let mut lines = BufReader::new(streams.0.stdout.take().unwrap()).lines();
    read_until(&mut lines, "started", 4);
    let victim = after_drain[0].clone();
    drop(nodes[names.iter().position(|n| *n == victim).unwrap()].take());
    let results: Vec<Value> =
        lines.map(Result::unwrap).filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(&l).unwrap()).collect();
    let stderr = std::io::read_to_string(streams.0.stderr.take().unwrap()).unwrap();
    assert!(streams.0.wait().unwrap().success(), "{stderr}");
    assert_eq!(results.len(), 8, "{results:?}");
    let (failed, finished): (Vec<&Value>, Vec<&Value>) = results.iter().partition(|r| !r["error"].is_null());
    for r in &failed {
        assert!(r["chunks"].as_u64().unwrap() > 0, "a request failed before its first token: {r}");
    }
    for r in &finished {
        assert!(matches!(r["finish"].as_str(), Some("length" | "stop")), "{r}");
    }
    eprintln!("node killed mid-stream: {} streams ended with an error, {} finished", failed.len(), finished.len());
    assert!(!failed.is_empty(), "the killed node's started streams ended with an error: {results:?}");
    assert!(failed.len() <= 2, "only the streams the killed replica was running fail: {results:?}");

    // Billed once each (eight records more, however many replicas a request tried),
    // under the id the response carried; a broken stream for the tokens it generated.
    let usage = until(30, "every request settled", || {
        let usage = c.usage();
        (usage.len() == billed_before + 8 && c.credits()["held_micros"] == 0).then_some(usage)
    });
    let by_id: BTreeMap<&str, &Value> = usage.iter().map(|u| (u["request_id"].as_str().unwrap(), u)).collect();
    for r in &results {
        let u = by_id.get(r["id"].as_str().unwrap()).unwrap_or_else(|| panic!("{r} was not billed"));
        let generated = u["completion_tokens"].as_u64().unwrap();
        if r["error"].is_null() {
            assert_eq!(Some(generated), r["usage"].as_u64(), "billed as the stream's usage said: {u}");
        } else {
            assert!(generated >= r["chunks"].as_u64().unwrap(), "billed for what it sent: {u} {r}");
        }
    }
    let spent: i64 = usage.iter().map(|u| u["cost_micros"].as_i64().unwrap()).sum();
    let balance = c.credits()["balance_micros"].as_i64().unwrap();
    assert_eq!(balance, 10_000_000 - spent, "the balance is the grant less every bill, once");
}
