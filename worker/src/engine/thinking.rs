//! A thinking budget: each completion's reasoning tokens are counted as the output
//! streams, and when a completion has spent its budget inside a reasoning block, the
//! family's closing marker is forced as its next tokens, so that the answer follows.
//!
//! The block is found in the output text, as the control plane reads it back (a
//! marker can come as any split of tokens): the output may begin inside a block the
//! prompt opened, or the model may open one itself. Forcing happens above the
//! backends — the sampler takes the forced token in place of a pick, on the host — so
//! it is the same on the CPU and on CUDA, and under a grammar, which consumes forced
//! tokens like sampled ones.

use super::sampler::StepRule;
use std::collections::VecDeque;
use tessera_proto::text::partial_suffix;

/// How a request's reasoning is watched and ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkingBudget {
    /// The output begins inside a reasoning block (the prompt opened it).
    pub inside: bool,
    /// The text that opens a block; empty when only the prompt opens one.
    pub open: String,
    /// The text that closes a block.
    pub close: String,
    /// Forced to end a block whose budget is spent: tokens whose text holds `close`.
    pub close_tokens: Vec<u32>,
    /// Reasoning tokens one completion may spend, over all its blocks.
    pub budget: usize,
}

/// Why a request's thinking budget cannot work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    #[error("the thinking budget names no closing marker")]
    NoClose,
    #[error("the thinking budget has no tokens to close reasoning with")]
    NoCloseTokens,
}

impl ThinkingBudget {
    /// Why the request's budget cannot work, if it cannot.
    pub fn check(&self) -> Result<(), BudgetError> {
        if self.close.is_empty() {
            return Err(BudgetError::NoClose);
        }
        if self.close_tokens.is_empty() {
            return Err(BudgetError::NoCloseTokens);
        }
        Ok(())
    }
}

/// One completion's reasoning so far.
#[derive(Debug, Clone)]
pub struct Thinking {
    spec: ThinkingBudget,
    inside: bool,
    /// Tokens produced inside reasoning blocks.
    spent: usize,
    /// Output text not yet searched past a possible marker start.
    tail: String,
    /// The rest of a forced close.
    forcing: VecDeque<u32>,
    /// A close has been forced in the current block.
    closing: bool,
    /// A block has ended and no answer text has followed yet.
    awaiting_answer: bool,
}

impl Thinking {
    pub fn new(spec: ThinkingBudget) -> Self {
        Self {
            inside: spec.inside,
            spec,
            spent: 0,
            tail: String::new(),
            forcing: VecDeque::new(),
            closing: false,
            awaiting_answer: false,
        }
    }

    /// Whether the output is inside a reasoning block now.
    pub fn inside(&self) -> bool {
        self.inside
    }

    /// No close is under way: the state is what replaying the output's tokens on
    /// another replica gives (`EngineCore::replay`), so a request may be handed over
    /// here.
    pub fn settled(&self) -> bool {
        self.forcing.is_empty() && !(self.closing && self.inside)
    }

    /// Reasoning tokens spent so far.
    pub fn spent(&self) -> usize {
        self.spent
    }

    /// This step's rule: the forced close once the budget is spent; until then, an
    /// end of output picked inside a block becomes its close (the model is done
    /// thinking, not done answering); and after a block, no end until the answer has
    /// begun.
    pub fn rule(&mut self) -> StepRule {
        let forced = self.forced();
        let free = forced.is_none();
        StepRule {
            forced,
            end_becomes: (free && self.inside && !self.closing).then(|| self.spec.close_tokens[0]),
            ends_banned: free && self.awaiting_answer,
            finish_within: None,
        }
    }

    /// The step's pick was an end token that became the close's first token: the rest
    /// of the close follows.
    pub fn close_begun(&mut self) {
        self.closing = true;
        self.forcing.extend(&self.spec.close_tokens[1..]);
    }

    /// The token this completion must take next, if its budget decides it.
    fn forced(&mut self) -> Option<u32> {
        if self.forcing.is_empty() && self.inside && !self.closing && self.spent >= self.spec.budget {
            self.closing = true;
            self.forcing.extend(&self.spec.close_tokens);
        }
        self.forcing.pop_front()
    }

    /// Records one output token and the text it completed.
    pub fn observe(&mut self, text: &str) {
        if self.inside {
            self.spent += 1;
        }
        self.tail.push_str(text);
        loop {
            let marker = if self.inside { self.spec.close.as_str() } else { self.spec.open.as_str() };
            let found = if marker.is_empty() { None } else { self.tail.find(marker) };
            match found {
                Some(at) => {
                    if !self.inside && !self.tail[..at].trim().is_empty() {
                        self.awaiting_answer = false;
                    }
                    self.tail.drain(..at + marker.len());
                    self.inside = !self.inside;
                    self.awaiting_answer = !self.inside;
                    self.closing = false;
                }
                None => {
                    if !self.inside && !self.tail.trim().is_empty() {
                        self.awaiting_answer = false;
                    }
                    // Keep only what may still begin the marker (with no open marker,
                    // only the prompt opens a block: nothing outside one to watch for).
                    let keep = if marker.is_empty() { 0 } else { partial_suffix(&self.tail, marker) };
                    self.tail.drain(..self.tail.len() - keep);
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(inside: bool, open: &str, close: &str, budget: usize) -> ThinkingBudget {
        ThinkingBudget { inside, open: open.into(), close: close.into(), close_tokens: vec![7, 8, 9], budget }
    }

    /// Runs `outputs` (the text of each token the model would pick) and returns each
    /// step's token: forced (its id) or the model's (None), and the spent count.
    fn run(t: &mut Thinking, outputs: &[&str], forced_text: &[&str; 3]) -> Vec<Option<u32>> {
        let mut taken = Vec::new();
        let mut model = outputs.iter();
        while taken.len() < outputs.len() + 3 {
            match t.forced() {
                Some(id) => {
                    taken.push(Some(id));
                    t.observe(forced_text[(id - 7) as usize]);
                }
                None => match model.next() {
                    Some(text) => {
                        taken.push(None);
                        t.observe(text);
                    }
                    None => break,
                },
            }
        }
        taken
    }

    #[test]
    fn a_spent_budget_forces_the_close_once_per_block() {
        let mut t = Thinking::new(spec(true, "<think>", "</think>", 3));
        let taken = run(&mut t, &["a", "b", "c", "d", "e"], &["\n</", "think>", "\n\n"]);
        assert_eq!(taken, [None, None, None, Some(7), Some(8), Some(9), None, None]);
        assert_eq!(t.spent(), 5, "three of the model's, and the forced tokens up to the marker's end");
        assert!(!t.inside);
        assert_eq!(t.forced(), None, "after the block, nothing is forced");
    }

    #[test]
    fn a_zero_budget_closes_at_once_and_a_model_that_closes_itself_is_left_alone() {
        let mut t = Thinking::new(spec(true, "<think>", "</think>", 0));
        assert_eq!(t.forced(), Some(7));
        let mut t = Thinking::new(spec(true, "<think>", "</think>", 10));
        for piece in ["hm", "</th", "ink>", "answer"] {
            assert_eq!(t.forced(), None);
            t.observe(piece);
        }
        assert!(!t.inside && t.spent() == 3, "a marker split across tokens is found");
    }

    #[test]
    fn a_block_the_model_opens_counts_from_its_marker_and_budgets_add_up() {
        let mut t = Thinking::new(spec(false, "<think>", "</think>", 2));
        for piece in ["Sure", " <th", "ink>", "x"] {
            assert_eq!(t.forced(), None);
            t.observe(piece);
        }
        assert_eq!(t.spent(), 1);
        t.observe("y");
        assert_eq!(t.forced(), Some(7), "two tokens inside: spent");
        // The model's own close still ends the block, forced or not.
        t.observe("</think>");
        assert!(!t.inside);
        t.forcing.clear();
        t.observe("<think>");
        assert_eq!(t.forced(), Some(7), "the budget is for all blocks: a new one closes at once");
    }

    #[test]
    fn an_end_inside_a_block_becomes_its_close_and_an_answer_must_follow() {
        let mut t = Thinking::new(spec(true, "<think>", "</think>", 100));
        let rule = t.rule();
        assert_eq!(rule, StepRule { end_becomes: Some(7), ..StepRule::default() });
        t.observe("hm");
        // The model picked an end: it became token 7, and the close's rest is forced.
        t.close_begun();
        t.observe("\n</");
        assert_eq!(t.rule().forced, Some(8));
        t.observe("think>");
        assert_eq!(t.rule().forced, Some(9));
        t.observe("\n\n");
        assert_eq!(t.rule(), StepRule { ends_banned: true, ..StepRule::default() }, "no empty answer");
        t.observe(" ");
        assert!(t.rule().ends_banned, "whitespace is not an answer");
        t.observe("Red");
        assert_eq!(t.rule(), StepRule::default());
        // A model that closes and answers in one piece of text.
        let mut t = Thinking::new(spec(true, "<think>", "</think>", 100));
        t.observe("x</think>\nBlue");
        assert_eq!(t.rule(), StepRule::default());
    }

    #[test]
    fn channel_markers_whose_close_begins_the_open_marker() {
        let mut t = Thinking::new(spec(false, "<|channel|>thought", "<|channel|>", 5));
        for piece in ["<|channel|>", "thought", " a"] {
            t.observe(piece);
        }
        assert!(t.inside, "`<|channel|>` alone, outside, is only the start of the open marker");
        t.observe("<|channel|>");
        assert!(!t.inside);
        let mut t = Thinking::new(spec(false, "", "</think>", 5));
        t.observe("<think> a");
        assert!(!t.inside && t.spent() == 0, "without an open marker only the prompt opens a block");
    }
}
