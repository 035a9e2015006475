//! Contracts between Tessera processes: the worker's gRPC service (`worker.proto`), the
//! prefix-block hash that the worker's KV cache and the control plane's router must
//! compute identically, the rendering of the ModelCard's chat template, which both
//! sides do, and the etcd key layout and records of the cluster (`cluster`).

pub mod block_hash;
pub mod chat_template;
pub mod cluster;
pub mod errors;
pub mod image;
pub mod scripted;
pub mod speculative;
pub mod text;
pub mod vision;

/// Largest gRPC message a client of the worker accepts: a ModelCard carries the whole
/// Hugging Face tokenizer (4.8 MB for Qwen2's 151k-token vocabulary), over tonic's
/// 4 MiB default.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A name outside a fixed set: what parsing a named enum refuses (on the command line,
/// in the catalog, in the database, in a query).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?} (known: {})", known.join(", "))]
pub struct UnknownName {
    pub what: &'static str,
    pub value: String,
    pub known: Vec<&'static str>,
}

impl UnknownName {
    pub fn new(what: &'static str, value: &str, known: impl IntoIterator<Item = &'static str>) -> Self {
        Self { what, value: value.to_string(), known: known.into_iter().collect() }
    }
}

/// Generated from proto/worker.proto.
pub mod worker {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("tessera.worker.v1");
}
