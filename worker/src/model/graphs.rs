//! Decode steps as captured graphs (CUDA graphs): one per batch size, recorded at
//! start-up over fixed index buffers, a fixed logits buffer and the KV cache itself, so
//! a decode step costs one launch instead of hundreds. A batch is padded up to the
//! nearest captured size with dummy sequences that write only to a scratch block no
//! sequence owns. Backends that cannot capture (the CPU) get no graphs, and every
//! batch takes the ordinary path.

use super::forward::{DeviceFlat, Flat, Model, SeqInput};
use super::{KvCache, ModelError};
use tessera_kernels::{Backend, KernelError};

pub struct DecodeGraphs<B: Backend> {
    /// Ascending by batch size.
    graphs: Vec<DecodeGraph<B>>,
    /// Block-table width of every graph: enough for the model's whole context.
    max_blocks: usize,
    /// A KV block outside the engine's pool: padding rows write there.
    scratch_block: u32,
}

struct DecodeGraph<B: Backend> {
    batch: usize,
    inputs: DeviceFlat<B>,
    logits: B::Buffer,
    graph: B::Graph,
}

impl<B: Backend> DecodeGraphs<B> {
    pub fn batch_sizes(&self) -> Vec<usize> {
        self.graphs.iter().map(|g| g.batch).collect()
    }
}

impl<B: Backend> Model<B> {
    /// Captures a decode graph for each of `sizes` over `kv`, whose block
    /// `scratch_block` must be left out of the engine's pool. Does nothing on backends
    /// that cannot capture.
    pub fn capture_decode_graphs(
        &self,
        kv: &mut KvCache<B>,
        scratch_block: u32,
        sizes: &[usize],
    ) -> Result<(), ModelError> {
        if scratch_block as usize >= kv.num_blocks {
            return Err(ModelError::Input(format!("scratch block {scratch_block} outside {} blocks", kv.num_blocks)));
        }
        let mut sizes: Vec<usize> = sizes.iter().copied().filter(|&s| s > 0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let bs = kv.block_size;
        let max_blocks = self.config.context_length.div_ceil(bs);
        let mut graphs = Vec::with_capacity(sizes.len());
        kv.graphs = None;
        for batch in sizes {
            // Captured with every row at the longest context, so that the attention's
            // split of the keys covers any context a replay brings.
            let dummy = pad(&Flat::default(), 0, batch, max_blocks, bs, scratch_block, max_blocks * bs);
            let inputs = self.upload(&dummy)?;
            let mut logits = self.backend().zeros(batch * self.config.vocab_size)?;
            let mut failed = None;
            let recorded = self.backend().capture(&mut || match self.run(&inputs, batch, max_blocks, kv) {
                Ok(Some(out)) => self.backend().copy_into(&out, &mut logits),
                Ok(None) => Err(KernelError::Device { op: "capture", detail: "no logits".into() }),
                Err(e) => {
                    let detail = e.to_string();
                    failed = Some(e);
                    Err(KernelError::Device { op: "capture", detail })
                }
            });
            let graph = match (recorded, failed) {
                (_, Some(e)) => return Err(e),
                (Err(e), None) => return Err(e.into()),
                (Ok(None), None) => return Ok(()),
                (Ok(Some(graph)), None) => graph,
            };
            graphs.push(DecodeGraph { batch, inputs, logits, graph });
        }
        kv.graphs = Some(DecodeGraphs { graphs, max_blocks, scratch_block });
        Ok(())
    }

    /// Runs `seqs` through a captured graph when they are all single-token decodes
    /// that want logits and a graph is large enough; returns the graph's logits buffer
    /// and its row count (padded rows last), or None for the ordinary path.
    pub fn decode_with_graph<'k>(
        &self,
        seqs: &[SeqInput<'_>],
        kv: &'k mut KvCache<B>,
    ) -> Result<Option<(&'k B::Buffer, usize)>, ModelError> {
        let Some(graphs) = &mut kv.graphs else { return Ok(None) };
        if seqs.is_empty() || seqs.iter().any(|s| s.tokens.len() != 1 || !s.logits || !s.embeds.is_empty()) {
            return Ok(None);
        }
        let Some(g) = graphs.graphs.iter_mut().find(|g| g.batch >= seqs.len()) else { return Ok(None) };
        let (bs, num_blocks) = (kv.block_size, kv.num_blocks);
        for (i, s) in seqs.iter().enumerate() {
            let context = s.cached + 1;
            let blocks = context.div_ceil(bs);
            if blocks > graphs.max_blocks || s.block_table.len() < blocks {
                return Err(ModelError::Input(format!("sequence {i}: {context} tokens need {blocks} blocks")));
            }
            if let Some(b) = s.block_table[..blocks].iter().find(|&&b| b as usize >= num_blocks) {
                return Err(ModelError::Input(format!("sequence {i}: block {b} outside a cache of {num_blocks}")));
            }
        }
        let flat = self.flatten(seqs, bs, &[])?;
        let padded = pad(&flat, seqs.len(), g.batch, graphs.max_blocks, bs, graphs.scratch_block, 1);
        let b = self.backend();
        let d = &mut g.inputs;
        b.write_index(&mut d.token_ids, &padded.token_ids)?;
        b.write_index(&mut d.positions, &padded.positions)?;
        b.write_index(&mut d.slots, &padded.slots)?;
        b.write_index(&mut d.query_start, &padded.query_start)?;
        b.write_index(&mut d.context_lens, &padded.context_lens)?;
        b.write_index(&mut d.block_tables, &padded.block_tables)?;
        b.replay(&g.graph)?;
        Ok(Some((&g.logits, g.batch)))
    }
}

/// `flat` (`n` single-token sequences) laid out for a graph of `batch` rows whose
/// block tables are `max_blocks` wide, then padded with dummy rows: each sees
/// `dummy_context` keys, all in the scratch block, and writes its key there.
fn pad(flat: &Flat, n: usize, batch: usize, max_blocks: usize, bs: usize, scratch: u32, dummy_context: usize) -> Flat {
    let mut out = Flat {
        token_ids: flat.token_ids.clone(),
        positions: flat.positions.clone(),
        slots: flat.slots.clone(),
        query_start: (0..=batch as u32).collect(),
        context_lens: flat.context_lens.clone(),
        block_tables: Vec::with_capacity(batch * max_blocks),
        max_blocks,
        logit_rows: (0..batch as u32).collect(),
        embed_rows: Vec::new(),
        embed_data: Vec::new(),
    };
    for i in 0..n {
        let row = &flat.block_tables[i * flat.max_blocks..(i + 1) * flat.max_blocks];
        out.block_tables.extend_from_slice(row);
        out.block_tables.resize((i + 1) * max_blocks, scratch);
    }
    let last = dummy_context - 1;
    for _ in n..batch {
        out.token_ids.push(0);
        out.positions.push(last as u32);
        out.slots.push(scratch * bs as u32 + (last % bs) as u32);
        out.context_lens.push(dummy_context as u32);
        out.block_tables.extend(std::iter::repeat_n(scratch, max_blocks));
    }
    out
}
