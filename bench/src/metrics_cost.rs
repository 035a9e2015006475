//! What metrics cost on the hot path: two `tessera serve`s, one recording metrics (the
//! control plane's and its worker's) and one started with `--no-metrics`, each sent the
//! same short streamed completions (one output token, so that the engine's time is as
//! small a part of each request as it can be) at the same concurrency. The servers take
//! turns, round after round, so that both meet the same machine; requests per second of
//! each over all its rounds, and their ratio.

use crate::api::{self, Server};
use crate::round;
use anyhow::Result;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// The `tessera` binary (default: beside this one).
    #[arg(long)]
    tessera: Option<PathBuf>,
    /// Requests per server and round.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    #[arg(long, default_value_t = 6)]
    rounds: usize,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
}

pub fn run(args: Args) -> Result<()> {
    let tessera = api::tessera_binary(args.tessera)?;
    let kv = ["--kv-cache-bytes".to_string(), "134217728".to_string()];
    let on = Server::start(&tessera, &kv)?;
    let off = Server::start(&tessera, &[kv[0].clone(), kv[1].clone(), "--no-metrics".into()])?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (mut on_time, mut off_time) = (Duration::ZERO, Duration::ZERO);
    runtime.block_on(async {
        for server in [&on, &off] {
            burst(server, args.concurrency, args.concurrency, 0).await?;
        }
        for r in 0..args.rounds {
            // Alternate which goes first, so that neither always follows the other.
            let order = if r % 2 == 0 { [(&on, true), (&off, false)] } else { [(&off, false), (&on, true)] };
            for (server, recording) in order {
                let took = burst(server, args.requests, args.concurrency, (r + 1) * args.requests).await?;
                *(if recording { &mut on_time } else { &mut off_time }) += took;
            }
        }
        anyhow::Ok(())
    })?;
    let total = (args.requests * args.rounds) as f64;
    let (on_rps, off_rps) = (total / on_time.as_secs_f64(), total / off_time.as_secs_f64());
    println!(
        "{}",
        json!({
            "bench": "metrics",
            "requests_per_server": args.requests * args.rounds,
            "concurrency": args.concurrency,
            "requests_per_s_metrics_on": round(on_rps),
            "requests_per_s_metrics_off": round(off_rps),
            "ratio": round(on_rps / off_rps),
        })
    );
    Ok(())
}

/// `n` streamed one-token completions, `concurrency` at a time; the time they took.
async fn burst(server: &Server, n: usize, concurrency: usize, first: usize) -> Result<Duration> {
    let start = Instant::now();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(first));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (port, key, next) = (server.port, server.key.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= first + n {
                        return anyhow::Ok(());
                    }
                    let body = json!({"model": "vendor-a/model-a", "prompt": format!("Request {i}: say ok."),
                        "max_tokens": 1, "temperature": 0, "stream": true});
                    api::stream(port, &key, "/v1/completions", &body).await?;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    Ok(start.elapsed())
}
