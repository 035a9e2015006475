//! `tessera-worker`: see `cli`.

use clap::Parser;
use tessera_worker::cli::{Cli, run};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    run(cli.command, &cli.traces)
}
