//! Contracts between Tessera processes: the worker's gRPC service (`worker.proto`) and
//! the prefix-block hash that the worker's KV cache and the control plane's router must
//! compute identically, and the rendering of the ModelCard's chat template, which both
//! sides do. The etcd key layout joins them with the cluster.

pub mod block_hash;
pub mod chat_template;

/// How the worker's INVALID_ARGUMENT for a request's grammar begins; the control plane
/// answers it as a 400 naming the parameter the grammar came from.
pub const GRAMMAR_REFUSED: &str = "the grammar does not compile: ";

/// Generated from proto/worker.proto.
pub mod worker {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("tessera.worker.v1");
}
