//! What the control plane adds to a request's latency: completions sent to the
//! worker's gRPC directly and through `tessera serve`'s HTTP API (SSE), at 1 and 64
//! concurrent streams. The two paths are interleaved within one run — each stream
//! alternates between them — so both meet the same engine load; the engine's own time
//! (tens of milliseconds a step on this CPU) is the noise the difference is read
//! against. Time to first token and to the end, p50 and p99, and the difference. Every
//! prompt starts with its own number, so no request is served from another's prefix
//! cache.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(clap::Args)]
pub struct Args {
    /// The `tessera` binary (default: beside this one).
    #[arg(long)]
    tessera: Option<PathBuf>,
    /// Concurrent streams, one measurement each.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 64])]
    concurrency: Vec<usize>,
    /// Requests per path and concurrency level (at least the concurrency).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
}

struct Serve {
    child: Child,
    _data: PathBuf,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._data);
    }
}

/// One request's times: to the first generated text, and to the end.
#[derive(Clone, Copy)]
struct Timing {
    first: Duration,
    total: Duration,
}

pub fn run(args: Args) -> Result<()> {
    let tessera = match args.tessera {
        Some(p) => p,
        None => std::env::current_exe()?.parent().context("bench directory")?.join("tessera"),
    };
    let data = std::env::temp_dir().join(format!("tessera-gateway-bench-{}", std::process::id()));
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut child = Command::new(&tessera)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--kv-cache-bytes", "268435456"])
        .arg("--data-dir")
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| {
            format!(
                "starting {} (build it with `cargo build --release -p tessera-control-plane`, and tessera-worker)",
                tessera.display()
            )
        })?;
    let stderr = child.stderr.take().context("stderr")?;
    let serve = Serve { child, _data: data.clone() };
    let mut worker = None;
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let Some(line) = lines.next() else { bail!("tessera serve exited before listening") };
        let line = line?;
        if line.contains("tessera-worker serving") {
            worker = line.rsplit(" on ").next().map(str::to_string);
        }
        if line.starts_with("tessera listening on") {
            break;
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    let worker = worker.context("the worker's address in the log")?;
    let key = std::fs::read_to_string(data.join("bootstrap.key"))?.trim().to_string();

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let max_tokens = args.max_tokens;
    let levels = runtime.block_on(async move {
        let client = WorkerClient::connect(format!("http://{worker}")).await?;
        let card = client.clone().get_model_card(pb::ModelCardRequest {}).await?.into_inner();
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(card.tokenizer_json.as_bytes()).map_err(anyhow::Error::msg)?;
        let prompt = |i: usize| -> Result<Vec<u32>> {
            let text = format!("Request {i:05}: write a short note about the weather in a city you like.");
            Ok(tokenizer.encode(text, false).map_err(anyhow::Error::msg)?.get_ids().to_vec())
        };
        // Warm both paths (connections, thread pools, the engine's first step).
        let warm = prompt(99_999)?;
        grpc(client.clone(), warm.clone(), max_tokens).await?;
        http(port, &key, &warm, max_tokens).await?;
        let mut levels = Vec::new();
        let mut next = 0;
        for &c in &args.concurrency {
            let n = (args.requests.max(c) / 2).max(1) * 2;
            let jobs: Vec<(bool, Vec<u32>)> =
                (next..next + n).map(|i| Ok((i % 2 == 0, prompt(i)?))).collect::<Result<_>>()?;
            next += n;
            let client = client.clone();
            let key = key.clone();
            let timings = run_level(c, jobs, move |(direct, p)| {
                let (client, key) = (client.clone(), key.clone());
                async move {
                    let t = if direct {
                        grpc(client, p, max_tokens).await?
                    } else {
                        http(port, &key, &p, max_tokens).await?
                    };
                    Ok((direct, t))
                }
            })
            .await?;
            let pick = |want: bool| timings.iter().filter(|(d, _)| *d == want).map(|(_, t)| *t).collect::<Vec<_>>();
            levels.push(report(c, &pick(true), &pick(false)));
        }
        anyhow::Ok(levels)
    })?;
    drop(serve);
    println!(
        "{}",
        json!({"bench": "gateway", "max_tokens": max_tokens, "requests_per_level": args.requests, "levels": levels})
    );
    Ok(())
}

/// `jobs` through `send`, `concurrency` at a time.
async fn run_level<J, T, F, Fut>(concurrency: usize, mut jobs: Vec<J>, send: F) -> Result<Vec<T>>
where
    J: Send + 'static,
    T: Send + 'static,
    F: Fn(J) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<T>> + Send,
{
    jobs.reverse();
    let prompts = jobs;
    let queue = std::sync::Arc::new(std::sync::Mutex::new(prompts));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (queue, send) = (queue.clone(), send.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let Some(p) = queue.lock().expect("queue").pop() else { return anyhow::Ok(out) };
                out.push(send(p).await?);
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

async fn grpc(
    mut client: WorkerClient<tonic::transport::Channel>,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Result<Timing> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let start = Instant::now();
    let request = pb::GenerateRequest {
        request_id: format!("bench-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams::default()),
        max_tokens,
        ..Default::default()
    };
    let mut stream = client.generate(request).await?.into_inner();
    let mut first = None;
    while let Some(r) = stream.message().await? {
        if first.is_none() && !r.text.is_empty() {
            first = Some(start.elapsed());
        }
    }
    let total = start.elapsed();
    Ok(Timing { first: first.unwrap_or(total), total })
}

/// A streamed legacy completion of the same token ids over a fresh HTTP/1.1 connection.
async fn http(port: u16, key: &str, prompt: &[u32], max_tokens: u32) -> Result<Timing> {
    let start = Instant::now();
    let body = json!({"model": "vendor-a/model-a", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": true})
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut socket = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    socket.write_all(request.as_bytes()).await?;
    let (mut seen, mut buf, mut first) = (String::new(), [0u8; 8192], None);
    loop {
        let n = socket.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        if first.is_none() && seen.lines().filter_map(|l| l.strip_prefix("data: {")).any(has_text) {
            first = Some(start.elapsed());
        }
        if seen.contains("data: [DONE]") {
            break;
        }
    }
    if !seen.starts_with("HTTP/1.1 200") {
        bail!("the API answered {}", seen.lines().next().unwrap_or_default());
    }
    let total = start.elapsed();
    Ok(Timing { first: first.unwrap_or(total), total })
}

fn has_text(event_tail: &str) -> bool {
    serde_json::from_str::<Value>(&format!("{{{event_tail}"))
        .ok()
        .and_then(|v| v["choices"][0]["text"].as_str().map(|t| !t.is_empty()))
        .unwrap_or(false)
}

fn percentile(mut ms: Vec<f64>, p: f64) -> f64 {
    ms.sort_by(f64::total_cmp);
    let i = ((ms.len() as f64 - 1.0) * p).round() as usize;
    (ms[i.min(ms.len() - 1)] * 100.0).round() / 100.0
}

fn report(concurrency: usize, direct: &[Timing], gateway: &[Timing]) -> Value {
    let ms = |t: &[Timing], f: fn(&Timing) -> Duration| t.iter().map(|x| f(x).as_secs_f64() * 1e3).collect::<Vec<_>>();
    let first = |t: &Timing| t.first;
    let total = |t: &Timing| t.total;
    let (d50, d99) = (percentile(ms(direct, first), 0.5), percentile(ms(direct, first), 0.99));
    let (g50, g99) = (percentile(ms(gateway, first), 0.5), percentile(ms(gateway, first), 0.99));
    json!({
        "concurrency": concurrency,
        "grpc_ttft_p50_ms": d50, "grpc_ttft_p99_ms": d99,
        "http_ttft_p50_ms": g50, "http_ttft_p99_ms": g99,
        "added_ttft_p50_ms": ((g50 - d50) * 100.0).round() / 100.0,
        "added_ttft_p99_ms": ((g99 - d99) * 100.0).round() / 100.0,
        "grpc_total_p50_ms": percentile(ms(direct, total), 0.5),
        "http_total_p50_ms": percentile(ms(gateway, total), 0.5),
    })
}
