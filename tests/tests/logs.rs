//! `tessera serve --log-format json`: every log line is one JSON object, and each line
//! a request logs names it by the id its response carried in `x-request-id` — a
//! streamed completion and a refused request alike.

use serde_json::Value;
use std::time::Duration;
use tessera_e2e::{Serve, python};

#[test]
fn json_logs_name_each_request_by_its_response_id() {
    let data = tempfile::tempdir().unwrap();
    let serve = Serve::start(data.path(), &["--log-format", "json"], &["RUST_LOG"]);
    let next = || serve.lines.recv_timeout(Duration::from_secs(120)).expect("tessera serve went quiet");

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
    let out = python(script, &serve.base_url(), &serve.key, &[]).output().unwrap();
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
