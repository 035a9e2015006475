//! One sequence's tokens and its place in the KV cache, as the scheduler sees them.

use super::block_pool::BlockId;
use crate::vision::placement::PlacedImages;
use std::sync::Arc;
use tessera_proto::block_hash::BlockHash;

pub type SeqId = u64;

#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys and values are in the cache.
    pub num_computed: usize,
    /// Prompt tokens found in the prefix cache at admission.
    pub num_cached_prompt: usize,
    pub block_table: Vec<BlockId>,
    /// Hashes of the sequence's full blocks, computed as they fill.
    pub block_hashes: Vec<BlockHash>,
    /// Blocks of `block_table` already registered in the prefix cache.
    pub num_cached_blocks: usize,
    /// Admit only once this sequence has computed its prompt (or is gone): the
    /// siblings of an `n` > 1 request then find the prompt's blocks in the cache.
    pub after: Option<SeqId>,
    /// Its prompt is scored (prompt log-probabilities): the prefix cache cannot serve
    /// it, since a cached block's logits are not kept.
    pub score_prompt: bool,
    /// The prompt's images: their rows go in at their placeholders, and their hashes
    /// into the hashes of the blocks holding them.
    pub images: Option<Arc<PlacedImages>>,
    /// Tokens proposed to follow `tokens`, verified by the next step (speculative
    /// decoding). They join `tokens` only as the model accepts them: no block hash, and
    /// so no prefix-cache entry, is ever made of a proposal.
    pub draft: Vec<u32>,
    /// Who the sequence is for (`engine::fair`), with its weight as the request gave it.
    pub tenant: Arc<str>,
    pub weight: u32,
    /// Lower runs sooner among its tenant's sequences (vLLM's `priority`).
    pub priority: i32,
    /// It was running and was preempted: it is admitted again before newer arrivals.
    pub preempted: bool,
    /// The step it last ran in: a tenant's rows rotate among its sequences.
    pub last_run: u64,
    /// Output tokens it arrived with, generated elsewhere (`with_prompt_len`).
    pub resumed: usize,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>) -> Self {
        Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            num_cached_prompt: 0,
            block_table: Vec::new(),
            block_hashes: Vec::new(),
            num_cached_blocks: 0,
            after: None,
            score_prompt: false,
            images: None,
            draft: Vec::new(),
            tenant: Arc::from(""),
            weight: 1,
            priority: 0,
            preempted: false,
            last_run: 0,
            resumed: 0,
        }
    }

    /// The same, its first `prompt_len` tokens the prompt and the rest output already
    /// generated (a resumed request).
    pub fn with_prompt_len(mut self, prompt_len: usize) -> Self {
        self.prompt_len = prompt_len.min(self.tokens.len());
        self.resumed = self.tokens.len() - self.prompt_len;
        self
    }

    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next sample.
    pub fn num_pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}
