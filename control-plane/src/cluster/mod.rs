//! The cluster, as the control plane sees it through etcd: its state read at one
//! revision (`state`), where replicas go (`placement`), and the elected controller that
//! writes it (`leader`); and the replica table the router follows (`table`).

pub mod commands;
pub mod leader;
pub mod placement;
pub mod state;
pub mod table;
