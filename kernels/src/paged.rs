//! The checks every backend makes of a paged batch before its attention kernel runs,
//! on the host copies of the index arrays, so that no kernel can read out of bounds.

use crate::error::expect_len;
use crate::{AttentionShape, KernelError, Result};

/// A paged batch's index arrays as host slices (see `PagedBatch`).
pub(crate) struct HostBatch<'a> {
    pub num_seqs: usize,
    pub query_start: &'a [u32],
    pub context_lens: &'a [u32],
    pub block_tables: &'a [u32],
    pub max_blocks_per_seq: usize,
}

/// One query row's place in the batch.
pub(crate) struct Row {
    pub seq: usize,
    /// Number of keys it sees (its position + 1).
    pub keys: usize,
}

impl HostBatch<'_> {
    /// Checks the batch against the query and cache lengths (in elements) and returns
    /// each query row's sequence and key count.
    pub fn validate(&self, q_len: usize, k_len: usize, v_len: usize, shape: &AttentionShape) -> Result<Vec<Row>> {
        const OP: &str = "paged_attention";
        if shape.num_kv_heads == 0 || !shape.num_heads.is_multiple_of(shape.num_kv_heads) {
            return Err(KernelError::shape(
                OP,
                format!("{} heads over {} KV heads", shape.num_heads, shape.num_kv_heads),
            ));
        }
        expect_len(OP, "query_start", self.query_start.len(), self.num_seqs + 1)?;
        expect_len(OP, "context_lens", self.context_lens.len(), self.num_seqs)?;
        expect_len(OP, "block_tables", self.block_tables.len(), self.num_seqs * self.max_blocks_per_seq)?;
        expect_len(OP, "value cache", v_len, k_len)?;
        let blocks_in_cache = k_len / shape.block_floats();
        let tokens = *self.query_start.last().unwrap_or(&0) as usize;
        expect_len(OP, "query", q_len, tokens * shape.q_width())?;
        let mut rows = Vec::with_capacity(tokens);
        for seq in 0..self.num_seqs {
            let (start, end) = (self.query_start[seq] as usize, self.query_start[seq + 1] as usize);
            let context = self.context_lens[seq] as usize;
            if start != rows.len() {
                return Err(KernelError::shape(
                    OP,
                    format!("sequence {seq} starts at row {start}, expected {}", rows.len()),
                ));
            }
            if end < start || end - start > context {
                return Err(KernelError::shape(
                    OP,
                    format!("sequence {seq}: {} queries for a context of {context}", end.wrapping_sub(start)),
                ));
            }
            let blocks = context.div_ceil(shape.block_size);
            if blocks > self.max_blocks_per_seq {
                return Err(KernelError::shape(
                    OP,
                    format!(
                        "sequence {seq}: context {context} needs {blocks} blocks, table has {}",
                        self.max_blocks_per_seq
                    ),
                ));
            }
            let table = &self.block_tables[seq * self.max_blocks_per_seq..][..blocks];
            if let Some(b) = table.iter().find(|&&b| b as usize >= blocks_in_cache) {
                return Err(KernelError::shape(
                    OP,
                    format!("sequence {seq}: block {b} outside a cache of {blocks_in_cache}"),
                ));
            }
            let first_pos = context - (end - start);
            rows.extend((0..end - start).map(|i| Row { seq, keys: first_pos + i + 1 }));
        }
        expect_len(OP, "query rows", rows.len(), tokens)?;
        Ok(rows)
    }
}
