//! The engine: many sequences served at once, vLLM-style. Built so far: the KV block
//! pool, the scheduler, the sampler and the incremental detokenizer; the loop that ties
//! them to the model follows.

pub mod block_pool;
pub mod detokenizer;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
