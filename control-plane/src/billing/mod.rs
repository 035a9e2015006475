//! Paying for tokens: the prices applied to a request's counts (`cost`), the credit
//! ledger with its holds and settlements (`ledger`), control planes' budget leases
//! of it (`lease`), personal plans (`plans`) paid
//! through a processor (`payments`) whose included usage pays requests
//! (`subscriptions`) at each model's supply discount (`supply`), and the meter that
//! carries one request from admission to settlement (`meter`).

pub mod cost;
pub mod lease;
pub mod ledger;
pub mod meter;
pub mod payments;
pub mod plans;
pub mod subscriptions;
pub mod supply;
pub mod usage;

pub use ledger::{Ledger, LedgerError, UsageRecord};
pub use meter::{AdmitError, Ask, Billing, Clock, Funding, Meter};
