//! The serving load generator: a `tessera serve` of several local replicas, and tenants
//! that each send chat completions under a long system prompt of their own (a closed
//! loop per tenant, every tenant at once), streamed, as an SDK would. Each routing policy
//! gets its own server started afresh (cold caches) with the same replicas and KV cache
//! size, one after the other in one run: cache-aware routing against round-robin.
//!
//! The KV cache of a replica is sized (by default) to hold a few tenants' prefixes, not
//! all of them: that is where routing matters. Round-robin shows each replica every
//! tenant, so its cache thrashes; cache-aware routing keeps each tenant on the replicas
//! holding its prefix.
//!
//! With `--peer llama-server` it runs the peer comparison instead (`peer`): one
//! replica, the same load against llama.cpp's server, level by level.
//!
//! Per policy: prefix hit rate (cached prompt tokens over prompt tokens, from each
//! response's usage), time to first token, time per output token after the first, the
//! gaps between streamed tokens (ITL), output tokens per second, p50 and p99; and the
//! ratios between the policies.

use crate::api::{self, Server};
use crate::round;
use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tessera_control_plane::router::choice::Routing;

#[derive(clap::Args)]
pub struct Args {
    /// The `tessera` binary (default: beside this one).
    #[arg(long)]
    tessera: Option<PathBuf>,
    /// Local replicas of the model.
    #[arg(long, default_value_t = 4)]
    replicas: u32,
    /// Tenants, each with its own system prompt, all sending at once.
    #[arg(long, default_value_t = 8)]
    tenants: u32,
    /// Requests each tenant sends, one after another (the first of each misses the
    /// cache under any policy: enough that the steady state dominates).
    #[arg(long, default_value_t = 12)]
    requests_per_tenant: u32,
    /// Words in each tenant's system prompt (about 1.3 tokens each).
    #[arg(long, default_value_t = 300)]
    system_prompt_words: usize,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Each replica's KV cache: 64 MiB holds about 2,900 tokens of SmolLM2-135M on the
    /// CPU (half-float K/V), a few tenants' prefixes.
    #[arg(long, default_value_t = 64 << 20)]
    kv_cache_bytes: u64,
    /// The policies to compare, in this order.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Routing::CacheAware, Routing::RoundRobin])]
    routing: Vec<Routing>,
    /// Instead of comparing routing policies: the same load against this peer, one
    /// after the other, level by level (`peer`); `none`: Tessera alone at each level,
    /// as on a GPU machine, where no peer is built.
    #[arg(long, value_enum)]
    peer: Option<Peer>,
    /// The peer's binary (default: where bench/peer/build-llama-server.sh builds it).
    #[arg(long)]
    llama_server: Option<PathBuf>,
    /// Concurrency levels of the peer comparison.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 16])]
    concurrency: Vec<usize>,
    /// Requests per level of the peer comparison (at least two per client).
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Output tokens of each request of the peer comparison (exact: `ignore_eos`).
    #[arg(long, default_value_t = 128)]
    output_tokens: u32,
    /// The peer's threads (`-t`, `-tb`); Tessera uses every core.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Instead of comparing routing policies: streams with and without a burst of long
    /// prompts arriving (`burst`), ITL p50 and p99 of each.
    #[arg(long)]
    burst: bool,
    /// Long prompts in the burst.
    #[arg(long, default_value_t = 4)]
    burst_prompts: usize,
    /// Tokens of each long prompt (about).
    #[arg(long, default_value_t = 4000)]
    burst_tokens: usize,
    /// Tokens each long prompt asks for (more than 1: a disaggregated one is handed over).
    #[arg(long, default_value_t = 1)]
    burst_max_tokens: u32,
    /// Streaming clients beside the burst.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// With `--burst`: the burst on one worker using both cores against a prefill worker
    /// and a decode worker pinned to a core each (disaggregated serving).
    #[arg(long)]
    disaggregate: bool,
    /// Requests each streaming client sends, one after another, with `--burst`.
    #[arg(long, default_value_t = 2)]
    requests_per_stream: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum Peer {
    LlamaServer,
    None,
}

/// One request as the client saw it.
struct Sample {
    timing: api::Timing,
    completion_tokens: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

pub fn run(args: Args) -> Result<()> {
    let tessera = api::tessera_binary(args.tessera.clone())?;
    if args.burst {
        return crate::burst::run(crate::burst::BurstArgs {
            tessera: &tessera,
            streams: args.streams,
            requests_per_stream: args.requests_per_stream,
            max_tokens: args.output_tokens,
            burst: args.burst_prompts,
            burst_tokens: args.burst_tokens,
            burst_max_tokens: args.burst_max_tokens,
            disaggregate: args.disaggregate,
        });
    }
    if let Some(peer) = args.peer {
        return crate::peer::run(crate::peer::PeerArgs {
            tessera: &tessera,
            llama_server: match peer {
                Peer::LlamaServer => Some(args.llama_server.clone()),
                Peer::None => None,
            },
            concurrency: &args.concurrency,
            requests: args.requests,
            max_tokens: args.output_tokens,
            threads: args.threads,
        });
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut policies = Vec::new();
    for &routing in &args.routing {
        let name = routing.to_possible_value().context("a routing policy's name")?.get_name().to_string();
        let server = Server::start(
            &tessera,
            &[
                "--replicas".into(),
                args.replicas.to_string(),
                "--routing".into(),
                name.clone(),
                "--kv-cache-bytes".into(),
                args.kv_cache_bytes.to_string(),
            ],
        )?;
        if server.workers.len() != args.replicas as usize {
            bail!("tessera serve started {} workers, not {}", server.workers.len(), args.replicas);
        }
        let mut report = runtime.block_on(phase(&server, &args))?;
        drop(server);
        report.insert("routing".into(), json!(name));
        policies.push(Value::Object(report));
    }
    let mut line = json!({
        "bench": "serve",
        "replicas": args.replicas,
        "tenants": args.tenants,
        "requests_per_tenant": args.requests_per_tenant,
        "system_prompt_words": args.system_prompt_words,
        "max_tokens": args.max_tokens,
        "kv_cache_bytes": args.kv_cache_bytes,
        "policies": policies,
    });
    let find = |name: &str| policies.iter().find(|p| p["routing"] == name);
    if let (Some(ca), Some(rr)) = (find("cache-aware"), find("round-robin")) {
        let ratio = |k: &str| ca[k].as_f64().zip(rr[k].as_f64()).map(|(a, b)| round(a / b));
        line["ttft_mean_ratio"] = json!(ratio("ttft_mean_ms"));
        line["ttft_p50_ratio"] = json!(ratio("ttft_p50_ms"));
        line["output_tokens_per_s_ratio"] = json!(ratio("output_tokens_per_s"));
        line["prefix_hit_rate_cache_aware"] = ca["prefix_hit_rate"].clone();
        line["prefix_hit_rate_round_robin"] = rr["prefix_hit_rate"].clone();
    }
    println!("{line}");
    Ok(())
}

/// Tenant `t`'s system prompt: its own words, the same in every phase.
fn system_prompt(t: u32, words: usize) -> String {
    const WORDS: [&str; 32] = [
        "account", "billing", "policy", "customer", "refund", "shipping", "warranty", "order", "invoice", "support",
        "product", "return", "delivery", "payment", "discount", "member", "service", "ticket", "priority", "region",
        "language", "contract", "renewal", "upgrade", "device", "network", "security", "privacy", "schedule",
        "holiday", "partner", "catalog",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(t).wrapping_mul(0x2545_f491_4f6c_dd1d);
    let mut text = format!("You are the assistant of tenant {t}. Follow these house rules exactly:");
    for _ in 0..words {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        text.push(' ');
        text.push_str(WORDS[(state >> 59) as usize]);
    }
    text
}

/// Every tenant's requests, then the phase's figures.
async fn phase(server: &Server, args: &Args) -> Result<serde_json::Map<String, Value>> {
    // Warm every replica (threads, first step) with a request each, sent at once so
    // that either policy spreads them.
    let warm: Vec<_> = (0..args.replicas)
        .map(|i| {
            let (port, key) = (server.port, server.key.clone());
            tokio::spawn(async move { request(port, &key, &format!("Warm-up {i}."), "Hello.", 4).await })
        })
        .collect();
    for w in warm {
        w.await??;
    }
    let start = Instant::now();
    let tenants: Vec<_> = (0..args.tenants)
        .map(|t| {
            let (port, key) = (server.port, server.key.clone());
            let (system, n, max_tokens) =
                (system_prompt(t, args.system_prompt_words), args.requests_per_tenant, args.max_tokens);
            tokio::spawn(async move {
                let mut samples = Vec::new();
                for i in 0..n {
                    let user = format!("Question {i}: in one sentence, what should customer {} expect?", i * 7 + t);
                    samples.push(request(port, &key, &system, &user, max_tokens).await?);
                }
                anyhow::Ok(samples)
            })
        })
        .collect();
    let mut samples = Vec::new();
    for t in tenants {
        samples.extend(t.await??);
    }
    let wall = start.elapsed().as_secs_f64();
    Ok(summary(&samples, wall))
}

/// One streamed chat completion under `system`.
async fn request(port: u16, key: &str, system: &str, user: &str, max_tokens: u32) -> Result<Sample> {
    let body = json!({
        "model": "vendor-a/model-a",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let events = api::stream(port, key, "/v1/chat/completions", &body).await?;
    let usage = events.iter().rev().find_map(|e| e.data.get("usage").filter(|u| !u.is_null())).context("no usage")?;
    // The catalog's model may think first: reasoning deltas carry tokens too.
    let carried_tokens = |e: &&api::Event| {
        let delta = &e.data["choices"][0]["delta"];
        ["content", "reasoning"].iter().any(|k| delta[k].as_str().is_some_and(|c| !c.is_empty()))
    };
    let times: Vec<Duration> = events.iter().filter(carried_tokens).map(|e| e.at).collect();
    let completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
    Ok(Sample {
        timing: api::timing(&times, completion_tokens)?,
        completion_tokens,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
    })
}

fn summary(samples: &[Sample], wall_s: f64) -> serde_json::Map<String, Value> {
    let ttft_ms: f64 = samples.iter().map(|s| s.timing.ttft.as_secs_f64() * 1e3).sum();
    let output: u64 = samples.iter().map(|s| s.completion_tokens).sum();
    let prompt: u64 = samples.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = samples.iter().map(|s| s.cached_tokens).sum();
    let mut figures = api::latency(samples.iter().map(|s| &s.timing));
    figures.insert("requests".into(), json!(samples.len()));
    figures.insert("prompt_tokens".into(), json!(prompt));
    figures.insert("prefix_hit_rate".into(), json!(round(cached as f64 / prompt.max(1) as f64)));
    figures.insert("ttft_mean_ms".into(), json!(round(ttft_ms / samples.len().max(1) as f64)));
    figures.insert("output_tokens_per_s".into(), json!(round(output as f64 / wall_s)));
    figures.insert("wall_s".into(), json!(round(wall_s)));
    figures
}
