//! A draft model: a smaller model with the target's tokenizer runs ahead of it, one
//! greedy token at a time, and its guesses go to verification.
//!
//! The draft keeps a paged KV cache of its own (its blocks, its tables): each sequence
//! it drafts for holds the KV of the tokens it has seen (`fed`). A step first catches
//! up on what the target decided since the last one — after a verification, the draft's
//! own guesses past the first rejection are dropped by cutting `fed` back to where it
//! still agrees with the sequence — then drafts `k` tokens for every sequence asked, in
//! `k` forwards batched across them. A sequence met for the first time catches up on
//! its whole prompt, a bounded number of tokens per step (`CATCH_UP_TOKENS`), and is
//! drafted for once it has.
//!
//! Both are timed — a drafting forward (what one more proposed position costs a step)
//! and a catch-up token (what bringing a sequence up to date costs, paid once) — first
//! on a dummy sequence when the draft is loaded, so that the engine weighs them before
//! it ever pays them: caught up on every new prompt unweighed, the draft cost a 4-stream
//! batch more than its few accepted guesses saved.
//!
//! Drafting is greedy (a point guess per position), so the engine's verification —
//! sampling each position as it would without speculation and keeping guesses while
//! they match — leaves the output distribution the target's, exactly, for sampled
//! requests too (see `speculate`'s note).

use super::{MAX_SPEC_TOKENS, Proposal, Proposer};
use crate::engine::executor::cache_with_graphs;
use crate::engine::sequence::SeqId;
use crate::model::{Forwarded, KvCache, Model, ModelError, SeqInput};
use std::collections::HashMap;
use std::time::Instant;
use tessera_kernels::Backend;
use tessera_kernels::pick::PickRow;
use tessera_proto::block_hash::BLOCK_TOKENS;

/// Most tokens of catching up (prompts met for the first time) in one step: a long
/// prompt delays the step it is caught up in by at most this many tokens' forward
/// through the draft, and is caught up over several steps.
pub const CATCH_UP_TOKENS: usize = 512;

/// Weight of the latest measure in the running step and catch-up times.
const LEARN: f64 = 0.3;

/// A sequence's acceptance before any of its guesses is verified: optimistic, so that a
/// sequence is tried, and its own acceptance learnt — at the prior (0.5), a draft whose
/// forwards and catching up cost half a step and more on a CPU is never tried, and the
/// sequences it guesses well for (code it is asked to repeat) are never found.
const NEW_ACCEPTANCE: f64 = 0.8;

/// Tokens of the dummy sequence timed at load.
const WARM_UP_TOKENS: usize = 64;

/// The id of the dummy sequence timed at load (never an engine's: those count up).
const WARM_UP_ID: SeqId = SeqId::MAX;

/// What the draft holds for one sequence.
#[derive(Debug, Default)]
struct Drafted {
    /// KV blocks, in order.
    table: Vec<u32>,
    /// The tokens whose keys and values are in the cache, at positions `0..fed.len()`.
    fed: Vec<u32>,
    /// The step it was last asked about, for eviction.
    used: u64,
}

/// A draft model's proposer.
pub struct DraftProposer<B: Backend> {
    model: Model<B>,
    kv: KvCache<B>,
    free: Vec<u32>,
    seqs: HashMap<SeqId, Drafted>,
    /// Steps since start.
    clock: u64,
    /// Running time of one drafting forward (one position for every sequence), seconds.
    step_seconds: f64,
    /// Running time of catching up, per token, seconds.
    token_seconds: f64,
    /// The draft's error, once it failed: it then proposes nothing.
    failed: Option<ModelError>,
}

/// One sequence's part of a drafting step.
struct Work {
    id: SeqId,
    /// Tokens to feed before drafting, in a forward of their own (a sequence far
    /// behind: met for the first time, or evicted), so that the drafting forwards'
    /// time — what one more position costs every step — is measured without them.
    catch_up: Vec<u32>,
    /// Tokens to feed next: what the model decided since the last step, then drafted
    /// ones one at a time.
    pending: Vec<u32>,
    /// Tokens still to draft.
    left: usize,
    drafted: Vec<u32>,
}

impl<B: Backend> DraftProposer<B> {
    /// `model`, with a KV cache of `num_blocks` blocks and, where the backend captures
    /// them, decode graphs of `graph_sizes` (a drafting step past the first is a batch
    /// of single-token decodes).
    pub fn new(model: Model<B>, num_blocks: usize, graph_sizes: &[usize]) -> Result<Self, ModelError> {
        let kv = cache_with_graphs(&model, num_blocks, graph_sizes)?;
        // Popped from the end: the lowest blocks first.
        let free = (0..num_blocks as u32).rev().collect();
        let mut draft = Self {
            model,
            kv,
            free,
            seqs: HashMap::new(),
            clock: 0,
            step_seconds: 0.0,
            token_seconds: 0.0,
            failed: None,
        };
        draft.warm_up()?;
        tracing::info!(
            "draft model timed: {:.1} ms a drafting forward, {:.2} ms a token caught up",
            draft.step_seconds * 1e3,
            draft.token_seconds * 1e3
        );
        Ok(draft)
    }

    /// Times a catch-up and a drafting forward on a dummy sequence, twice (the first
    /// pays for cold caches), so that the first requests are weighed with what the
    /// draft costs on this machine.
    fn warm_up(&mut self) -> Result<(), ModelError> {
        let len = WARM_UP_TOKENS.min(self.model.config.context_length.saturating_sub(2));
        if len == 0 {
            return Ok(());
        }
        let tokens: Vec<u32> = (0..len as u32).map(|t| t % self.model.config.vocab_size as u32).collect();
        for _ in 0..2 {
            self.release(WARM_UP_ID);
            self.step_seconds = 0.0;
            self.token_seconds = 0.0;
            let ask = Proposal { id: WARM_UP_ID, tenant: "", tokens: &tokens, max: 1 };
            self.draft(&[ask])?;
        }
        self.release(WARM_UP_ID);
        Ok(())
    }

    /// Tokens `p` is behind by past what a drafting forward feeds anyway: what
    /// catching it up feeds.
    fn behind(&self, p: &Proposal<'_>) -> usize {
        let fed = self.seqs.get(&p.id).map_or(&[][..], |d| &d.fed[..]);
        let behind = p.tokens.len() - still_fed(fed, p.tokens);
        match behind > MAX_SPEC_TOKENS + 1 {
            true => behind,
            false => 0,
        }
    }

    /// Gets `p` ready to draft: its state cut back to what still agrees with its
    /// tokens, blocks for `tokens + max` positions, and what to feed this step (at most
    /// `budget` tokens). None when it cannot be drafted for now.
    fn prepare(&mut self, p: &Proposal<'_>, budget: &mut usize) -> Option<Work> {
        let context = self.model.config.context_length;
        if p.tokens.is_empty() || p.tokens.len() + p.max > context {
            return None;
        }
        let clock = self.clock;
        let d = self.seqs.entry(p.id).or_default();
        d.used = clock;
        d.fed.truncate(still_fed(&d.fed, p.tokens));
        let behind = p.tokens.len() - d.fed.len();
        let need = (p.tokens.len() + p.max).div_ceil(BLOCK_TOKENS);
        if !self.reserve(p.id, need) {
            return None;
        }
        let d = self.seqs.get_mut(&p.id).expect("entered above");
        // A long catch-up goes in pieces; the first token's row asks for nothing.
        let take = behind.min((*budget).max(1));
        *budget = budget.saturating_sub(take);
        let start = d.fed.len();
        let caught_up = take == behind;
        // More than a verification can have settled since the last step goes first,
        // all but the token whose logits give the first guess.
        let split = match caught_up {
            false => start + take,
            true if behind > MAX_SPEC_TOKENS + 1 => p.tokens.len() - 1,
            true => start,
        };
        Some(Work {
            id: p.id,
            catch_up: p.tokens[start..split].to_vec(),
            pending: p.tokens[split..start + take].to_vec(),
            left: if caught_up { p.max } else { 0 },
            drafted: Vec::new(),
        })
    }

    /// Makes `id` hold `need` blocks, evicting the sequences asked about least
    /// recently if the pool runs short. False when even that leaves too few.
    fn reserve(&mut self, id: SeqId, need: usize) -> bool {
        let have = self.seqs.get(&id).map_or(0, |d| d.table.len());
        if have >= need {
            return true;
        }
        while self.free.len() < need - have {
            let Some(victim) = self
                .seqs
                .iter()
                .filter(|(other, d)| **other != id && !d.table.is_empty() && d.used < self.clock)
                .min_by_key(|(_, d)| d.used)
                .map(|(&other, _)| other)
            else {
                return false;
            };
            self.release(victim);
        }
        let d = self.seqs.get_mut(&id).expect("entered by the caller");
        let from = self.free.len() - (need - have);
        d.table.extend(self.free.drain(from..).rev());
        true
    }

    fn release(&mut self, id: SeqId) {
        if let Some(d) = self.seqs.remove(&id) {
            self.free.extend(d.table.into_iter().rev());
        }
    }

    /// One forward of the draft over `work` (each sequence's tokens to catch up, or
    /// its pending ones), and each sequence's greedy next token where it asked for one.
    fn forward(&mut self, work: &mut [&mut Work], catching_up: bool) -> Result<(), ModelError> {
        let asks: Vec<bool> = work.iter().map(|w| !catching_up && w.left > 0).collect();
        let picks = {
            let inputs: Vec<SeqInput<'_>> = work
                .iter()
                .zip(&asks)
                .map(|(w, &logits)| {
                    let d = &self.seqs[&w.id];
                    let tokens = if catching_up { &w.catch_up } else { &w.pending };
                    SeqInput { tokens, cached: d.fed.len(), block_table: &d.table, logits, embeds: &[] }
                })
                .collect();
            let rows = vec![PickRow::default(); asks.iter().filter(|&&a| a).count()];
            match self.model.forward_picking(&inputs, &mut self.kv, &rows)? {
                Forwarded::Picked(picks) => picks.into_iter().map(|p| p.token).collect(),
                Forwarded::Logits(logits) => greedy(&logits, self.model.config.vocab_size),
            }
        };
        let mut picks = picks.into_iter();
        for (w, ask) in work.iter_mut().zip(asks) {
            let d = self.seqs.get_mut(&w.id).expect("prepared");
            d.fed.append(if catching_up { &mut w.catch_up } else { &mut w.pending });
            if ask {
                let token = picks.next().ok_or_else(|| ModelError::Input("the draft returned too few rows".into()))?;
                w.drafted.push(token);
                w.left -= 1;
                if w.left > 0 {
                    w.pending.push(token);
                }
            }
        }
        Ok(())
    }

    fn draft(&mut self, seqs: &[Proposal<'_>]) -> Result<Vec<Vec<u32>>, ModelError> {
        self.clock += 1;
        let mut budget = CATCH_UP_TOKENS;
        let mut work: Vec<Option<Work>> = seqs.iter().map(|p| self.prepare(p, &mut budget)).collect();
        let mut behind: Vec<&mut Work> = work.iter_mut().flatten().filter(|w| !w.catch_up.is_empty()).collect();
        if !behind.is_empty() {
            let (started, tokens) = (Instant::now(), behind.iter().map(|w| w.catch_up.len()).sum::<usize>());
            self.forward(&mut behind, true)?;
            learn(&mut self.token_seconds, started.elapsed().as_secs_f64() / tokens as f64);
        }
        // The first drafting forward feeds what the target decided since the last step
        // and makes every sequence's first guess; each after it is a batch of
        // single-token decodes.
        let (started, mut forwards) = (Instant::now(), 0);
        loop {
            let mut active: Vec<&mut Work> = work.iter_mut().flatten().filter(|w| w.left > 0).collect();
            if active.is_empty() {
                break;
            }
            self.forward(&mut active, false)?;
            forwards += 1;
        }
        if forwards > 0 {
            learn(&mut self.step_seconds, started.elapsed().as_secs_f64() / f64::from(forwards));
        }
        Ok(work.into_iter().map(|w| w.map(|w| w.drafted).unwrap_or_default()).collect())
    }
}

/// How much of `fed` a sequence of `tokens` keeps: what still agrees with them, short of
/// the last token, which is fed again if need be (its logits give the first guess).
fn still_fed(fed: &[u32], tokens: &[u32]) -> usize {
    let agree = fed.iter().zip(tokens).take_while(|(a, b)| a == b).count();
    agree.min(tokens.len().saturating_sub(1))
}

/// Moves a running time toward `secs` (to it, the first time).
fn learn(running: &mut f64, secs: f64) {
    *running = match *running {
        0.0 => secs,
        s => s + LEARN * (secs - s),
    };
}

/// The most likely token of each `vocab`-wide row.
fn greedy(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks_exact(vocab)
        .map(|row| row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as u32))
        .collect()
}

impl<B: Backend> Proposer for DraftProposer<B> {
    fn propose(&mut self, seqs: &[Proposal<'_>]) -> Vec<Vec<u32>> {
        if self.failed.is_some() {
            return vec![Vec::new(); seqs.len()];
        }
        match self.draft(seqs) {
            Ok(drafts) => drafts,
            Err(e) => {
                // The target serves on without speculation: a draft's failure (its
                // memory, its device) costs speed, never an answer.
                tracing::error!("the draft model failed ({e}); speculation is off from here");
                for p in seqs {
                    self.release(p.id);
                }
                self.failed = Some(e);
                vec![Vec::new(); seqs.len()]
            }
        }
    }

    fn finished(&mut self, id: SeqId, _tenant: &str, _tokens: &[u32]) {
        self.release(id);
    }

    fn step_seconds(&self) -> f64 {
        self.step_seconds
    }

    fn catch_up_seconds(&self, p: &Proposal<'_>) -> f64 {
        self.behind(p) as f64 * self.token_seconds
    }

    fn new_acceptance(&self) -> f64 {
        NEW_ACCEPTANCE
    }

    fn held_blocks(&self) -> usize {
        self.seqs.values().map(|d| d.table.len()).sum()
    }
}
