//! The engine: many sequences served at once, vLLM-style — continuous batching with
//! chunked prefill (`scheduler`), a paged KV cache with prefix caching (`block_pool`),
//! sampling (`sampler`) under a grammar where the request has one (`grammar`), incremental detokenization with stop strings
//! (`detokenizer`), tied together one step at a time by `core::EngineCore`, which
//! `runner::EngineHandle` runs on its own thread for the async world. `executor` runs
//! the batches: one model, or the ranks of a tensor-parallel group.

pub mod block_pool;
pub mod core;
pub mod detokenizer;
pub mod executor;
pub mod fair;
pub mod grammar;
pub mod kv_tier;
pub mod pacing;
pub mod runner;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod speculate;
pub mod thinking;
