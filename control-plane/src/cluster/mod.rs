//! The cluster, as the control plane sees it through etcd: its state read at one
//! revision (`state`), where replicas go (`placement`), and the elected controller that
//! writes it (`leader`); the replica table the router follows (`table`); and the
//! `tessera control-plane` process that runs them all behind the API (`control_plane`).

pub mod commands;
pub mod control_plane;
pub mod leader;
pub mod placement;
pub mod state;
pub mod table;

use tokio::sync::watch;

/// What a control plane shows of the cluster (in /health): the replica table it
/// routes by, and whether it leads placement.
#[derive(Clone)]
pub struct ClusterView {
    pub table: watch::Receiver<table::Table>,
    pub leading: watch::Receiver<bool>,
}
