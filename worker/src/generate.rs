//! Greedy generation for one sequence: the simplest driver of the forward pass, used
//! by `tessera-worker generate`, the reference test and the forward benchmark.

use crate::model::{KvCache, Model, ModelError, SeqInput};
use tessera_kernels::Backend;

pub const BLOCK_SIZE: usize = 16;
/// Prompt tokens per forward while prefilling.
pub const PREFILL_CHUNK: usize = 512;

/// One sequence with its own KV cache, blocks laid out in order.
pub struct SingleSequence<B: Backend> {
    kv: KvCache<B>,
    block_table: Vec<u32>,
    pub tokens: Vec<u32>,
}

impl<B: Backend> SingleSequence<B> {
    /// Room for `capacity` tokens.
    pub fn new(model: &Model<B>, capacity: usize) -> Result<Self, ModelError> {
        let blocks = capacity.div_ceil(BLOCK_SIZE).max(1);
        Ok(Self {
            kv: model.new_kv_cache(blocks, BLOCK_SIZE)?,
            block_table: (0..blocks as u32).collect(),
            tokens: Vec::new(),
        })
    }

    /// Runs `tokens` after those already cached, in chunks; returns the last one's logits.
    pub fn extend(&mut self, model: &Model<B>, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::Input("no tokens to run".into()));
        }
        let mut logits = Vec::new();
        for (i, chunk) in tokens.chunks(PREFILL_CHUNK).enumerate() {
            let last = (i + 1) * PREFILL_CHUNK >= tokens.len();
            let seq = SeqInput {
                tokens: chunk,
                cached: self.tokens.len(),
                block_table: &self.block_table,
                logits: last,
                embeds: &[],
            };
            logits = model.forward(&[seq], &mut self.kv)?;
            self.tokens.extend_from_slice(chunk);
        }
        Ok(logits)
    }
}

/// The greedy token: the sampler's argmax, as a token id.
pub fn argmax(logits: &[f32]) -> u32 {
    crate::engine::sampler::argmax(logits) as u32
}

#[derive(Debug, Clone)]
pub struct GreedyRun {
    pub output: Vec<u32>,
    /// Logits after the prompt, before the first generated token.
    pub first_logits: Vec<f32>,
}

/// Up to `max_tokens` greedy tokens after `prompt`, stopping after any of `stop_ids`
/// (which is not included).
pub fn greedy<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
) -> Result<GreedyRun, ModelError> {
    let capacity = prompt.len() + max_tokens;
    if capacity > model.config.context_length {
        return Err(ModelError::Input(format!(
            "{} prompt tokens plus {max_tokens} new tokens exceed the context of {}",
            prompt.len(),
            model.config.context_length
        )));
    }
    let mut seq = SingleSequence::new(model, capacity)?;
    let first_logits = seq.extend(model, prompt)?;
    let mut logits = first_logits.clone();
    let mut output = Vec::new();
    while output.len() < max_tokens {
        let next = argmax(&logits);
        if stop_ids.contains(&next) {
            break;
        }
        output.push(next);
        if output.len() < max_tokens {
            logits = seq.extend(model, &[next])?;
        }
    }
    Ok(GreedyRun { output, first_logits })
}
