//! `tessera-bench`: benchmarks that print one JSON line each.

mod engine;
mod forward;
mod gateway;

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
    /// Continuous batching throughput against one request at a time, offline.
    Engine(engine::Args),
    /// The latency the control plane adds over the worker's gRPC (needs the release
    /// `tessera` and `tessera-worker` binaries).
    Gateway(gateway::Args),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Forward(args) => forward::run(args),
        Command::Engine(args) => engine::run(args),
        Command::Gateway(args) => gateway::run(args),
    }
}
