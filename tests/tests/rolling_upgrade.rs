//! A rolling upgrade of the control planes under traffic, on loopback with every part
//! real (see `support/cluster.rs`): two `tessera control-plane` processes over one
//! database and one etcd, a node serving the model. Each control plane in turn is
//! stopped with SIGTERM while 20 streams run through it (and SDK clients keep sending
//! through the other), then started again on its port: every stream runs to its end
//! across the signal, the process exits cleanly, the clients of the other see no
//! failure, and every request is billed exactly once.

#[path = "../support/cluster.rs"]
mod cluster;

use cluster::{Cluster, Process, STEADY, STREAMS, python, read_until, until};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use tessera_e2e::free_port;

const STREAMS_PER_STOP: u32 = 20;
/// Every stream is still generating when its control plane gets SIGTERM (asserted).
const MAX_TOKENS: u64 = 128;

#[test]
fn control_planes_stopped_and_restarted_in_turn_lose_no_request_and_bill_each_once() {
    let c = Cluster::start();
    // Streams get as long as they need after SIGTERM (on two busy cores, 20 streams at
    // once decode slowly); Kubernetes' grace period is set above this (deploy/kubernetes).
    let grace = ["--shutdown-grace-secs", "300"];
    let start = |port| c.control_plane_on(port, &grace);
    let mut cps = [start(free_port()), start(free_port())];
    // Room for every stream at once (20 × ~170 tokens of 23 KB): none waits or is
    // preempted. No pacing: all twenty prompts go into one step, so every stream is
    // generating long before any can end.
    let _node = c.agent("n1", &["--max-num-seqs", "32", "--kv-cache-bytes", "268435456", "--prompt-step-percent", "0"]);
    c.deploy(1);
    until(120, "a ready replica", || (c.ready_nodes().len() == 1).then_some(()));
    for cp in &cps {
        assert_eq!(cluster::chat(&cp.base_url(), &c.key, 1), 1);
    }
    let mut billed = 2;
    let t0 = std::time::Instant::now();

    for stopped in 0..2 {
        let other = &cps[1 - stopped];
        let stop = format!("{}/stop-{stopped}", c.data_dir());
        // Process: killed if the test fails before it writes the stop file.
        let steady_env = [("THREADS", "1".into()), ("STOP", stop.clone())];
        let mut steady = Process(python(STEADY, &other.base_url(), &c.key, &steady_env).spawn().unwrap());
        let mut steady_lines = BufReader::new(steady.0.stdout.take().unwrap()).lines();
        read_until(&mut steady_lines, "ok", 1);

        let signalled = format!("{}/signalled-{stopped}", c.data_dir());
        let env = [
            ("N", STREAMS_PER_STOP.to_string()),
            ("MAX_TOKENS", MAX_TOKENS.to_string()),
            ("SIGNALLED", signalled.clone()),
        ];
        let mut streams = Process(python(STREAMS, &cps[stopped].base_url(), &c.key, &env).spawn().unwrap());
        let mut lines = BufReader::new(streams.0.stdout.take().unwrap()).lines();
        // Every stream is generating: each has had content (and none has ended).
        let mut started = 0;
        while started < STREAMS_PER_STOP {
            let Some(line) = lines.next() else {
                let stderr = std::io::read_to_string(streams.0.stderr.take().unwrap()).unwrap();
                panic!("the streams ended before {STREAMS_PER_STOP} started: {stderr}");
            };
            let line = line.unwrap();
            started += (line == "started") as u32;
            assert!(!line.starts_with('{'), "a stream ended before all started: {line}");
        }
        eprintln!("{:?}: {STREAMS_PER_STOP} streams generating through control plane {stopped}", t0.elapsed());
        std::fs::write(&signalled, "").unwrap();
        let port = cps[stopped].port;
        let status = cps[stopped].process.terminate(300);
        eprintln!("{:?}: control plane {stopped} exited", t0.elapsed());
        assert!(status.success(), "control plane {stopped} ended with {status} after SIGTERM");

        let results: Vec<Value> = lines
            .map(Result::unwrap)
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(&l).unwrap())
            .collect();
        let stderr = std::io::read_to_string(streams.0.stderr.take().unwrap()).unwrap();
        assert!(streams.0.wait().unwrap().success(), "{stderr}");
        assert_eq!(results.len(), STREAMS_PER_STOP as usize, "{results:?}");
        for r in &results {
            assert!(r["error"].is_null(), "a stream failed across SIGTERM: {r}");
            assert_eq!(r["finish"], "length", "{r}");
            assert_eq!(r["usage"], MAX_TOKENS, "{r}");
            assert!(r["after_signal"].as_u64().unwrap() > 0, "the stream was still running at SIGTERM: {r}");
        }

        // Started again on its port, it serves.
        cps[stopped] = start(port);
        until(60, "the restarted control plane answers", || cps[stopped].health());
        assert_eq!(cluster::chat(&cps[stopped].base_url(), &c.key, 1), 1);

        std::fs::write(&stop, "").unwrap();
        let rest: Vec<String> = steady_lines.map(Result::unwrap).collect();
        assert!(steady.0.wait().unwrap().success());
        let failures: Vec<&String> = rest.iter().filter(|l| l.starts_with("failure")).collect();
        assert!(failures.is_empty(), "requests through the other control plane failed: {failures:?}");
        let done: usize =
            rest.iter().find_map(|l| l.strip_prefix("done ")).expect("the clients' summary").parse().unwrap();
        eprintln!(
            "control plane {stopped} restarted: {} streams across SIGTERM, {done} requests beside",
            results.len()
        );

        // Every request billed once: the streams, the clients' and the restart check.
        billed += STREAMS_PER_STOP as usize + done + 1;
        let usage = until(30, "every request settled", || {
            let usage = c.usage();
            (usage.len() >= billed && c.credits()["held_micros"] == 0).then_some(usage)
        });
        assert_eq!(usage.len(), billed, "as many usage records as requests");
        let mut by_id: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
        for u in &usage {
            by_id.entry(u["request_id"].as_str().unwrap()).or_default().push(u);
        }
        assert_eq!(by_id.len(), usage.len(), "a request was billed twice");
        for r in &results {
            let u = by_id.get(r["id"].as_str().unwrap()).unwrap_or_else(|| panic!("{r} was not billed"))[0];
            assert_eq!(u["completion_tokens"], MAX_TOKENS, "billed as the stream's usage said: {u}");
        }
    }
    let spent: i64 = c.usage().iter().map(|u| u["cost_micros"].as_i64().unwrap()).sum();
    assert_eq!(
        c.credits()["balance_micros"].as_i64().unwrap(),
        10_000_000 - spent,
        "the balance is the grant less every bill, once"
    );
}
