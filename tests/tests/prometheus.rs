//! A real Prometheus (Debian's `prometheus`) scrapes a running `tessera serve` of two
//! workers: the control plane from a static target, the workers through the control
//! plane's HTTP service discovery (`/metrics/targets`). Queried through Prometheus's own
//! HTTP API, the worker series (vLLM's names) carry each replica's labels, and the
//! control plane's request counter carries route, status and model.

use serde_json::Value;
use std::io::{BufRead, BufReader};
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
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// GET `url`, as text; None when it does not answer 200.
fn get(url: &str) -> Option<String> {
    let script = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())";
    let out = Command::new("python3").args(["-c", script, url]).stderr(Stdio::null()).output().unwrap();
    out.status.success().then(|| String::from_utf8(out.stdout).unwrap())
}

/// Waits (up to `secs`) for `f`: Prometheus scrapes and discovers on its own schedule.
fn until<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The series a PromQL query returns, each as its label set.
fn series(prometheus: u16, query: &str) -> Vec<Value> {
    let url = format!("http://127.0.0.1:{prometheus}/api/v1/query?query={}", encode(query));
    let Some(body) = get(&url) else { return Vec::new() };
    let v: Value = serde_json::from_str(&body).unwrap();
    v["data"]["result"].as_array().map(|r| r.iter().map(|s| s["metric"].clone()).collect()).unwrap_or_default()
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn prometheus_finds_every_worker_through_discovery_and_reads_their_labels() {
    let Some(prometheus) = std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join("prometheus")).find(|p| p.exists()))
    else {
        panic!("this test starts a real Prometheus: apt-get install prometheus (`.ci/run` does)");
    };
    binary("tessera-worker", "tessera-worker");
    let tessera = binary("tessera-control-plane", "tessera");
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = Command::new(&tessera)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--replicas", "2"])
        .args(["--kv-cache-bytes", "67108864"])
        .arg("--data-dir")
        .arg(data.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let _serve = Process(child);
    let mut workers = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.contains("tessera-worker serving") {
            workers.push(line.rsplit(" on ").next().unwrap().to_string());
        }
        if line.starts_with("tessera listening on") {
            break;
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    assert_eq!(workers.len(), 2, "two local workers");
    let key = std::fs::read_to_string(data.path().join("bootstrap.key")).unwrap().trim().to_string();

    // One request, so that the counters exist.
    let script = r#"
import os, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
c.chat.completions.create(model="vendor-a/model-a", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
"#;
    let status = Command::new("python3")
        .args(["-c", script])
        .env("BASE", format!("http://127.0.0.1:{port}/v1"))
        .env("KEY", &key)
        .status()
        .unwrap();
    assert!(status.success());

    let targets: Value =
        serde_json::from_str(&get(&format!("http://127.0.0.1:{port}/metrics/targets")).unwrap()).unwrap();
    let mut discovered: Vec<&str> =
        targets.as_array().unwrap().iter().map(|g| g["targets"][0].as_str().unwrap()).collect();
    discovered.sort();
    workers.sort();
    assert_eq!(discovered, workers, "discovery lists every worker");

    let config = data.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n\
             - job_name: tessera-control-plane\n  static_configs:\n  - targets: ['127.0.0.1:{port}']\n\
             - job_name: tessera-worker\n  http_sd_configs:\n  - url: http://127.0.0.1:{port}/metrics/targets\n    refresh_interval: 1s\n"
        ),
    )
    .unwrap();
    let web = free_port();
    let _prometheus = Process(
        Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", data.path().join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    let running = until(60, "Prometheus scrapes both workers", || {
        Some(series(web, "vllm:num_requests_running")).filter(|s| s.len() == 2)
    });
    let mut replicas: Vec<&str> = running.iter().map(|s| s["replica"].as_str().unwrap()).collect();
    replicas.sort();
    assert_eq!(replicas, ["smollm2-135m-instruct-0", "smollm2-135m-instruct-1"]);
    for s in &running {
        assert_eq!(
            (s["job"].as_str(), s["model_name"].as_str()),
            (Some("tessera-worker"), Some("smollm2-135m-instruct"))
        );
    }
    let generated = until(30, "a worker's generation counter", || {
        Some(series(web, "vllm:generation_tokens_total > 0")).filter(|s| s.len() == 1)
    });
    assert_eq!(generated[0]["job"], "tessera-worker");
    let requests = until(30, "the control plane's request counter", || {
        Some(series(web, "tessera_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"}"))
            .filter(|s| !s.is_empty())
    });
    assert_eq!(
        (requests[0]["job"].as_str(), requests[0]["model"].as_str()),
        (Some("tessera-control-plane"), Some("vendor-a/model-a"))
    );
}
