//! One forward pass over a flattened batch of sequences (prefill chunks and decodes
//! mixed), reading and writing K/V through each sequence's block table.

use super::ModelError;
use super::config::ModelConfig;
use super::kv_cache::KvCache;
use super::weights::{self, Weights};
use crate::loader::TensorSource;
use tessera_kernels::{AttentionShape, Backend, PagedBatch};

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    backend: B,
    weights: Weights<B>,
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
}

/// The batch flattened into the index arrays the kernels read.
struct Flat {
    token_ids: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    query_start: Vec<u32>,
    context_lens: Vec<u32>,
    block_tables: Vec<u32>,
    max_blocks: usize,
    logit_rows: Vec<u32>,
}

impl<B: Backend> Model<B> {
    pub fn load(backend: B, config: ModelConfig, source: &dyn TensorSource) -> Result<Self, ModelError> {
        let weights = weights::load(&backend, &config, source)?;
        Ok(Self { config, backend, weights })
    }

    /// A model over weights already on the device (benchmarks build random ones there).
    pub fn from_weights(backend: B, config: ModelConfig, weights: Weights<B>) -> Self {
        Self { config, backend, weights }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    fn attention_shape(&self, block_size: usize) -> AttentionShape {
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
            .map(|_| Ok((self.backend.zeros(floats)?, self.backend.zeros(floats)?)))
            .collect::<Result<_, ModelError>>()?;
        Ok(KvCache { block_size, num_blocks, layers })
    }

    /// Runs the batch; returns `[n, vocab]` logits for the `n` sequences that asked.
    pub fn forward(&self, seqs: &[SeqInput<'_>], kv: &mut KvCache<B>) -> Result<Vec<f32>, ModelError> {
        match self.forward_on_device(seqs, kv)? {
            Some(logits) => Ok(self.backend.download(&logits)?),
            None => Ok(Vec::new()),
        }
    }

    /// `forward`, leaving the logits on the device (None when no sequence asked).
    pub fn forward_on_device(
        &self,
        seqs: &[SeqInput<'_>],
        kv: &mut KvCache<B>,
    ) -> Result<Option<B::Buffer>, ModelError> {
        let flat = self.flatten(seqs, kv)?;
        let (b, w, c) = (&self.backend, &self.weights, &self.config);
        let shape = self.attention_shape(kv.block_size);
        let tokens = flat.token_ids.len();
        let positions = b.upload_index(&flat.positions)?;
        let slots = b.upload_index(&flat.slots)?;
        let query_start = b.upload_index(&flat.query_start)?;
        let context_lens = b.upload_index(&flat.context_lens)?;
        let block_tables = b.upload_index(&flat.block_tables)?;
        let batch = PagedBatch {
            num_seqs: seqs.len(),
            query_start: &query_start,
            context_lens: &context_lens,
            block_tables: &block_tables,
            max_blocks_per_seq: flat.max_blocks,
        };

        let mut h = b.embedding(&b.upload_index(&flat.token_ids)?, &w.embed)?;
        let Some(first) = w.layers.first() else {
            return Err(ModelError::Input("the model has no layers".into()));
        };
        // Each residual add is fused with the norm that follows it.
        let mut x = b.rms_norm(&h, &first.attn_norm, c.rms_norm_eps)?;
        for (i, (layer, (k_cache, v_cache))) in w.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            let qkv = b.linear(&x, tokens, &layer.qkv, layer.qkv_bias.as_ref())?;
            let [mut q, mut k, v]: [B::Buffer; 3] = b
                .split_columns(&qkv, &[c.q_width(), c.kv_width(), c.kv_width()])?
                .try_into()
                .map_err(|_| ModelError::Input("split_columns returned the wrong number of parts".into()))?;
            b.rope(&mut q, &positions, c.num_heads, c.head_dim, &w.inv_freq, c.rope_style)?;
            b.rope(&mut k, &positions, c.num_kv_heads, c.head_dim, &w.inv_freq, c.rope_style)?;
            b.write_kv(&k, &v, &slots, &shape, k_cache, v_cache)?;
            let attn = b.paged_attention(&q, k_cache, v_cache, &batch, &shape)?;
            let attn_out = b.linear(&attn, tokens, &layer.o, None)?;
            let x_ffn = b.add_rms_norm(&mut h, &attn_out, &layer.ffn_norm, c.rms_norm_eps)?;

            let gate_up = b.linear(&x_ffn, tokens, &layer.gate_up, None)?;
            let act = b.silu_mul(&gate_up, c.intermediate_size)?;
            let mlp_out = b.linear(&act, tokens, &layer.down, None)?;
            match w.layers.get(i + 1) {
                Some(next) => x = b.add_rms_norm(&mut h, &mlp_out, &next.attn_norm, c.rms_norm_eps)?,
                None => b.add_assign(&mut h, &mlp_out)?,
            }
        }
        if flat.logit_rows.is_empty() {
            return Ok(None);
        }
        let last = b.gather_rows(&h, c.hidden_size, &b.upload_index(&flat.logit_rows)?)?;
        let x = b.rms_norm(&last, &w.final_norm, c.rms_norm_eps)?;
        Ok(Some(b.linear(&x, flat.logit_rows.len(), w.lm_head(), None)?))
    }

    fn flatten(&self, seqs: &[SeqInput<'_>], kv: &KvCache<B>) -> Result<Flat, ModelError> {
        let bs = kv.block_size;
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
            f.query_start.push(f.token_ids.len() as u32);
            f.context_lens.push(context as u32);
            f.block_tables.extend_from_slice(&s.block_table[..blocks]);
            f.block_tables.resize((i + 1) * max_blocks, 0);
            if s.logits {
                f.logit_rows.push(f.token_ids.len() as u32 - 1);
            }
        }
        Ok(f)
    }
}
