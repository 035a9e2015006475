//! Paying for tokens: the prices applied to a request's counts (`cost`), the credit
//! ledger with its holds and settlements (`ledger`), and the meter that carries one
//! request from admission to settlement (`meter`).

pub mod cost;
pub mod ledger;
pub mod meter;

pub use ledger::{Ledger, LedgerError, UsageRecord};
pub use meter::{Ask, Billing, Meter};
