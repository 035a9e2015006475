//! A real Prometheus (Debian's `prometheus`) scrapes a running `tessera serve` of two
//! workers: the control plane from a static target, the workers through the control
//! plane's HTTP service discovery (`/metrics/targets`). Queried through Prometheus's own
//! HTTP API, the worker series (vLLM's names) carry each replica's labels, and the
//! control plane's request counter carries route, status and model. Prometheus loads
//! `deploy/prometheus/rules.yml` (so every rule parses), and every metric a rule or a
//! `deploy/grafana` dashboard queries is one the processes export.

use serde_json::Value;
use std::process::{Command, Stdio};
use tessera_e2e::{Process, Serve, free_port, get, python, until};

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
    let data = tempfile::tempdir().unwrap();
    // A supply state (and its load) every two seconds rather than ten minutes.
    // Each worker with a second KV tier, so that its metrics are exported too.
    let args = ["--replicas", "2", "--supply-refresh-secs", "2", "--kv-offload-bytes", "8000000"];
    let serve = Serve::start(data.path(), &args, &[]);
    let port = serve.port;
    let mut workers: Vec<String> = serve
        .started
        .iter()
        .filter(|l| l.contains("tessera-worker serving"))
        .map(|l| l.rsplit(" on ").next().unwrap().to_string())
        .collect();
    assert_eq!(workers.len(), 2, "two local workers");

    // One request, so that the counters exist.
    let script = r#"
import os, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0)
c.chat.completions.create(model="vendor-a/model-a", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
"#;
    let out = python(script, &serve.base_url(), &serve.key, &[]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

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
             - job_name: tessera-worker\n  http_sd_configs:\n  - url: http://127.0.0.1:{port}/metrics/targets\n    refresh_interval: 1s\n\
             rule_files:\n- {}\n",
            deploy().join("prometheus/rules.yml").display()
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
    // Every rule loaded (a rule that does not parse fails Prometheus's start), and every
    // query of the rules and dashboards names an exported metric or a recorded one.
    let rules: Value = serde_json::from_str(&get(&format!("http://127.0.0.1:{web}/api/v1/rules")).unwrap()).unwrap();
    let rules: Vec<&Value> =
        rules["data"]["groups"].as_array().unwrap().iter().flat_map(|g| g["rules"].as_array().unwrap()).collect();
    assert!(rules.iter().any(|r| r["type"] == "alerting") && rules.iter().any(|r| r["type"] == "recording"));
    let recorded: Vec<String> =
        rules.iter().filter(|r| r["type"] == "recording").map(|r| r["name"].as_str().unwrap().to_string()).collect();
    let control_plane = until(30, "a supply state recorded", || {
        get(&format!("http://127.0.0.1:{port}/metrics")).filter(|t| t.contains("tessera_supply_load_ratio{"))
    });
    // The endpoint's latency histograms, by model and endpoint: one request, one first
    // token, its prompt and output counted.
    for name in [
        "tessera_time_to_first_token_seconds",
        "tessera_request_duration_seconds",
        "tessera_request_prompt_tokens",
        "tessera_request_output_tokens",
    ] {
        let line = format!("{name}_count{{model=\"vendor-a/model-a\",endpoint=\"chat.completions\"}} 1");
        assert!(control_plane.lines().any(|l| l == line), "{line} in\n{control_plane}");
    }
    // The request's credit came from a budget lease: one taken, none returned yet.
    let renewals = control_plane.lines().find_map(|l| l.strip_prefix("tessera_budget_lease_renewals_total "));
    assert!(renewals.and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 1), "{renewals:?} lease renewals");
    assert!(control_plane.contains("tessera_budget_lease_returns_total{reason=\"expired\"} 0"), "{control_plane}");
    let itl = "tessera_inter_token_latency_seconds_count{model=\"vendor-a/model-a\",endpoint=\"chat.completions\"} ";
    let gaps = control_plane.lines().find_map(|l| l.strip_prefix(itl)).and_then(|n| n.parse::<u64>().ok());
    assert!(gaps.is_some_and(|n| (1..=3).contains(&n)), "{gaps:?} gaps between 4 tokens");
    let mut exported = exported_names(&control_plane);
    let mut tenants = Vec::new();
    for w in &workers {
        let text = get(&format!("http://{w}/metrics")).unwrap();
        tenants.extend(text.lines().filter(|l| l.starts_with("tessera:tenant_batch_share{")).map(String::from));
        exported.extend(exported_names(&text));
    }
    // The request's organization has a share of the steps, under its id.
    assert!(tenants.iter().any(|l| l.contains("tenant=\"org_")), "{tenants:?}");
    // `tessera serve --kv-offload-bytes` reached the workers: their tiers report.
    assert!(exported.iter().any(|n| n == "tessera:kv_tier_bytes"), "no second KV tier's metrics");
    exported.extend(recorded);
    exported.push("up".into());
    // Only a cluster's control plane has these (tests/cluster.rs reads them there).
    exported.extend(["tessera_etcd_connected", "tessera_etcd_revision", "tessera_placement_leader"].map(String::from));
    // Only a disaggregated pool's handoffs make these (tests/robustness.rs reads them there).
    exported.extend(
        [
            "tessera_handoffs_total",
            "tessera:kv_transfers_total",
            "tessera:kv_transfer_bytes_total",
            "tessera:kv_transfer_seconds_bucket",
        ]
        .map(String::from),
    );
    let mut queries: Vec<(String, String)> =
        rules.iter().map(|r| (format!("rule {}", r["name"]), r["query"].as_str().unwrap().to_string())).collect();
    let dashboards = deploy().join("grafana/dashboards");
    let mut count = 0;
    for entry in std::fs::read_dir(&dashboards).unwrap() {
        let path = entry.unwrap().path();
        let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
        count += 1;
        let mut exprs = Vec::new();
        collect_exprs(&dashboard, &mut exprs);
        assert!(!exprs.is_empty(), "{} has no queries", path.display());
        queries.extend(exprs.into_iter().map(|e| (path.display().to_string(), e)));
    }
    assert!(count >= 3, "the Overview, Capacity and Nodes dashboards");
    for (place, query) in &queries {
        for name in metric_names(query) {
            assert!(exported.contains(&name), "{place}: {name} is not exported (in {query})");
        }
    }
}

fn deploy() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The metric names in Prometheus's text format, histograms' series included.
fn exported_names(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect()
}

/// Every `expr` in a dashboard, however deeply its panels nest.
fn collect_exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            if let Some(Value::String(e)) = o.get("expr") {
                out.push(e.clone());
            }
            o.values().for_each(|v| collect_exprs(v, out));
        }
        Value::Array(a) => a.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

/// The metric names a PromQL query reads: identifiers left once strings, label
/// matchers, ranges and grouping clauses are gone, that are neither functions (followed
/// by a parenthesis), keywords, nor Grafana variables.
fn metric_names(query: &str) -> Vec<String> {
    const KEYWORDS: [&str; 14] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
        "atan2",
    ];
    const AGGREGATIONS: [&str; 12] = [
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    // Strings, {…} and […] go.
    let mut plain = String::new();
    let mut skip_until: Option<char> = None;
    for c in query.chars() {
        match skip_until {
            Some(end) if c == end => skip_until = None,
            Some(_) => {}
            None => match c {
                '"' => skip_until = Some('"'),
                '{' => skip_until = Some('}'),
                '[' => skip_until = Some(']'),
                c => plain.push(c),
            },
        }
    }
    let chars: Vec<char> = plain.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let starts = c.is_ascii_alphabetic() || c == '_' || c == ':';
        if !starts || (i > 0 && (chars[i - 1] == '$' || chars[i - 1].is_ascii_alphanumeric() || chars[i - 1] == '.')) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let next = chars[i..].iter().find(|c| !c.is_whitespace());
        if KEYWORDS.contains(&word.as_str()) {
            // A grouping clause's label list goes with it.
            if matches!(word.as_str(), "by" | "without" | "on" | "ignoring" | "group_left" | "group_right")
                && next == Some(&'(')
            {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
            }
            continue;
        }
        // Aggregations may put their grouping before their parenthesis.
        if next != Some(&'(') && !AGGREGATIONS.contains(&word.as_str()) {
            names.push(word);
        }
    }
    names
}

#[test]
fn promql_metric_names_are_told_from_functions_labels_and_variables() {
    let q = "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket{job=\"w\"}[$__rate_interval]))) \
             / on (model_name) group_left tessera:ttft:p50 > bool 2 and up == 1";
    assert_eq!(metric_names(q), ["vllm:time_to_first_token_seconds_bucket", "tessera:ttft:p50", "up"]);
}
