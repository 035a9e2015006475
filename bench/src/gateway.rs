//! What the control plane adds to a request's latency: completions sent to the
//! worker's gRPC directly and through `tessera serve`'s HTTP API (SSE), at 1 and 64
//! concurrent streams. The two paths are interleaved within one run — each stream
//! alternates between them — so both meet the same engine load; the engine's own time
//! (tens of milliseconds a step on this CPU) is the noise the difference is read
//! against. Time to first token and to the end, p50 and p99, and the difference. Every
//! prompt starts with its own number, so no request is served from another's prefix
//! cache.

use crate::api::{self, Server};
use crate::{percentile, round};
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};

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
    /// Against a scripted worker that answers at once, in this process, instead of a
    /// `tessera serve` (`gateway_scripted`): concurrency 1 and an open loop.
    #[arg(long)]
    scripted: bool,
    /// The open loop's requests per second (with --scripted).
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// The open loop's seconds for each path (with --scripted).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
}

/// One request's times: to the first generated text, and to the end.
#[derive(Clone, Copy)]
pub(crate) struct Timing {
    first: Duration,
    total: Duration,
}

pub fn run(args: Args) -> Result<()> {
    if args.scripted {
        let requests = args.requests.max(1000);
        return crate::gateway_scripted::run(crate::gateway_scripted::ScriptedArgs {
            requests,
            rate: args.rate,
            seconds: args.seconds,
        });
    }
    let tessera = api::tessera_binary(args.tessera)?;
    let serve = Server::start(&tessera, &["--kv-cache-bytes".into(), "268435456".into()])?;
    let worker = serve.workers.first().cloned().context("the worker's address in the log")?;
    let (port, key) = (serve.port, serve.key.clone());

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let max_tokens = args.max_tokens;
    let levels = runtime.block_on(async move {
        let client = WorkerClient::connect(format!("http://{worker}"))
            .await?
            .max_decoding_message_size(tessera_proto::MAX_MESSAGE_BYTES);
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
        http(port, &key, "vendor-a/model-a", &warm, max_tokens).await?;
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
                        http(port, &key, "vendor-a/model-a", &p, max_tokens).await?
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
pub(crate) async fn run_level<J, T, F, Fut>(concurrency: usize, mut jobs: Vec<J>, send: F) -> Result<Vec<T>>
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

pub(crate) async fn grpc(
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

/// A streamed legacy completion of the same token ids.
pub(crate) async fn http(port: u16, key: &str, model: &str, prompt: &[u32], max_tokens: u32) -> Result<Timing> {
    let start = Instant::now();
    let events = api::stream(port, key, "/v1/completions", &completion(model, prompt, max_tokens)).await?;
    timing(start, &events)
}

/// The same on a kept-alive connection.
pub(crate) async fn http_on(
    conn: &mut api::Conn,
    key: &str,
    model: &str,
    prompt: &[u32],
    max_tokens: u32,
) -> Result<Timing> {
    let start = Instant::now();
    let events = conn.stream(key, "/v1/completions", &completion(model, prompt, max_tokens)).await?;
    timing(start, &events)
}

fn completion(model: &str, prompt: &[u32], max_tokens: u32) -> Value {
    json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true})
}

/// When the first text arrived, and the whole reply, since `start`.
fn timing(start: Instant, events: &[api::Event]) -> Result<Timing> {
    let total = start.elapsed();
    let has_text = |e: &&api::Event| e.data["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty());
    let first = events.iter().find(has_text).map(|e| e.at);
    Ok(Timing { first: first.unwrap_or(total), total })
}

pub(crate) fn report(concurrency: usize, direct: &[Timing], gateway: &[Timing]) -> Value {
    let ms = |t: &[Timing], f: fn(&Timing) -> Duration| t.iter().map(|x| f(x).as_secs_f64() * 1e3).collect::<Vec<_>>();
    let first = |t: &Timing| t.first;
    let total = |t: &Timing| t.total;
    let p = |t: &[Timing], f, q| round(percentile(&ms(t, f), q));
    let (d50, d99) = (p(direct, first, 0.5), p(direct, first, 0.99));
    let (g50, g99) = (p(gateway, first, 0.5), p(gateway, first, 0.99));
    json!({
        "concurrency": concurrency,
        "grpc_ttft_p50_ms": d50, "grpc_ttft_p99_ms": d99,
        "http_ttft_p50_ms": g50, "http_ttft_p99_ms": g99,
        "added_ttft_p50_ms": round(g50 - d50),
        "added_ttft_p99_ms": round(g99 - d99),
        "grpc_total_p50_ms": p(direct, total, 0.5),
        "http_total_p50_ms": p(gateway, total, 0.5),
    })
}
