//! `tessera serve --log-format json`: every log line is one JSON object, and each line
//! a request logs names it by the id its response carried in `x-request-id` — a
//! streamed completion and a refused request alike.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use tessera_e2e::binary;

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn json_logs_name_each_request_by_its_response_id() {
    binary("tessera-worker", "tessera-worker");
    let tessera = binary("tessera-control-plane", "tessera");
    let data = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(&tessera)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--kv-cache-bytes", "67108864"])
        .args(["--log-format", "json"])
        .arg("--data-dir")
        .arg(data.path())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let _serve = Process(child);
    // The server's own lines (JSON) and its workers' relayed output (text, prefixed).
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines() {
            if tx.send(line.unwrap()).is_err() {
                return;
            }
        }
    });
    let next = || lines.recv_timeout(Duration::from_secs(120)).expect("tessera serve went quiet");
    while !next().contains("tessera listening on") {}
    let key = std::fs::read_to_string(data.path().join("bootstrap.key")).unwrap().trim().to_string();

    // A streamed chat completion and a request without a model; their response ids.
    let script = r#"
import json, os, urllib.request, urllib.error
def post(body):
    req = urllib.request.Request(os.environ["BASE"] + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["KEY"], "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            r.read()
            return r.headers["x-request-id"]
    except urllib.error.HTTPError as e:
        return e.headers["x-request-id"]
print(post({"model": "vendor-a/model-a", "stream": True, "max_tokens": 3,
            "messages": [{"role": "user", "content": "Hi"}]}))
print(post({"messages": [{"role": "user", "content": "Hi"}]}))
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .env("BASE", format!("http://127.0.0.1:{port}/v1"))
        .env("KEY", &key)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ids: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect();
    assert_eq!(ids.len(), 2);

    let mut answered: Vec<(String, Value)> = Vec::new();
    while answered.len() < 2 {
        let line = next();
        if line.starts_with("[worker ") {
            continue;
        }
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        let id = v["span"]["request_id"].as_str().map(str::to_string);
        if v["fields"]["message"] == "answered" {
            answered.push((id.expect("an access line names its request"), v["fields"].clone()));
        }
    }
    let of = |id: &str| answered.iter().find(|(i, _)| i == id).map(|(_, f)| f.clone());
    let streamed = of(&ids[0]).unwrap_or_else(|| panic!("no line for {} in {answered:?}", ids[0]));
    assert_eq!((streamed["status"].as_u64(), streamed["model"].as_str()), (Some(200), Some("vendor-a/model-a")));
    assert_eq!(streamed["route"], "/v1/chat/completions");
    let refused = of(&ids[1]).unwrap_or_else(|| panic!("no line for {} in {answered:?}", ids[1]));
    assert_eq!(refused["status"].as_u64(), Some(400));
}
