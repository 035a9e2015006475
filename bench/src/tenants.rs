//! A noisy neighbour on one replica: does one organization's flood slow another's
//! requests? Organization A (the bootstrap one) runs `flood` concurrent long generations
//! in a closed loop; organization B sends short requests one at a time. Three phases on
//! one `tessera serve`, one after the other: B alone, A alone, both.
//!
//! Printed: B's time to first token alone and under the flood (p50, p99) and the ratio
//! of the p50s, which fair sharing bounds; A's output tokens per second alone and beside
//! B, so that the line also shows the flooder keeping the capacity B does not want.
//! A's throughput over a window counts each of its requests' tokens in proportion to
//! the part of the request inside the window (a closed loop's requests straddle its
//! edges).

use crate::api::Server;
use crate::peer::{self, MODEL, Target};
use crate::round;
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// The `tessera` binary (default: beside this one).
    #[arg(long)]
    tessera: Option<PathBuf>,
    /// The flooder's concurrent generations.
    #[arg(long, default_value_t = 48)]
    flood: usize,
    /// Output tokens of each of the flooder's generations.
    #[arg(long, default_value_t = 256)]
    flood_tokens: u32,
    /// The bystander's requests in each phase it runs in.
    #[arg(long, default_value_t = 40)]
    requests: usize,
    /// Output tokens of each of the bystander's requests.
    #[arg(long, default_value_t = 8)]
    bystander_tokens: u32,
    /// Seconds the flooder runs alone (after its streams have started).
    #[arg(long, default_value_t = 15.0)]
    flood_alone_s: f64,
    /// The flooder's scheduling weight (`tessera orgs set-weight`); the bystander keeps
    /// the default.
    #[arg(long)]
    flood_weight: Option<u32>,
    /// Extra `tessera serve` arguments, e.g. `--fair-share=off` to see the engine without it.
    #[arg(long, allow_hyphen_values = true, value_delimiter = ' ')]
    serve_args: Vec<String>,
}

/// One finished request of the flooder: when it ran and the tokens it produced.
#[derive(Clone, Copy)]
struct Span {
    start: Instant,
    end: Instant,
    tokens: u64,
}

/// Tokens per second over `from..to`, each span's tokens spread evenly over it.
fn rate(spans: &[Span], from: Instant, to: Instant) -> f64 {
    let tokens: f64 = spans
        .iter()
        .map(|s| {
            let inside = s.end.min(to).saturating_duration_since(s.start.max(from));
            s.tokens as f64 * inside.as_secs_f64() / (s.end - s.start).as_secs_f64().max(1e-9)
        })
        .sum();
    tokens / (to - from).as_secs_f64()
}

pub fn run(args: Args) -> Result<()> {
    let tessera = crate::api::tessera_binary(args.tessera.clone())?;
    let load_before = peer::load_average();
    // Room in the KV cache for every flood stream at full length.
    let mut serve = vec!["--kv-cache-bytes".to_string(), (1u64 << 30).to_string()];
    serve.extend(args.serve_args.iter().filter(|a| !a.is_empty()).cloned());
    let server = Server::start(&tessera, &serve)?;
    let org = server.operator(&["orgs", "create", "bystander"])?;
    let org_id = org["id"].as_str().context("the new organization's id")?.to_string();
    server.operator(&["credits", "grant", "--org", &org_id, "--usd", "1000"])?;
    let key = server.operator(&["keys", "create", "--org", &org_id, "--name", "bench"])?;
    if let Some(w) = args.flood_weight {
        // The bootstrap organization, whose key the flooder uses, is called "default".
        server.operator(&["orgs", "set-weight", "default", "--weight", &w.to_string()])?;
    }
    let flooder = Arc::new(Target { port: server.port, key: server.key.clone(), model: MODEL.into() });
    let bystander = Target {
        port: server.port,
        key: key["secret"].as_str().context("the new key's secret")?.to_string(),
        model: MODEL.into(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        // Warm up: threads started, first steps' allocations made.
        peer::request(&bystander, &peer::system_prompt(0), "Say hello.", 4).await?;
        let alone = bystanding(&bystander, &args, 0).await?;

        let spans = Arc::new(Mutex::new(Vec::new()));
        let flood: Vec<_> = (0..args.flood)
            .map(|c| {
                let (target, spans, tokens) = (flooder.clone(), spans.clone(), args.flood_tokens);
                tokio::spawn(async move {
                    for i in 0.. {
                        let start = Instant::now();
                        let q = peer::question(1000 + c, i);
                        let sample = peer::request(&target, "You write long answers.", &q, tokens).await?;
                        let span = Span { start, end: Instant::now(), tokens: sample.completion_tokens() };
                        spans.lock().expect("spans").push(span);
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        // The flood's streams all start (their prompts prefilled) before timing begins:
        // a load generator's schedule, not synchronisation.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let from = Instant::now();
        tokio::time::sleep(Duration::from_secs_f64(args.flood_alone_s)).await;
        let flood_alone_until = Instant::now();
        let beside = bystanding(&bystander, &args, 1).await?;
        let beside_until = Instant::now();
        // Every request overlapping the windows has finished by the time one more
        // generation's length has passed; wait for them, then stop the flood.
        let longest = spans.lock().expect("spans").iter().map(|s| s.end - s.start).max().unwrap_or_default();
        tokio::time::sleep(longest + Duration::from_secs(1)).await;
        for f in &flood {
            f.abort();
        }
        let spans = spans.lock().expect("spans").clone();
        let flood_alone = rate(&spans, from, flood_alone_until);
        let flood_beside = rate(&spans, flood_alone_until, beside_until);
        let ttft = |m: &serde_json::Map<String, Value>| m["ttft_p50_ms"].as_f64();
        let line = json!({
            "bench": "tenants",
            "device": server.device,
            "flood_streams": args.flood,
            "flood_tokens": args.flood_tokens,
            "flood_weight": args.flood_weight,
            "bystander_tokens": args.bystander_tokens,
            "serve_args": args.serve_args,
            "bystander_alone": alone,
            "bystander_under_flood": beside,
            "bystander_ttft_p50_ratio": ttft(&beside).zip(ttft(&alone)).map(|(a, b)| round(a / b)),
            "flooder_tokens_per_s_alone": round(flood_alone),
            "flooder_tokens_per_s_beside_bystander": round(flood_beside),
            "load_average_before": load_before,
        });
        println!("{line}");
        anyhow::Ok(())
    })
}

/// The bystander's requests, one at a time; their figures.
async fn bystanding(target: &Target, args: &Args, phase: usize) -> Result<serde_json::Map<String, Value>> {
    let start = Instant::now();
    let mut samples = Vec::new();
    for i in 0..args.requests {
        let q = format!("Question {phase}-{i}: what is the capital of France?");
        samples.push(peer::request(target, "You answer briefly.", &q, args.bystander_tokens).await?);
    }
    Ok(peer::summary(&samples, start.elapsed().as_secs_f64()))
}
