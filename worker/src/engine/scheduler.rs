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
//! Progress: the first running sequence is never preempted while another runs, so it
//! advances every step; the engine admits only sequences that fit the whole cache alone
//! (`fits`), so preempting everyone behind it always makes room, it finishes, and the
//! next takes its place. Preempted sequences return to the head of the queue, ahead of
//! later arrivals, so none waits forever. A lone sequence that still cannot grow (which
//! `fits` rules out) is not put back into the queue to loop: it is `exhausted`, and the
//! engine ends it as having filled its context.
//!
//! Tenants (`fair`): while more than one contends for the replica, a step runs at most
//! `contended_batch` rows, split among them by weight, the tenant furthest behind
//! first; the rest wait a step (their blocks kept). Waiting sequences are admitted in
//! that tenant order too, then preempted ones first, then by priority and arrival; and
//! when blocks run out the victim is a sequence of the tenant running the most rows
//! for its weight, its lowest priority and newest first. The first running sequence
//! still is never preempted while another runs: when it needs blocks it may take them
//! from sequences already planned for the step, which are then taken out of it.
//!
//! Plain synchronous data, owned by the engine thread.

use super::block_pool::{BlockId, BlockPool, KvEvents, PoolStats};
use super::fair::{self, Fairness};
use super::kv_tier::{KvTiers, Tier};
use super::sequence::{SeqId, Sequence};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_proto::block_hash::{BLOCK_TOKENS, BlockHash, BlockHasher};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub num_blocks: usize,
    /// Rows a step runs while tenants contend (`fair`).
    pub contended_batch: usize,
}

/// One sequence's share of a step: tokens `start..start + len` run now, the last
/// `draft` of them the sequence's proposed tokens (`Sequence::draft`), to be verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    /// This chunk reaches the end of the sequence: sample a token from its logits.
    pub sample: bool,
    pub draft: usize,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Step {
    pub scheduled: Vec<Scheduled>,
    /// Sequences sent back to the queue this step.
    pub preempted: Vec<SeqId>,
    /// Running alone, and still no room to grow: they end here (see the module's note).
    pub exhausted: Vec<SeqId>,
    /// Of `preempted`, those preempted to make room for another tenant's sequence
    /// (`rebalance`).
    pub fair_preemptions: usize,
    /// Cached blocks this step hands out again: copy each to the second tier
    /// (`Scheduler::offloaded`) before anything writes them.
    pub offload: Vec<(BlockId, BlockHash)>,
    /// Blocks to fill from the second tier before the forward (after `offload`): a
    /// prefix found there, each block's saved contents and the tier it came from.
    pub onload: Vec<(BlockId, Arc<Vec<u8>>, Tier)>,
}

impl Step {
    /// Whether the step does nothing at all.
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
            && self.preempted.is_empty()
            && self.exhausted.is_empty()
            && self.offload.is_empty()
            && self.onload.is_empty()
    }
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    hasher: BlockHasher,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// In admission order.
    running: Vec<SeqId>,
    fair: Fairness,
    /// Steps planned.
    steps: u64,
    /// The second KV tier, when there is one, and this step's moves to and from it.
    tiers: Option<KvTiers>,
    offload: Vec<(BlockId, BlockHash)>,
    onload: HashMap<BlockId, (BlockHash, Arc<Vec<u8>>, Tier)>,
}

/// Where a block is, as the router's prefix index keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Device,
    Host,
    Disk,
    /// Held nowhere any more.
    Gone,
}

impl From<Tier> for Place {
    fn from(t: Tier) -> Self {
        match t {
            Tier::Host => Place::Host,
            Tier::Disk => Place::Disk,
        }
    }
}

/// A tenant's load on the replica, as metrics report it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantLoad {
    pub tenant: Arc<str>,
    pub running: usize,
    pub waiting: usize,
    /// Share of recent steps' rows, 0 to 1.
    pub share: f64,
}

/// The rows each tenant may still run in a contended step.
struct Share {
    left: HashMap<Arc<str>, usize>,
    /// The tenant furthest behind: its first piece of work runs whole.
    first: Option<Arc<str>>,
    /// Rows of the step not yet run, whoever's.
    total: usize,
    /// Second pass: rows a tenant was allotted and could not use (its sequences wait
    /// for blocks or for a sibling's prompt) go to anyone, so that a step never runs
    /// less than it could.
    spare: bool,
}

impl Share {
    /// How many of `n` rows `tenant` may run now.
    fn allowed(&self, tenant: &Arc<str>, n: usize) -> usize {
        match () {
            _ if self.spare => n.min(self.total),
            _ if self.first.as_ref() == Some(tenant) => n,
            _ => n.min(self.left.get(tenant).copied().unwrap_or(0)),
        }
    }

    fn spend(&mut self, tenant: &Arc<str>, n: usize) {
        if self.first.as_ref() == Some(tenant) {
            self.first = None;
        }
        if let Some(l) = self.left.get_mut(tenant) {
            *l = l.saturating_sub(n);
        }
        self.total = self.total.saturating_sub(n);
    }

    fn refund(&mut self, tenant: &Arc<str>, n: usize) {
        if let Some(l) = self.left.get_mut(tenant) {
            *l += n;
        }
        self.total += n;
    }
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, hasher: BlockHasher) -> Self {
        Self::with_grace(config, hasher, fair::GRACE)
    }

    /// `new`, with how long an idle tenant still counts as contending (`fair::GRACE`).
    pub fn with_grace(config: SchedulerConfig, hasher: BlockHasher, grace: Duration) -> Self {
        Self {
            pool: BlockPool::new(config.num_blocks),
            fair: Fairness::new(config.contended_batch, grace),
            config,
            hasher,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            steps: 0,
            tiers: None,
            offload: Vec::new(),
            onload: HashMap::new(),
        }
    }

    /// Keeps the blocks the pool evicts in `tiers`, and finds prefixes there.
    pub fn with_tiers(mut self, tiers: KvTiers) -> Self {
        self.pool.track_evictions();
        self.tiers = Some(tiers);
        self
    }

    pub fn tiers(&self) -> Option<&KvTiers> {
        self.tiers.as_ref()
    }

    pub fn tiers_mut(&mut self) -> Option<&mut KvTiers> {
        self.tiers.as_mut()
    }

    /// The blocks of `Step::onload` could not all be copied in: none of them is served
    /// from the cache (their sequences end with the failed step; their contents are
    /// lost to the tiers too).
    pub fn onload_failed(&mut self, step: &Step) {
        for (id, _, _) in &step.onload {
            self.pool.uncache(*id);
        }
    }

    /// A block of `Step::offload`, copied: into the second tier, unless the device holds
    /// its hash again.
    pub fn offloaded(&mut self, hash: BlockHash, data: Arc<Vec<u8>>) {
        if let Some(tiers) = &mut self.tiers
            && !self.pool.holds(hash)
        {
            tiers.put(hash, data);
        }
    }

    pub fn add(&mut self, seq: Sequence) {
        self.fair.join(&seq.tenant, seq.weight);
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq.id, seq);
    }

    /// Tokens the whole cache holds.
    pub fn capacity_tokens(&self) -> usize {
        self.config.num_blocks * BLOCK_TOKENS
    }

    /// Whether a sequence that may reach `tokens` tokens (prompt and output) can run
    /// alone in the cache: what the progress guarantee needs of every sequence.
    pub fn fits(&self, tokens: usize) -> bool {
        tokens <= self.capacity_tokens()
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

    /// Each block whose place changed since the last call, and where it is now: the net
    /// of every change between (a block evicted to the second tier and found again is
    /// on the device), so that a report's order does not matter.
    pub fn take_kv_changes(&mut self) -> Vec<(BlockHash, Place)> {
        let KvEvents { stored, removed } = self.pool.take_events();
        let tiers = self.tiers.as_mut().map(KvTiers::take_events).unwrap_or_default();
        let mut touched: Vec<BlockHash> = stored
            .into_iter()
            .chain(removed)
            .chain(tiers.stored.into_iter().map(|(h, _)| h))
            .chain(tiers.removed)
            .collect();
        touched.sort_unstable();
        touched.dedup();
        touched.into_iter().map(|h| (h, self.place(h))).collect()
    }

    /// Every block held and where: what a new watcher of the cache starts from.
    pub fn kv_snapshot(&self) -> Vec<(BlockHash, Place)> {
        let device = self.pool.cached_hashes().into_iter().map(|h| (h, Place::Device));
        let tiers = self.tiers.iter().flat_map(KvTiers::held).map(|(h, t)| (h, Place::from(t)));
        device.chain(tiers).collect()
    }

    /// Where a block is now.
    pub fn place(&self, hash: BlockHash) -> Place {
        if self.pool.holds(hash) {
            return Place::Device;
        }
        self.tiers.as_ref().and_then(|t| t.find(hash)).map_or(Place::Gone, Place::from)
    }

    /// Plans the next forward.
    pub fn schedule(&mut self) -> Step {
        self.schedule_paced(usize::MAX)
    }

    /// Running sequences with a single token to run: decodes.
    pub fn decoding(&self) -> usize {
        self.decoding_sequences().count()
    }

    /// The decoding sequences, in the order they run.
    pub fn decoding_sequences(&self) -> impl Iterator<Item = &Sequence> {
        self.running.iter().map(|id| &self.seqs[id]).filter(|s| s.num_pending() == 1)
    }

    /// Proposes tokens to follow a decoding sequence, for the next step to verify
    /// (as many as its token budget leaves room for).
    pub fn propose(&mut self, id: SeqId, draft: Vec<u32>) {
        if let Some(seq) = self.seqs.get_mut(&id).filter(|s| s.num_pending() == 1) {
            seq.draft = draft;
        }
    }

    /// Plans the next forward with prompt chunks (sequences with more than one token to
    /// run) taking at most `prompt_tokens` of the budget between them; decodes are never
    /// held back by it (`pacing`), only by fair sharing while tenants contend.
    pub fn schedule_paced(&mut self, prompt_tokens: usize) -> Step {
        self.steps += 1;
        loop {
            let step = self.form_step(prompt_tokens);
            // Nothing to run but prompts whose blocks are coming up from disk: a read
            // is waited for here rather than an empty step handed out.
            if !step.is_empty() || !self.tiers.as_mut().is_some_and(KvTiers::wait_for_read) {
                return step;
            }
        }
    }

    fn form_step(&mut self, prompt_tokens: usize) -> Step {
        if let Some(tiers) = &mut self.tiers {
            tiers.start_pass();
        }
        let mut step = Step::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut prompt_left = prompt_tokens.max(1);
        let mut share = self.share(Instant::now());
        if share.is_some() {
            self.rebalance(&mut step);
        }
        for pass in 0..if share.is_some() { 2 } else { 1 } {
            if let Some(share) = &mut share {
                share.spare = pass == 1;
            }
            self.plan_running(&mut step, &mut budget, &mut prompt_left, &mut share);
            if step.preempted.is_empty() {
                let mut admitting = budget.min(prompt_left);
                let offered = admitting;
                self.admit(&mut admitting, &mut step, &mut share);
                budget -= offered - admitting;
            }
        }
        self.add_proposals(&mut step, budget, &mut share);
        let mut rows: HashMap<Arc<str>, usize> = HashMap::new();
        for s in &step.scheduled {
            let seq = self.seqs.get_mut(&s.id).expect("scheduled sequences are known");
            seq.last_run = self.steps;
            self.fair.charge(&seq.tenant, s.len);
            *rows.entry(seq.tenant.clone()).or_default() += s.len;
        }
        if !rows.is_empty() {
            self.fair.record_step(&rows);
        }
        step.offload = std::mem::take(&mut self.offload);
        step.onload = self.onload.drain().map(|(id, (_, data, tier))| (id, data, tier)).collect();
        if let Some(tiers) = &mut self.tiers {
            for (_, data, tier) in &step.onload {
                tiers.onloaded(*tier, data.len() as u64);
            }
        }
        step
    }

    /// `pool.allocate`, noting the cached blocks it evicts for the second tier: copied
    /// before the step writes them, or, if this step was to fill one from the tier, that
    /// block's contents go back to the tier untouched.
    fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        let blocks = self.pool.allocate(n)?;
        if let Some(tiers) = &mut self.tiers {
            for (id, hash) in self.pool.take_evicted() {
                match self.onload.remove(&id) {
                    Some((loading, data, _)) if loading == hash => tiers.put_back(hash, data),
                    _ => self.offload.push((id, hash)),
                }
            }
        }
        Some(blocks)
    }

    /// Takes the blocks `tier_continuation` found into `blocks` (fresh from `allocate`), to be
    /// filled before the step's forward; how many it could (a file that fails to read
    /// ends the prefix there).
    fn take_from_tiers(&mut self, hashes: &[BlockHash], blocks: &[BlockId]) -> usize {
        let Some(tiers) = &mut self.tiers else { return 0 };
        for (i, (&hash, &id)) in hashes.iter().zip(blocks).enumerate() {
            let Some((data, tier)) = tiers.take(hash) else { return i };
            self.pool.cache(id, hash);
            self.onload.insert(id, (hash, data, tier));
        }
        hashes.len().min(blocks.len())
    }

    /// Each tenant known here: its sequences running and waiting, and its share of
    /// recent steps' rows (for metrics).
    pub fn tenants(&self) -> Vec<TenantLoad> {
        let mut loads: HashMap<&str, TenantLoad> = HashMap::new();
        for (name, _, share) in self.fair.shares() {
            loads.insert(name, TenantLoad { tenant: name.clone(), share, ..TenantLoad::default() });
        }
        for (ids, running) in [(self.running.iter().collect::<Vec<_>>(), true), (self.waiting.iter().collect(), false)]
        {
            for id in ids {
                let s = &self.seqs[id];
                if let Some(l) = loads.get_mut(&*s.tenant) {
                    *if running { &mut l.running } else { &mut l.waiting } += 1;
                }
            }
        }
        loads.into_values().collect()
    }

    /// Plans the running sequences not planned yet, in `running_order`, within the
    /// budgets.
    fn plan_running(
        &mut self,
        step: &mut Step,
        budget: &mut usize,
        prompt_left: &mut usize,
        share: &mut Option<Share>,
    ) {
        for id in self.running_order(share.is_some()) {
            if *budget == 0 {
                break;
            }
            // Preempted already, to make room for one before it; or planned in the pass before.
            let Some(seq) = self.seqs.get(&id).filter(|_| self.running.contains(&id)) else { continue };
            if step.scheduled.iter().any(|s| s.id == id) {
                continue;
            }
            let tenant = seq.tenant.clone();
            let pending = seq.num_pending();
            let chunk = pending > 1;
            let mut n = pending.min(*budget).min(if chunk { *prompt_left } else { usize::MAX });
            if let Some(share) = share {
                n = share.allowed(&tenant, n);
            }
            if n == 0 {
                // A prompt whose chunk waits for the next step, or a tenant whose rows
                // for this step are spent.
                continue;
            }
            // Make room, preempting others; possibly this sequence itself, unless it is
            // the first: preempting it would free nothing for anyone.
            let scheduled = loop {
                if self.grow(id, n) {
                    break true;
                }
                match self.victim(id, step) {
                    Some(victim) => {
                        if let Some(at) = step.scheduled.iter().position(|s| s.id == victim) {
                            let planned = step.scheduled.remove(at);
                            *budget += planned.len;
                            if planned.len > 1 {
                                *prompt_left += planned.len;
                            }
                            if let Some(share) = share {
                                share.refund(&self.seqs[&victim].tenant, planned.len);
                            }
                        }
                        self.preempt(victim);
                        step.preempted.push(victim);
                    }
                    None if self.running.first() == Some(&id) => {
                        self.exhaust(id);
                        step.exhausted.push(id);
                        break false;
                    }
                    None => {
                        self.preempt(id);
                        step.preempted.push(id);
                        break false;
                    }
                }
            };
            if !scheduled {
                continue;
            }
            step.scheduled.push(self.plan(id, n));
            if let Some(share) = share {
                share.spend(&tenant, n);
            }
            *budget -= n;
            if chunk {
                *prompt_left -= n;
            }
        }
    }

    /// While tenants contend, each one's rows for the next step (`fair`); None while
    /// one has the replica to itself.
    fn share(&self, now: Instant) -> Option<Share> {
        if !self.fair.contended(now) {
            return None;
        }
        let mut demands: HashMap<Arc<str>, usize> = HashMap::new();
        for id in self.running.iter().chain(&self.waiting) {
            let seq = &self.seqs[id];
            *demands.entry(seq.tenant.clone()).or_default() += seq.num_pending().max(1);
        }
        let first = demands
            .keys()
            .min_by(|a, b| self.fair.vtime(a).total_cmp(&self.fair.vtime(b)).then_with(|| a.cmp(b)))
            .cloned();
        Some(Share { left: self.fair.allot(&demands), first, total: self.config.contended_batch, spare: false })
    }

    /// The order running sequences are planned in: admission order, or while tenants
    /// contend, tenant by tenant (furthest behind first), each one's by priority and
    /// then least recently run.
    fn running_order(&self, contended: bool) -> Vec<SeqId> {
        if !contended {
            return self.running.clone();
        }
        let mut keyed: Vec<(f64, &str, i32, u64, usize, SeqId)> = self
            .running
            .iter()
            .enumerate()
            .map(|(at, id)| {
                let s = &self.seqs[id];
                (self.fair.vtime(&s.tenant), &*s.tenant, s.priority, s.last_run, at, *id)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| (a.1, a.2, a.3, a.4).cmp(&(b.1, b.2, b.3, b.4))));
        keyed.into_iter().map(|k| k.5).collect()
    }

    /// Each tenant's running sequences over its weight: who runs the most for its share.
    fn running_loads(&self) -> HashMap<Arc<str>, f64> {
        let mut loads: HashMap<Arc<str>, f64> = HashMap::new();
        for r in &self.running {
            let s = &self.seqs[r];
            *loads.entry(s.tenant.clone()).or_default() += 1.0 / f64::from(s.weight.max(1));
        }
        loads
    }

    /// Whom to preempt so that `id` can grow: of the running sequences besides it and
    /// the first, one not planned for this step if any (else, only for the first, one
    /// that is), of the tenant running the most rows for its weight, its lowest
    /// priority, newest admitted. None: nobody may be preempted for it.
    fn victim(&self, id: SeqId, step: &Step) -> Option<SeqId> {
        let loads = self.running_loads();
        let load = |s: &Sequence| loads[&*s.tenant];
        let pick = |planned: bool| {
            self.running
                .iter()
                .enumerate()
                .skip(1)
                .filter(|&(_, &r)| r != id && step.scheduled.iter().any(|s| s.id == r) == planned)
                .max_by(|(ia, a), (ib, b)| {
                    let (sa, sb) = (&self.seqs[*a], &self.seqs[*b]);
                    load(sa).total_cmp(&load(sb)).then(sa.priority.cmp(&sb.priority)).then(ia.cmp(ib))
                })
                .map(|(_, &r)| r)
        };
        pick(false).or_else(|| if self.running.first() == Some(&id) { pick(true) } else { None })
    }

    /// Runs decodes' proposals with them from what the step leaves over, its budget
    /// and free blocks: never at a decode's or a prompt's expense, never by preempting
    /// anyone. They cost like a decode for pacing's sake (a step of verifications is a
    /// decode step, only longer). Proposals that do not fit are dropped, as are those
    /// of sequences that did not run.
    fn add_proposals(&mut self, step: &mut Step, mut budget: usize, share: &mut Option<Share>) {
        for s in &mut step.scheduled {
            let want = match self.seqs.get(&s.id) {
                Some(seq) if s.len == 1 && s.sample => {
                    let want = seq.draft.len().min(budget);
                    // A proposal is a row too: within the tenant's rows while others contend.
                    match share {
                        Some(share) => share.left.get(&seq.tenant).map_or(0, |&l| want.min(l)),
                        None => want,
                    }
                }
                _ => 0,
            };
            let fits = want > 0 && self.grow(s.id, 1 + want);
            let seq = self.seqs.get_mut(&s.id).expect("scheduled sequences are known");
            if fits {
                seq.draft.truncate(want);
                (s.len, s.draft) = (1 + want, want);
                budget -= want;
                if let Some(share) = share {
                    share.spend(&seq.tenant, want);
                }
            } else {
                seq.draft.clear();
            }
        }
        for id in &self.running {
            if let Some(seq) = self.seqs.get_mut(id).filter(|q| !q.draft.is_empty())
                && !step.scheduled.iter().any(|s| s.id == *id)
            {
                seq.draft.clear();
            }
        }
    }

    /// Admits waiting sequences while the budget, `max_num_seqs` and the pool allow:
    /// while tenants contend the one furthest behind first, and within their rows; then
    /// preempted sequences, then by priority and arrival.
    fn admit(&mut self, budget: &mut usize, step: &mut Step, share: &mut Option<Share>) {
        let order = self.waiting_order(share.is_some());
        for id in order {
            if *budget == 0 || self.running.len() >= self.config.max_num_seqs {
                break;
            }
            let parent = self.seqs[&id].after.and_then(|p| self.seqs.get(&p));
            if parent.is_some_and(|p| p.num_computed < p.prompt_len) {
                continue;
            }
            let seq = self.seqs.get_mut(&id).expect("waiting sequences are known");
            update_hashes(&self.hasher, seq);
            let prefix = reusable_prefix(seq);
            // The prefix goes on in the second tier: those blocks are copied, not computed.
            let tiered = tier_continuation(&self.pool, self.tiers.as_ref(), prefix);
            // Those on disk are read ahead: the sequence waits for them, the others go on.
            if self.tiers.as_mut().is_some_and(|t| !t.ready(&tiered)) {
                continue;
            }
            let hits = self.pool.take_cached_prefix(prefix);
            let found = hits.len() + tiered.len();
            let mut n = (seq.tokens.len() - found * BLOCK_TOKENS).min(*budget);
            if let Some(share) = share {
                n = share.allowed(&seq.tenant, n);
            }
            if n == 0 {
                self.pool.release(hits.into_iter().rev());
                continue;
            }
            let need = (found * BLOCK_TOKENS + n).div_ceil(BLOCK_TOKENS) - hits.len();
            let Some(fresh) = self.allocate(need) else {
                self.pool.release(hits.into_iter().rev());
                if self.running.is_empty() {
                    // Not even an empty cache holds it: waiting would block the queue forever.
                    self.waiting.retain(|&w| w != id);
                    step.exhausted.push(id);
                    continue;
                }
                break;
            };
            let loaded = self.take_from_tiers(&tiered, &fresh);
            let seq = self.seqs.get_mut(&id).expect("waiting sequences are known");
            seq.num_computed = (hits.len() + loaded) * BLOCK_TOKENS;
            if seq.num_output() == seq.resumed {
                seq.num_cached_prompt = seq.num_computed.min(seq.prompt_len);
            }
            seq.num_cached_blocks = hits.len() + loaded;
            seq.block_table = hits;
            seq.block_table.extend(fresh);
            seq.preempted = false;
            if let Some(share) = share {
                share.spend(&seq.tenant, n);
            }
            self.waiting.retain(|&w| w != id);
            self.running.push(id);
            step.scheduled.push(self.plan(id, n));
            *budget -= n;
        }
    }

    /// Waiting sequences in the order they are admitted: while tenants contend the one
    /// furthest behind first, then preempted sequences, then by priority and arrival.
    fn waiting_order(&self, contended: bool) -> Vec<SeqId> {
        let mut keyed: Vec<(f64, &str, bool, i32, SeqId)> = self
            .waiting
            .iter()
            .map(|id| {
                let s = &self.seqs[id];
                let vtime = if contended { self.fair.vtime(&s.tenant) } else { 0.0 };
                (vtime, &*s.tenant, !s.preempted, s.priority, *id)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| (a.1, a.2, a.3, a.4).cmp(&(b.1, b.2, b.3, b.4))));
        keyed.into_iter().map(|k| k.4).collect()
    }

    /// While tenants contend and the batch (`max_num_seqs`) or the cache is too full to
    /// admit a waiting sequence, makes room for it if its tenant runs fewer rows for
    /// its weight than another: one sequence of the tenant running the most for its
    /// weight is preempted (its lowest priority, newest; never the first running), if
    /// that leaves the two no further apart the other way. The step admits nobody (a
    /// preemption step never does); the next admits the waiting one, its tenant being
    /// further behind.
    fn rebalance(&mut self, step: &mut Step) {
        let loads = self.running_loads();
        let load = |tenant: &str| loads.get(tenant).copied().unwrap_or(0.0);
        let seats = self.running.len() >= self.config.max_num_seqs;
        let mut victim = None;
        for id in self.waiting_order(true) {
            let seq = &self.seqs[&id];
            if seq.after.and_then(|p| self.seqs.get(&p)).is_some_and(|p| p.num_computed < p.prompt_len) {
                continue;
            }
            // Nor for one whose blocks are still coming up from disk (their reads are
            // asked for here, the seats being full).
            let seq = self.seqs.get_mut(&id).expect("waiting sequences are known");
            update_hashes(&self.hasher, seq);
            let tiered = tier_continuation(&self.pool, self.tiers.as_ref(), reusable_prefix(seq));
            if self.tiers.as_mut().is_some_and(|t| !t.ready(&tiered)) {
                continue;
            }
            let seq = &self.seqs[&id];
            // Its first chunk's blocks, cache hits aside.
            let blocks = seq.tokens.len().min(self.config.max_num_batched_tokens).div_ceil(BLOCK_TOKENS);
            if !seats && self.pool.num_free() >= blocks {
                // It can be admitted as things are.
                return;
            }
            let after = load(&seq.tenant) + 1.0 / f64::from(seq.weight.max(1));
            victim = self
                .running
                .iter()
                .enumerate()
                .skip(1)
                .map(|(at, r)| (at, &self.seqs[r]))
                .filter(|(_, r)| r.tenant != seq.tenant && load(&r.tenant) - 1.0 / f64::from(r.weight.max(1)) >= after)
                .max_by(|(ia, a), (ib, b)| {
                    load(&a.tenant).total_cmp(&load(&b.tenant)).then(a.priority.cmp(&b.priority)).then(ia.cmp(ib))
                })
                .map(|(_, r)| r.id);
            if victim.is_some() {
                break;
            }
        }
        if let Some(victim) = victim {
            self.preempt(victim);
            step.preempted.push(victim);
            step.fair_preemptions += 1;
        }
    }

    fn plan(&self, id: SeqId, len: usize) -> Scheduled {
        let seq = &self.seqs[&id];
        Scheduled { id, start: seq.num_computed, len, sample: seq.num_computed + len == seq.tokens.len(), draft: 0 }
    }

    /// Gives `id` blocks for `n` more tokens; false if the pool is short.
    fn grow(&mut self, id: SeqId, n: usize) -> bool {
        let seq = self.seqs.get_mut(&id).expect("running sequences are known");
        let need = (seq.num_computed + n).div_ceil(BLOCK_TOKENS).saturating_sub(seq.block_table.len());
        match self.allocate(need) {
            Some(blocks) => {
                self.seqs.get_mut(&id).expect("running sequences are known").block_table.extend(blocks);
                true
            }
            None => false,
        }
    }

    /// Takes a sequence out of the running set for good, its blocks freed; it stays
    /// known until `remove`.
    fn exhaust(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        let seq = self.seqs.get_mut(&id).expect("running sequences are known");
        self.pool.release(std::mem::take(&mut seq.block_table).into_iter().rev());
    }

    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        let seq = self.seqs.get_mut(&id).expect("running sequences are known");
        self.pool.release(std::mem::take(&mut seq.block_table).into_iter().rev());
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        seq.draft.clear();
        seq.preempted = true;
        self.waiting.push_front(id);
    }

    /// Records that the step ran: the scheduled tokens are in the cache now, and full
    /// blocks join the prefix cache. Proposals are not the sequence's tokens yet:
    /// `settle` counts those the model accepted once they are.
    pub fn complete(&mut self, step: &Step) {
        for s in &step.scheduled {
            let Some(seq) = self.seqs.get_mut(&s.id) else { continue };
            seq.num_computed = s.start + s.len - s.draft;
            self.cache_full_blocks(s.id);
        }
    }

    /// After a verification: the proposed tokens the sequence went on with (those now
    /// in `tokens` after its computed ones, in order, but not its last) have their keys
    /// and values in the cache already and count as computed; the rest are forgotten,
    /// and the blocks that held only them return to the pool. Returns how many counted.
    pub fn settle(&mut self, id: SeqId) -> usize {
        let Some(seq) = self.seqs.get_mut(&id) else { return 0 };
        let draft = std::mem::take(&mut seq.draft);
        let ahead = &seq.tokens[seq.num_computed..seq.tokens.len().saturating_sub(1).max(seq.num_computed)];
        let kept = ahead.iter().zip(&draft).take_while(|(t, d)| t == d).count();
        seq.num_computed += kept;
        let keep_blocks = seq.tokens.len().max(seq.num_computed).div_ceil(BLOCK_TOKENS);
        if seq.block_table.len() > keep_blocks {
            let spare: Vec<BlockId> = seq.block_table.drain(keep_blocks..).collect();
            self.pool.release(spare.into_iter().rev());
        }
        self.cache_full_blocks(id);
        kept
    }

    /// Registers the sequence's newly full computed blocks in the prefix cache.
    fn cache_full_blocks(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        update_hashes(&self.hasher, seq);
        let full = seq.num_computed / BLOCK_TOKENS;
        for b in seq.num_cached_blocks..full {
            self.pool.cache(seq.block_table[b], seq.block_hashes[b]);
            // The device holds it again: no tier keeps another copy.
            if let Some(tiers) = &mut self.tiers {
                tiers.forget(seq.block_hashes[b]);
            }
        }
        seq.num_cached_blocks = seq.num_cached_blocks.max(full);
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
        self.fair.leave(&seq.tenant, Instant::now());
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.pool.release(std::mem::take(&mut seq.block_table).into_iter().rev());
        Some(seq)
    }

    pub fn block_table(&self, id: SeqId) -> &[BlockId] {
        &self.seqs[&id].block_table
    }
}

/// The full blocks of a waiting sequence a cache may give it: all but the one holding
/// its last token, whose logits give the next; none for a prompt being scored, which is
/// computed whole every time it is admitted.
fn reusable_prefix(seq: &Sequence) -> &[BlockHash] {
    let usable = if seq.score_prompt && seq.num_output() == 0 { 0 } else { (seq.tokens.len() - 1) / BLOCK_TOKENS };
    &seq.block_hashes[..usable.min(seq.block_hashes.len())]
}

/// The blocks of `prefix` past those cached on the device that the second tier holds,
/// in a row.
fn tier_continuation(pool: &BlockPool, tiers: Option<&KvTiers>, prefix: &[BlockHash]) -> Vec<BlockHash> {
    let rest = &prefix[pool.cached_prefix_len(prefix)..];
    let Some(tiers) = tiers else { return Vec::new() };
    rest.iter().take_while(|&&h| tiers.find(h).is_some()).copied().collect()
}

/// Extends the sequence's block hashes over its full blocks, each block holding an
/// image's tokens keyed by that image's content too.
fn update_hashes(hasher: &BlockHasher, seq: &mut Sequence) {
    let spans = seq.images.as_ref().map_or(&[][..], |i| &i.spans[..]);
    hasher.extend(&mut seq.block_hashes, &seq.tokens, spans);
}

#[cfg(test)]
mod tests {
    use super::super::kv_tier::TierConfig;
    use super::*;

    fn sched(tokens: usize, seqs: usize, blocks: usize) -> Scheduler {
        let config = SchedulerConfig {
            max_num_batched_tokens: tokens,
            max_num_seqs: seqs,
            num_blocks: blocks,
            contended_batch: seqs,
        };
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
    fn paced_steps_cap_prompt_chunks_but_never_decodes() {
        let mut s = sched(512, 8, 100);
        for id in 1..=3 {
            s.add(Sequence::new(id, prompt(10, id as u32)));
        }
        let step = s.schedule();
        s.complete(&step);
        for x in &step.scheduled {
            s.append(x.id, 1);
        }
        assert!(s.decoding() > 0);
        // Two long prompts arrive: 24 prompt tokens between them, the three decodes too.
        s.add(Sequence::new(4, prompt(100, 4)));
        s.add(Sequence::new(5, prompt(100, 5)));
        let step = s.schedule_paced(24);
        let lens: Vec<(SeqId, usize)> = step.scheduled.iter().map(|x| (x.id, x.len)).collect();
        assert_eq!(lens, vec![(1, 1), (2, 1), (3, 1), (4, 24)]);
        s.complete(&step);
        for x in step.scheduled.iter().filter(|x| x.sample) {
            s.append(x.id, 1);
        }
        // Next step: the running prompt's next chunk first, then the waiting one's.
        let lens: Vec<(SeqId, usize)> = s.schedule_paced(30).scheduled.iter().map(|x| (x.id, x.len)).collect();
        assert_eq!(lens, vec![(1, 1), (2, 1), (3, 1), (4, 30)]);
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
                Scheduled { id: 1, start: 10, len: 1, sample: true, draft: 0 },
                Scheduled { id: 2, start: 0, len: 31, sample: false, draft: 0 },
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
        assert_eq!(step.scheduled, vec![Scheduled { id: 2, start: 16, len: 17, sample: true, draft: 0 }]);
    }

    /// A scheduler of `seqs` rows and `blocks` blocks whose tenants contend in steps of
    /// `batch` rows, with `grace`.
    fn contended(seqs: usize, blocks: usize, batch: usize, grace: Duration) -> Scheduler {
        let config = SchedulerConfig {
            max_num_batched_tokens: 1000,
            max_num_seqs: seqs,
            num_blocks: blocks,
            contended_batch: batch,
        };
        Scheduler::with_grace(config, BlockHasher::new("test"), grace)
    }

    fn of(tenant: &str, weight: u32, id: SeqId, len: usize) -> Sequence {
        Sequence { tenant: tenant.into(), weight, ..Sequence::new(id, prompt(len, id as u32)) }
    }

    fn rows_of(s: &Scheduler, step: &Step, tenant: &str) -> usize {
        step.scheduled.iter().filter(|x| &*s.get(x.id).unwrap().tenant == tenant).map(|x| x.len).sum()
    }

    #[test]
    fn a_flooder_keeps_to_its_share_while_another_tenant_has_work() {
        let mut s = contended(256, 1000, 8, Duration::from_secs(3600));
        for id in 0..24 {
            s.add(of("a", 1, id, 10));
        }
        // Alone, the flooder's prompts all run at once: nobody else wants the replica.
        let step = run(&mut s);
        assert_eq!(step.scheduled.len(), 24);
        assert_eq!(run(&mut s).scheduled.len(), 24, "24 decodes");
        // Another tenant's 30-token prompt runs whole in the next step, beside no more
        // than the flooder's share of the rest.
        s.add(of("b", 1, 100, 30));
        let step = run(&mut s);
        assert_eq!(rows_of(&s, &step, "b"), 30, "the prompt of the tenant furthest behind is not cut");
        assert!(rows_of(&s, &step, "a") <= 4, "{step:?}");
        // While b decodes, steps are 8 rows: b's 1 and 7 of the flooder's, rotating
        // among its 24 streams, so each advances every few steps.
        let mut ran: HashMap<SeqId, usize> = HashMap::new();
        for _ in 0..12 {
            let step = run(&mut s);
            assert_eq!((rows_of(&s, &step, "b"), rows_of(&s, &step, "a")), (1, 7), "{step:?}");
            for x in &step.scheduled {
                *ran.entry(x.id).or_default() += 1;
            }
        }
        assert!((0..24).all(|id| (3..=4).contains(&ran[&id])), "every stream advances in turn: {ran:?}");
        // b done: within the grace the flooder's steps stay short (b may be back at any
        // moment); past it, they are whole again.
        s.remove(100);
        assert_eq!(run(&mut s).scheduled.len(), 8);
        let mut s = {
            let mut t = contended(256, 1000, 8, Duration::ZERO);
            for id in 0..24 {
                t.add(of("a", 1, id, 10));
            }
            t.add(of("b", 1, 100, 30));
            run(&mut t);
            t.remove(100);
            t
        };
        assert_eq!(run(&mut s).scheduled.len(), 24, "no grace: the flooder has the replica again");
    }

    #[test]
    fn weights_divide_the_rows_and_virtual_time_evens_out_the_rest() {
        let mut s = contended(256, 1000, 8, Duration::from_secs(3600));
        for id in 0..16 {
            s.add(of("heavy", 3, id, 4));
            s.add(of("light", 1, 100 + id, 4));
        }
        let (mut heavy, mut light) = (0, 0);
        for _ in 0..400 {
            let step = run(&mut s);
            heavy += rows_of(&s, &step, "heavy");
            light += rows_of(&s, &step, "light");
            assert!(step.scheduled.len() <= 8 + 4, "{step:?}");
        }
        let ratio = heavy as f64 / light as f64;
        assert!((2.7..=3.3).contains(&ratio), "{heavy} rows against {light}");
    }

    #[test]
    fn priority_orders_a_tenants_own_queue_and_never_another_tenants() {
        // Room for 2 running sequences.
        let mut s = contended(2, 1000, 2, Duration::from_secs(3600));
        s.add(of("a", 1, 1, 4));
        s.add(Sequence { priority: 5, ..of("a", 1, 2, 4) });
        s.add(Sequence { priority: -5, ..of("a", 1, 3, 4) });
        s.add(Sequence { priority: -100, ..of("b", 1, 4, 4) });
        let step = run(&mut s);
        let ids: Vec<SeqId> = step.scheduled.iter().map(|x| x.id).collect();
        // One of each tenant: a's most urgent (-5, not the -100 of b's that asked for
        // it), and b's.
        assert_eq!(ids.len(), 2);
        assert!(ids.contains(&3) && ids.contains(&4), "{ids:?}");
        s.remove(3);
        let step = run(&mut s);
        assert!(step.scheduled.iter().any(|x| x.id == 1), "then a's priority 0 before its 5: {step:?}");
    }

    #[test]
    fn blocks_are_taken_from_the_tenant_running_the_most_for_its_weight() {
        // 8 blocks: a's three 31-token prompts and b's one take 2 each, and fill them
        // with a sampled token each; the next tokens need more, and they come from a,
        // the tenant with 3 rows to b's 1, though b was admitted last. (Steps as large
        // as the batch: this is about blocks.)
        let mut s = contended(8, 8, 200, Duration::from_secs(3600));
        for id in 1..=3 {
            s.add(of("a", 1, id, 31));
        }
        s.add(of("b", 1, 4, 31));
        run(&mut s);
        run(&mut s);
        assert_eq!(s.pool().num_free(), 0);
        let step = run(&mut s);
        assert!(!step.preempted.is_empty());
        assert!(step.preempted.iter().all(|&id| &*s.get(id).unwrap().tenant == "a"), "{step:?}");
        assert!(step.scheduled.iter().any(|x| x.id == 4), "b runs on: {step:?}");
        // With a weighing 4, its 3 rows are less for its weight than b's 1: b's goes.
        let mut s = contended(8, 8, 200, Duration::from_secs(3600));
        for id in 1..=3 {
            s.add(of("a", 4, id, 31));
        }
        s.add(of("b", 1, 4, 31));
        run(&mut s);
        run(&mut s);
        let step = run(&mut s);
        assert_eq!(step.preempted.first(), Some(&4), "b's first (a's own then make room for a): {step:?}");
    }

    #[test]
    fn a_full_batch_makes_room_for_a_tenant_running_less_than_its_share() {
        // Room for 4 sequences, all the flooder's.
        let mut s = contended(4, 1000, 8, Duration::from_secs(3600));
        for id in 1..=4 {
            s.add(of("a", 1, id, 8));
        }
        run(&mut s);
        s.add(Sequence { priority: 1, ..of("a", 1, 5, 8) });
        s.add(of("b", 1, 6, 8));
        // The flooder's newest goes back to the queue (not the first, which must go on)…
        let step = run(&mut s);
        assert_eq!((step.preempted.clone(), step.fair_preemptions), (vec![4], 1), "{step:?}");
        // …and b takes its seat, ahead of the flooder's own waiting ones.
        let step = run(&mut s);
        assert!(step.scheduled.iter().any(|x| x.id == 6), "{step:?}");
        // Now 3 against 1: the flooder's waiting sequences do not take b's seat back,
        // and nobody else is preempted.
        for _ in 0..5 {
            let step = run(&mut s);
            assert!(step.preempted.is_empty() && step.scheduled.iter().any(|x| x.id == 6), "{step:?}");
        }
        // Weights count: a flooder of weight 3 with 3 seats of 4 is within its share.
        let mut s = contended(4, 1000, 8, Duration::from_secs(3600));
        for id in 1..=4 {
            s.add(of("a", 3, id, 8));
        }
        run(&mut s);
        s.add(of("b", 1, 6, 8));
        assert_eq!(run(&mut s).fair_preemptions, 1, "4 seats for weight 3 against 0 for 1");
        run(&mut s);
        s.add(of("b", 1, 7, 8));
        for _ in 0..3 {
            assert_eq!(run(&mut s).fair_preemptions, 0, "3 for weight 3 against 1 for 1: even");
        }
    }

    #[test]
    fn no_seat_is_taken_for_a_prompt_whose_blocks_are_still_on_disk() {
        let disk = tempfile::tempdir().unwrap();
        let config = TierConfig { host_bytes: 0, disk: Some((disk.path().into(), 1 << 20)), identity: "t".into() };
        let mut s = contended(4, 1000, 8, Duration::from_secs(3600)).with_tiers(KvTiers::open(&config).unwrap());
        for id in 1..=4 {
            s.add(of("a", 1, id, 8));
        }
        run(&mut s);
        // b's prompt continues into two blocks on disk.
        let mut b = of("b", 1, 6, 40);
        update_hashes(&s.hasher, &mut b);
        for &hash in &b.block_hashes[..2] {
            s.tiers_mut().unwrap().put(hash, Arc::new(vec![6; 8]));
        }
        s.tiers_mut().unwrap().flush();
        s.add(b);
        // Its reads are asked for; nobody is preempted while they are under way...
        let step = run(&mut s);
        assert_eq!((step.preempted.len(), step.fair_preemptions), (0, 0), "{step:?}");
        while s.tiers_mut().unwrap().wait_for_read() {}
        // ...then the flooder's newest makes room, and b starts after its two blocks.
        assert_eq!(run(&mut s).preempted, [4]);
        let step = run(&mut s);
        let b = step.scheduled.iter().find(|x| x.id == 6).map(|x| x.start);
        assert_eq!((b, step.onload.len()), (Some(32), 2), "{step:?}");
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
    fn a_lone_sequence_that_cannot_grow_ends_instead_of_preempting_itself() {
        // 2 blocks hold 32 tokens; this one (admitted without `fits`, which refuses it)
        // reaches a 33rd. It used to be preempted and readmitted for ever.
        let mut s = sched(1000, 8, 2);
        assert!(!s.fits(33));
        s.add(Sequence::new(1, prompt(31, 0)));
        run(&mut s);
        run(&mut s);
        let step = run(&mut s);
        assert_eq!((step.exhausted, step.preempted, step.scheduled), (vec![1], vec![], vec![]));
        assert_eq!(s.num_running() + s.num_waiting(), 0);
        assert_eq!(s.pool().num_free(), 2, "its blocks are free at once");
        assert!(s.remove(1).is_some(), "it stays known until the engine ends it");
        // Nor does one that no empty cache can take wait at the head of the queue.
        s.add(Sequence::new(2, prompt(40, 1)));
        s.add(Sequence::new(3, prompt(5, 2)));
        let step = run(&mut s);
        assert_eq!(step.exhausted, vec![2]);
        assert_eq!(step.scheduled.iter().map(|x| x.id).collect::<Vec<_>>(), vec![3]);
    }

    /// xorshift64: the property walk's numbers, the same on every run.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// Every block's references are exactly the block tables that hold it, and waiting
    /// sequences hold none.
    fn check_blocks(s: &Scheduler, seed: u64) {
        let mut refs = vec![0u32; s.pool.num_blocks()];
        for seq in s.seqs.values() {
            for &b in &seq.block_table {
                refs[b as usize] += 1;
            }
        }
        for (b, &r) in refs.iter().enumerate() {
            assert_eq!(s.pool.refs(b as BlockId), r, "seed {seed}: block {b}");
        }
        assert_eq!(s.pool.num_used(), refs.iter().filter(|&&r| r > 0).count(), "seed {seed}");
        for id in &s.waiting {
            assert!(s.seqs[id].block_table.is_empty(), "seed {seed}: waiting sequence {id} holds blocks");
        }
    }

    #[test]
    fn every_sequence_finishes_or_is_refused_and_no_block_leaks() {
        // Random caches, budgets and arrivals: prompts up to past the cache, shared
        // prefixes, `n` siblings. Every step with work advances a sequence; every
        // sequence that `fits` gets all its tokens; the pool ends whole.
        // Half the seeds with three tenants of random weights and priorities, contending
        // throughout (a long grace), in steps of a random few rows.
        // A third with a second KV tier (host memory of a few blocks; every sixth a disk
        // tier below it): the device's contents are modelled block by block (the hash of
        // what each holds), so that every block a step reads must hold the keys of the
        // tokens it stands for — computed, cached or copied back — and no block moves
        // down holding another's.
        let mut preemptions = 0;
        let mut refused = 0;
        let mut drafted = 0;
        let mut loaded = [0usize; 2];
        let disks = tempfile::tempdir().unwrap();
        for seed in 1..=300u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let num_blocks = rng.below(24) + 1;
            let budget = [1, 5, 16, 40, 1000][rng.below(5)];
            let tenants = if seed % 2 == 0 { 3 } else { 1 };
            let mut s = sched(budget, rng.below(6) + 1, num_blocks);
            if tenants > 1 {
                let config = SchedulerConfig { contended_batch: [1, 3, 16][rng.below(3)], ..s.config };
                s = Scheduler::with_grace(config, BlockHasher::new("test"), Duration::from_secs(3600));
            }
            let host_bytes = 8 * rng.below(8) as u64;
            if seed % 3 == 0 {
                let disk = (seed % 6 == 0).then(|| (disks.path().join(seed.to_string()), 8 * rng.below(12) as u64 + 8));
                let tiers = KvTiers::open(&TierConfig { host_bytes, disk, identity: "test".into() }).unwrap();
                s = s.with_tiers(tiers);
            }
            let mut device: Vec<Option<u64>> = vec![None; num_blocks];
            let weights: Vec<u32> = (0..tenants).map(|_| rng.below(3) as u32 + 1).collect();
            let stems: Vec<Vec<u32>> = (0..3).map(|k| prompt(num_blocks * BLOCK_TOKENS + 40, 1000 * k)).collect();
            let mut arrivals: Vec<(usize, Vec<u32>, usize, usize, usize, i32)> = (0..30)
                .map(|_| {
                    let at = rng.below(200);
                    let len = rng.below(num_blocks * BLOCK_TOKENS + 20) + 1;
                    let shared = rng.below(len + 1);
                    let mut p = stems[rng.below(3)][..shared].to_vec();
                    p.extend((shared..len).map(|_| rng.below(50_000) as u32));
                    (at, p, rng.below(40) + 1, rng.below(3) + 1, rng.below(tenants), rng.below(3) as i32 - 1)
                })
                .collect();
            arrivals.sort_by_key(|a| std::cmp::Reverse(a.0));
            // Sequence id → tokens it must reach; and each finished sequence's length.
            let mut want: HashMap<SeqId, usize> = HashMap::new();
            let mut got: HashMap<SeqId, usize> = HashMap::new();
            let mut next_id = 0;
            let mut steps = 0;
            // Blocks copied back this walk, from host and disk: the tiers' hits.
            let mut hits = [0u64; 2];
            while s.has_work() || !arrivals.is_empty() {
                while arrivals.last().is_some_and(|a| a.0 <= steps) {
                    let (_, p, max_tokens, n, tenant, priority) = arrivals.pop().unwrap();
                    if !s.fits(p.len() + max_tokens) {
                        refused += 1;
                        continue;
                    }
                    let first = next_id;
                    for i in 0..n {
                        let after = (i > 0).then_some(first);
                        let (tenant, weight) = (Arc::from(format!("t{tenant}")), weights[tenant]);
                        s.add(Sequence { after, tenant, weight, priority, ..Sequence::new(next_id, p.clone()) });
                        want.insert(next_id, p.len() + max_tokens);
                        next_id += 1;
                    }
                }
                steps += 1;
                assert!(steps < 100_000, "seed {seed}: no end in sight");
                // Every output token is 1; half the decodes propose a run of 1s and 2s
                // (a 2 is rejected, and 1 sampled in its place).
                let decoding: Vec<SeqId> = s.decoding_sequences().map(|q| q.id).collect();
                for id in decoding {
                    let draft = (0..rng.below(6)).map(|_| 1 + rng.below(2) as u32).collect();
                    s.propose(id, if rng.below(2) == 0 { draft } else { Vec::new() });
                }
                let had_work = s.has_work();
                let step = s.schedule();
                assert!(step.exhausted.is_empty(), "seed {seed}: {:?} could not grow", step.exhausted);
                assert_eq!(had_work, !step.scheduled.is_empty(), "seed {seed}: step {steps} advanced nothing");
                preemptions += step.preempted.len();
                drafted += step.scheduled.iter().map(|x| x.draft).sum::<usize>();
                // The engine's copies: evicted blocks down, then found ones up.
                for &(id, hash) in &step.offload {
                    assert_eq!(device[id as usize], Some(hash), "seed {seed}: block {id} moved down holding another's");
                    s.offloaded(hash, Arc::new(hash.to_le_bytes().to_vec()));
                }
                for (id, data, tier) in &step.onload {
                    device[*id as usize] = Some(u64::from_le_bytes(data[..].try_into().unwrap()));
                    loaded[(*tier == Tier::Disk) as usize] += 1;
                    hits[(*tier == Tier::Disk) as usize] += 1;
                }
                // The forward reads every full block before each chunk.
                for x in &step.scheduled {
                    let q = s.get(x.id).unwrap();
                    for b in 0..x.start / BLOCK_TOKENS {
                        let held = device[q.block_table[b] as usize];
                        assert_eq!(held, Some(q.block_hashes[b]), "seed {seed}: sequence {} read a stale block", x.id);
                    }
                }
                let drafts: HashMap<SeqId, Vec<u32>> =
                    step.scheduled.iter().map(|x| (x.id, s.get(x.id).unwrap().draft.clone())).collect();
                s.complete(&step);
                // ...and writes the keys of the tokens it ran.
                let wrote = |s: &Scheduler, id: SeqId, device: &mut Vec<Option<u64>>| {
                    let q = s.get(id).unwrap();
                    for b in 0..q.num_computed / BLOCK_TOKENS {
                        device[q.block_table[b] as usize] = Some(q.block_hashes[b]);
                    }
                };
                for x in &step.scheduled {
                    wrote(&s, x.id, &mut device);
                }
                for x in step.scheduled.iter().filter(|x| x.sample) {
                    let accepted = drafts[&x.id].iter().take_while(|&&d| d == 1).count();
                    let mut finished = false;
                    for _ in 0..=accepted {
                        s.append(x.id, 1);
                        let len = s.get(x.id).unwrap().tokens.len();
                        if len == want[&x.id] {
                            s.remove(x.id);
                            got.insert(x.id, len);
                            finished = true;
                            break;
                        }
                    }
                    if !finished {
                        let kept = s.settle(x.id);
                        wrote(&s, x.id, &mut device);
                        assert_eq!(kept, accepted, "seed {seed}: every accepted proposal counts as computed");
                        let q = s.get(x.id).unwrap();
                        assert_eq!(q.num_pending(), 1, "seed {seed}");
                        // Blocks for the computed tokens, and none past the pending one's.
                        let blocks = q.block_table.len();
                        assert!(blocks >= q.num_computed.div_ceil(BLOCK_TOKENS), "seed {seed}");
                        assert!(blocks <= q.tokens.len().div_ceil(BLOCK_TOKENS), "seed {seed}");
                    }
                }
                check_blocks(&s, seed);
                if let Some(tiers) = s.tiers() {
                    for (hash, tier) in tiers.held() {
                        assert!(!s.pool.holds(hash), "seed {seed}: {hash:x} on the device and in {tier:?}");
                    }
                    assert!(tiers.occupancy().0 <= host_bytes, "seed {seed}: host tier over its size");
                }
            }
            assert_eq!(got, want, "seed {seed}: every admitted sequence ran to its end");
            if let Some(stats) = s.tiers().map(KvTiers::stats) {
                // A block found but given back before its step (its room went to another)
                // is no hit.
                assert_eq!([stats.host_hits, stats.disk_hits], hits, "seed {seed}: hits as copied");
            }
            assert_eq!(s.pool().num_free(), num_blocks, "seed {seed}: every block returned");
        }
        // The walk reached the cases it is about.
        assert!(preemptions > 100, "{preemptions} preemptions");
        assert!(refused > 100, "{refused} refused");
        assert!(drafted > 1000, "{drafted} proposed tokens verified");
        assert!(loaded[0] > 100 && loaded[1] > 20, "blocks copied back from host and disk: {loaded:?}");
    }

    #[test]
    fn proposals_run_with_their_decode_and_only_accepted_ones_are_kept_or_cached() {
        let mut s = sched(1000, 8, 100);
        // A 14-token prompt, then its first token: 15 tokens, the 15th pending.
        s.add(Sequence::new(1, prompt(14, 0)));
        run(&mut s);
        s.propose(1, vec![5, 6, 7, 8, 9]);
        let step = s.schedule();
        assert_eq!(step.scheduled, vec![Scheduled { id: 1, start: 14, len: 6, sample: true, draft: 5 }]);
        assert_eq!(s.block_table(1).len(), 2, "room for the proposals' keys and values");
        s.complete(&step);
        assert_eq!(s.get(1).unwrap().num_computed, 15, "proposals are not the sequence's yet");
        // The model agrees with 5 and 6, then picks 4.
        for t in [5, 6, 4] {
            s.append(1, t);
        }
        assert_eq!(s.settle(1), 2);
        let seq = s.get(1).unwrap();
        assert_eq!((seq.num_computed, seq.tokens.len()), (17, 18));
        assert!(seq.draft.is_empty());
        // Block 0 (16 tokens: prompt, first token, 5) is cached; block 1 holds 6 and the
        // pending 4 only, and is not.
        assert_eq!(s.pool().cached_hashes().len(), 1);
        assert_eq!(seq.block_hashes.len(), 1);
        // Nothing accepted, and blocks that held only proposals go back.
        s.propose(1, (100..116).collect());
        let step = s.schedule();
        assert_eq!((step.scheduled[0].len, step.scheduled[0].draft), (17, 16));
        assert_eq!(s.block_table(1).len(), 3);
        s.complete(&step);
        s.append(1, 3);
        assert_eq!(s.settle(1), 0);
        assert_eq!(s.block_table(1).len(), 2);
        assert_eq!(s.pool().num_free(), 98);
        assert_eq!(s.pool().cached_hashes().len(), 1);
        // A budget short of the whole proposal takes what fits.
        let mut s = sched(4, 8, 100);
        s.add(Sequence::new(1, prompt(3, 0)));
        run(&mut s);
        s.propose(1, vec![1, 2, 3, 4, 5]);
        let step = s.schedule();
        assert_eq!((step.scheduled[0].len, step.scheduled[0].draft), (4, 3));
        assert_eq!(s.get(1).unwrap().draft, vec![1, 2, 3]);
        // Nor do they take a decode's budget: with 2 tokens a step, two decodes run and
        // the proposal waits.
        let mut s = sched(2, 8, 100);
        s.add(Sequence::new(1, prompt(1, 0)));
        s.add(Sequence::new(2, prompt(1, 1)));
        run(&mut s);
        s.propose(1, vec![1, 2]);
        let step = s.schedule();
        assert_eq!(
            step.scheduled.iter().map(|x| (x.id, x.len, x.draft)).collect::<Vec<_>>(),
            vec![(1, 1, 0), (2, 1, 0)]
        );
        assert!(s.get(1).unwrap().draft.is_empty(), "a proposal that did not run is dropped");
        // Proposals never preempt: without free blocks for them, the decode runs alone.
        let mut s = sched(1000, 8, 2);
        s.add(Sequence::new(1, prompt(14, 0)));
        s.add(Sequence::new(2, prompt(14, 1)));
        run(&mut s);
        s.propose(1, vec![1, 2, 3, 4]);
        let step = s.schedule();
        assert!(step.preempted.is_empty());
        assert_eq!((step.scheduled[0].len, step.scheduled[0].draft), (1, 0));
        // A prompt still being computed takes no proposal.
        let mut s = sched(1000, 8, 100);
        s.add(Sequence::new(1, prompt(3, 0)));
        s.propose(1, vec![1]);
        assert!(s.get(1).unwrap().draft.is_empty());
    }

    #[test]
    fn a_block_evicted_before_its_copy_in_goes_back_to_the_tier_untouched() {
        let tiers = KvTiers::open(&TierConfig { host_bytes: 1 << 10, disk: None, identity: "t".into() }).unwrap();
        let mut s = sched(64, 4, 2).with_tiers(tiers);
        let saved = Arc::new(vec![7u8; 8]);
        s.tiers.as_mut().unwrap().put(42, saved.clone());
        // Admitted from the tier into a fresh block (its copy-in pending), then released
        // (its sequence preempted) and evicted again in the same step.
        let block = s.allocate(1).unwrap();
        assert_eq!(s.take_from_tiers(&[42], &block), 1);
        assert_eq!(s.place(42), Place::Device);
        s.pool.release(block);
        let both = s.allocate(2).unwrap();
        let step = s.schedule();
        assert!(step.onload.is_empty() && step.offload.is_empty(), "{:?}", step.offload);
        assert_eq!(s.place(42), Place::Host);
        // Evicted once (the first put), never a hit: no step copied it in.
        let stats = s.tiers().unwrap().stats();
        assert_eq!((stats.offloaded_blocks, stats.host_hits, stats.onloaded_bytes), (1, 0, 0), "{stats:?}");
        assert_eq!(s.tiers.as_mut().unwrap().take(42), Some((saved.clone(), Tier::Host)), "the saved bytes");
        // A copy-in that fails leaves nothing served from the block it was for.
        s.pool.release(both);
        s.tiers.as_mut().unwrap().put(42, saved);
        let block = s.allocate(1).unwrap();
        s.take_from_tiers(&[42], &block);
        let step = s.schedule();
        assert_eq!(step.onload.len(), 1);
        assert_eq!(s.tiers().unwrap().stats().host_hits, 1, "a step copies it in");
        s.onload_failed(&step);
        assert_eq!(s.place(42), Place::Gone);
        assert!(s.pool.take_cached_prefix(&[42]).is_empty());
    }

    #[test]
    fn a_prompt_waits_for_its_blocks_from_disk_while_the_running_decode() {
        let disk = tempfile::tempdir().unwrap();
        let config = TierConfig { host_bytes: 0, disk: Some((disk.path().into(), 1 << 20)), identity: "t".into() };
        let mut s = sched(1000, 8, 100).with_tiers(KvTiers::open(&config).unwrap());
        // A 50-token prompt whose first three blocks are on disk, each holding its hash.
        let mut waiting = Sequence::new(2, prompt(50, 3));
        update_hashes(&s.hasher, &mut waiting);
        let on_disk = waiting.block_hashes[..3].to_vec();
        for &hash in &on_disk {
            s.tiers_mut().unwrap().put(hash, Arc::new(hash.to_le_bytes().to_vec()));
        }
        s.tiers_mut().unwrap().flush();
        s.add(Sequence::new(1, prompt(5, 0)));
        run(&mut s);
        assert_eq!(s.decoding(), 1, "sequence 1 decodes");

        // Its blocks are asked for; the decode runs without waiting for them.
        s.add(waiting);
        let step = run(&mut s);
        let ran: Vec<_> = step.scheduled.iter().map(|x| (x.id, x.len)).collect();
        assert_eq!(ran, [(1, 1)]);
        assert!(step.onload.is_empty());
        while s.tiers_mut().unwrap().wait_for_read() {}
        // Read, their files are not needed: the step copies them from memory.
        for folder in std::fs::read_dir(disk.path()).unwrap().flatten() {
            for file in std::fs::read_dir(folder.path()).unwrap().flatten() {
                std::fs::remove_file(file.path()).unwrap();
            }
        }
        let step = run(&mut s);
        let ran: Vec<_> = step.scheduled.iter().map(|x| (x.id, x.start, x.len)).collect();
        assert_eq!(ran, [(1, 6, 1), (2, 48, 2)], "the prompt from its fourth block");
        assert!(step.onload.iter().all(|(_, _, tier)| *tier == Tier::Disk));
        let mut onload: Vec<_> = step.onload.iter().map(|(_, data, _)| data.to_vec()).collect();
        onload.sort();
        let mut want: Vec<_> = on_disk.iter().map(|h| h.to_le_bytes().to_vec()).collect();
        want.sort();
        assert_eq!(onload, want);
        assert_eq!(s.tiers().unwrap().stats().disk_errors, 0);

        // Alone, a prompt's step waits for its reads rather than being empty.
        let mut alone = Sequence::new(3, prompt(40, 9));
        update_hashes(&s.hasher, &mut alone);
        let hash = alone.block_hashes[0];
        s.remove(1);
        s.remove(2);
        s.tiers_mut().unwrap().put(hash, Arc::new(vec![1; 8]));
        s.tiers_mut().unwrap().flush();
        s.add(alone);
        let step = s.schedule();
        assert_eq!(step.scheduled.iter().map(|x| (x.id, x.start)).collect::<Vec<_>>(), [(3, 16)]);
        assert_eq!(step.onload.len(), 1);
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
