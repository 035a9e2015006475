//! Turning logits into tokens: penalties, logit bias, temperature, top-k, top-p, min-p,
//! seeded sampling, and log-probabilities. Rows of a batch are independent; each
//! sequence carries its own random generator, so a seeded request draws the same tokens
//! whatever else shares its batch.

use super::grammar::Constraint;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::collections::HashMap;
use tessera_kernels::pick::{Draw, PickRow};

/// How one sequence samples. Defaults are "off" for every filter and penalty.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// 1 is off.
    pub top_p: f32,
    /// -1 (or 0) is off.
    pub top_k: i32,
    /// 0 is off.
    pub min_p: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// 1 is off; applies to prompt and output tokens.
    pub repetition_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
    /// How many top alternatives to return with each token's log-probability (0..=20);
    /// None returns no log-probabilities.
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }
}

/// A sequence's sampling state across steps.
#[derive(Debug, Clone)]
pub struct SamplerState {
    pub params: SamplingParams,
    rng: StdRng,
    /// Output token counts (frequency and presence penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens seen in prompt or output (repetition penalty).
    seen: HashMap<u32, ()>,
    /// The grammar the output must follow, if any.
    pub constraint: Option<Constraint>,
    /// This step's random draw, once a device row has taken it.
    drawn: Option<f32>,
    /// Tokens that end the output: end-of-sequence (unless ignored) and stop ids.
    pub ends: Vec<u32>,
    /// What the engine decides for this step (reset by `push`).
    pub rule: StepRule,
    /// This step's pick was an end token, replaced by `rule.end_becomes`.
    redirected: bool,
}

/// What the engine decides for one step of a sequence beyond its request's settings:
/// a thinking budget's rules (`super::thinking`). The grammar, if any, consumes
/// whatever token results, as it would a sampled one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRule {
    /// The token to take, whatever the logits.
    pub forced: Option<u32>,
    /// An end token picked becomes this one.
    pub end_becomes: Option<u32>,
    /// End tokens may not be picked.
    pub ends_banned: bool,
    /// Tokens left to the output, this one included, once they are few: a grammar's
    /// output must then finish in time (`Constraint::finish_in_time`).
    pub finish_within: Option<usize>,
}

/// A bias that no logit survives, for tokens a step may not take (finite, so that
/// device kernels' arithmetic stays finite).
const BANNED: f32 = -1e30;

impl SamplerState {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let seen =
            if params.repetition_penalty != 1.0 { prompt.iter().map(|&t| (t, ())).collect() } else { HashMap::new() };
        Self {
            params,
            rng,
            output_counts: HashMap::new(),
            seen,
            constraint: None,
            drawn: None,
            ends: Vec::new(),
            rule: StepRule::default(),
            redirected: false,
        }
    }

    /// The row a device can pick for this sequence; None when it follows a grammar,
    /// which only the host can apply, or its token is forced, or a redirected end needs
    /// its log-probability. A sampled row takes this step's random draw from the sequence's generator, and the host's sampler uses
    /// that same draw should the backend hand the logits back instead: one draw per
    /// step either way (a forced step draws too), so a seeded request gives the same
    /// tokens on any backend.
    pub fn device_row(&mut self) -> Option<PickRow> {
        let redirect_logprob = self.rule.end_becomes.is_some() && self.params.logprobs.is_some();
        if self.constraint.is_some() || self.rule.forced.is_some() || redirect_logprob {
            return None;
        }
        let p = &self.params;
        let mut history = Vec::new();
        if p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            history.extend(self.output_counts.iter().map(|(&t, &c)| (t, c, self.seen.contains_key(&t))));
            history.extend(self.seen.keys().filter(|t| !self.output_counts.contains_key(t)).map(|&t| (t, 0, true)));
        }
        let draw = (p.temperature > 0.0).then(|| {
            let uniform = *self.drawn.get_or_insert_with(|| self.rng.random::<f32>());
            Draw {
                temperature: p.temperature,
                top_k: u32::try_from(p.top_k).unwrap_or(0),
                top_p: p.top_p,
                min_p: p.min_p,
                uniform,
            }
        });
        let mut logit_bias = p.logit_bias.clone();
        if self.rule.ends_banned {
            logit_bias.extend(self.ends.iter().map(|&t| (t, BANNED)));
        }
        Some(PickRow {
            repetition_penalty: p.repetition_penalty,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            history,
            logit_bias,
            top_logprobs: p.logprobs,
            draw,
        })
    }

    /// This step's random draw: the one a device row took, or a new one.
    fn uniform(&mut self) -> f32 {
        self.drawn.take().unwrap_or_else(|| self.rng.random::<f32>())
    }

    /// The token a pick becomes: an end token, where this step's rule says so, is
    /// replaced (`redirected` tells).
    pub fn redirect_end(&mut self, token: u32) -> u32 {
        match self.rule.end_becomes {
            Some(instead) if self.ends.contains(&token) => {
                self.redirected = true;
                instead
            }
            _ => token,
        }
    }

    /// Whether this step's pick was an end token, replaced.
    pub fn redirected(&self) -> bool {
        self.redirected
    }

    /// Records a token sampled elsewhere for this sequence (a resumed request), with
    /// the step's random draw it took there, so that a seeded request goes on as it
    /// would have.
    pub fn replay(&mut self, token: u32) {
        if self.params.temperature > 0.0 {
            self.rng.random::<f32>();
        }
        if let Some(c) = &self.constraint {
            c.accept(token);
        }
        self.push(token);
    }

    /// Records a token the sequence produced.
    pub fn push(&mut self, token: u32) {
        self.drawn = None;
        self.rule = StepRule::default();
        self.redirected = false;
        *self.output_counts.entry(token).or_default() += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token, ());
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log P(token) under the model's raw distribution, when asked.
    pub logprob: Option<f32>,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One prompt token scored by the model: its log-probability after the tokens before
/// it, its rank in the vocabulary (1: the most likely), the `k` most likely tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptScore {
    pub token: u32,
    pub logprob: f32,
    pub rank: u32,
    pub top: Vec<(u32, f32)>,
}

/// Scores `next[i]` under row `i` of `rows` (`[next.len(), vocab]`), in parallel.
pub fn score_rows(rows: &[f32], vocab: usize, next: &[u32], k: u32) -> Vec<PromptScore> {
    rows.par_chunks(vocab)
        .zip(next.par_iter())
        .map(|(row, &token)| {
            let lp = log_softmax(row);
            let logprob = lp[token as usize];
            let rank = 1 + lp.iter().filter(|&&x| x > logprob).count() as u32;
            let top = top_k_indices(&lp, k as usize).into_iter().map(|i| (i as u32, lp[i])).collect();
            PromptScore { token, logprob, rank, top }
        })
        .collect()
}

/// Samples one token per row of `logits` (`[states.len(), vocab]`), in parallel.
pub fn sample_batch(logits: &mut [f32], vocab: usize, states: &mut [&mut SamplerState]) -> Vec<Sampled> {
    assert_eq!(logits.len(), states.len() * vocab, "one row of logits per sequence");
    logits.par_chunks_mut(vocab).zip(states.par_iter_mut()).map(|(row, state)| sample(row, state)).collect()
}

/// Samples one token from one row, which it overwrites.
pub fn sample(logits: &mut [f32], state: &mut SamplerState) -> Sampled {
    // Log-probabilities describe the model, before any penalty or filter.
    let (logprob_of, top_logprobs) = match state.params.logprobs {
        Some(k) => {
            let lp = log_softmax(logits);
            (Some(lp.clone()), top_k_indices(&lp, k as usize).into_iter().map(|i| (i as u32, lp[i])).collect())
        }
        None => (None, Vec::new()),
    };
    let uniform = (state.params.temperature > 0.0).then(|| state.uniform());
    if let Some(token) = state.rule.forced {
        if let Some(c) = &state.constraint {
            c.accept(token);
        }
        return Sampled { token, logprob: logprob_of.map(|lp| lp[token as usize]), top_logprobs };
    }
    let p = &state.params;
    apply_penalties(logits, p, &state.output_counts, &state.seen);
    for &(token, bias) in &p.logit_bias {
        if let Some(l) = logits.get_mut(token as usize) {
            *l += bias;
        }
    }
    if state.rule.ends_banned {
        for &t in &state.ends {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    if let Some(c) = &state.constraint {
        c.mask(logits);
    }
    let picked = match uniform {
        Some(u) => draw(logits, p, u),
        None => argmax(logits),
    };
    let mut token = state.redirect_end(picked as u32);
    if let (Some(c), Some(remaining)) = (&state.constraint, state.rule.finish_within) {
        token = c.finish_in_time(token, remaining);
    }
    let token = token as usize;
    if let Some(c) = &state.constraint {
        c.accept(token as u32);
    }
    Sampled { token: token as u32, logprob: logprob_of.map(|lp| lp[token]), top_logprobs }
}

fn apply_penalties(logits: &mut [f32], p: &SamplingParams, counts: &HashMap<u32, u32>, seen: &HashMap<u32, ()>) {
    if p.repetition_penalty != 1.0 {
        for &t in seen.keys() {
            let l = &mut logits[t as usize];
            *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        for (&t, &c) in counts {
            logits[t as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
        }
    }
}

/// Temperature, then top-k, top-p and min-p over the survivors, then the token at which
/// the kept probabilities, walked from the most likely, pass `uniform` of their sum.
/// Weights are relative to the most likely token (1 there) and summed in f64: an f32
/// running sum over a 100k-token vocabulary drifts by more than a token's share.
fn draw(logits: &[f32], p: &SamplingParams, uniform: f32) -> usize {
    let k = if p.top_k > 0 { (p.top_k as usize).min(logits.len()) } else { logits.len() };
    // Candidates by descending logit, equal logits by index (as a device picks them); a
    // full sort only when no top-k narrows it.
    let before = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if k < logits.len() {
        order.select_nth_unstable_by(k - 1, before);
        order.truncate(k);
    }
    order.sort_unstable_by(before);
    let max = logits[order[0]];
    let weights: Vec<f32> = order.iter().map(|&i| ((logits[i] - max) / p.temperature).exp()).collect();
    // top-p: the smallest prefix whose weight reaches top_p of the whole (at least one).
    let mut keep = weights.len();
    if p.top_p < 1.0 {
        let target = p.top_p as f64 * weights.iter().map(|&w| w as f64).sum::<f64>();
        let mut mass = 0.0;
        for (i, &w) in weights.iter().enumerate() {
            mass += w as f64;
            if mass >= target {
                keep = i + 1;
                break;
            }
        }
    }
    // min-p: drop tokens less likely than min_p times the most likely one (weight 1).
    if p.min_p > 0.0 {
        keep = keep.min(weights.iter().take_while(|&&w| w >= p.min_p).count().max(1));
    }
    let kept: f64 = weights[..keep].iter().map(|&w| w as f64).sum();
    if !(kept.is_finite() && kept > 0.0) {
        // Broken logits (NaN, infinities): the most likely token, as a device picks.
        return argmax(logits);
    }
    let target = uniform as f64 * kept;
    let mut mass = 0.0;
    for (i, &w) in weights[..keep].iter().enumerate() {
        mass += w as f64;
        if mass >= target {
            return order[i];
        }
    }
    order[keep - 1]
}

pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits.iter().map(|l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32;
    logits.iter().map(|l| l - max - log_sum).collect()
}

/// Indices of the `k` largest values, largest first; equal values by index, as a
/// device orders them.
fn top_k_indices(v: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(v.len());
    if k == 0 {
        return Vec::new();
    }
    let before = |a: &usize, b: &usize| v[*b].total_cmp(&v[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.select_nth_unstable_by(k - 1, before);
    idx.truncate(k);
    idx.sort_unstable_by(before);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_rows_carry_the_history_the_penalties_read() {
        let params = SamplingParams {
            repetition_penalty: 1.2,
            frequency_penalty: 0.5,
            logit_bias: vec![(4, 2.0)],
            logprobs: Some(3),
            ..SamplingParams::greedy()
        };
        let mut state = SamplerState::new(params, &[1, 2, 2]);
        [2, 3, 3].iter().for_each(|&t| state.push(t));
        let row = state.device_row().unwrap();
        let mut history = row.history.clone();
        history.sort_unstable();
        assert_eq!(history, vec![(1, 0, true), (2, 1, true), (3, 2, true)]);
        assert_eq!((row.repetition_penalty, row.frequency_penalty, row.presence_penalty), (1.2, 0.5, 0.0));
        assert_eq!((row.logit_bias.clone(), row.top_logprobs), (vec![(4, 2.0)], Some(3)));
        assert_eq!(row.draw, None, "temperature 0 picks greedily");
        // Without penalties nothing of the history is needed.
        let mut plain = SamplerState::new(SamplingParams::greedy(), &[1, 2]);
        assert!(plain.device_row().unwrap().history.is_empty());
    }

    #[test]
    fn a_device_row_takes_the_steps_draw_and_the_host_reuses_it() {
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            seed: Some(7),
            ..Default::default()
        };
        let logits = logits_of(&PROBS);
        // Host only: the tokens a seeded sequence draws.
        let mut host = SamplerState::new(params.clone(), &[]);
        let host_tokens: Vec<u32> = (0..50).map(|_| sample(&mut logits.clone(), &mut host).token).collect();
        // A device row each step (asked twice: one draw all the same), then the logits
        // handed back to the host: the same tokens.
        let mut mixed = SamplerState::new(params.clone(), &[]);
        let mut mixed_tokens = Vec::new();
        for _ in 0..50 {
            let draw = mixed.device_row().unwrap().draw.expect("a sampled row draws");
            assert_eq!(mixed.device_row().unwrap().draw, Some(draw));
            assert_eq!((draw.temperature, draw.top_k, draw.top_p, draw.min_p), (0.7, 40, 0.9, 0.05));
            assert!((0.0..1.0).contains(&draw.uniform));
            let token = sample(&mut logits.clone(), &mut mixed).token;
            mixed.push(token);
            mixed_tokens.push(token);
        }
        assert_eq!(mixed_tokens, host_tokens);
        // top_k off (-1) is 0 on the device.
        let mut off = SamplerState::new(SamplingParams::default(), &[]);
        assert_eq!(off.device_row().unwrap().draw.unwrap().top_k, 0);
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn counts(params: SamplingParams, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut state = SamplerState::new(SamplingParams { seed: Some(1), ..params }, &[]);
        let mut c = vec![0; logits.len()];
        for _ in 0..draws {
            c[sample(&mut logits.to_vec(), &mut state).token as usize] += 1;
        }
        c
    }

    const PROBS: [f32; 5] = [0.4, 0.3, 0.15, 0.1, 0.05];

    #[test]
    fn a_draw_from_broken_logits_takes_the_maximum() {
        let mut state = SamplerState::new(SamplingParams { seed: Some(3), ..Default::default() }, &[]);
        assert_eq!(sample(&mut [1.0, f32::INFINITY, 0.5], &mut state).token, 1);
        assert_eq!(sample(&mut [f32::NEG_INFINITY; 3], &mut state).token, 0);
    }

    #[test]
    fn greedy_takes_the_maximum() {
        let mut state = SamplerState::new(SamplingParams::greedy(), &[]);
        assert_eq!(sample(&mut [0.1, 3.0, -1.0, 2.9], &mut state).token, 1);
    }

    #[test]
    fn temperature_one_follows_the_distribution() {
        let c = counts(SamplingParams::default(), &logits_of(&PROBS), 20_000);
        for (i, p) in PROBS.iter().enumerate() {
            let f = c[i] as f32 / 20_000.0;
            assert!((f - p).abs() < 0.02, "token {i}: {f} vs {p}");
        }
    }

    #[test]
    fn top_k_keeps_only_the_k_most_likely() {
        let c = counts(SamplingParams { top_k: 2, ..Default::default() }, &logits_of(&PROBS), 5_000);
        assert!(c[0] > 0 && c[1] > 0);
        assert_eq!(c[2..].iter().sum::<usize>(), 0);
        // Renormalised: 0.4 / 0.7 of draws go to token 0.
        assert!((c[0] as f32 / 5_000.0 - 0.4 / 0.7).abs() < 0.03);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
        // 0.4 + 0.3 = 0.7 < 0.8, + 0.15 = 0.85 ≥ 0.8: three tokens.
        let c = counts(SamplingParams { top_p: 0.8, ..Default::default() }, &logits_of(&PROBS), 5_000);
        assert!(c[..3].iter().all(|&n| n > 0));
        assert_eq!(c[3] + c[4], 0);
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_top() {
        // Floor 0.3 · 0.4 = 0.12: tokens 0, 1, 2 stay.
        let c = counts(SamplingParams { min_p: 0.3, ..Default::default() }, &logits_of(&PROBS), 5_000);
        assert!(c[..3].iter().all(|&n| n > 0));
        assert_eq!(c[3] + c[4], 0);
    }

    #[test]
    fn penalties_and_bias_shift_logits_as_specified() {
        let params = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            repetition_penalty: 2.0,
            logit_bias: vec![(3, -100.0)],
            ..SamplingParams::greedy()
        };
        let mut state = SamplerState::new(params, &[0]);
        state.push(1);
        state.push(1);
        let mut logits = vec![4.0, 3.0, -1.0, 10.0];
        let s = sample(&mut logits, &mut state);
        // Token 0 (prompt): 4 / 2 = 2. Token 1 (output twice): 3 / 2 - 2·0.5 - 0.25 = 0.25.
        // Token 3: 10 - 100. Token 2 untouched.
        assert_eq!(logits, vec![2.0, 0.25, -1.0, -90.0]);
        assert_eq!(s.token, 0);
        // Negative logits are multiplied by the repetition penalty.
        let mut state = SamplerState::new(SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() }, &[0]);
        let mut logits = vec![-1.0, -1.5];
        assert_eq!(sample(&mut logits, &mut state).token, 1);
        assert_eq!(logits[0], -2.0);
    }

    #[test]
    fn logit_bias_can_force_a_token() {
        let c = counts(SamplingParams { logit_bias: vec![(4, 100.0)], ..Default::default() }, &logits_of(&PROBS), 200);
        assert_eq!(c[4], 200);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_with_top_alternatives() {
        let params = SamplingParams { logprobs: Some(2), logit_bias: vec![(4, 100.0)], ..SamplingParams::greedy() };
        let mut state = SamplerState::new(params, &[]);
        let s = sample(&mut logits_of(&PROBS), &mut state);
        assert_eq!(s.token, 4);
        assert!((s.logprob.unwrap() - 0.05f32.ln()).abs() < 1e-5, "the bias does not change the reported logprob");
        assert_eq!(s.top_logprobs.len(), 2);
        assert_eq!(s.top_logprobs[0].0, 0);
        assert!((s.top_logprobs[0].1 - 0.4f32.ln()).abs() < 1e-5);
        assert_eq!(s.top_logprobs[1].0, 1);
        let mut none = SamplerState::new(SamplingParams::greedy(), &[]);
        assert_eq!(sample(&mut logits_of(&PROBS), &mut none).logprob, None);
    }

    #[test]
    fn seeded_rows_draw_the_same_tokens_whatever_shares_the_batch() {
        let vocab = PROBS.len();
        let row = logits_of(&PROBS);
        let seeded = || SamplerState::new(SamplingParams { seed: Some(42), ..Default::default() }, &[]);
        let alone: Vec<u32> = {
            let mut s = seeded();
            (0..50).map(|_| sample(&mut row.clone(), &mut s).token).collect()
        };
        let mut mine = seeded();
        let mut other =
            SamplerState::new(SamplingParams { seed: Some(7), temperature: 2.0, ..Default::default() }, &[]);
        let mut batched = Vec::new();
        for _ in 0..50 {
            let mut logits: Vec<f32> = [row.clone(), row.clone()].concat();
            let out = sample_batch(&mut logits, vocab, &mut [&mut other, &mut mine]);
            batched.push(out[1].token);
        }
        assert_eq!(alone, batched);
    }
}
