//! A cluster on loopback for end-to-end tests, every part real: etcd, `tessera
//! control-plane` processes over one SQLite database, `tessera-worker agent` nodes of
//! one CPU device each serving the real model, the operator commands, and the official
//! `openai` Python SDK as the client. An organization with credit and a key is made
//! first.

// Each test file uses its own part of this.
#![allow(dead_code)]

#[path = "etcd.rs"]
pub mod etcd;

use serde_json::Value;
use std::process::{Command, Stdio};
pub use tessera_e2e::{Process, python, until};
use tessera_e2e::{binary, free_port};

/// The model every test deploys (the built-in catalog's).
pub const MODEL: &str = "vendor-a/model-a";
/// The agents' and control planes' lease, seconds.
pub const LEASE_TTL_SECS: u64 = 2;

/// `tessera ARGS --json`, parsed.
pub fn tessera(args: &[&str]) -> Value {
    let out = Command::new(binary("tessera-control-plane", "tessera")).args(args).arg("--json").output().unwrap();
    assert!(out.status.success(), "tessera {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

pub struct Cluster {
    pub etcd: etcd::Etcd,
    data: tempfile::TempDir,
    pub org: String,
    pub key: String,
}

/// A control plane's API port and process.
pub struct ControlPlane {
    pub port: u16,
    pub process: Process,
}

impl ControlPlane {
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// GET /health (no API key: load balancers ask), as JSON; None while it does not
    /// answer.
    pub fn health(&self) -> Option<Value> {
        self.get("/health").map(|body| serde_json::from_str(&body).unwrap())
    }

    /// GET /metrics (Prometheus's text format); None while it does not answer.
    pub fn metrics(&self) -> Option<String> {
        self.get("/metrics")
    }

    fn get(&self, path: &str) -> Option<String> {
        tessera_e2e::get(&format!("http://127.0.0.1:{}{path}", self.port))
    }
}

impl Cluster {
    /// etcd, and an organization with $10 of credit and a key.
    pub fn start() -> Self {
        assert!(
            Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success()),
            "this test drives the API with the official SDK: pip install openai (`.ci/run` does)"
        );
        let etcd = etcd::Etcd::start();
        let data = tempfile::tempdir().unwrap();
        let dir = data.path().to_str().unwrap().to_string();
        let org = tessera(&["orgs", "create", "acme", "--data-dir", &dir])["id"].as_str().unwrap().to_string();
        tessera(&["credits", "grant", "--org", &org, "--usd", "10", "--data-dir", &dir]);
        let key = tessera(&["keys", "create", "--org", &org, "--name", "k", "--data-dir", &dir]);
        let key = key["secret"].as_str().unwrap().to_string();
        Self { etcd, data, org, key }
    }

    pub fn endpoint(&self) -> String {
        self.etcd.endpoint.clone()
    }

    pub fn data_dir(&self) -> &str {
        self.data.path().to_str().unwrap()
    }

    /// `tessera control-plane` on a free port, over the cluster's database.
    pub fn control_plane(&self) -> ControlPlane {
        self.control_plane_on(free_port(), &[])
    }

    /// `tessera control-plane` on `port` (a restart takes its old one), `extra` flags.
    pub fn control_plane_on(&self, port: u16, extra: &[&str]) -> ControlPlane {
        let child = Command::new(binary("tessera-control-plane", "tessera"))
            .args(["control-plane", "--etcd", &self.endpoint(), "--data-dir", self.data_dir()])
            // Traffic tests are about placement, not limits: clients that finish many short
            // requests at once must never meet the default burst of 20.
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--rate-limit-rpm",
                "1000000",
                "--rate-limit-burst",
                "100000",
            ])
            .args(["--lease-ttl-secs", &LEASE_TTL_SECS.to_string(), "--node-grace-secs", "1"])
            .args(extra)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        ControlPlane { port, process: Process(child) }
    }

    /// A node of one CPU device with a 64 MiB KV cache unless `extra` (agent flags) sizes it.
    pub fn agent(&self, node: &str, extra: &[&str]) -> Process {
        let child = Command::new(binary("tessera-worker", "tessera-worker"))
            .args(["agent", "--etcd", &self.endpoint(), "--node-id", node, "--devices", "1"])
            .args(["--lease-ttl-secs", "3"])
            .args(if extra.contains(&"--kv-cache-bytes") { &[][..] } else { &["--kv-cache-bytes", "67108864"][..] })
            .args(extra)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Process(child)
    }

    /// Applies a deployment of `replicas` replicas of the model.
    pub fn deploy(&self, replicas: u32) {
        let file = self.data.path().join("deployments.toml");
        let toml = format!("[[deployment]]\nmodel = \"{MODEL}\"\nreplicas = {replicas}\ntensor_parallel = 1\n");
        std::fs::write(&file, toml).unwrap();
        tessera(&["deployments", "apply", file.to_str().unwrap(), "--etcd", &self.endpoint()]);
    }

    /// `tessera replicas list`: every placed replica, started or not.
    pub fn replicas(&self) -> Vec<Value> {
        tessera(&["replicas", "list", "--etcd", &self.endpoint()]).as_array().unwrap().clone()
    }

    /// The nodes holding a ready replica, sorted.
    pub fn ready_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .replicas()
            .iter()
            .filter(|r| r["state"] == "ready")
            .map(|r| r["node"].as_str().unwrap().to_string())
            .collect();
        nodes.sort();
        nodes
    }

    /// The organization's usage records, newest first.
    pub fn usage(&self) -> Vec<Value> {
        let records =
            tessera(&["usage", "list", "--org", &self.org, "--limit", "100000", "--data-dir", self.data_dir()]);
        records.as_array().unwrap().clone()
    }

    /// The organization's spendable balance and held credit, in micro-dollars.
    pub fn credits(&self) -> Value {
        tessera(&["credits", "show", "--org", &self.org, "--data-dir", self.data_dir()])
    }
}

/// SDK clients (`THREADS`) sending streamed chat completions back to back until the file
/// `STOP` exists (or 15 minutes pass: a test that died never writes it); prints how many
/// succeeded, then each failure.
pub const STEADY: &str = r#"
import os, sys, threading, time, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
done, failures = [0], []
deadline = time.monotonic() + 900
# print writes the text and the newline apart: threads' lines would interleave.
lock = threading.Lock()
def say(line):
    with lock: print(line, flush=True)
def client(t):
    i = 0
    while not os.path.exists(os.environ["STOP"]) and time.monotonic() < deadline:
        try:
            text, finish = "", None
            for chunk in c.chat.completions.create(model="vendor-a/model-a", max_tokens=12, stream=True,
                    messages=[{"role": "user", "content": f"Client {t} asks {i}"}]):
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
            assert finish in ("length", "stop"), finish
            done[0] += 1
            say("ok")
        except Exception as e:
            failures.append(repr(e))
        i += 1
threads = [threading.Thread(target=client, args=(t,)) for t in range(int(os.environ["THREADS"]))]
for t in threads: t.start()
for t in threads: t.join()
print("done", done[0], flush=True)
for f in failures: print("failure", f, flush=True)
"#;

/// `N` streams at once (`MAX_TOKENS` each, default 768, `ignore_eos`), each announcing its
/// first content (`started`); then one JSON line per stream: its x-request-id, the
/// chunks that carried text (and how many came once the file `SIGNALLED` existed, if
/// named), how it finished, its usage, and the error that ended it, if one did.
pub const STREAMS: &str = r#"
import json, os, threading, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
results = {}
# print writes the text and the newline apart: threads' lines would interleave.
lock = threading.Lock()
def say(line):
    with lock: print(line, flush=True)
def stream(i):
    r = {"id": None, "chunks": 0, "after_signal": 0, "finish": None, "error": None}
    signalled = os.environ.get("SIGNALLED")
    try:
        # Long enough that no stream can finish before the node is killed (with TCP_NODELAY
        # 96 tokens could), whatever the machine's speed: it is killed after four start.
        raw = c.chat.completions.with_raw_response.create(model="vendor-a/model-a",
            max_tokens=int(os.environ.get("MAX_TOKENS", "768")),
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
                    say("started")
                r["chunks"] += 1
                if signalled and os.path.exists(signalled):
                    r["after_signal"] += 1
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
pub fn read_until(lines: &mut impl Iterator<Item = std::io::Result<String>>, what: &str, count: u32) {
    let mut seen = 0;
    while seen < count {
        let line = lines.next().unwrap_or_else(|| panic!("the clients stopped before {count} said {what:?}")).unwrap();
        seen += (line == what) as u32;
    }
}

/// Sends `count` chat completions one after another through the SDK, each of which must
/// succeed (after waiting for the model to be served); returns how many did.
pub fn chat(base: &str, key: &str, count: u32) -> u32 {
    let script = r#"
import os, time, openai
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
    let out = python(script, base, key, &[("COUNT", count.to_string())]).output().unwrap();
    assert!(out.status.success(), "the SDK client failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}
