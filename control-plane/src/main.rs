//! `tessera`: the control plane. The OpenAI-compatible API and `tessera serve` land
//! with the API issue; until then this binary only reports its version.

use clap::Parser;

#[derive(Parser)]
#[command(name = "tessera", version, about = "Tessera control plane (the API is not built yet)")]
struct Cli {}

fn main() {
    Cli::parse();
    eprintln!("tessera {}: the API server is not built yet; use `tessera-worker generate`", env!("CARGO_PKG_VERSION"));
    std::process::exit(2);
}
