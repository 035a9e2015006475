//! Prompt-lookup decoding: the tokens that followed the last place the sequence's own
//! latest n tokens appeared (in its prompt or its output so far) are proposed to follow
//! them again. Code edits, summaries and answers that quote their input repeat long
//! runs of it; nothing is learnt, and a sequence without a match costs nothing.

use super::{Proposal, Proposer};

/// Longest and shortest suffixes looked up, longest first: a longer match is a better
/// guess. A single token is the last resort: its guesses are kept less often, but
/// where a step's extra rows cost little (one stream) they still pay, and where rows
/// are dear the sequence's lower acceptance has fewer of them verified. Fresh code and
/// chat, which seldom repeat two tokens in a row, gain most from it
/// (`bench/results/2026-11-29-issue47-single-token.md`).
const MAX_N: usize = 4;
const MIN_N: usize = 1;

#[derive(Debug, Default)]
pub struct NgramProposer;

impl Proposer for NgramProposer {
    fn propose(&mut self, seqs: &[Proposal<'_>]) -> Vec<Vec<u32>> {
        seqs.iter().map(|p| lookup(p.tokens, p.max)).collect()
    }
}

/// Up to `max` tokens that followed the most recent earlier occurrence of the longest
/// suffix of `tokens` (of `MIN_N..=MAX_N` tokens) that occurred before.
pub fn lookup(tokens: &[u32], max: usize) -> Vec<u32> {
    lookup_match(tokens, max).map(|(_, next)| next).unwrap_or_default()
}

/// `lookup`, with the length of the suffix matched; None without a match.
pub fn lookup_match(tokens: &[u32], max: usize) -> Option<(usize, Vec<u32>)> {
    if max == 0 {
        return None;
    }
    let len = tokens.len();
    for n in (MIN_N..=MAX_N.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Occurrences ending before the last token: each has a continuation.
        let found = (0..len - n).rev().find(|&at| &tokens[at..at + n] == suffix);
        if let Some(at) = found {
            let from = at + n;
            return Some((n, tokens[from..(from + max).min(len)].to_vec()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_suffix_seen_before_proposes_what_followed_it_most_recently() {
        // "1 2 3 4" appeared at 0 (followed by 5 6) and later "9 3 4" (followed by 8):
        // the 3-token suffix "2 3 4" wins over the more recent 2-token "3 4".
        let tokens = [1, 2, 3, 4, 5, 6, 9, 3, 4, 8, 7, 2, 3, 4];
        assert_eq!(lookup(&tokens, 3), vec![5, 6, 9]);
        // Only a 2-token match: the most recent one.
        let tokens = [3, 4, 5, 0, 3, 4, 6, 7, 3, 4];
        assert_eq!(lookup(&tokens, 2), vec![6, 7]);
    }

    #[test]
    fn proposals_stop_at_the_end_of_the_sequence_and_at_max() {
        // The repeat overlaps the suffix itself: "5 5" was last seen one token earlier.
        assert_eq!(lookup(&[5, 5, 5], 4), vec![5]);
        assert_eq!(lookup(&[1, 2, 3, 1, 2], 1), vec![3]);
        assert_eq!(lookup(&[1, 2, 3, 1, 2], 0), Vec::<u32>::new());
    }

    #[test]
    fn nothing_is_proposed_without_a_repeat() {
        assert!(lookup(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(lookup(&[7], 4).is_empty());
        assert!(lookup(&[], 4).is_empty());
    }

    #[test]
    fn a_single_token_is_the_last_resort() {
        // Only "9" repeats: what followed its last occurrence.
        assert_eq!(lookup(&[1, 9, 2, 9], 4), vec![2, 9]);
        assert_eq!(lookup_match(&[1, 9, 2, 9], 4), Some((1, vec![2, 9])));
        // A two-token match wins over a more recent single token.
        assert_eq!(lookup_match(&[4, 5, 6, 5, 7, 4, 5], 1), Some((2, vec![6])));
    }
}
