//! Speculative decoding: a proposer guesses the tokens that follow a decoding sequence,
//! the engine runs the guesses through the target model as one chunk of its ordinary
//! batch (logits at every position) and keeps the longest run the model agrees with,
//! plus the model's own next token. Each step then yields one to `k + 1` tokens of a
//! sequence for about the price of one when the guesses are good.
//!
//! The engine verifies by sampling each position exactly as a step without speculation
//! would — the same rule, penalties, grammar mask and random draw — and accepting a
//! proposal while it equals the token sampled. For proposers that guess one token per
//! position (not a distribution), this is rejection sampling (Leviathan et al., Chen et
//! al.) with a point-mass draft: a proposal `d` is accepted with probability `p(d)`, and
//! on rejection the token comes from `p` without `d`, renormalised. So the output is
//! the target's, exactly, and more: a seeded request gives the same tokens with and
//! without speculation.
//!
//! How many tokens to verify is decided per step from what the engine has measured:
//! a proposal's `j`-th token is worth `α^j` expected tokens (`α`: the sequence's recent
//! per-token acceptance), and costs one more row of the forward. Tokens are added,
//! best first, while they raise the step's expected tokens per second — so large
//! batches (whose steps are already compute-bound) and poor guessers verify nothing.
//! A draft model's guesses cost a forward of the draft per position as well, which the
//! same rule weighs (`Proposer::step_seconds`), and, for a sequence it has not seen (or
//! has fallen behind on), a catch-up on its tokens first: paid once, so weighed spread
//! over the steps the sequence is expected to have left (`Proposer::catch_up_seconds`,
//! over a typical output's length), and not paid at all where drafting would not
//! make up for it.

pub mod draft;
pub mod ngram;
pub mod rejection;
pub mod suffix;

use super::sequence::SeqId;
use std::collections::HashMap;

pub use tessera_proto::speculative::{DEFAULT_SPEC_TOKENS, MAX_SPEC_TOKENS, SpecConfig, SpecMethod};

/// One sequence a proposer is asked about.
#[derive(Debug, Clone, Copy)]
pub struct Proposal<'a> {
    pub id: SeqId,
    /// Who the sequence's request is for (`Request::tenant`).
    pub tenant: &'a str,
    /// Prompt and output so far.
    pub tokens: &'a [u32],
    /// Most tokens wanted.
    pub max: usize,
}

/// What guesses tokens. Asked for a batch at once, so that a draft model can run
/// its sequences together.
pub trait Proposer: Send {
    /// Up to `max` tokens to follow each sequence, in order (fewer or none where it has
    /// no guess).
    fn propose(&mut self, seqs: &[Proposal<'_>]) -> Vec<Vec<u32>>;

    /// A sequence has ended with these tokens (prompt and output); whatever the
    /// proposer kept for it can go, and what it learns from it stays with `tenant`.
    fn finished(&mut self, _id: SeqId, _tenant: &str, _tokens: &[u32]) {}

    /// Seconds one more proposed position costs the proposer for the whole batch (a
    /// draft model's forward); lookups cost nothing worth weighing.
    fn step_seconds(&self) -> f64 {
        0.0
    }

    /// Seconds it would take to bring the proposer up to date on `p` before it can
    /// guess (a draft model's catch-up on tokens it has not seen); paid once.
    fn catch_up_seconds(&self, _p: &Proposal<'_>) -> f64 {
        0.0
    }

    /// A sequence's α before any of its guesses is verified. Lookups, whose guesses
    /// cost nothing, start at the prior: a deeper first verification of a sequence
    /// whose guesses are unknown costs rows, and measured, lost them their gain on
    /// fresh code and chat.
    fn new_acceptance(&self) -> f64 {
        PRIOR_ACCEPTANCE
    }

    /// KV blocks it holds (a draft model's cache).
    fn held_blocks(&self) -> usize {
        0
    }
}

/// The proposer of a method that needs nothing but its configuration (None for a
/// draft model, which the engine is given: `Speculator::with_proposer`).
fn proposer(config: &SpecConfig) -> Option<Box<dyn Proposer>> {
    match config.method {
        SpecMethod::Ngram => Some(Box::new(ngram::NgramProposer)),
        SpecMethod::Suffix => Some(Box::new(suffix::SuffixProposer::default())),
        SpecMethod::Draft => None,
    }
}

/// What the engine has measured of its steps, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCosts {
    /// A step of the batch's decodes alone (`[0]`), and with each number of rows more
    /// (proposed tokens).
    pub secs: Vec<f64>,
    /// What each row past those adds.
    pub per_row: f64,
}

impl StepCosts {
    /// A step of `decode_step` seconds, each row more adding `per_row`.
    pub fn linear(decode_step: f64, per_row: f64) -> Self {
        Self { secs: vec![decode_step], per_row }
    }

    /// Rows that cost nothing: every proposal is verified (for tests that want
    /// speculation every step, whatever the machine's speed).
    pub fn free() -> Self {
        Self::linear(1.0, 0.0)
    }

    /// A step with `extra` rows beside the decodes.
    pub fn secs(&self, extra: usize) -> f64 {
        let last = self.secs.len() - 1;
        match self.secs.get(extra) {
            Some(&s) => s,
            None => self.secs[last] + (extra - last) as f64 * self.per_row,
        }
    }

    fn is_free(&self) -> bool {
        self.per_row <= 0.0 && self.secs.iter().all(|&s| s <= self.secs[0])
    }
}

/// Counts since start, under vLLM's metric names (`metrics`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Sequences verified with at least one proposed token.
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// Accepted tokens by their position in the proposal.
    pub accepted_per_position: Vec<u64>,
}

/// A proposal's `j`-th token is accepted with probability `α^j`: a sequence's α before
/// any of its proposals is verified (unless its proposer says otherwise:
/// `Proposer::new_acceptance`), and what a sequence that verifies nothing drifts back
/// toward.
pub const PRIOR_ACCEPTANCE: f64 = 0.5;
/// Weight of one verified position in a sequence's running acceptance.
const LEARN: f64 = 0.2;
/// Output tokens a sequence is expected to make, before any has ended.
const PRIOR_OUTPUT_TOKENS: f64 = 128.0;
/// Weight of an ended sequence's output length in the running one.
const LEARN_OUTPUT: f64 = 0.1;
/// A sequence that verifies nothing drifts back toward the prior at this rate per step,
/// so one that guessed badly once is tried again later.
const FORGET: f64 = 0.02;

/// The engine's speculation: the proposer, each sequence's recent acceptance, counts.
pub struct Speculator {
    config: SpecConfig,
    proposer: Box<dyn Proposer>,
    acceptance: HashMap<SeqId, f64>,
    /// Running output length of ended sequences: how many steps a catch-up is spread over.
    output_tokens: f64,
    stats: SpecStats,
}

impl Speculator {
    /// Speculation by `config`'s method; None for a draft model (`with_proposer`).
    pub fn new(config: SpecConfig) -> Option<Self> {
        let proposer = proposer(&config)?;
        Some(Self::with_proposer(config, proposer))
    }

    /// Speculation with proposals from `proposer`.
    pub fn with_proposer(config: SpecConfig, proposer: Box<dyn Proposer>) -> Self {
        Self {
            proposer,
            stats: SpecStats { accepted_per_position: vec![0; config.max_tokens], ..SpecStats::default() },
            config,
            acceptance: HashMap::new(),
            output_tokens: PRIOR_OUTPUT_TOKENS,
        }
    }

    pub fn config(&self) -> &SpecConfig {
        &self.config
    }

    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// The proposals worth verifying this step for `seqs` (the batch's decoding
    /// sequences, all of them: their count sets the step's cost), by sequence.
    pub fn propose(&mut self, seqs: &[Proposal<'_>], costs: &StepCosts) -> Vec<(SeqId, Vec<u32>)> {
        let new = self.proposer.new_acceptance();
        let alphas: Vec<f64> = seqs.iter().map(|p| *self.acceptance.entry(p.id).or_insert(new)).collect();
        let limits: Vec<usize> = seqs.iter().map(|p| p.max.min(self.config.max_tokens)).collect();
        // The proposer is asked only about sequences that could get a token verified
        // at all: at large batches, none (and nothing is looked up).
        let draft_step = self.proposer.step_seconds();
        let entry: Vec<f64> = seqs
            .iter()
            .zip(&alphas)
            .map(|(p, &a)| match self.proposer.catch_up_seconds(p) {
                0.0 => 0.0,
                // Spread over the steps it has left: a typical output, at 1 + α tokens each.
                secs => secs * (1.0 + a) / (p.max as f64).min(self.output_tokens).max(1.0),
            })
            .collect();
        let could = choose(&alphas, &limits, seqs.len(), costs, draft_step, &entry);
        let asks: Vec<Proposal<'_>> =
            seqs.iter().zip(&could).filter(|(_, k)| **k > 0).map(|(p, &k)| Proposal { max: k, ..*p }).collect();
        let mut answers = self.proposer.propose(&asks).into_iter();
        let mut proposed: Vec<Vec<u32>> =
            could.iter().map(|&k| if k > 0 { answers.next().unwrap_or_default() } else { Vec::new() }).collect();
        let lens: Vec<usize> = proposed.iter().zip(&limits).map(|(p, &l)| p.len().min(l)).collect();
        // Catching up is paid by now.
        let keep = choose(&alphas, &lens, seqs.len(), costs, draft_step, &vec![0.0; seqs.len()]);
        for (p, &k) in seqs.iter().zip(&keep) {
            if k == 0 {
                let a = self.acceptance.get_mut(&p.id).expect("inserted above");
                *a += FORGET * (PRIOR_ACCEPTANCE - *a);
            }
        }
        seqs.iter()
            .zip(proposed.iter_mut())
            .zip(keep)
            .filter(|(_, k)| *k > 0)
            .map(|((ask, p), k)| {
                p.truncate(k);
                (ask.id, std::mem::take(p))
            })
            .collect()
    }

    /// A verification's result: `accepted` of `proposed` tokens were kept.
    pub fn verified(&mut self, id: SeqId, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.stats.drafts += 1;
        self.stats.draft_tokens += proposed as u64;
        self.stats.accepted_tokens += accepted as u64;
        for n in &mut self.stats.accepted_per_position[..accepted] {
            *n += 1;
        }
        let a = self.acceptance.entry(id).or_insert(self.proposer.new_acceptance());
        for _ in 0..accepted {
            *a += LEARN * (1.0 - *a);
        }
        if accepted < proposed {
            *a += LEARN * (0.0 - *a);
        }
    }

    /// KV blocks the proposer holds.
    pub fn held_blocks(&self) -> usize {
        self.proposer.held_blocks()
    }

    /// A sequence has ended with `tokens`, `output` of them its own, for `tenant`.
    pub fn finished(&mut self, id: SeqId, tenant: &str, tokens: &[u32], output: usize) {
        self.output_tokens += LEARN_OUTPUT * (output as f64 - self.output_tokens);
        self.acceptance.remove(&id);
        self.proposer.finished(id, tenant, tokens);
    }
}

/// How many of each sequence's proposed tokens (`lens`) to verify. The step yields one
/// token per decoding sequence (`decodes`) whatever is verified; a proposed token
/// promises `α^j` more and makes the step a row longer (`costs`); a position deeper
/// than any verified costs a drafting step (`draft_step`: a draft model's forward,
/// shared by every sequence drafted that deep), and a sequence's first row its share of
/// catching the proposer up (`entry`, per step). Rows are taken the one promising most
/// first, and the number of rows is the one whose step yields the most tokens per
/// second — every count is weighed, not only while each row pays for itself, because
/// a row's price is uneven (a row past a multiple of four costs a CPU kernel pass,
/// the three after it little).
fn choose(
    alphas: &[f64],
    lens: &[usize],
    decodes: usize,
    costs: &StepCosts,
    draft_step: f64,
    entry: &[f64],
) -> Vec<usize> {
    if costs.is_free() && draft_step <= 0.0 && entry.iter().all(|&e| e <= 0.0) {
        return lens.to_vec();
    }
    let gain = |i: usize, k: usize| alphas[i].powi(k as i32 + 1);
    // Rows go in order of what they promise less what they cost to enter, in tokens at
    // the rate of decodes alone: a sequence to catch up comes after an equal one
    // caught up already.
    let base_rate = decodes as f64 / costs.secs(0);
    let value = |i: usize, k: usize| gain(i, k) - if k == 0 { entry[i] * base_rate } else { 0.0 };
    let mut keep = vec![0; lens.len()];
    let (mut tokens, mut depth, mut entered) = (decodes as f64, 0, 0.0);
    let mut best = (tokens / costs.secs(0), keep.clone());
    for rows in 1.. {
        let next = (0..lens.len()).filter(|&i| keep[i] < lens[i]).max_by(|&a, &b| {
            // The higher promise first; between equals, the shallower (a shared draft
            // step serves them together).
            value(a, keep[a]).total_cmp(&value(b, keep[b])).then(keep[b].cmp(&keep[a]))
        });
        let Some(i) = next else { break };
        tokens += gain(i, keep[i]);
        if keep[i] == 0 {
            entered += entry[i];
        }
        keep[i] += 1;
        depth = depth.max(keep[i]);
        let rate = tokens / (costs.secs(rows) + draft_step * depth as f64 + entered);
        if rate > best.0 {
            best = (rate, keep.clone());
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn cheap() -> StepCosts {
        StepCosts::linear(0.040, 0.004)
    }

    /// `choose` for sequences the proposer is up to date on.
    fn weigh(alphas: &[f64], lens: &[usize], decodes: usize, costs: &StepCosts, draft_step: f64) -> Vec<usize> {
        choose(alphas, lens, decodes, costs, draft_step, &vec![0.0; alphas.len()])
    }

    #[test]
    fn good_guessers_verify_more_than_poor_ones_and_cheap_rows_buy_more() {
        // α 0.9 against 0.3 at a tenth of a step per row: 0.3 is worth one row (0.3 >
        // 0.1), not two (0.09); 0.9 is worth many.
        let keep = weigh(&[0.9, 0.3], &[8, 8], 2, &StepCosts::linear(0.040, 0.002), 0.0);
        assert!(keep[0] >= 6 && keep[1] == 1, "{keep:?}");
        // Dearer rows: fewer for both.
        let dear = weigh(&[0.9, 0.3], &[8, 8], 2, &StepCosts::linear(0.040, 0.016), 0.0);
        assert!(dear[0] < keep[0] && dear[1] == 0, "{dear:?}");
        // Never more than proposed.
        assert_eq!(weigh(&[0.99], &[2], 1, &cheap(), 0.0), vec![2]);
    }

    #[test]
    fn a_large_batch_verifies_nothing_where_a_single_stream_would() {
        // 64 decodes in a 60 ms step: each already yields a token for ~1 ms, so a 4 ms
        // row at α 0.7 does not pay; one stream at 40 ms does.
        assert_eq!(weigh(&[0.7; 64], &[4; 64], 64, &StepCosts::linear(0.060, 0.004), 0.0), vec![0; 64]);
        assert!(weigh(&[0.7], &[4], 1, &cheap(), 0.0)[0] > 0);
    }

    #[test]
    fn an_uneven_row_price_is_weighed_over_every_count_of_rows() {
        // Four decodes in 64 ms; a fifth row takes a kernel pass of its own (100 ms),
        // the three after it little; a ninth another pass. One row does not pay for
        // itself, four together do.
        let costs = StepCosts { secs: vec![0.064, 0.100, 0.102, 0.104, 0.106], per_row: 0.030 };
        assert_eq!(weigh(&[0.9; 4], &[4; 4], 4, &costs, 0.0), vec![1; 4]);
        // Poorer guessers: not even four.
        assert_eq!(weigh(&[0.4; 4], &[4; 4], 4, &costs, 0.0), vec![0; 4]);
    }

    #[test]
    fn a_draft_step_is_weighed_once_per_depth_and_shared_by_the_batch() {
        // A draft forward at a third of a target step (two cores: 0.5B against 1.5B):
        // one stream at α 0.8 gains 0.8 tokens for 0.36 of a step — worth it; a poor
        // guesser (α 0.3) is not, where lookups (free) would be.
        let costs = &StepCosts::linear(0.040, 0.001);
        assert!(weigh(&[0.8], &[4], 1, costs, 0.0133)[0] >= 1);
        assert_eq!(weigh(&[0.3], &[4], 1, costs, 0.0133), vec![0]);
        assert!(weigh(&[0.3], &[4], 1, costs, 0.0)[0] > 0);
        // A dearer draft buys fewer positions.
        let cheap = weigh(&[0.8], &[8], 1, costs, 0.004)[0];
        let dear = weigh(&[0.8], &[8], 1, costs, 0.0133)[0];
        assert!(dear < cheap, "{dear} positions with a dear draft, {cheap} with a cheap one");
        // Four streams share each drafting step: one's 0.8 tokens alone would not pay
        // for it beside four tokens a step, four's 3.2 do.
        let four = weigh(&[0.8; 4], &[8; 4], 4, &StepCosts::linear(0.044, 0.001), 0.0133);
        assert_eq!(four, vec![2; 4]);
    }

    #[test]
    fn catching_up_is_weighed_once_and_only_where_drafting_makes_up_for_it() {
        // Four streams where drafting two deep pays for its draft steps (see above)...
        let costs = &StepCosts::linear(0.044, 0.001);
        assert_eq!(choose(&[0.8; 4], &[8; 4], 4, costs, 0.0133, &[0.0; 4]), vec![2; 4]);
        // ...does not pay for catching each up as well, a step's worth spread per step;
        let dear = choose(&[0.8; 4], &[8; 4], 4, costs, 0.0133, &[0.044; 4]);
        assert_eq!(dear, vec![0; 4]);
        // a little catching up leaves it paying, and only those behind pay it;
        let little = choose(&[0.8; 4], &[8; 4], 4, costs, 0.0133, &[0.002; 4]);
        assert!(little.iter().all(|&k| k >= 2), "{little:?}");
        let one_behind = choose(&[0.8; 4], &[8; 4], 4, costs, 0.0133, &[0.0, 0.0, 0.0, 0.044]);
        assert_eq!(one_behind, vec![2, 2, 2, 0]);
        // a single stream gains enough to catch up.
        assert!(choose(&[0.8], &[4], 1, &StepCosts::linear(0.040, 0.001), 0.0133, &[0.006])[0] > 0);
    }

    /// A proposer that costs what it is told (catching up: all but sequence 1), starts
    /// sequences at α 0.8 as a draft model does, and records whom it was asked about.
    struct Priced {
        step: f64,
        catch_up: f64,
        asked: Arc<Mutex<Vec<SeqId>>>,
    }

    /// Draft-model speculation by a `Priced` proposer, and its record of whom it was asked.
    fn priced(step: f64, catch_up: f64) -> (Speculator, Arc<Mutex<Vec<SeqId>>>) {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let config = SpecConfig { method: SpecMethod::Draft, max_tokens: 4, draft: None };
        (Speculator::with_proposer(config, Box::new(Priced { step, catch_up, asked: asked.clone() })), asked)
    }

    impl Proposer for Priced {
        fn propose(&mut self, seqs: &[Proposal<'_>]) -> Vec<Vec<u32>> {
            self.asked.lock().unwrap().extend(seqs.iter().map(|p| p.id));
            seqs.iter().map(|p| vec![1; p.max]).collect()
        }
        fn step_seconds(&self) -> f64 {
            self.step
        }
        fn catch_up_seconds(&self, p: &Proposal<'_>) -> f64 {
            if p.id == 1 { 0.0 } else { self.catch_up }
        }
        fn new_acceptance(&self) -> f64 {
            0.8
        }
    }

    #[test]
    fn a_proposer_is_not_asked_about_sequences_whose_catch_up_would_not_pay() {
        // Four seconds to catch up sequence 2, spread over a typical output's 128 tokens
        // at 1.8 tokens a step (α before anything is verified: 0.8): 56 ms a step, more
        // than drafting it gains; sequence 1 is caught up already.
        let (mut s, asked) = priced(0.004, 4.0);
        let tokens = [5u32; 16];
        let seqs = [1, 2].map(|id| Proposal { id, tenant: "", tokens: &tokens, max: 5000 });
        let costs = StepCosts::linear(0.040, 0.001);
        let proposed = s.propose(&seqs, &costs);
        assert_eq!(*asked.lock().unwrap(), vec![1]);
        assert_eq!(proposed.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![1]);
        // Long outputs (learnt as sequences end) spread it thin enough to pay.
        for id in 10..60 {
            s.finished(id, "", &[], 4000);
        }
        asked.lock().unwrap().clear();
        s.propose(&seqs, &costs);
        assert_eq!(*asked.lock().unwrap(), vec![1, 2]);
    }

    #[test]
    fn a_new_sequence_is_tried_where_only_good_guessers_pay() {
        // A draft step over half a decode's: not worth it at α 0.5...
        let (mut s, asked) = priced(0.025, 0.0);
        let costs = StepCosts::linear(0.040, 0.001);
        assert_eq!(weigh(&[0.5], &[4], 1, &costs, 0.025), vec![0]);
        let tokens = [5u32; 16];
        let drafted_for = |s: &mut Speculator, id| {
            asked.lock().unwrap().clear();
            s.propose(&[Proposal { id, tenant: "", tokens: &tokens, max: 100 }], &costs);
            asked.lock().unwrap().contains(&id)
        };
        // ...but a new sequence is tried, and kept at only while its guesses are good.
        assert!(drafted_for(&mut s, 1));
        s.verified(1, 2, 2);
        assert!(drafted_for(&mut s, 1));
        s.verified(1, 2, 0);
        s.verified(1, 1, 0);
        assert!(!drafted_for(&mut s, 1));
        assert!(drafted_for(&mut s, 2));
    }

    #[test]
    fn acceptance_is_learnt_and_counted_by_position() {
        let mut s = Speculator::new(SpecConfig { method: SpecMethod::Ngram, max_tokens: 4, draft: None }).unwrap();
        let tokens: Vec<u32> = [1, 2, 3, 4, 1, 2].to_vec();
        let ask = [Proposal { id: 7, tenant: "", tokens: &tokens, max: 8 }];
        let free = StepCosts::free();
        let first = s.propose(&ask, &free);
        assert_eq!(first, vec![(7, vec![3, 4, 1, 2])]);
        s.verified(7, 4, 2);
        s.verified(7, 3, 3);
        assert_eq!(s.stats().drafts, 2);
        assert_eq!((s.stats().draft_tokens, s.stats().accepted_tokens), (7, 5));
        assert_eq!(s.stats().accepted_per_position, vec![2, 2, 1, 0]);
        // Rejections drive α down until nothing is worth verifying; then it recovers.
        for _ in 0..20 {
            s.verified(7, 1, 0);
        }
        assert!(s.propose(&ask, &cheap()).is_empty());
        let recovered = (0..200).find(|_| !s.propose(&ask, &cheap()).is_empty());
        assert!(recovered.is_some(), "a sequence that stopped guessing is tried again");
        s.finished(7, "", &tokens, 2);
        assert!(s.acceptance.is_empty());
    }
}
