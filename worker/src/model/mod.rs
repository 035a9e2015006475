//! The llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2): configuration,
//! weights, and the forward pass over a flattened batch with a paged KV cache.

pub mod config;
mod forward;
mod graphs;
mod kv_cache;
pub mod shard;
pub mod weights;

pub use config::{Architecture, ModelConfig};
pub use forward::{Embeds, Forwarded, Model, SeqInput};
pub use graphs::DecodeGraphs;
pub use kv_cache::{KvCache, block_bytes as kv_block_bytes};

use crate::loader::LoadError;
use tessera_kernels::KernelError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("invalid forward input: {0}")]
    Input(String),
}
