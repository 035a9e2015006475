//! The engine: many sequences served at once, vLLM-style. Built so far: the KV block
//! pool, the sampler and the incremental detokenizer; the scheduler and the loop that
//! ties them to the model follow.

pub mod block_pool;
pub mod detokenizer;
pub mod sampler;
