//! One forward pass over a flattened batch of sequences (prefill chunks and decodes
//! mixed), reading and writing K/V through each sequence's block table.

use super::ModelError;
use super::config::ModelConfig;
use super::kv_cache::KvCache;
use super::shard::Shard;
use super::weights::{self, Weights};
use crate::loader::TensorSource;
use std::sync::Arc;
use tessera_kernels::collective::AllReduce;
use tessera_kernels::pick::{PickRow, Picked};
use tessera_kernels::{AttentionShape, Backend, PagedBatch};

pub struct Model<B: Backend> {
    /// The shape this model runs: a tensor-parallel rank's share of the heads and MLP.
    pub config: ModelConfig,
    backend: B,
    weights: Weights<B>,
    /// The other ranks, when this is one rank of a tensor-parallel group.
    comm: Option<Arc<dyn AllReduce<B>>>,
}

/// What a forward hands the sampler: tokens the device picked, or `[n, vocab]` logits.
#[derive(Debug)]
pub enum Forwarded {
    Picked(Vec<Picked>),
    Logits(Vec<f32>),
}

/// One sequence's part of a batch.
#[derive(Debug, Clone)]
pub struct SeqInput<'a> {
    /// The tokens to run now (a prefill chunk, or one token when decoding).
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV cache, before `tokens`.
    pub cached: usize,
    /// KV blocks of the sequence, covering at least `cached + tokens.len()` positions.
    pub block_table: &'a [u32],
    /// Whether to return logits for the last of `tokens`.
    pub logits: bool,
    /// Rows that stand in for some of `tokens`' embeddings: an image's features at
    /// its placeholder tokens (none for text).
    pub embeds: &'a [Embeds<'a>],
}

/// `rows` (`n × hidden_size` floats) replace the embeddings of `tokens[at..at + n]`.
#[derive(Debug, Clone, Copy)]
pub struct Embeds<'a> {
    pub at: usize,
    pub rows: &'a [f32],
}

/// The batch flattened into the index arrays the kernels read.
#[derive(Default)]
pub(super) struct Flat {
    pub(super) token_ids: Vec<u32>,
    pub(super) positions: Vec<u32>,
    pub(super) slots: Vec<u32>,
    pub(super) query_start: Vec<u32>,
    pub(super) context_lens: Vec<u32>,
    pub(super) block_tables: Vec<u32>,
    pub(super) max_blocks: usize,
    pub(super) logit_rows: Vec<u32>,
    /// Batch rows whose embeddings `embed_data` replaces, `hidden_size` floats each.
    pub(super) embed_rows: Vec<u32>,
    pub(super) embed_data: Vec<f32>,
}

/// `Flat` on the device.
pub(super) struct DeviceFlat<B: Backend> {
    pub(super) tokens: usize,
    pub(super) token_ids: B::Index,
    pub(super) positions: B::Index,
    pub(super) slots: B::Index,
    pub(super) query_start: B::Index,
    pub(super) context_lens: B::Index,
    pub(super) block_tables: B::Index,
    pub(super) logit_rows: Option<B::Index>,
    pub(super) num_logits: usize,
    pub(super) embeds: Option<(B::Index, B::Buffer)>,
}

impl<B: Backend> Model<B> {
    pub fn load(backend: B, config: ModelConfig, source: &dyn TensorSource) -> Result<Self, ModelError> {
        let weights = weights::load(&backend, &config, source, Shard::WHOLE)?;
        Ok(Self { config, backend, weights, comm: None })
    }

    /// Rank `comm.rank()` of a tensor-parallel group of `comm.size()`: its slice of the
    /// weights, and `comm` to sum the row-parallel products with the other ranks.
    pub fn load_shard(
        backend: B,
        config: ModelConfig,
        source: &dyn TensorSource,
        comm: Arc<dyn AllReduce<B>>,
    ) -> Result<Self, ModelError> {
        let shard = Shard { rank: comm.rank(), size: comm.size() };
        let rank_config = config.shard(shard.size)?;
        let weights = weights::load(&backend, &config, source, shard)?;
        Ok(Self { config: rank_config, backend, weights, comm: Some(comm) })
    }

    /// A model over weights already on the device (benchmarks build random ones there).
    pub fn from_weights(backend: B, config: ModelConfig, weights: Weights<B>) -> Self {
        Self { config, backend, weights, comm: None }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub(super) fn attention_shape(&self, block_size: usize) -> AttentionShape {
        let c = &self.config;
        AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size,
            scale: (c.head_dim as f32).powf(-0.5),
        }
    }

    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache<B>, ModelError> {
        let floats = num_blocks * self.attention_shape(block_size).block_floats();
        let layers = (0..self.config.num_layers)
            .map(|_| Ok((self.backend.kv_zeros(floats)?, self.backend.kv_zeros(floats)?)))
            .collect::<Result<_, ModelError>>()?;
        Ok(KvCache { block_size, num_blocks, layers, graphs: None })
    }

    /// Blocks `ids` of `kv` as stored, each every layer's keys then its values: what a
    /// second KV tier keeps of a block the pool evicts, or a handoff sends. Each layer
    /// half is copied for all the blocks at once (one transfer on a GPU, not one each).
    pub fn save_kv_blocks(&self, kv: &KvCache<B>, ids: &[u32]) -> Result<Vec<Vec<u8>>, ModelError> {
        let elems = self.attention_shape(kv.block_size).block_floats();
        let half = elems * self.backend.kv_element_bytes();
        let mut blocks = vec![Vec::with_capacity(2 * kv.layers.len() * half); ids.len()];
        let mut staged = Vec::with_capacity(ids.len() * half);
        for (k, v) in &kv.layers {
            for cache in [k, v] {
                staged.clear();
                self.backend.kv_save_blocks(cache, elems, ids, &mut staged)?;
                for (block, part) in blocks.iter_mut().zip(staged.chunks_exact(half)) {
                    block.extend_from_slice(part);
                }
            }
        }
        Ok(blocks)
    }

    /// Writes blocks `save_kv_blocks` gave into blocks `ids` of `kv`, each layer half
    /// for all of them at once.
    pub fn load_kv_blocks(&self, kv: &mut KvCache<B>, ids: &[u32], blocks: &[&[u8]]) -> Result<(), ModelError> {
        let elems = self.attention_shape(kv.block_size).block_floats();
        let half = elems * self.backend.kv_element_bytes();
        let parts = 2 * kv.layers.len();
        if ids.len() != blocks.len() {
            return Err(ModelError::Input(format!("{} saved KV blocks for {} block ids", blocks.len(), ids.len())));
        }
        if let Some(b) = blocks.iter().find(|b| b.len() != parts * half) {
            return Err(ModelError::Input(format!(
                "a saved KV block of {} bytes; this cache's are {} ({parts} layer halves)",
                b.len(),
                parts * half
            )));
        }
        let mut staged = Vec::with_capacity(ids.len() * half);
        for (part, cache) in kv.layers.iter_mut().flat_map(|(k, v)| [k, v]).enumerate() {
            staged.clear();
            for b in blocks {
                staged.extend_from_slice(&b[part * half..(part + 1) * half]);
            }
            self.backend.kv_load_blocks(cache, elems, ids, &staged)?;
        }
        Ok(())
    }

    /// Runs the batch; returns `[n, vocab]` logits for the `n` sequences that asked.
    /// A batch of single-token decodes runs as a captured graph when the cache holds
    /// one big enough (see `capture_decode_graphs`).
    pub fn forward(&self, seqs: &[SeqInput<'_>], kv: &mut KvCache<B>) -> Result<Vec<f32>, ModelError> {
        if let Some((logits, _)) = self.decode_with_graph(seqs, kv)? {
            return self.download_rows(logits, seqs.len());
        }
        match self.forward_on_device(seqs, kv)? {
            Some(logits) => Ok(self.backend.download(&logits)?),
            None => Ok(Vec::new()),
        }
    }

    /// `forward`, and for each sequence `all_rows` marks (a prompt being scored) the
    /// logits of every one of its tokens, in order, where the others give their last.
    pub fn forward_scoring(
        &self,
        seqs: &[SeqInput<'_>],
        kv: &mut KvCache<B>,
        all_rows: &[bool],
    ) -> Result<Vec<f32>, ModelError> {
        let flat = self.flatten(seqs, kv.block_size, all_rows)?;
        let inputs = self.upload(&flat)?;
        match self.run(&inputs, seqs.len(), flat.max_blocks, kv)? {
            Some(logits) => Ok(self.backend.download(&logits)?),
            None => Ok(Vec::new()),
        }
    }

    /// `forward` for a batch whose sampled rows can all be picked on a device, `rows`
    /// holding one entry per sequence that asks for logits: the backend picks the tokens on its
    /// device when it can, and only the picks leave it.
    pub fn forward_picking(
        &self,
        seqs: &[SeqInput<'_>],
        kv: &mut KvCache<B>,
        rows: &[PickRow],
    ) -> Result<Forwarded, ModelError> {
        let b = &self.backend;
        let vocab = self.config.vocab_size;
        if let Some((logits, batch)) = self.decode_with_graph(seqs, kv)? {
            // The graph's padding rows are picked too, then dropped.
            let mut padded = rows.to_vec();
            padded.resize(batch, PickRow::default());
            return Ok(match b.device_pick(logits, vocab, &padded)? {
                Some(mut picks) => {
                    picks.truncate(rows.len());
                    Forwarded::Picked(picks)
                }
                None => Forwarded::Logits(self.download_rows(logits, rows.len())?),
            });
        }
        let Some(logits) = self.forward_on_device(seqs, kv)? else { return Ok(Forwarded::Logits(Vec::new())) };
        Ok(match b.device_pick(&logits, vocab, rows)? {
            Some(picks) => Forwarded::Picked(picks),
            None => Forwarded::Logits(b.download(&logits)?),
        })
    }

    /// The first `rows` rows of a graph's padded logits, on the host.
    fn download_rows(&self, logits: &B::Buffer, rows: usize) -> Result<Vec<f32>, ModelError> {
        let mut all = self.backend.download(logits)?;
        all.truncate(rows * self.config.vocab_size);
        Ok(all)
    }

    /// `forward`, leaving the logits on the device (None when no sequence asked).
    pub fn forward_on_device(
        &self,
        seqs: &[SeqInput<'_>],
        kv: &mut KvCache<B>,
    ) -> Result<Option<B::Buffer>, ModelError> {
        let flat = self.flatten(seqs, kv.block_size, &[])?;
        let inputs = self.upload(&flat)?;
        self.run(&inputs, seqs.len(), flat.max_blocks, kv)
    }

    /// The flattened batch's index arrays, on the device.
    pub(super) fn upload(&self, f: &Flat) -> Result<DeviceFlat<B>, ModelError> {
        let b = &self.backend;
        Ok(DeviceFlat {
            tokens: f.token_ids.len(),
            token_ids: b.upload_index(&f.token_ids)?,
            positions: b.upload_index(&f.positions)?,
            slots: b.upload_index(&f.slots)?,
            query_start: b.upload_index(&f.query_start)?,
            context_lens: b.upload_index(&f.context_lens)?,
            block_tables: b.upload_index(&f.block_tables)?,
            logit_rows: (!f.logit_rows.is_empty()).then(|| b.upload_index(&f.logit_rows)).transpose()?,
            num_logits: f.logit_rows.len(),
            embeds: match f.embed_rows.is_empty() {
                true => None,
                false => Some((b.upload_index(&f.embed_rows)?, b.upload(&f.embed_data)?)),
            },
        })
    }

    /// The forward itself, over index arrays already on the device: nothing here
    /// copies between host and device, so a decode step can be captured as a graph.
    pub(super) fn run(
        &self,
        d: &DeviceFlat<B>,
        num_seqs: usize,
        max_blocks: usize,
        kv: &mut KvCache<B>,
    ) -> Result<Option<B::Buffer>, ModelError> {
        match self.comm {
            // A tensor-parallel rank stays on its own thread: on a shared pool, a rank
            // waiting in an all-reduce could be handed another rank's step to run.
            Some(_) => self.run_layers(d, num_seqs, max_blocks, kv),
            None => self.backend.step(|| self.run_layers(d, num_seqs, max_blocks, kv)),
        }
    }

    fn run_layers(
        &self,
        d: &DeviceFlat<B>,
        num_seqs: usize,
        max_blocks: usize,
        kv: &mut KvCache<B>,
    ) -> Result<Option<B::Buffer>, ModelError> {
        let (b, w, c) = (&self.backend, &self.weights, &self.config);
        let shape = self.attention_shape(kv.block_size);
        let tokens = d.tokens;
        let batch = PagedBatch {
            num_seqs,
            query_start: &d.query_start,
            context_lens: &d.context_lens,
            block_tables: &d.block_tables,
            max_blocks_per_seq: max_blocks,
        };

        let mut h = b.embedding(&d.token_ids, &w.embed)?;
        if let Some((rows, data)) = &d.embeds {
            b.scatter_rows(&mut h, c.hidden_size, rows, data)?;
        }
        let Some(first) = w.layers.first() else {
            return Err(ModelError::Input("the model has no layers".into()));
        };
        // Each residual add is fused with the norm that follows it.
        let mut x = b.rms_norm(&h, &first.attn_norm, c.rms_norm_eps)?;
        for (i, (layer, (k_cache, v_cache))) in w.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            let qkv = b.linear(&x, tokens, &layer.qkv, layer.qkv_bias.as_ref())?;
            let q =
                b.qkv_to_cache(&qkv, &d.positions, &w.inv_freq, c.rope_style, &d.slots, &shape, k_cache, v_cache)?;
            let attn = b.paged_attention(&q, k_cache, v_cache, &batch, &shape)?;
            let mut attn_out = b.linear(&attn, tokens, &layer.o, None)?;
            self.all_reduce(&mut attn_out)?;
            let x_ffn = b.add_rms_norm(&mut h, &attn_out, &layer.ffn_norm, c.rms_norm_eps)?;

            let act = b.linear_silu_mul(&x_ffn, tokens, &layer.gate_up, c.intermediate_size)?;
            let mut mlp_out = b.linear(&act, tokens, &layer.down, None)?;
            self.all_reduce(&mut mlp_out)?;
            match w.layers.get(i + 1) {
                Some(next) => x = b.add_rms_norm(&mut h, &mlp_out, &next.attn_norm, c.rms_norm_eps)?,
                None => b.add_assign(&mut h, &mlp_out)?,
            }
        }
        let Some(rows) = &d.logit_rows else { return Ok(None) };
        let last = b.gather_rows(&h, c.hidden_size, rows)?;
        let x = b.rms_norm(&last, &w.final_norm, c.rms_norm_eps)?;
        Ok(Some(b.linear(&x, d.num_logits, w.lm_head(), None)?))
    }

    /// Fails the other ranks' pending all-reduces: this rank will not join them.
    pub fn abort_group(&self) {
        if let Some(c) = &self.comm {
            c.abort();
        }
    }

    /// Sums a row-parallel product over the tensor-parallel ranks (nothing alone).
    fn all_reduce(&self, x: &mut B::Buffer) -> Result<(), ModelError> {
        match &self.comm {
            Some(c) => Ok(c.all_reduce_sum(&self.backend, x)?),
            None => Ok(()),
        }
    }

    /// The batch's index arrays; logits rows are each sequence's last token, or all its
    /// tokens where `all_rows` says so.
    pub(super) fn flatten(&self, seqs: &[SeqInput<'_>], bs: usize, all_rows: &[bool]) -> Result<Flat, ModelError> {
        let max_blocks = seqs.iter().map(|s| (s.cached + s.tokens.len()).div_ceil(bs)).max().unwrap_or(0);
        let mut f = Flat {
            token_ids: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            query_start: vec![0],
            context_lens: Vec::new(),
            block_tables: Vec::with_capacity(seqs.len() * max_blocks),
            max_blocks,
            logit_rows: Vec::new(),
            embed_rows: Vec::new(),
            embed_data: Vec::new(),
        };
        for (i, s) in seqs.iter().enumerate() {
            let context = s.cached + s.tokens.len();
            if s.tokens.is_empty() {
                return Err(ModelError::Input(format!("sequence {i} has no tokens to run")));
            }
            if context > self.config.context_length {
                return Err(ModelError::Input(format!(
                    "sequence {i}: {context} tokens exceed the context of {}",
                    self.config.context_length
                )));
            }
            let blocks = context.div_ceil(bs);
            if s.block_table.len() < blocks {
                return Err(ModelError::Input(format!(
                    "sequence {i}: {blocks} blocks needed, {} given",
                    s.block_table.len()
                )));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                return Err(ModelError::Input(format!("sequence {i}: token id {t} is outside the vocabulary")));
            }
            for (j, &t) in s.tokens.iter().enumerate() {
                let pos = s.cached + j;
                f.token_ids.push(t);
                f.positions.push(pos as u32);
                f.slots.push(s.block_table[pos / bs] * bs as u32 + (pos % bs) as u32);
            }
            let first = f.token_ids.len() - s.tokens.len();
            for e in s.embeds {
                let n = e.rows.len() / self.config.hidden_size;
                if e.rows.len() % self.config.hidden_size != 0 || e.at + n > s.tokens.len() {
                    return Err(ModelError::Input(format!(
                        "sequence {i}: {} embedding floats at token {} do not fit {} tokens of width {}",
                        e.rows.len(),
                        e.at,
                        s.tokens.len(),
                        self.config.hidden_size
                    )));
                }
                f.embed_rows.extend((first + e.at..first + e.at + n).map(|r| r as u32));
                f.embed_data.extend_from_slice(e.rows);
            }
            f.query_start.push(f.token_ids.len() as u32);
            f.context_lens.push(context as u32);
            f.block_tables.extend_from_slice(&s.block_table[..blocks]);
            f.block_tables.resize((i + 1) * max_blocks, 0);
            let end = f.token_ids.len() as u32;
            if all_rows.get(i).copied().unwrap_or(false) {
                f.logit_rows.extend(end - s.tokens.len() as u32..end);
            } else if s.logits {
                f.logit_rows.push(end - 1);
            }
        }
        Ok(f)
    }
}
