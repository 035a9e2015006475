//! Device memory for keys and values: per layer, `[blocks, block_size, kv_heads,
//! head_dim]` for K and the same for V. Which block belongs to which sequence is the
//! caller's business (the engine's block pool); this only owns the memory.

use tessera_kernels::Backend;

pub struct KvCache<B: Backend> {
    pub block_size: usize,
    pub num_blocks: usize,
    /// (keys, values) per layer.
    pub layers: Vec<(B::Buffer, B::Buffer)>,
    /// Decode steps captured over this cache, when the backend can capture.
    pub graphs: Option<super::graphs::DecodeGraphs<B>>,
}

/// Bytes one block takes across all layers, K and V, at `element_bytes` an element
/// (`Backend::kv_element_bytes`).
pub fn block_bytes(element_bytes: usize, num_layers: usize, kv_width: usize, block_size: usize) -> usize {
    2 * num_layers * block_size * kv_width * element_bytes
}
