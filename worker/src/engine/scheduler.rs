//! The scheduler: which sequences run in the next forward, and how many of their tokens.
//!
//! vLLM V1's policy. Each step has a token budget (`max_num_batched_tokens`) shared by
//! decodes (one token each) and prefill chunks (long prompts are cut to what the budget
//! leaves). Running sequences go first, in admission order; then waiting ones are
//! admitted first come first served, each starting from the longest prefix already in
//! the cache. When blocks run out, the most recently admitted running sequence is
//! preempted: its blocks are freed and it returns to the head of the queue, to be
//! recomputed (prompt and output so far) when there is room.
//!
//! Plain synchronous data, owned by the engine thread.

use super::block_pool::{BlockId, BlockPool, KvEvents, PoolStats};
use super::sequence::{SeqId, Sequence};
use std::collections::{HashMap, VecDeque};
use tessera_proto::block_hash::{BLOCK_TOKENS, BlockHasher};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub num_blocks: usize,
}

/// One sequence's share of a step: tokens `start..start + len` run now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    /// This chunk reaches the end of the sequence: sample a token from its logits.
    pub sample: bool,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Step {
    pub scheduled: Vec<Scheduled>,
    /// Sequences sent back to the queue this step.
    pub preempted: Vec<SeqId>,
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    hasher: BlockHasher,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// In admission order: the last is preempted first.
    running: Vec<SeqId>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, hasher: BlockHasher) -> Self {
        Self {
            pool: BlockPool::new(config.num_blocks),
            config,
            hasher,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq.id, seq);
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    pub fn take_kv_events(&mut self) -> KvEvents {
        self.pool.take_events()
    }

    /// Plans the next forward.
    pub fn schedule(&mut self) -> Step {
        let mut step = Step::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let n = self.seqs[&id].num_pending().min(budget);
            // Make room, preempting from the back; possibly this sequence itself.
            let scheduled = loop {
                if self.grow(id, n) {
                    break true;
                }
                let victim = *self.running.last().expect("the sequence itself is running");
                self.preempt(victim);
                step.preempted.push(victim);
                if victim == id {
                    break false;
                }
            };
            if !scheduled {
                break;
            }
            step.scheduled.push(self.plan(id, n));
            budget -= n;
            i += 1;
        }
        if step.preempted.is_empty() {
            self.admit(&mut budget, &mut step);
        }
        step
    }

    /// Admits waiting sequences while the budget, `max_num_seqs` and the pool allow.
    fn admit(&mut self, budget: &mut usize, step: &mut Step) {
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let parent = self.seqs[&id].after.and_then(|p| self.seqs.get(&p));
            if parent.is_some_and(|p| p.num_computed < p.prompt_len) {
                break;
            }
            let seq = self.seqs.get_mut(&id).expect("waiting sequences are known");
            // Reuse cached full blocks, but always leave at least one token to run: its
            // logits give the next token.
            let usable = (seq.tokens.len() - 1) / BLOCK_TOKENS;
            update_hashes(&self.hasher, seq);
            let hits = self.pool.take_cached_prefix(&seq.block_hashes[..usable.min(seq.block_hashes.len())]);
            let n = (seq.tokens.len() - hits.len() * BLOCK_TOKENS).min(*budget);
            let need = (hits.len() * BLOCK_TOKENS + n).div_ceil(BLOCK_TOKENS) - hits.len();
            let Some(fresh) = self.pool.allocate(need) else {
                self.pool.release(hits.into_iter().rev());
                break;
            };
            seq.num_computed = hits.len() * BLOCK_TOKENS;
            if seq.num_output() == 0 {
                seq.num_cached_prompt = seq.num_computed;
            }
            seq.num_cached_blocks = hits.len();
            seq.block_table = hits;
            seq.block_table.extend(fresh);
            self.waiting.pop_front();
            self.running.push(id);
            step.scheduled.push(self.plan(id, n));
            *budget -= n;
        }
    }

    fn plan(&self, id: SeqId, len: usize) -> Scheduled {
        let seq = &self.seqs[&id];
        Scheduled { id, start: seq.num_computed, len, sample: seq.num_computed + len == seq.tokens.len() }
    }

    /// Gives `id` blocks for `n` more tokens; false if the pool is short.
    fn grow(&mut self, id: SeqId, n: usize) -> bool {
        let seq = self.seqs.get_mut(&id).expect("running sequences are known");
        let need = (seq.num_computed + n).div_ceil(BLOCK_TOKENS).saturating_sub(seq.block_table.len());
        match self.pool.allocate(need) {
            Some(blocks) => {
                seq.block_table.extend(blocks);
                true
            }
            None => false,
        }
    }

    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        let seq = self.seqs.get_mut(&id).expect("running sequences are known");
        self.pool.release(std::mem::take(&mut seq.block_table).into_iter().rev());
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        self.waiting.push_front(id);
    }

    /// Records that the step ran: the scheduled tokens are in the cache now, and full
    /// blocks join the prefix cache.
    pub fn complete(&mut self, step: &Step) {
        for s in &step.scheduled {
            let Some(seq) = self.seqs.get_mut(&s.id) else { continue };
            seq.num_computed = s.start + s.len;
            update_hashes(&self.hasher, seq);
            let full = seq.num_computed / BLOCK_TOKENS;
            for b in seq.num_cached_blocks..full {
                self.pool.cache(seq.block_table[b], seq.block_hashes[b]);
            }
            seq.num_cached_blocks = seq.num_cached_blocks.max(full);
        }
    }

    /// Appends a sampled token to a running sequence.
    pub fn append(&mut self, id: SeqId, token: u32) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens.push(token);
        }
    }

    /// Removes a sequence (finished or aborted) and frees its blocks at once.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&id)?;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.pool.release(std::mem::take(&mut seq.block_table).into_iter().rev());
        Some(seq)
    }

    pub fn block_table(&self, id: SeqId) -> &[BlockId] {
        &self.seqs[&id].block_table
    }
}

/// Extends the sequence's block hashes over its full blocks.
fn update_hashes(hasher: &BlockHasher, seq: &mut Sequence) {
    let full = seq.tokens.len() / BLOCK_TOKENS;
    while seq.block_hashes.len() < full {
        let b = seq.block_hashes.len();
        let parent = seq.block_hashes.last().copied();
        let h = hasher.next(parent, &seq.tokens[b * BLOCK_TOKENS..(b + 1) * BLOCK_TOKENS]);
        seq.block_hashes.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(tokens: usize, seqs: usize, blocks: usize) -> Scheduler {
        let config = SchedulerConfig { max_num_batched_tokens: tokens, max_num_seqs: seqs, num_blocks: blocks };
        Scheduler::new(config, BlockHasher::new("test"))
    }

    fn prompt(len: usize, salt: u32) -> Vec<u32> {
        (0..len as u32).map(|i| i * 7 + salt).collect()
    }

    /// Runs a step as the engine would: complete it, append a token where sampled.
    fn run(s: &mut Scheduler) -> Step {
        let step = s.schedule();
        s.complete(&step);
        for x in step.scheduled.iter().filter(|x| x.sample) {
            s.append(x.id, 1);
        }
        step
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_under_the_budget() {
        let mut s = sched(64, 8, 100);
        s.add(Sequence::new(1, prompt(150, 0)));
        let lens: Vec<(usize, usize, bool)> =
            (0..4).map(|_| run(&mut s).scheduled.iter().map(|x| (x.start, x.len, x.sample)).next().unwrap()).collect();
        assert_eq!(lens, vec![(0, 64, false), (64, 64, false), (128, 22, true), (150, 1, true)]);
    }

    #[test]
    fn decodes_and_a_prefill_chunk_share_a_step() {
        let mut s = sched(32, 8, 100);
        s.add(Sequence::new(1, prompt(10, 0)));
        run(&mut s);
        s.add(Sequence::new(2, prompt(100, 1)));
        let step = run(&mut s);
        assert_eq!(
            step.scheduled,
            vec![
                Scheduled { id: 1, start: 10, len: 1, sample: true },
                Scheduled { id: 2, start: 0, len: 31, sample: false },
            ]
        );
    }

    #[test]
    fn max_num_seqs_bounds_the_running_set() {
        let mut s = sched(1000, 2, 100);
        for id in 0..3 {
            s.add(Sequence::new(id, prompt(5, id as u32)));
        }
        let step = run(&mut s);
        assert_eq!(step.scheduled.len(), 2);
        assert_eq!(s.num_waiting(), 1);
    }

    #[test]
    fn a_shared_prefix_is_served_from_the_cache() {
        let mut s = sched(1000, 8, 100);
        let mut a = prompt(64, 0);
        a.extend([900, 901]);
        s.add(Sequence::new(1, a.clone()));
        run(&mut s);
        let mut b = prompt(64, 0);
        b.extend([700, 701, 702]);
        s.add(Sequence::new(2, b));
        let step = run(&mut s);
        let x = step.scheduled.iter().find(|x| x.id == 2).unwrap();
        assert_eq!((x.start, x.len), (64, 3));
        assert_eq!(s.get(2).unwrap().num_cached_prompt, 64);
        // The same prompt again: at most one block is recomputed (the last token must run).
        s.add(Sequence::new(3, a));
        let step = run(&mut s);
        let x = step.scheduled.iter().find(|x| x.id == 3).unwrap();
        assert_eq!((x.start, x.len), (64, 2));
        assert_eq!(s.pool_stats().hit_blocks, 8);
    }

    #[test]
    fn an_exact_block_multiple_prompt_still_runs_its_last_token() {
        let mut s = sched(1000, 8, 100);
        s.add(Sequence::new(1, prompt(32, 0)));
        run(&mut s);
        s.add(Sequence::new(2, prompt(32, 0)));
        let x = run(&mut s).scheduled.into_iter().find(|x| x.id == 2).unwrap();
        assert_eq!((x.start, x.len, x.sample), (16, 16, true));
    }

    #[test]
    fn running_out_of_blocks_preempts_the_newest_and_it_resumes_later() {
        // 4 blocks: two 31-token prompts take 2 each; they fill them with one sampled
        // token each, and the next token of either needs a fifth block.
        let mut s = sched(1000, 8, 4);
        s.add(Sequence::new(1, prompt(31, 0)));
        s.add(Sequence::new(2, prompt(31, 1)));
        run(&mut s);
        run(&mut s);
        assert_eq!(s.pool().num_free(), 0);
        let step = run(&mut s);
        assert_eq!(step.preempted, vec![2]);
        assert_eq!(step.scheduled.iter().map(|x| x.id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(s.get(2).unwrap().num_computed, 0);
        assert_eq!(s.num_waiting(), 1);
        // Once 1 is gone, 2 is recomputed — prompt and both tokens sampled before it
        // was preempted — from its first block, still cached (its second was reused).
        s.remove(1);
        let step = run(&mut s);
        assert_eq!(step.scheduled, vec![Scheduled { id: 2, start: 16, len: 17, sample: true }]);
    }

    #[test]
    fn a_sibling_waits_for_its_parents_prompt_and_then_shares_its_blocks() {
        let mut s = sched(1000, 8, 100);
        s.add(Sequence::new(1, prompt(40, 0)));
        s.add(Sequence { after: Some(1), ..Sequence::new(2, prompt(40, 0)) });
        let step = run(&mut s);
        assert_eq!(step.scheduled.iter().map(|x| x.id).collect::<Vec<_>>(), vec![1]);
        let step = run(&mut s);
        let x = step.scheduled.iter().find(|x| x.id == 2).unwrap();
        assert_eq!((x.start, x.len), (32, 8), "two full blocks shared");
        assert_eq!(s.block_table(2)[..2], s.block_table(1)[..2]);
    }

    #[test]
    fn removing_returns_every_block() {
        let mut s = sched(1000, 8, 20);
        s.add(Sequence::new(1, prompt(100, 0)));
        s.add(Sequence::new(2, prompt(40, 1)));
        run(&mut s);
        assert!(s.pool().num_free() < 20);
        s.remove(1);
        s.remove(2);
        assert_eq!(s.pool().num_free(), 20);
        assert!(!s.has_work());
    }
}
