//! `tessera-bench`: benchmarks that print one JSON line each.

mod api;
mod billing;
mod burst;
mod console;
mod engine;
mod forward;
mod gateway;
mod gateway_scripted;
#[cfg(feature = "cuda")]
mod gpu;
mod grammar;
mod kernels;
mod kv_tiers;
mod leases_model;
mod metrics_cost;
mod peer;
mod serve;
mod spec;
mod tenants;
mod vision;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tessera-bench", about = "Tessera benchmarks (JSON out)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prefill and single-sequence decode speed of the forward pass, beside llama.cpp's.
    Forward(forward::Args),
    /// Admission and settlement cost per request on SQLite and PostgreSQL, and the
    /// requests one process admits per second with billing on and off.
    Billing(billing::Args),
    /// Budget leases at a scale this machine cannot run (8 control planes, 10,000
    /// requests a second), simulated with the control plane's own lease sizing.
    LeasesModel(leases_model::Args),
    /// The console: argon2id time, and page render times under 50 signed-in users.
    Console(console::Args),
    /// Continuous batching throughput against one request at a time, offline.
    Engine(engine::Args),
    /// The second KV tier on multi-turn chat whose working set is several times the
    /// cache: prefix hit rate and time to first token without it, in host memory, on
    /// disk, and across a restart.
    KvTiers(kv_tiers::Args),
    /// Constrained decoding against free decoding, and the token mask's time per step.
    Grammar(grammar::Args),
    /// The CPU backend's matrix products and paged attention on SmolLM2-135M's shapes.
    Kernels(kernels::Args),
    /// The latency the control plane adds over the worker's gRPC (needs the release
    /// `tessera` and `tessera-worker` binaries).
    Gateway(gateway::Args),
    /// A serving load generator against a multi-replica `tessera serve`: tenants with
    /// long system prompts of their own, cache-aware routing against round-robin; or,
    /// with `--peer llama-server`, one replica against llama.cpp's server on the same load.
    Serve(serve::Args),
    /// Speculative decoding on against off, and against llama-server's speculation, on
    /// code edits, fresh code and chat.
    Spec(spec::Args),
    /// A noisy neighbour: one organization's short requests beside another's flood of
    /// long generations on one replica, time to first token alone and beside it.
    Tenants(tenants::Args),
    /// Requests per second through `tessera serve` with metrics on against off.
    Metrics(metrics_cost::Args),
    /// The vision encoder: images encoded per second and a one-image request's time to
    /// first token, SmolVLM2-256M's shapes.
    Vision(vision::Args),
    /// The CUDA backend on a Llama-3-8B-shaped model with random weights: decode steps,
    /// prefill and paged attention against the device's bandwidth and matrix ceilings.
    #[cfg(feature = "cuda")]
    Gpu(gpu::Args),
}

/// The `p` quantile (0 to 1) of `values`, nearest rank.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(((sorted.len().max(1) - 1) as f64 * p).round() as usize).copied().unwrap_or(f64::NAN)
}

/// A figure to three decimals, as every benchmark line prints it.
fn round(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Forward(args) => forward::run(args),
        Command::Engine(args) => engine::run(args),
        Command::KvTiers(args) => kv_tiers::run(args),
        Command::Console(args) => console::run(args),
        Command::Billing(args) => billing::run(args),
        Command::LeasesModel(args) => leases_model::run(args),
        Command::Gateway(args) => gateway::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Metrics(args) => metrics_cost::run(args),
        Command::Tenants(args) => tenants::run(args),
        Command::Spec(args) => spec::run(args),
        Command::Kernels(args) => kernels::run(args),
        Command::Grammar(args) => grammar::run(args),
        Command::Vision(args) => vision::run(args),
        #[cfg(feature = "cuda")]
        Command::Gpu(args) => gpu::run(args),
    }
}
