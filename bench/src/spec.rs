//! Speculative decoding, side by side: `tessera serve` with speculation off and with
//! each method asked for (`--methods ngram,suffix,draft`; `draft` where the model has a
//! draft model, given in a copy of its catalog), and llama.cpp's `llama-server` plain
//! and with its own speculation (`ngram-simple`, and `draft-simple` with the same draft
//! model), each started afresh on the same GGUF file and the same requests, one after
//! the other in one run.
//!
//! The workload mixes three kinds of greedy, streamed chat requests, each ending where
//! the model ends it (or at `max_tokens`):
//! - `edit`: a piece of code and an edit to make, answered with the whole code again —
//!   an answer that repeats most of its prompt, where guessing from the prompt pays;
//! - `fresh`: new code from a description;
//! - `chat`: a question in prose.
//!
//! Per server and kind: decode speed, the output tokens after the first over the time
//! from the first to the last (summed over requests), time to first token, and for
//! Tessera the proposals' acceptance (from the worker's metrics) and for llama-server
//! its own (`timings.draft_n_accepted` / `draft_n`). One JSON line per model and
//! concurrency, with the ratios the targets are stated in.

use crate::api::{self, Server};
use crate::peer::{LlamaServer, closed_loop, has_amx, llama_server, load_average};
use crate::round;
use anyhow::{Context, Result};
use serde_json::{Map, Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tessera_worker::model_cache;

#[derive(clap::Args)]
pub struct Args {
    /// The `tessera` binary (default: beside this one).
    #[arg(long)]
    tessera: Option<PathBuf>,
    /// The models: `smollm2` (the default catalog's SmolLM2-135M), `qwen1.5b`
    /// (Qwen2.5-Coder-1.5B, `deploy/catalog-qwen.toml`, drafted by the 0.5B for llama.cpp).
    #[arg(long, value_delimiter = ',', default_values_t = [String::from("smollm2"), String::from("qwen1.5b")])]
    models: Vec<String>,
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 16])]
    concurrency: Vec<usize>,
    /// Requests per level (at least two per client), the kinds in turn.
    #[arg(long, default_value_t = 9)]
    requests: usize,
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// llama-server at this path (else `$LLAMA_SERVER`, else where
    /// `bench/peer/build-llama-server.sh` builds it); `--peer none` leaves it out.
    #[arg(long)]
    llama_server: Option<PathBuf>,
    #[arg(long, default_value = "llama-server")]
    peer: String,
    /// llama-server's threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Tessera's speculative methods, each a side of its own (`tessera_<method>`).
    #[arg(long, value_delimiter = ',', default_values_t = [String::from("ngram")])]
    methods: Vec<String>,
    /// Most tokens a draft model proposes per step.
    #[arg(long, default_value_t = 4)]
    draft_tokens: usize,
    /// Times each of Tessera's sides runs per level, in turn and every other round in
    /// reverse (off, ngram, draft, draft, ngram, off, …), each on a fresh server; a
    /// side's figures pool its rounds. On a machine whose speed drifts by more than the
    /// difference measured, one round each in a fixed order shows the drift.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
}

/// A model as both servers are given it.
struct Model {
    label: &'static str,
    /// `tessera serve` arguments naming its catalog.
    catalog: Vec<String>,
    id: &'static str,
    weights: &'static str,
    /// llama.cpp's draft model for `draft-simple`.
    draft: Option<&'static str>,
}

fn model(label: &str) -> Result<Model> {
    let qwen_catalog = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/catalog-qwen.toml");
    Ok(match label {
        "smollm2" => Model {
            label: "smollm2",
            catalog: Vec::new(),
            id: crate::peer::MODEL,
            weights: model_cache::SMOLLM2_135M_INSTRUCT.name,
            draft: None,
        },
        "qwen1.5b" => Model {
            label: "qwen1.5b",
            catalog: vec!["--catalog".into(), qwen_catalog.display().to_string()],
            id: "qwen/qwen2.5-coder-1.5b-instruct",
            weights: model_cache::QWEN25_CODER_15B_INSTRUCT.name,
            draft: Some(model_cache::QWEN25_CODER_05B_INSTRUCT.name),
        },
        other => anyhow::bail!("unknown model {other:?} (smollm2, qwen1.5b)"),
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Edit,
    Fresh,
    Chat,
}

const KINDS: [Kind; 3] = [Kind::Edit, Kind::Fresh, Kind::Chat];

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Edit => "edit",
            Kind::Fresh => "fresh",
            Kind::Chat => "chat",
        }
    }
}

const CODE: [&str; 4] = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n    return total / len(values)\n\n\ndef describe(values):\n    return {\"mean\": mean(values), \"variance\": variance(values), \"count\": len(values)}\n",
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count):\n        self.items[name] = self.items.get(name, 0) + count\n\n    def remove(self, name, count):\n        if self.items.get(name, 0) < count:\n            raise ValueError(\"not enough \" + name)\n        self.items[name] -= count\n\n    def total(self):\n        return sum(self.items.values())\n",
    "def parse_line(line):\n    parts = line.strip().split(\",\")\n    name = parts[0]\n    age = int(parts[1])\n    city = parts[2]\n    return {\"name\": name, \"age\": age, \"city\": city}\n\n\ndef parse_file(path):\n    rows = []\n    with open(path) as f:\n        for line in f:\n            if line.strip():\n                rows.append(parse_line(line))\n    return rows\n",
    "fn largest(values: &[i64]) -> Option<i64> {\n    let mut best = None;\n    for &v in values {\n        match best {\n            None => best = Some(v),\n            Some(b) if v > b => best = Some(v),\n            _ => {}\n        }\n    }\n    best\n}\n\nfn smallest(values: &[i64]) -> Option<i64> {\n    let mut best = None;\n    for &v in values {\n        match best {\n            None => best = Some(v),\n            Some(b) if v < b => best = Some(v),\n            _ => {}\n        }\n    }\n    best\n}\n",
];

const EDITS: [&str; 4] = [
    "Add a docstring to every function. Reply with the full code only.",
    "Rename the variable `total` to `acc` (or, where there is none, the first parameter to `data`). Reply with the full code only.",
    "Add type annotations everywhere they are missing. Reply with the full code only.",
    "Add a short comment above every function. Reply with the full code only.",
];

const FRESH: [&str; 6] = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python class for a stack with push, pop, peek and is_empty.",
    "Write a Rust function that counts the words in a string.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a JavaScript function that debounces another function.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
];

const CHAT: [&str; 6] = [
    "Why is the sky blue? Answer in a short paragraph.",
    "What are the main differences between a process and a thread?",
    "Give me three tips for writing clear commit messages.",
    "Explain what a hash map is to a beginner.",
    "What is the difference between TCP and UDP?",
    "How does garbage collection work, briefly?",
];

/// Request `i` of the workload: its kind and user message.
fn job(i: usize) -> (Kind, String) {
    let kind = KINDS[i % 3];
    let j = i / 3;
    let text = match kind {
        Kind::Edit => format!("{}\n\n```\n{}```", EDITS[j % EDITS.len()], CODE[(j / EDITS.len() + j) % CODE.len()]),
        Kind::Fresh => FRESH[j % FRESH.len()].to_string(),
        Kind::Chat => CHAT[j % CHAT.len()].to_string(),
    };
    (kind, text)
}

/// One request as the client saw it.
struct Sample {
    kind: Kind,
    ttft: Duration,
    /// From the first token's arrival to the last's.
    decode: Duration,
    tokens: u64,
    /// llama-server's proposals and acceptances, when it reports them.
    drafted: Option<(u64, u64)>,
}

async fn request(port: u16, key: &str, model: &str, kind: Kind, user: &str, max_tokens: u32) -> Result<Sample> {
    let body = json!({
        "model": model,
        "messages": [{"role": "system", "content": "You are a helpful coding assistant."}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let events = api::stream(port, key, "/v1/chat/completions", &body).await?;
    let content = |e: &&api::Event| e.data["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty());
    let times: Vec<Duration> = events.iter().filter(content).map(|e| e.at).collect();
    let first = *times.first().context("no token arrived")?;
    let last = *times.last().unwrap_or(&first);
    let usage = events.iter().rev().find_map(|e| e.data.get("usage").filter(|u| u.is_object()));
    let tokens = usage.and_then(|u| u["completion_tokens"].as_u64()).unwrap_or(times.len() as u64);
    let timings = events.iter().rev().find_map(|e| e.data.get("timings").filter(|t| t.is_object()));
    let drafted = timings.and_then(|t| Some((t["draft_n"].as_u64()?, t["draft_n_accepted"].as_u64()?)));
    Ok(Sample { kind, ttft: first, decode: last - first, tokens, drafted })
}

/// `c` clients in a closed loop over `n` requests of the workload.
async fn level(port: u16, key: &str, model: &str, c: usize, n: usize, max_tokens: u32) -> Result<(Vec<Sample>, f64)> {
    request(port, key, model, Kind::Chat, "Say hello.", 4).await?;
    let (key, model): (Arc<str>, Arc<str>) = (key.into(), model.into());
    closed_loop(c, n, move |i| {
        let (key, model) = (key.clone(), model.clone());
        async move {
            let (kind, user) = job(i);
            request(port, &key, &model, kind, &user, max_tokens).await
        }
    })
    .await
}

/// One of Tessera's sides over its rounds.
#[derive(Default)]
struct Pooled {
    samples: Vec<Sample>,
    wall: f64,
    /// Each round's output tokens/s.
    throughputs: Vec<f64>,
    /// Proposed and accepted tokens, from the workers' metrics.
    counted: Option<(f64, f64)>,
}

/// Output tokens/s of `samples` over `wall_s` (a round's, or pooled rounds').
fn round_tps(samples: &[Sample], wall_s: f64) -> f64 {
    round(samples.iter().map(|s| s.tokens).sum::<u64>() as f64 / wall_s)
}

/// Decode speed and time to first token by kind, and over the whole mix.
fn figures(samples: &[Sample], wall_s: f64) -> Map<String, Value> {
    let of = |filter: &dyn Fn(&Sample) -> bool| {
        let chosen: Vec<&Sample> = samples.iter().filter(|s| filter(s)).collect();
        let tokens: u64 = chosen.iter().map(|s| s.tokens.saturating_sub(1)).sum();
        let secs: f64 = chosen.iter().map(|s| s.decode.as_secs_f64()).sum();
        let ttft: Vec<f64> = chosen.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        let mut m = json!({
            "requests": chosen.len(),
            "output_tokens": chosen.iter().map(|s| s.tokens).sum::<u64>(),
            "decode_tokens_per_s": round(tokens as f64 / secs.max(1e-9)),
            "ttft_p50_ms": round(crate::percentile(&ttft, 0.5)),
        });
        let drafted: Vec<(u64, u64)> = chosen.iter().filter_map(|s| s.drafted).collect();
        if !drafted.is_empty() {
            let (n, accepted) = drafted.iter().fold((0, 0), |(a, b), (n, k)| (a + n, b + k));
            m["draft_tokens"] = json!(n);
            m["acceptance"] = json!(round(accepted as f64 / n.max(1) as f64));
        }
        m
    };
    let mut out = Map::new();
    for kind in KINDS {
        out.insert(kind.as_str().into(), of(&|s: &Sample| s.kind == kind));
    }
    out.insert("mix".into(), of(&|_| true));
    out.insert("output_tokens_per_s".into(), json!(round_tps(samples, wall_s)));
    out
}

/// The workers' speculation counters (a catalog may start several): proposed tokens
/// and accepted ones.
fn spec_counters(server: &Server) -> Option<(f64, f64)> {
    let mut text = String::new();
    for addr in &server.workers {
        text.push_str(&ureq_get(addr, "/metrics").ok()?);
    }
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| {
                l.starts_with(name)
                    && (l.as_bytes().get(name.len()) == Some(&b'{') || l.as_bytes().get(name.len()) == Some(&b' '))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    Some((sum("vllm:spec_decode_num_draft_tokens_total"), sum("vllm:spec_decode_num_accepted_tokens_total")))
}

/// A plain HTTP/1.1 GET on the loopback: the body.
fn ureq_get(addr: &str, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

pub fn run(args: Args) -> Result<()> {
    let tessera = api::tessera_binary(args.tessera.clone())?;
    let llama = match args.peer.as_str() {
        "none" => None,
        _ => Some(llama_server(args.llama_server.clone())?),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    for label in &args.models {
        let m = model(label)?;
        for &c in &args.concurrency {
            let n = args.requests.max(2 * c);
            let load_before = load_average();
            let mut line = json!({
                "bench": "spec",
                "model": m.label,
                "concurrency": c,
                "requests": n,
                "max_tokens": args.max_tokens,
                "cpu_path": tessera_kernels::cpu::dispatched_path(),
                "load_average_before": load_before,
            });
            let mut sides = vec![(
                "tessera_off".to_string(),
                [m.catalog.clone(), vec!["--speculative".into(), "off".into()]].concat(),
            )];
            let mut catalogs = Vec::new();
            for method in &args.methods {
                let serve_args = match (method.as_str(), m.draft) {
                    ("draft", None) => continue,
                    ("draft", Some(draft)) => {
                        let dir = tempfile::tempdir()?;
                        let path = dir.path().join("catalog.toml");
                        std::fs::write(&path, drafting_catalog(m.id, draft, args.draft_tokens)?)?;
                        catalogs.push(dir);
                        vec!["--catalog".into(), path.display().to_string(), "--speculative".into(), "catalog".into()]
                    }
                    (method, _) => [m.catalog.clone(), vec!["--speculative".into(), method.into()]].concat(),
                };
                sides.push((format!("tessera_{method}"), serve_args));
            }
            let mut pooled: Vec<Pooled> = sides.iter().map(|_| Pooled::default()).collect();
            for r in 0..args.rounds.max(1) {
                let mut order: Vec<usize> = (0..sides.len()).collect();
                if r % 2 == 1 {
                    order.reverse();
                }
                for i in order {
                    let server = Server::start(&tessera, &sides[i].1)?;
                    let before = spec_counters(&server);
                    let (samples, wall) =
                        runtime.block_on(level(server.port, &server.key, m.id, c, n, args.max_tokens))?;
                    let p = &mut pooled[i];
                    p.throughputs.push(round_tps(&samples, wall));
                    p.wall += wall;
                    p.samples.extend(samples);
                    if let (Some((d0, a0)), Some((d1, a1))) = (before, spec_counters(&server)) {
                        p.counted = Some(p.counted.map_or((d1 - d0, a1 - a0), |(d, a)| (d + d1 - d0, a + a1 - a0)));
                    }
                    line["device"] = json!(server.device);
                }
            }
            for ((side, _), p) in sides.iter().zip(pooled) {
                let mut f = figures(&p.samples, p.wall);
                if let Some((drafted, accepted)) = p.counted {
                    f.insert("draft_tokens".into(), json!(drafted));
                    f.insert("acceptance".into(), json!(round(accepted / drafted.max(1.0))));
                }
                if p.throughputs.len() > 1 {
                    f.insert("rounds_output_tokens_per_s".into(), json!(p.throughputs));
                }
                line[side.as_str()] = Value::Object(f);
            }
            if args.rounds > 1 {
                line["rounds"] = json!(args.rounds);
            }
            if let Some(binary) = &llama {
                let gguf = model_cache::resolve(m.weights)?;
                let mut peers = vec![
                    ("llama_plain", Vec::new()),
                    ("llama_ngram", vec!["--spec-type".to_string(), "ngram-simple".into()]),
                ];
                if let Some(draft) = m.draft {
                    let draft = model_cache::resolve(draft)?;
                    peers.push((
                        "llama_draft",
                        vec!["--spec-type".into(), "draft-simple".into(), "-md".into(), draft.display().to_string()],
                    ));
                }
                for (side, extra) in peers {
                    let server = LlamaServer::start(binary, &gguf, args.threads, &extra)?;
                    let (samples, wall) = runtime.block_on(level(server.port, "", m.label, c, n, args.max_tokens))?;
                    line[side] = Value::Object(figures(&samples, wall));
                }
                line["llama_no_repack"] = json!(has_amx());
                line["threads"] = json!(args.threads);
            }
            let methods: Vec<&str> = sides.iter().skip(1).map(|(s, _)| s.as_str()).collect();
            ratios(&mut line, &methods);
            println!("{line}");
        }
    }
    Ok(())
}

/// The Qwen catalog with `model` drafted by `draft`.
fn drafting_catalog(model: &str, draft: &str, tokens: usize) -> Result<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/catalog-qwen.toml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let at = text.find(&format!("id = \"{model}\"")).with_context(|| format!("{model} in {}", path.display()))?;
    let (head, tail) = text.split_at(at);
    let line = tail.lines().find(|l| l.starts_with("speculative =")).context("its speculative line")?;
    let drafted = format!("speculative = {{ method = \"draft\", draft = \"{draft}\", max_tokens = {tokens} }}");
    Ok(format!("{head}{}", tail.replacen(line, &drafted, 1)))
}

/// The ratios the targets are stated in, for each of Tessera's speculating `sides`:
/// over speculation off (edits, the mix, and throughput), and over llama-server's best
/// configuration on edits.
fn ratios(line: &mut Value, sides: &[&str]) {
    let get = |side: &str, kind: &str, key: &str| line[side][kind][key].as_f64();
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).filter(|(_, b)| *b > 0.0).map(|(a, b)| round(a / b));
    let llama_best = ["llama_plain", "llama_ngram", "llama_draft"]
        .iter()
        .filter_map(|s| get(s, "edit", "decode_tokens_per_s"))
        .fold(None, |best: Option<f64>, v| Some(best.map_or(v, |b| b.max(v))));
    let mut r = Map::new();
    for side in sides {
        let on = side.trim_start_matches("tessera_");
        let edit = get(side, "edit", "decode_tokens_per_s");
        let throughput = |s: &str| line[s]["output_tokens_per_s"].as_f64();
        r.insert(
            on.into(),
            json!({
                "edit_over_off": ratio(edit, get("tessera_off", "edit", "decode_tokens_per_s")),
                "mix_over_off": ratio(get(side, "mix", "decode_tokens_per_s"), get("tessera_off", "mix", "decode_tokens_per_s")),
                "throughput_over_off": ratio(throughput(side), throughput("tessera_off")),
                "edit_over_llama_best": ratio(edit, llama_best),
            }),
        );
    }
    line["ratios"] = Value::Object(r);
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_drafting_catalog_drafts_only_the_model_named() {
        let text =
            super::drafting_catalog("qwen/qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", 4).unwrap();
        let drafted = "speculative = { method = \"draft\", draft = \"qwen2.5-coder-0.5b-instruct\", max_tokens = 4 }";
        let (small, large) = text.split_once("id = \"qwen/qwen2.5-coder-1.5b-instruct\"").unwrap();
        assert!(!small.contains(drafted) && large.contains(drafted), "{text}");
    }
}
