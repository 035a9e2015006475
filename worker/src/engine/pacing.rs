//! How many prompt tokens a step may take beside the decodes, so that a long prompt
//! arriving does not freeze the sequences already streaming.
//!
//! The budget comes from measured step times, not from a constant: a step of decodes
//! alone takes `d` seconds (a running average, since it grows with the batch), each
//! prompt token adds `p` seconds (likewise; it grows through a long prompt, as each
//! token attends to all before it), and a step with prompt chunks may take at
//! most `ratio · d`, so chunks get `(ratio − 1) · d / p` tokens between them. On a
//! 2-core CPU that is a few dozen tokens (a prompt token costs about a millisecond,
//! a decode step a few); on a GPU, hundreds. With nothing decoding there is nobody to
//! freeze, and a prompt takes the whole step budget. Step times only steer the chunk
//! sizes: which tokens run, and so every output, stay what they would be.

use super::speculate::StepCosts;
use std::collections::BTreeMap;
use std::time::Duration;

/// The least a step gives prompt chunks while others decode, so prompts always move.
/// Small: late in a long prompt a token costs several times what an early one does
/// (attention over all before it — about 4 ms at 3,600 tokens of context on a 2-core
/// CPU, against 1 ms), and a floor of 16 made those steps 5× a decode step.
pub const MIN_PROMPT_TOKENS: usize = 4;
/// Prompt tokens a step gives chunks before a decode step and a prompt token have been
/// timed. Not the floor: when streams start together, every step carries some prompt
/// until all are in, so no decode step is timed alone for a while — at 4 tokens a step
/// 16 streams' first tokens took 4.8 s (p50), at 16 0.27 s.
pub const UNMEASURED_PROMPT_TOKENS: usize = 16;
/// Weight of the newest step in the running averages.
const ALPHA: f64 = 0.2;
/// Steps after which a batch size's decode time, not measured again since, is dropped:
/// a decode step's cost grows with the contexts it attends over, and a time taken
/// with short ones would go on underpricing that batch size's steps.
const STALE_AFTER_STEPS: u64 = 2_000;

#[derive(Debug, Clone)]
pub struct Pacer {
    /// A step with prompt chunks takes at most this many decode steps' time; None: no
    /// limit beyond the step's token budget.
    ratio: Option<f64>,
    /// Running averages of the times of steps without prompt chunks, by how many rows
    /// they ran (a decode is one row, each token proposed to follow it one more): a
    /// step of 16 costs several of 1, and one average for all let an estimate made
    /// with 1 stream judge the chunks of steps that decode 16 (each prompt token
    /// seemed to cost the 15 others' decodes, and prompts starved). By rows, not
    /// decodes and proposals apart, because a row's price is not one number: the CPU's
    /// matrix kernels take input rows four at a time, so a fifth row costs a pass of
    /// its own and the next three little (4 decodes: 64 ms, and a fifth row 100 ms, on
    /// two cores with Qwen2.5-Coder-1.5B).
    /// Each with the step it was last measured at.
    decode_secs: BTreeMap<usize, (f64, u64)>,
    /// Steps observed.
    steps: u64,
    /// Running averages of the seconds prompt chunks added to their steps and of their
    /// tokens: their ratio is a prompt token's cost, each step weighed by its tokens.
    prompt: Option<(f64, f64)>,
}

/// A speculating engine leaves proposals out of a step when a decode step of its batch
/// size has not been timed alone for this many steps, so that the cost proposals are
/// weighed against stays measured.
const REMEASURE_AFTER_STEPS: u64 = 64;

impl Pacer {
    /// `percent`: the longest step with prompt chunks, in percent of a decode step's
    /// time (0: no limit).
    pub fn new(percent: u32) -> Self {
        let ratio = (percent > 0).then(|| f64::from(percent.max(100)) / 100.0);
        Self { ratio, decode_secs: BTreeMap::new(), steps: 0, prompt: None }
    }

    /// What a step of `decodes` decodes alone takes: as measured, else between the
    /// nearest batches measured, else past the largest that one scaled by batch size (an
    /// overestimate, erring on longer chunks rather than starved prompts), else below
    /// the smallest that one as it is.
    fn decode_step(&self, decodes: usize) -> Option<f64> {
        let below = self.decode_secs.range(..=decodes).next_back();
        let above = self.decode_secs.range(decodes..).next();
        Some(match (below, above) {
            (Some((&n, &(d, _))), _) if n == decodes => d,
            (Some((&n0, &(d0, _))), Some((&n1, &(d1, _)))) => d0 + (d1 - d0) * (decodes - n0) as f64 / (n1 - n0) as f64,
            (Some((&n, &(d, _))), None) => d * decodes as f64 / n as f64,
            (None, Some((_, &(d, _)))) => d,
            (None, None) => return None,
        })
    }

    /// Prompt tokens the next step may take beside `decodes` decodes.
    pub fn prompt_tokens(&self, decodes: usize) -> usize {
        let Some(ratio) = self.ratio.filter(|_| decodes > 0) else { return usize::MAX };
        match (self.decode_step(decodes), self.prompt) {
            (Some(d), Some((secs, tokens))) if secs > 0.0 => {
                (((ratio - 1.0) * d * tokens / secs) as usize).max(MIN_PROMPT_TOKENS)
            }
            // Prompt tokens have added nothing measurable: the step budget decides.
            (Some(_), Some(_)) => usize::MAX,
            // Nothing measured yet: modest chunks until something is.
            _ => UNMEASURED_PROMPT_TOKENS,
        }
    }

    /// What a speculating engine weighs its proposals against: the time of a step of
    /// `decodes` decodes alone, and with each number of rows more, as timed lately
    /// (between sizes timed, read between them; past the largest, each row more at a
    /// prompt token's cost). None when no step of that many decodes has been timed
    /// lately, nor sizes on both sides of it: the next step should run without
    /// proposals, and be timed. (Scaling the largest size timed up, as chunk sizes may,
    /// priced a step of 4 at four of 1 — three times what it takes on a CPU — and
    /// every proposal looked cheap beside it.)
    pub fn costs(&self, decodes: usize) -> Option<StepCosts> {
        let mut secs = vec![self.lately_timed(decodes)?];
        let largest = self.decode_secs.iter().rev().find_map(|e| self.lately(e)).map_or(decodes, |(n, _)| n);
        secs.extend((decodes + 1..=largest).map_while(|rows| self.lately_timed(rows)));
        let last = *secs.last().expect("one at least");
        let per_row = match self.prompt {
            Some((s, t)) if s > 0.0 && t > 0.0 => s / t,
            // No prompt token timed: a row at the average row's price of the largest step.
            _ => last / largest.max(1) as f64,
        };
        Some(StepCosts { secs, per_row })
    }

    /// A timed size if it was timed lately: its rows and seconds.
    fn lately(&self, (&n, &(d, at)): (&usize, &(f64, u64))) -> Option<(usize, f64)> {
        (self.steps - at <= REMEASURE_AFTER_STEPS).then_some((n, d))
    }

    /// A step of `rows` rows as timed lately, or between the nearest sizes timed lately
    /// on either side of it.
    fn lately_timed(&self, rows: usize) -> Option<f64> {
        if let Some((_, d)) = self.decode_secs.get_key_value(&rows).and_then(|e| self.lately(e)) {
            return Some(d);
        }
        let (n0, d0) = self.decode_secs.range(..rows).rev().find_map(|e| self.lately(e))?;
        let (n1, d1) = self.decode_secs.range(rows..).find_map(|e| self.lately(e))?;
        Some(d0 + (d1 - d0) * (rows - n0) as f64 / (n1 - n0) as f64)
    }

    /// A step that ran `decodes` decodes and `proposed` tokens proposed to follow them
    /// (and no prompt chunk) in `took`: timed as a step of that many rows.
    pub fn observe_verification(&mut self, took: Duration, decodes: usize, proposed: usize) {
        self.observe(took, decodes + proposed, 0)
    }

    /// A step that ran `decodes` single-token decodes and `prompt_tokens` tokens of
    /// prompt chunks in `took`.
    pub fn observe(&mut self, took: Duration, decodes: usize, prompt_tokens: usize) {
        let secs = took.as_secs_f64();
        let average = |old: f64, new: f64| old + ALPHA * (new - old);
        self.steps += 1;
        if prompt_tokens == 0 {
            if decodes > 0 {
                let now = self.steps;
                let (d, at) = self.decode_secs.entry(decodes).or_insert((secs, now));
                (*d, *at) = (average(*d, secs), now);
                self.decode_secs.retain(|_, (_, at)| now - *at <= STALE_AFTER_STEPS);
            }
            return;
        }
        // What the decodes beside the chunks cost, as a step of them alone would. A
        // prompt alone teaches too: its tokens share each weight read, so the estimate
        // starts low and the first paced chunks large, which keeps prompts arriving
        // together moving (their first tokens came later when only paced steps taught).
        // Seconds and tokens are averaged apart, so a few-token chunk whose step ran
        // long for other reasons (the decodes' own cost moves with the batch) weighs
        // as little as its tokens: averaging per-token costs instead let one such step
        // shrink the next chunks, whose steps were as noisy, down to the floor.
        let decode_part = if decodes > 0 { self.decode_step(decodes).unwrap_or(0.0) } else { 0.0 };
        let (extra, tokens) = ((secs - decode_part).max(0.0), prompt_tokens as f64);
        self.prompt = Some(self.prompt.map_or((extra, tokens), |(s, t)| (average(s, extra), average(t, tokens))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn proposals_are_weighed_against_steps_of_as_many_rows_timed_lately() {
        let mut p = Pacer::new(250);
        assert_eq!(p.costs(1), None, "nothing timed");
        p.observe(MS(40), 1, 0);
        // Nothing but a step of 1: a row more is priced at the average row's.
        assert_eq!(p.costs(1), Some(StepCosts { secs: vec![0.040], per_row: 0.040 }));
        // A prompt token timed: rows past those timed cost what it does (2 ms).
        p.observe(MS(40 + 20), 1, 10);
        let c = p.costs(1).unwrap();
        assert!(c.secs == [0.040] && (c.per_row - 0.002).abs() < 1e-12, "{c:?}");
        // One decode verifying 4 proposals (5 rows) in 52 ms, and steps of 3 decodes
        // in 45 ms: rows 2 and 4 are read between the sizes timed.
        p.observe_verification(MS(52), 1, 4);
        p.observe(MS(45), 3, 0);
        let c = p.costs(1).unwrap();
        let near = |a: f64, b: f64| assert!((a - b).abs() < 1e-9, "{a} against {b}: {c:?}");
        for (got, want) in c.secs.iter().zip([0.040, 0.0425, 0.045, 0.0485, 0.052]) {
            near(*got, want);
        }
        assert_eq!(c.secs.len(), 5);
        near(c.secs(6), 0.056); // 7 rows: 2 past the 5 timed
        // A larger batch is not guessed from a smaller one: a step of 6 is timed first.
        assert_eq!(p.costs(6), None);
        assert!(p.costs(2).is_some(), "between sizes timed");
        // Long without a decode step of 1 alone: time one again.
        for _ in 0..REMEASURE_AFTER_STEPS {
            p.observe_verification(MS(52), 1, 4);
        }
        assert_eq!(p.costs(1), None);
        assert_eq!(p.costs(2), None, "nor is a size between stale ones");
        p.observe(MS(40), 1, 0);
        assert!(p.costs(1).is_some());
    }

    #[test]
    fn chunks_fill_the_step_time_the_ratio_allows() {
        let mut p = Pacer::new(300);
        assert_eq!(p.prompt_tokens(0), usize::MAX, "nothing decoding: no limit");
        assert_eq!(p.prompt_tokens(4), UNMEASURED_PROMPT_TOKENS, "nothing measured yet");
        // A lone prompt: 200 tokens in 200 ms, 1 ms a token.
        p.observe(MS(200), 0, 200);
        // Decode steps of 10 ms: chunks may add 20 ms, 20 tokens.
        for _ in 0..50 {
            p.observe(MS(10), 4, 0);
        }
        let near = |got: usize, want: usize| assert!(got.abs_diff(want) <= 1, "{got} tokens, not {want}");
        near(p.prompt_tokens(4), 20);
        // Settled at 1 ms a token in 20-token chunks, one 4-token chunk whose step ran
        // 30 ms long weighs as its 4 tokens: the chunks shrink a little, not to 8.
        for _ in 0..50 {
            p.observe(MS(10 + 20), 4, 20);
        }
        p.observe(MS(10 + 4 + 30), 4, 4);
        assert!((13..=16).contains(&p.prompt_tokens(4)), "{}", p.prompt_tokens(4));
        // Slower prompt tokens (2 ms each beside the decodes, as late in a long
        // prompt): fewer of them.
        for _ in 0..50 {
            p.observe(MS(10 + 2 * 20), 4, 20);
        }
        near(p.prompt_tokens(4), 10);
        // Far slower (10 ms each): never fewer than the least.
        for _ in 0..50 {
            p.observe(MS(10 + 10 * 20), 4, 20);
        }
        assert_eq!(p.prompt_tokens(4), MIN_PROMPT_TOKENS, "2 would do, but never fewer than the least");
        // A bigger batch decodes slower: its chunks may be longer (80 ms at 10 ms a
        // token); the batch of 4 keeps its own time, and batches between interpolate.
        for _ in 0..50 {
            p.observe(MS(40), 16, 0);
        }
        near(p.prompt_tokens(16), 8);
        assert_eq!(p.prompt_tokens(4), MIN_PROMPT_TOKENS);
        near(p.prompt_tokens(10), 5);
        assert_eq!(Pacer::new(0).prompt_tokens(4), usize::MAX, "0 turns pacing off");

        // Only one stream timed alone (6 ms a step): a step of 16 decodes is judged as
        // 16 of those, so 20 prompt tokens beside 16 decodes in 116 ms cost 1 ms each,
        // not the 5.5 ms a 6 ms decode step would leave them.
        let mut q = Pacer::new(300);
        q.observe(MS(6), 1, 0);
        q.observe(MS(96 + 20), 16, 20);
        near(q.prompt_tokens(16), 192);
    }

    #[test]
    fn a_batch_size_not_timed_for_long_is_forgotten() {
        let mut p = Pacer::new(300);
        p.observe(MS(200), 0, 200);
        // 16 streams decoded once, early, over short contexts: 20 ms a step.
        p.observe(MS(20), 16, 0);
        assert_eq!(p.prompt_tokens(16), 40);
        // Then only 4 streams for a long while, 10 ms a step: the old time of 16 goes,
        // and a step of 16 is judged as four of 4 (40 ms, 80 tokens beside it).
        for _ in 0..STALE_AFTER_STEPS {
            p.observe(MS(10), 4, 0);
        }
        assert_eq!(p.prompt_tokens(16), 40, "still within its time");
        p.observe(MS(10), 4, 0);
        assert_eq!(p.prompt_tokens(16), 80);
    }
}
