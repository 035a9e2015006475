//! `tessera`: the control plane's command line.

use clap::Parser;
use tessera_control_plane::config::{Cli, Command, LogFormat};
use tessera_control_plane::{cluster, ops, serve};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The built-in worker starts the runtimes it needs itself.
    if let Command::Worker(command) = cli.command {
        return tessera_worker::cli::run(command, &cli.traces);
    }
    tokio::runtime::Runtime::new()?.block_on(control_plane(cli))
}

async fn control_plane(cli: Cli) -> anyhow::Result<()> {
    let _telemetry = tessera_worker::telemetry::init(
        cli.log_format == LogFormat::Json,
        "warn,tessera_control_plane::api=info,tessera_control_plane::console=info",
        &cli.traces,
        "tessera",
    )?;
    match cli.command {
        Command::Serve(config) => serve::run(config, cli.log_format, cli.traces.clone()).await,
        Command::ControlPlane(config) => cluster::control_plane::run(config).await,
        Command::Orgs(cmd) => ops::orgs(cmd).await,
        Command::Keys(cmd) => ops::keys(cmd).await,
        Command::Credits(cmd) => ops::credits(cmd).await,
        Command::Usage(cmd) => ops::usage(cmd).await,
        Command::Capacity(cmd) => ops::capacity(cmd).await,
        Command::Users(cmd) => ops::users(cmd).await,
        Command::Plans(cmd) => ops::plans(cmd).await,
        Command::Supply(cmd) => ops::supply(cmd).await,
        Command::Nodes(cmd) => cluster::commands::nodes(cmd).await,
        Command::Deployments(cmd) => cluster::commands::deployments(cmd).await,
        Command::Replicas(cmd) => cluster::commands::replicas(cmd).await,
        Command::Worker(_) => unreachable!("run before the runtime starts"),
    }
}
