//! `tessera serve --log-format json`: every log line is one JSON object — the worker's
//! too — and each line a request logs names it by the id its response carried in
//! `x-request-id`, in the control plane and in the worker, a streamed completion and a
//! refused request alike. A client's own id (`X-Client-Request-Id`) is echoed, logged
//! and kept in the usage record beside ours; a malformed one is refused.

use serde_json::Value;
use std::time::Duration;
use tessera_e2e::{Serve, binary, python, until};

#[test]
fn json_logs_name_each_request_by_its_response_id() {
    let data = tempfile::tempdir().unwrap();
    let serve = Serve::start(data.path(), &["--log-format", "json"], &["RUST_LOG"]);
    let next = || serve.lines.recv_timeout(Duration::from_secs(120)).expect("tessera serve went quiet");

    // A streamed chat completion and a request without a model; their response ids.
    let script = r#"
import json, os, urllib.request, urllib.error
def post(body, client_id=None):
    headers = {"Authorization": "Bearer " + os.environ["KEY"], "Content-Type": "application/json"}
    if client_id is not None:
        headers["X-Client-Request-Id"] = client_id
    req = urllib.request.Request(os.environ["BASE"] + "/chat/completions", data=json.dumps(body).encode(),
        headers=headers)
    try:
        with urllib.request.urlopen(req) as r:
            r.read()
            return r.status, r.headers["x-request-id"], r.headers.get("x-client-request-id")
    except urllib.error.HTTPError as e:
        return e.code, e.headers["x-request-id"], e.headers.get("x-client-request-id")
hi = [{"role": "user", "content": "Hi"}]
print(post({"model": "vendor-a/model-a", "stream": True, "max_tokens": 3, "messages": hi}, "trace-me-42")[1])
print(post({"messages": hi})[1])
echoed = post({"model": "vendor-a/model-a", "stream": True, "max_tokens": 3, "messages": hi}, "trace-me-42")[2]
assert echoed == "trace-me-42", echoed
status, _, _ = post({"model": "vendor-a/model-a", "max_tokens": 3, "messages": hi}, "has a space")
assert status == 400, status
"#;
    let out = python(script, &serve.base_url(), &serve.key, &[]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ids: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect();
    assert_eq!(ids.len(), 2);

    let mut answered: Vec<(String, Value)> = Vec::new();
    let mut worker_line = None;
    while answered.len() < 2 || worker_line.is_none() {
        let line = next();
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        let id = v["span"]["request_id"].as_str().map(str::to_string);
        if v["fields"]["message"] == "answered" {
            let mut fields = v["fields"].clone();
            fields["client_request_id"] = v["span"]["client_request_id"].clone();
            answered.push((id.expect("an access line names its request"), fields));
        }
        // The worker's line for the streamed request: its id is the request's own.
        if v["target"].as_str().is_some_and(|t| t.starts_with("tessera_worker")) && v["fields"]["request_id"] == ids[0]
        {
            worker_line = Some(v["fields"].clone());
        }
    }
    let worker_line = worker_line.unwrap();
    assert_eq!(worker_line["message"], "request finished", "{worker_line}");
    assert!(worker_line["prompt_tokens"].as_u64() > Some(0) && worker_line["output_tokens"].as_u64() > Some(0));
    let of = |id: &str| answered.iter().find(|(i, _)| i == id).map(|(_, f)| f.clone());
    let streamed = of(&ids[0]).unwrap_or_else(|| panic!("no line for {} in {answered:?}", ids[0]));
    assert_eq!((streamed["status"].as_u64(), streamed["model"].as_str()), (Some(200), Some("vendor-a/model-a")));
    assert_eq!(streamed["route"], "/v1/chat/completions");
    assert_eq!(streamed["client_request_id"], "trace-me-42", "the client's id beside ours");
    let refused = of(&ids[1]).unwrap_or_else(|| panic!("no line for {} in {answered:?}", ids[1]));
    assert_eq!(refused["status"].as_u64(), Some(400));

    // The usage record keeps both ids (once the request has settled).
    let record = until(60, "the streamed request's usage record", || {
        let listed = std::process::Command::new(binary("tessera-control-plane", "tessera"))
            .args(["usage", "list", "--json", "--org", "default", "--data-dir"])
            .arg(data.path())
            .output()
            .ok()?;
        let records: Value = serde_json::from_slice(&listed.stdout).ok()?;
        records.as_array()?.iter().find(|r| r["request_id"] == ids[0]).cloned()
    });
    assert_eq!(record["client_request_id"], "trace-me-42");
}
