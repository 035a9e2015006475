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

use cluster::{Cluster, Process, python, tessera, until};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};

/// SDK clients (`THREADS`) sending streamed chat completions back to back until the file
/// `STOP` exists; prints how many succeeded, then each failure.
const STEADY: &str = r#"
import os, sys, threading, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
done, failures = [0], []
def client(t):
    i = 0
    while not os.path.exists(os.environ["STOP"]):
        try:
            text, finish = "", None
            for chunk in c.chat.completions.create(model="vendor-a/model-a", max_tokens=12, stream=True,
                    messages=[{"role": "user", "content": f"Client {t} asks {i}"}]):
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
            assert finish in ("length", "stop"), finish
            done[0] += 1
            print("ok", flush=True)
        except Exception as e:
            failures.append(repr(e))
        i += 1
threads = [threading.Thread(target=client, args=(t,)) for t in range(int(os.environ["THREADS"]))]
for t in threads: t.start()
for t in threads: t.join()
print("done", done[0], flush=True)
for f in failures: print("failure", f, flush=True)
"#;

/// `N` streams at once, each announcing its first content (`started`); then one JSON
/// line per stream: its x-request-id, the chunks that carried text, how it finished,
/// and the error that ended it, if one did (and whether that came before any text).
const STREAMS: &str = r#"
import json, os, threading, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
results = {}
def stream(i):
    r = {"id": None, "chunks": 0, "finish": None, "error": None}
    try:
        # Long enough that no stream can finish before the node is killed (with TCP_NODELAY
        # 96 tokens could), whatever the machine's speed: it is killed after four start.
        raw = c.chat.completions.with_raw_response.create(model="vendor-a/model-a", max_tokens=768,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"Tell a long story about the number {i}."}])
        r["id"] = raw.headers.get("x-request-id")
        for chunk in raw.parse():
            if chunk.usage:
                r["usage"] = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if (delta.content or getattr(delta, "reasoning", None) or ""):
                if r["chunks"] == 0:
                    print("started", flush=True)
                r["chunks"] += 1
            r["finish"] = chunk.choices[0].finish_reason or r["finish"]
    except Exception as e:
        r["error"] = repr(e)
    results[i] = r
threads = [threading.Thread(target=stream, args=(i,)) for i in range(int(os.environ["N"]))]
for t in threads: t.start()
for t in threads: t.join()
for r in results.values(): print(json.dumps(r), flush=True)
"#;

/// Reads the clients' output until `count` lines have said `what`.
fn read_until(lines: &mut impl Iterator<Item = std::io::Result<String>>, what: &str, count: u32) {
    let mut seen = 0;
    while seen < count {
        let line = lines.next().unwrap_or_else(|| panic!("the clients stopped before {count} said {what:?}")).unwrap();
        seen += (line == what) as u32;
    }
}

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
    let mut steady =
        python(STEADY, &cp.base_url(), &c.key, &[("THREADS", "4".into()), ("STOP", stop.clone())]).spawn().unwrap();
    let mut lines = BufReader::new(steady.stdout.take().unwrap()).lines();
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
    assert!(steady.wait().unwrap().success());
    let failures: Vec<&String> = rest.iter().filter(|l| l.starts_with("failure")).collect();
    assert!(failures.is_empty(), "requests failed during the drain: {failures:?}");
    let summary = rest.iter().find(|l| l.starts_with("done ")).expect("the clients' summary");
    eprintln!("drain under load: {summary}");

    // Kill a node while eight streams run: each replica runs two and queues two.
    let billed_before = c.usage().len();
    let mut streams = python(STREAMS, &cp.base_url(), &c.key, &[("N", "8".into())]).spawn().unwrap();
    let mut lines = BufReader::new(streams.stdout.take().unwrap()).lines();
    read_until(&mut lines, "started", 4);
    let victim = after_drain[0].clone();
    drop(nodes[names.iter().position(|n| *n == victim).unwrap()].take());
    let results: Vec<Value> =
        lines.map(Result::unwrap).filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(&l).unwrap()).collect();
    let stderr = std::io::read_to_string(streams.stderr.take().unwrap()).unwrap();
    assert!(streams.wait().unwrap().success(), "{stderr}");
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
