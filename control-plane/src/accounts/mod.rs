//! Organizations and API keys: the secrets' format and the SQL store.

pub mod keys;
pub mod store;

pub use store::{ApiKey, BillingMode, NewKey, Org, Store, StoreError, User};
