//! The Tessera control plane: the OpenAI-compatible API in front of the workers, API
//! keys and organizations, the model catalog, and `tessera serve`.

pub mod accounts;
pub mod api;
pub mod billing;
pub mod calendar;
pub mod capacity;
pub mod catalog;
pub mod chat;
pub mod cluster;
pub mod config;
pub mod console;
pub mod db;
pub mod images;
pub mod keep_alive;
pub mod limits;
pub mod metrics;
pub mod ops;
pub mod rate;
pub mod router;
pub mod serve;
pub mod status;
pub mod weights;
pub mod workers;
