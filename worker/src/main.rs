//! `tessera-worker`: see `cli`.

use clap::Parser;
use tessera_worker::cli::{Cli, run};

fn main() -> anyhow::Result<()> {
    run(Cli::parse().command)
}
