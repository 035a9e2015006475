//! `tessera`: the control plane's command line.

use clap::Parser;
use tessera_control_plane::config::{Cli, Command};
use tessera_control_plane::{cluster, ops, serve};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Serve(config) => serve::run(config).await,
        Command::ControlPlane(config) => cluster::control_plane::run(config).await,
        Command::Orgs(cmd) => ops::orgs(cmd).await,
        Command::Keys(cmd) => ops::keys(cmd).await,
        Command::Credits(cmd) => ops::credits(cmd).await,
        Command::Usage(cmd) => ops::usage(cmd).await,
        Command::Users(cmd) => ops::users(cmd).await,
        Command::Plans(cmd) => ops::plans(cmd).await,
        Command::Supply(cmd) => ops::supply(cmd).await,
        Command::Nodes(cmd) => cluster::commands::nodes(cmd).await,
        Command::Deployments(cmd) => cluster::commands::deployments(cmd).await,
        Command::Replicas(cmd) => cluster::commands::replicas(cmd).await,
    }
}
