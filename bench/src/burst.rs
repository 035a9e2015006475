//! Streams against a burst of long prompts: does a step stay short while 4,000-token
//! prompts are prefilled beside the decodes? `streams` clients stream chat completions
//! (the peer comparison's requests) on one `tessera serve`, once alone and once while
//! `burst` prompts of about `burst_tokens` tokens arrive together, half a second in.
//! Per phase: the gaps between the streams' tokens (ITL), p50 and p99, and the ratio the
//! issue bounds, p99 over p50 in the burst phase.

use crate::api::Server;
use crate::peer::{self, MODEL, Sample, Target};
use crate::round;
use anyhow::Result;
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

pub struct BurstArgs<'a> {
    pub tessera: &'a Path,
    pub streams: usize,
    pub requests_per_stream: usize,
    pub max_tokens: u32,
    pub burst: usize,
    pub burst_tokens: usize,
}

pub fn run(args: BurstArgs<'_>) -> Result<()> {
    // Room in the KV cache for the burst and the streams together.
    let server = Server::start(args.tessera, &["--kv-cache-bytes".into(), (1u64 << 30).to_string()])?;
    let target = Target { port: server.port, key: server.key.clone(), model: MODEL.into() };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let steady = runtime.block_on(phase(&target, &args, 0, false))?;
    let burst = runtime.block_on(phase(&target, &args, 1, true))?;
    let ratio = burst["itl_p99_ms"].as_f64().zip(burst["itl_p50_ms"].as_f64()).map(|(a, b)| round(a / b));
    println!(
        "{}",
        json!({
            "bench": "serve_burst",
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "burst_prompts": args.burst,
            "steady": steady,
            "burst": burst,
            "burst_itl_p99_over_p50": ratio,
        })
    );
    Ok(())
}

/// The streams' requests, with the burst half a second in when `burst`; the streams'
/// figures (the burst's own requests are not in them).
async fn phase(
    target: &Target,
    args: &BurstArgs<'_>,
    round_no: usize,
    burst: bool,
) -> Result<serde_json::Map<String, Value>> {
    peer::request(target, &peer::system_prompt(0), "Say hello.", 4).await?;
    let start = Instant::now();
    let streams: Vec<_> = (0..args.streams)
        .map(|s| {
            let t = Target { port: target.port, key: target.key.clone(), model: target.model.clone() };
            let (n, max_tokens) = (args.requests_per_stream, args.max_tokens);
            tokio::spawn(async move {
                let mut samples: Vec<Sample> = Vec::new();
                for i in 0..n {
                    let q = peer::question(100 + round_no, s * n + i);
                    samples.push(peer::request(&t, &peer::system_prompt(s % 4), &q, max_tokens).await?);
                }
                anyhow::Ok(samples)
            })
        })
        .collect();
    let long: Vec<_> = (0..if burst { args.burst } else { 0 })
        .map(|b| {
            let t = Target { port: target.port, key: target.key.clone(), model: target.model.clone() };
            let words = args.burst_tokens * 10 / 11;
            tokio::spawn(async move {
                // A load generator's schedule, not synchronisation: the streams are under
                // way by then.
                tokio::time::sleep(Duration::from_millis(500)).await;
                let text =
                    format!("Summarise this log:{}", peer::words(1_000_000 + (round_no * 100 + b) as u64, words));
                let body = json!({
                    "model": t.model,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": 1,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                let events = crate::api::stream(t.port, &t.key, "/v1/chat/completions", &body).await?;
                let usage = events.iter().rev().find_map(|e| e.data["usage"]["prompt_tokens"].as_u64());
                anyhow::Ok(usage.unwrap_or(0))
            })
        })
        .collect();
    let mut samples = Vec::new();
    for s in streams {
        samples.extend(s.await??);
    }
    let wall = start.elapsed().as_secs_f64();
    let mut prompt_tokens = Vec::new();
    for l in long {
        prompt_tokens.push(l.await??);
    }
    let mut figures = peer::summary(&samples, wall);
    if burst {
        figures.insert("burst_prompt_tokens".into(), json!(prompt_tokens));
    }
    Ok(figures)
}
