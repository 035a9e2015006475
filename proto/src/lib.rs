//! Contracts between Tessera processes. Today: the prefix-block hash that the worker's
//! KV cache and the control plane's router must compute identically. The gRPC schema
//! (worker.proto) and the etcd key layout join it as those processes land.

pub mod block_hash;
