//! `tessera serve` against llama.cpp's own `llama-server` on the same GGUF file and the
//! same load, measured one after the other in one run: for each concurrency, a fresh
//! Tessera takes the load, then a fresh llama-server (`-np 16 -t THREADS -tb THREADS`,
//! continuous batching on every core). Each prints its figures and the ratios on one
//! JSON line per level.
//!
//! The load is the one of issue 25: streamed chat completions, each a shared system
//! prompt (4 of them, about 100 tokens each) and a question of its own (about 110
//! tokens), `max_tokens` output tokens with `ignore_eos` (both servers honour it) so
//! every request produces exactly that many, greedy; a closed loop of `c` clients until
//! `requests` have been answered. Questions differ between levels, so neither server
//! finds a level's prompts cached by the one before — only the system prompts, as in
//! production.
//!
//! With no peer (`--peer none`) Tessera runs alone at each level: on a GPU machine, where
//! no peer is built, for its own TTFT, TPOT and throughput from 1 to 256 clients. Each
//! level answers at least two requests per client, and the line names the worker's device.
//!
//! llama-server is found at `--llama-server`, else `$LLAMA_SERVER`, else where
//! `bench/peer/build-llama-server.sh` builds it, else in `~/.cache/peer-bench/build-server/bin`;
//! the script builds it from the PyPI sdist of llama-cpp-python (15 minutes).

use crate::api::{self, Server};
use crate::round;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tessera_worker::model_cache;

/// What the peer comparison needs beyond `serve`'s own arguments.
pub struct PeerArgs<'a> {
    pub tessera: &'a Path,
    /// The peer: llama-server at this path (else found as above), or none at all.
    pub llama_server: Option<Option<PathBuf>>,
    pub concurrency: &'a [usize],
    pub requests: usize,
    pub max_tokens: u32,
    pub threads: usize,
}

/// The catalog model served by SmolLM2-135M-Instruct, the file both servers load.
pub(crate) const MODEL: &str = "vendor-c/model-c";

pub fn run(args: PeerArgs<'_>) -> Result<()> {
    let llama = args.llama_server.clone().map(llama_server).transpose()?;
    // The file the peer loads (Tessera's worker finds its own).
    let gguf = llama.as_ref().map(|_| model_cache::resolve(model_cache::SMOLLM2_135M_INSTRUCT.name)).transpose()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut tpot = Vec::new();
    for &c in args.concurrency {
        let n = args.requests.max(2 * c);
        let load_before = load_average();
        let (ours, device) = {
            let server = Server::start(args.tessera, &[])?;
            let target = Target { port: server.port, key: server.key.clone(), model: MODEL.into() };
            (runtime.block_on(level(&target, c, n, args.max_tokens))?, server.device.clone())
        };
        tpot.push((c, ours["tpot_p50_ms"].as_f64()));
        let mut line = json!({
            "bench": "serve_peer",
            "peer": if llama.is_some() { "llama-server" } else { "none" },
            "device": device,
            "concurrency": c,
            "requests": n,
            "max_tokens": args.max_tokens,
            "tessera": ours,
            "load_average_before": load_before,
        });
        if let (Some(llama), Some(gguf)) = (&llama, &gguf) {
            let theirs = {
                let peer = LlamaServer::start(llama, gguf, args.threads, &[])?;
                let target = Target { port: peer.port, key: String::new(), model: "smollm2".into() };
                runtime.block_on(level(&target, c, n, args.max_tokens))?
            };
            let ratio = |k: &str| ours[k].as_f64().zip(theirs[k].as_f64()).map(|(a, b)| round(a / b));
            line["output_tokens_per_s_ratio"] = json!(ratio("output_tokens_per_s"));
            line["ttft_p50_ratio"] = json!(ratio("ttft_p50_ms"));
            line["tpot_p50_ratio"] = json!(ratio("tpot_p50_ms"));
            line["llama_server"] = Value::Object(theirs);
            line["threads"] = json!(args.threads);
        }
        println!("{line}");
    }
    let at = |c: usize| tpot.iter().find(|(l, _)| *l == c).and_then(|(_, t)| *t);
    if let (Some(one), Some(four)) = (at(1), at(4)) {
        println!("{}", json!({"bench": "serve_peer_tpot", "tpot_p50_c4_over_c1": round(four / one)}));
    }
    Ok(())
}

/// An OpenAI-compatible endpoint on the loopback.
pub(crate) struct Target {
    pub port: u16,
    pub key: String,
    pub model: String,
}

/// `c` clients in a closed loop until `n` requests are answered; the level's figures.
async fn level(target: &Target, c: usize, n: usize, max_tokens: u32) -> Result<serde_json::Map<String, Value>> {
    // One request first: threads started, the first step's allocations made.
    request(target, &system_prompt(0), "Say hello.", 4).await?;
    let target = Arc::new(Target { port: target.port, key: target.key.clone(), model: target.model.clone() });
    let (samples, wall_s) = closed_loop(c, n, move |i| {
        let target = target.clone();
        async move { request(&target, &system_prompt(i % 4), &question(c, i), max_tokens).await }
    })
    .await?;
    Ok(summary(&samples, wall_s))
}

/// `c` clients, each sending request `i` (the next not yet taken) and waiting for its
/// answer, until `n` have been answered: every answer, and the seconds it took.
pub(crate) async fn closed_loop<T, F, Fut>(c: usize, n: usize, send: F) -> Result<(Vec<T>, f64)>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<T>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let clients: Vec<_> = (0..c)
        .map(|_| {
            let (next, send) = (next.clone(), send.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    answers.push(send(i).await?);
                }
                anyhow::Ok(answers)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for client in clients {
        answers.extend(client.await??);
    }
    Ok((answers, start.elapsed().as_secs_f64()))
}

/// One request as the client saw it.
pub(crate) struct Sample {
    timing: api::Timing,
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl Sample {
    pub(crate) fn completion_tokens(&self) -> u64 {
        self.completion_tokens
    }
}

pub(crate) async fn request(target: &Target, system: &str, user: &str, max_tokens: u32) -> Result<Sample> {
    let body = json!({
        "model": target.model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let events = api::stream(target.port, &target.key, "/v1/chat/completions", &body).await?;
    let content = |e: &&api::Event| e.data["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty());
    let times: Vec<Duration> = events.iter().filter(content).map(|e| e.at).collect();
    let usage = events.iter().rev().find_map(|e| e.data.get("usage").filter(|u| u.is_object()));
    let completion_tokens = usage.and_then(|u| u["completion_tokens"].as_u64()).unwrap_or(times.len() as u64);
    Ok(Sample {
        timing: api::timing(&times, completion_tokens)?,
        prompt_tokens: usage.and_then(|u| u["prompt_tokens"].as_u64()).unwrap_or(0),
        completion_tokens,
    })
}

pub(crate) fn summary(samples: &[Sample], wall_s: f64) -> serde_json::Map<String, Value> {
    let output: u64 = samples.iter().map(|s| s.completion_tokens).sum();
    let prompt: u64 = samples.iter().map(|s| s.prompt_tokens).sum();
    let mut figures = api::latency(samples.iter().map(|s| &s.timing));
    figures.insert("requests".into(), json!(samples.len()));
    figures.insert("prompt_tokens_mean".into(), json!(round(prompt as f64 / samples.len().max(1) as f64)));
    figures.insert("output_tokens".into(), json!(output));
    figures.insert("output_tokens_per_s".into(), json!(round(output as f64 / wall_s)));
    figures.insert("wall_s".into(), json!(round(wall_s)));
    figures
}

const WORDS: [&str; 32] = [
    "account", "billing", "policy", "customer", "refund", "shipping", "warranty", "order", "invoice", "support",
    "product", "return", "delivery", "payment", "discount", "member", "service", "ticket", "priority", "region",
    "language", "contract", "renewal", "upgrade", "device", "network", "security", "privacy", "schedule", "holiday",
    "partner", "catalog",
];

/// `n` words drawn from `seed`.
pub(crate) fn words(seed: u64, n: usize) -> String {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
    let mut text = String::new();
    for _ in 0..n {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        text.push(' ');
        text.push_str(WORDS[(state >> 59) as usize]);
    }
    text
}

/// System prompt `s` of the 4: about 100 tokens.
pub(crate) fn system_prompt(s: usize) -> String {
    format!("You are support assistant {s}. Keep to these rules:{}", words(s as u64, 85))
}

/// Request `i`'s question at concurrency `c`: about 110 tokens of its own.
pub(crate) fn question(c: usize, i: usize) -> String {
    format!("Ticket {c}-{i}: a customer writes about{}. Answer them.", words(((c as u64) << 32) | i as u64, 95))
}

/// The llama-server binary: as given, from the environment, or where a script built it.
pub(crate) fn llama_server(given: Option<PathBuf>) -> Result<PathBuf> {
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let tessera_home = std::env::var_os("TESSERA_HOME").map(PathBuf::from).unwrap_or(home.join(".cache/tessera"));
    let candidates = given.into_iter().chain(std::env::var_os("LLAMA_SERVER").map(PathBuf::from)).chain([
        tessera_home.join("peer/llama-server/build/bin/llama-server"),
        home.join(".cache/peer-bench/build-server/bin/llama-server"),
    ]);
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
    }
    bail!(
        "no llama-server found: build it with bench/peer/build-llama-server.sh (about 15 minutes), or pass --llama-server"
    )
}

/// Seconds of the last minute's load average, from /proc.
pub(crate) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// Whether this CPU has AMX tiles: llama.cpp's AMX matrix products crash on these
/// machines unless it is started with `--no-repack`.
pub(crate) fn has_amx() -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.contains(" amx_tile"))
}

/// A running llama-server on a free loopback port, killed when dropped.
pub(crate) struct LlamaServer {
    child: Child,
    pub port: u16,
}

impl LlamaServer {
    /// `llama-server -m GGUF` with 16 slots on `threads` threads, `--no-repack` where
    /// the CPU has AMX (see `has_amx`), and `extra` arguments.
    pub(crate) fn start(binary: &Path, gguf: &Path, threads: usize, extra: &[String]) -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let threads = threads.to_string();
        let child = Command::new(binary)
            .arg("-m")
            .arg(gguf)
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "-c", "8192", "-np", "16"])
            .args(["-t", &threads, "-tb", &threads, "--no-webui"])
            .args(has_amx().then_some("--no-repack"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(120);
        while !server.healthy() {
            if let Some(status) = server.child.try_wait()? {
                bail!("llama-server exited with {status} before it was ready");
            }
            if Instant::now() > deadline {
                bail!("llama-server not ready after 120 s");
            }
            // Polling a process we do not control: there is nothing to wait on.
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(server)
    }

    /// Whether GET /health answers 200 (503 while the model loads).
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").is_err() {
            return false;
        }
        let mut head = [0u8; 12];
        s.read_exact(&mut head).is_ok() && head.ends_with(b"200")
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET `path` from `addr` (host:port) over a fresh HTTP/1.1 connection; the body.
pub(crate) fn http_get(addr: &str, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr)?;
    write!(conn, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "GET {path} from {addr}: {}", head.lines().next().unwrap_or(""));
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Ok(body.to_string());
    }
    // Chunked: each chunk's hexadecimal size line, its bytes, CRLF; a 0 ends it.
    let (mut rest, mut out) = (body, String::new());
    loop {
        let (size, after) = rest.split_once("\r\n").context("a chunk's size line")?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)?;
        if size == 0 {
            return Ok(out);
        }
        out.push_str(after.get(..size).context("a chunk cut short")?);
        rest = after.get(size + 2..).context("a chunk's end")?;
    }
}
