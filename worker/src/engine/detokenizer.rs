//! Incremental detokenization: token ids in, text deltas out, never a broken UTF-8
//! character in a delta, and stop strings cut out of the text.
//!
//! Each step decodes a short window of recent tokens twice — up to the last emitted
//! token and up to the new one — and emits the difference, so tokenizers whose tokens
//! depend on their neighbours (leading spaces, byte pieces) decode as they would whole.
//! Text that could still begin a stop string is held back until it no longer can.

use tokenizers::Tokenizer;

/// Prompt tokens used as left context for the first output tokens.
const CONTEXT_TOKENS: usize = 5;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delta {
    /// Text to send now (possibly empty).
    pub text: String,
    /// Set when a stop string matched: generation ends, the match is not emitted.
    pub stopped_on: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Detokenizer {
    tokens: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// Tokens up to here have been turned into text.
    read_offset: usize,
    stops: Vec<String>,
    /// Decoded but not yet emitted (a possible stop-string prefix).
    held: String,
    stopped: bool,
    /// Output tokens pushed so far, and how many come before stop strings count.
    pushed: usize,
    stops_after: usize,
    /// A matched stop string is emitted with the text before it.
    keep_stop: bool,
    /// Special tokens decode to nothing.
    skip_special: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("detokenizing: {0}")]
pub struct DetokenizeError(String);

impl Detokenizer {
    pub fn new(prompt: &[u32], stops: Vec<String>) -> Self {
        let context = &prompt[prompt.len().saturating_sub(CONTEXT_TOKENS)..];
        Self {
            tokens: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
            pushed: 0,
            stops_after: 0,
            keep_stop: false,
            skip_special: true,
        }
    }

    /// Stop strings count only in text from the `n`th output token on (vLLM's
    /// `min_tokens`): earlier text is sent as it comes.
    pub fn stops_after(mut self, n: usize) -> Self {
        self.stops_after = n;
        self
    }

    /// A matched stop string is sent, at the end of the text.
    pub fn keeping_stop(mut self, keep: bool) -> Self {
        self.keep_stop = keep;
        self
    }

    /// Whether special tokens (end-of-turn markers and the like) decode to nothing.
    pub fn skipping_special(mut self, skip: bool) -> Self {
        self.skip_special = skip;
        self
    }

    /// Adds one generated token and returns the text it completes.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<Delta, DetokenizeError> {
        if self.stopped {
            return Ok(Delta::default());
        }
        self.tokens.push(token);
        self.pushed += 1;
        let skip = self.skip_special;
        let decode = |ids: &[u32]| tokenizer.decode(ids, skip).map_err(|e| DetokenizeError(e.to_string()));
        let before = decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let after = decode(&self.tokens[self.prefix_offset..])?;
        // An unfinished character decodes as U+FFFD: wait for the bytes that finish it.
        if after.len() <= before.len() || after.ends_with('\u{FFFD}') {
            return Ok(Delta::default());
        }
        let new = match after.get(before.len()..) {
            Some(new) if after.starts_with(&before) => new.to_string(),
            // The window re-decoded differently (rare): take what lies past the old text.
            _ => after.chars().skip(before.chars().count()).collect(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(self.release(new))
    }

    /// Ends the sequence: whatever was held back for a stop string is sent.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    fn release(&mut self, new: String) -> Delta {
        if self.pushed < self.stops_after {
            // Too early for stop strings: whatever was held goes out with the new text.
            let text = std::mem::take(&mut self.held) + &new;
            return Delta { text, stopped_on: None };
        }
        self.held.push_str(&new);
        if let Some((at, stop)) = self.first_stop() {
            self.stopped = true;
            let end = if self.keep_stop { at + stop.len() } else { at };
            let text = self.held[..end].to_string();
            self.held.clear();
            return Delta { text, stopped_on: Some(stop) };
        }
        let keep = self.held_back_len();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Delta { text, stopped_on: None }
    }

    /// The earliest stop string in the held text.
    fn first_stop(&self) -> Option<(usize, String)> {
        self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s.clone()))).min_by_key(|(at, _)| *at)
    }

    /// Length of the longest suffix of the held text that begins some stop string.
    fn held_back_len(&self) -> usize {
        let h = &self.held;
        let mut best = 0;
        for stop in &self.stops {
            for (start, _) in h.char_indices() {
                let tail = &h[start..];
                if tail.len() > best && stop.starts_with(tail) {
                    best = tail.len();
                    break;
                }
            }
        }
        best
    }
}
