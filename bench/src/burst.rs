//! Streams against a burst of long prompts: does a step stay short while 4,000-token
//! prompts are prefilled beside the decodes? `streams` clients stream chat completions
//! (the peer comparison's requests) on one `tessera serve`, once alone and once while
//! `burst` prompts of about `burst_tokens` tokens arrive together, half a second in.
//! Per phase: the gaps between the streams' tokens (ITL), p50 and p99, and the ratio the
//! issue bounds, p99 over p50 in the burst phase.
//!
//! With `disaggregate`: the burst phase on one aggregated worker using both cores,
//! against a prefill worker and a decode worker pinned to one core each (`taskset`),
//! the streams' ITL and throughput side by side, and the KV transfer's bytes and time
//! per handed-over request from the prefill worker's metrics.

use crate::api::Server;
use crate::peer::{self, MODEL, Sample, Target};
use crate::round;
use anyhow::{Context, Result};
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
    /// Tokens each long prompt asks for (1: only its prefill matters).
    pub burst_max_tokens: u32,
    pub disaggregate: bool,
}

pub fn run(args: BurstArgs<'_>) -> Result<()> {
    if args.disaggregate {
        return disaggregation(&args);
    }
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
            let max_tokens = args.burst_max_tokens;
            tokio::spawn(async move {
                // A load generator's schedule, not synchronisation: the streams are under
                // way by then.
                tokio::time::sleep(Duration::from_millis(500)).await;
                let text =
                    format!("Summarise this log:{}", peer::words(1_000_000 + (round_no * 100 + b) as u64, words));
                let body = json!({
                    "model": t.model,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens,
                    // Exactly `max_tokens` (an end sampled first would skip a handoff).
                    "ignore_eos": true,
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

/// The burst phase aggregated (one worker, both cores) and disaggregated (a prefill and
/// a decode worker, a core each), with the same prompts.
fn disaggregation(args: &BurstArgs<'_>) -> Result<()> {
    let load_average = crate::peer::load_average();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let cache = ["--kv-cache-bytes".to_string(), (1u64 << 30).to_string()];
    let (aggregated, device) = {
        let server = Server::start(args.tessera, &cache)?;
        let target = Target { port: server.port, key: server.key.clone(), model: MODEL.into() };
        (runtime.block_on(phase(&target, args, 1, true))?, server.device.clone())
    };
    let pin = pinning_worker(args.tessera)?;
    let mut split = cache.to_vec();
    split.extend(["--prefill-replicas", "1", "--decode-replicas", "1", "--worker-bin"].map(String::from));
    split.push(pin.display().to_string());
    let (disaggregated, transfer) = {
        let server = Server::start(args.tessera, &split)?;
        let target = Target { port: server.port, key: server.key.clone(), model: MODEL.into() };
        let figures = runtime.block_on(phase(&target, args, 1, true))?;
        // Workers start prefill first, then decode (`tessera serve`).
        let prefill = server.workers.first().context("the prefill worker's address")?;
        (figures, transfer_figures(&crate::peer::http_get(prefill, "/metrics")?))
    };
    let _ = std::fs::remove_file(&pin);
    let ratio =
        |key: &str| disaggregated[key].as_f64().zip(aggregated[key].as_f64()).map(|(d, a)| round(d / a.max(1e-9)));
    println!(
        "{}",
        json!({
            "bench": "disaggregation",
            "device": device,
            "cpu_path": tessera_kernels::cpu::dispatched_path(),
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "burst_prompts": args.burst,
            "burst_max_tokens": args.burst_max_tokens,
            "aggregated": aggregated,
            "disaggregated": disaggregated,
            "itl_p99_ratio": ratio("itl_p99_ms"),
            "itl_p50_ratio": ratio("itl_p50_ms"),
            "throughput_ratio": ratio("output_tokens_per_s"),
            "transfer": transfer,
            "cores": "aggregated: 2; disaggregated: prefill on core 0, decode on core 1 (taskset)",
            "load_average_before": load_average,
        })
    );
    Ok(())
}

/// A worker program for `--worker-bin` that starts `tessera-worker` pinned: a prefill
/// worker to core 0, a decode worker to core 1.
fn pinning_worker(tessera: &Path) -> Result<std::path::PathBuf> {
    let worker = tessera.with_file_name("tessera-worker");
    anyhow::ensure!(worker.is_file(), "{} is missing: build tessera-worker too", worker.display());
    let script = std::env::temp_dir().join(format!("tessera-bench-pin-{}.sh", std::process::id()));
    let text = format!(
        "#!/bin/sh\ncase \"$*\" in\n  *\"--disaggregation-mode prefill\"*) exec taskset -c 0 '{w}' \"$@\" ;;\n  \
         *\"--disaggregation-mode decode\"*) exec taskset -c 1 '{w}' \"$@\" ;;\nesac\nexec '{w}' \"$@\"\n",
        w = worker.display()
    );
    std::fs::write(&script, text)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    Ok(script)
}

/// Handoffs, and bytes and seconds per handoff, from a prefill worker's metrics.
fn transfer_figures(metrics: &str) -> Value {
    let value = |name: &str, label: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
            + 0.0 // an empty sum is -0.0
    };
    let handoffs = value("tessera:kv_transfer_seconds_count", "");
    let per = |x: f64| round(x / handoffs.max(1.0));
    json!({
        "handoffs": handoffs,
        "failed": value("tessera:kv_transfers_total", "outcome=\"failed\""),
        "bytes_per_handoff": per(value("tessera:kv_transfer_bytes_total", "direction=\"sent\"")),
        "blocks_per_handoff": per(value("tessera:kv_transfer_blocks_total", "direction=\"sent\"")),
        "ms_per_handoff": per(value("tessera:kv_transfer_seconds_sum", "") * 1000.0),
    })
}
