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

use std::time::Duration;

/// The least a step gives prompt chunks while others decode, so prompts always move.
/// Small: late in a long prompt a token costs several times what an early one does
/// (attention over all before it — about 4 ms at 3,600 tokens of context on a 2-core
/// CPU, against 1 ms), and a floor of 16 made those steps 5× a decode step.
pub const MIN_PROMPT_TOKENS: usize = 4;
/// Weight of the newest step in the running averages.
const ALPHA: f64 = 0.2;

#[derive(Debug, Clone)]
pub struct Pacer {
    /// A step with prompt chunks takes at most this many decode steps' time; None: no
    /// limit beyond the step's token budget.
    ratio: Option<f64>,
    decode_secs: Option<f64>,
    secs_per_prompt_token: Option<f64>,
}

impl Pacer {
    /// `percent`: the longest step with prompt chunks, in percent of a decode step's
    /// time (0: no limit).
    pub fn new(percent: u32) -> Self {
        let ratio = (percent > 0).then(|| f64::from(percent.max(100)) / 100.0);
        Self { ratio, decode_secs: None, secs_per_prompt_token: None }
    }

    /// Prompt tokens the next step may take, given whether any sequence is decoding.
    pub fn prompt_tokens(&self, decoding: bool) -> usize {
        let Some(ratio) = self.ratio.filter(|_| decoding) else { return usize::MAX };
        match (self.decode_secs, self.secs_per_prompt_token) {
            (Some(d), Some(p)) if p > 0.0 => (((ratio - 1.0) * d / p) as usize).max(MIN_PROMPT_TOKENS),
            // Nothing measured yet: small chunks until something is.
            _ => MIN_PROMPT_TOKENS,
        }
    }

    /// A step that ran `decodes` single-token decodes and `prompt_tokens` tokens of
    /// prompt chunks in `took`.
    pub fn observe(&mut self, took: Duration, decodes: usize, prompt_tokens: usize) {
        let secs = took.as_secs_f64();
        let average = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + ALPHA * (new - o)));
        if prompt_tokens == 0 {
            if decodes > 0 {
                self.decode_secs = average(self.decode_secs, secs);
            }
            return;
        }
        // What the decodes beside the chunks cost, as a step of them alone would. A
        // prompt alone teaches too: its tokens share each weight read, so the estimate
        // starts low (the first paced steps run long) and chunks start large — learning
        // from paced steps only kept steady steps tighter but, at 16 streams, starved
        // the prompts arriving (time to first token p50 4.3 s against 0.3 s).
        let decode_part = if decodes > 0 { self.decode_secs.unwrap_or(0.0) } else { 0.0 };
        let per_token = (secs - decode_part).max(0.0) / prompt_tokens as f64;
        self.secs_per_prompt_token = average(self.secs_per_prompt_token, per_token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn chunks_fill_the_step_time_the_ratio_allows() {
        let mut p = Pacer::new(300);
        assert_eq!(p.prompt_tokens(false), usize::MAX, "nothing decoding: no limit");
        assert_eq!(p.prompt_tokens(true), MIN_PROMPT_TOKENS, "nothing measured yet");
        // A lone prompt: 200 tokens in 200 ms, 1 ms a token.
        p.observe(MS(200), 0, 200);
        // Decode steps of 10 ms: chunks may add 20 ms, 20 tokens.
        for _ in 0..50 {
            p.observe(MS(10), 4, 0);
        }
        let near = |got: usize, want: usize| assert!(got.abs_diff(want) <= 1, "{got} tokens, not {want}");
        near(p.prompt_tokens(true), 20);
        // Slower prompt tokens (2 ms each beside the decodes, as late in a long
        // prompt): fewer of them.
        for _ in 0..50 {
            p.observe(MS(10 + 2 * 20), 4, 20);
        }
        near(p.prompt_tokens(true), 10);
        // Far slower (10 ms each): never fewer than the least.
        for _ in 0..50 {
            p.observe(MS(10 + 10 * 20), 4, 20);
        }
        assert_eq!(p.prompt_tokens(true), MIN_PROMPT_TOKENS, "2 would do, but never fewer than the least");
        // A bigger batch decodes slower: its chunks may be longer (80 ms at 10 ms a token).
        for _ in 0..50 {
            p.observe(MS(40), 16, 0);
        }
        near(p.prompt_tokens(true), 8);
        assert_eq!(Pacer::new(0).prompt_tokens(true), usize::MAX, "0 turns pacing off");
    }
}
