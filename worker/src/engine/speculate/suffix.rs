//! Suffix speculation: besides the sequence's own prompt and output (as `ngram`), the
//! text of the replica's recent requests of the same tenant — prompts and outputs of
//! finished sequences — is searched for the sequence's latest tokens, and what followed
//! there is proposed (vLLM's suffix decoding does this with suffix trees; here, hashed
//! n-gram keys over a ring of recent tokens). Agents and tools that send the same
//! scaffolding again and again, and answers that repeat earlier answers, are where it
//! pays.
//!
//! Nothing crosses between tenants (organizations): each has an index of its own. A
//! proposal cannot change an output (the model verifies it; outputs are the same with
//! speculation off), but how fast a stream runs would show whether text like it was
//! seen recently — a timing side channel, as a shared prefix cache has one — so another
//! organization's requests never feed it.
//!
//! Memory is bounded: each tenant keeps its last `TENANT_TOKENS` tokens (its ring grows
//! as text arrives), and past `TOTAL_TOKENS` over all tenants the least recently used
//! tenant's index goes; each index's keys are pruned to the positions its ring holds.

use super::ngram;
use super::{Proposal, Proposer};
use crate::engine::sequence::SeqId;
use std::collections::HashMap;
use std::hash::BuildHasher;

/// Tokens one tenant's index keeps (the most recent).
pub const TENANT_TOKENS: usize = 1 << 16;
/// Tokens all tenants' indexes keep between them.
pub const TOTAL_TOKENS: usize = 1 << 18;
/// Lengths of the keys looked up: a long match first (a precise guess), then a short one.
const LONG_KEY: usize = 8;
const SHORT_KEY: usize = 3;
/// Between documents in the ring: no key or proposal spans it (no token has this id).
const SEPARATOR: u32 = u32::MAX;

/// The recent text of one tenant and where each key last occurred in it.
struct TenantIndex {
    /// Tokens by absolute position modulo `TENANT_TOKENS`; it grows to that as text
    /// arrives, then wraps.
    ring: Vec<u32>,
    /// Tokens written since the index began (the next absolute position).
    written: u64,
    /// Key hash → the absolute position just after the key's latest occurrence.
    long: HashMap<u64, u64>,
    short: HashMap<u64, u64>,
    /// When the tenant was last served (the proposer's clock), for eviction.
    used: u64,
}

impl TenantIndex {
    fn new() -> Self {
        Self { ring: Vec::new(), written: 0, long: HashMap::new(), short: HashMap::new(), used: 0 }
    }

    /// Tokens the index holds now.
    fn len(&self) -> usize {
        self.ring.len()
    }

    fn at(&self, pos: u64) -> Option<u32> {
        let oldest = self.written.saturating_sub(TENANT_TOKENS as u64);
        (pos >= oldest && pos < self.written).then(|| self.ring[(pos % TENANT_TOKENS as u64) as usize])
    }

    fn push(&mut self, token: u32) {
        match self.ring.len() < TENANT_TOKENS {
            true => self.ring.push(token),
            false => self.ring[(self.written % TENANT_TOKENS as u64) as usize] = token,
        }
        self.written += 1;
    }

    /// Appends a document, keying every position of it.
    fn add(&mut self, hasher: &impl BuildHasher, tokens: &[u32]) {
        let tokens = &tokens[tokens.len().saturating_sub(TENANT_TOKENS - 1)..];
        self.push(SEPARATOR);
        for (i, &t) in tokens.iter().enumerate() {
            self.push(t);
            let after = self.written;
            if i + 1 >= SHORT_KEY {
                self.short.insert(key(hasher, &tokens[i + 1 - SHORT_KEY..=i]), after);
            }
            if i + 1 >= LONG_KEY {
                self.long.insert(key(hasher, &tokens[i + 1 - LONG_KEY..=i]), after);
            }
        }
        // Keys whose position has left the ring go, so the maps stay bounded.
        if self.short.len() > 2 * TENANT_TOKENS {
            let oldest = self.written.saturating_sub(TENANT_TOKENS as u64);
            self.short.retain(|_, p| *p > oldest);
            self.long.retain(|_, p| *p > oldest);
        }
    }

    /// What followed the latest earlier occurrence of `suffix`'s last `key_len` tokens
    /// (checked token by token: a hash can collide, and the ring moves on), with how
    /// many of `suffix`'s tokens matched before it.
    fn continuation(
        &self,
        hasher: &impl BuildHasher,
        suffix: &[u32],
        key_len: usize,
        max: usize,
    ) -> Option<(usize, Vec<u32>)> {
        if suffix.len() < key_len {
            return None;
        }
        let map = if key_len == LONG_KEY { &self.long } else { &self.short };
        let &after = map.get(&key(hasher, &suffix[suffix.len() - key_len..]))?;
        let matched = (1..=suffix.len())
            .take_while(|&j| after >= j as u64 && self.at(after - j as u64) == Some(suffix[suffix.len() - j]))
            .count();
        if matched < key_len {
            return None;
        }
        let next: Vec<u32> =
            (0..max as u64).map_while(|j| self.at(after + j)).take_while(|&t| t != SEPARATOR).collect();
        (!next.is_empty()).then_some((matched, next))
    }
}

fn key(hasher: &impl BuildHasher, tokens: &[u32]) -> u64 {
    hasher.hash_one(tokens)
}

#[derive(Default)]
pub struct SuffixProposer {
    tenants: HashMap<String, TenantIndex>,
    hasher: std::collections::hash_map::RandomState,
    clock: u64,
}

impl SuffixProposer {
    /// Tokens held over all tenants.
    fn held(&self) -> usize {
        self.tenants.values().map(TenantIndex::len).sum()
    }

    /// The guess for one sequence: the longer of its own match (`ngram`) and its
    /// tenant's.
    fn guess(&self, p: &Proposal<'_>) -> Vec<u32> {
        let own = ngram::lookup_match(p.tokens, p.max);
        let seen = self.tenants.get(p.tenant).and_then(|t| {
            t.continuation(&self.hasher, p.tokens, LONG_KEY, p.max)
                .or_else(|| t.continuation(&self.hasher, p.tokens, SHORT_KEY, p.max))
        });
        match (own, seen) {
            (Some((n, own)), Some((m, seen))) => {
                if m > n {
                    seen
                } else {
                    own
                }
            }
            (Some((_, own)), None) => own,
            (None, Some((_, seen))) => seen,
            (None, None) => Vec::new(),
        }
    }
}

impl Proposer for SuffixProposer {
    fn propose(&mut self, seqs: &[Proposal<'_>]) -> Vec<Vec<u32>> {
        self.clock += 1;
        for p in seqs {
            if let Some(t) = self.tenants.get_mut(p.tenant) {
                t.used = self.clock;
            }
        }
        seqs.iter().map(|p| self.guess(p)).collect()
    }

    fn finished(&mut self, _id: SeqId, tenant: &str, tokens: &[u32]) {
        self.clock += 1;
        let index = self.tenants.entry(tenant.to_string()).or_insert_with(TenantIndex::new);
        index.used = self.clock;
        index.add(&self.hasher, tokens);
        while self.held() > TOTAL_TOKENS {
            let Some(oldest) = self.tenants.iter().min_by_key(|(_, t)| t.used).map(|(k, _)| k.clone()) else { break };
            self.tenants.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask<'a>(tenant: &'a str, tokens: &'a [u32], max: usize) -> Proposal<'a> {
        Proposal { id: 1, tenant, tokens, max }
    }

    #[test]
    fn a_tenants_earlier_text_is_proposed_to_its_later_requests_only() {
        let mut s = SuffixProposer::default();
        let earlier: Vec<u32> = (100..140).collect();
        s.finished(1, "org-a", &earlier);
        // A new request of org-a reaches 110..113: what followed is proposed.
        let now = [7, 8, 110, 111, 112];
        assert_eq!(s.propose(&[ask("org-a", &now, 4)]), vec![vec![113, 114, 115, 116]]);
        // Another organization's request, the same tokens: nothing.
        assert_eq!(s.propose(&[ask("org-b", &now, 4)]), vec![Vec::<u32>::new()]);
        // The proposal stops at the end of the earlier document.
        let end = [137, 138, 139];
        assert_eq!(s.propose(&[ask("org-a", &end, 4)]), vec![Vec::<u32>::new()]);
    }

    #[test]
    fn the_longer_match_wins_between_the_sequence_and_its_tenant() {
        let mut s = SuffixProposer::default();
        s.finished(1, "t", &[1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 51]);
        // Own text repeats "8 9" (2 tokens, followed by 60); the tenant's matched 9.
        let tokens = [1, 2, 3, 4, 5, 6, 8, 9, 60, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(s.propose(&[ask("t", &tokens, 2)]), vec![vec![50, 51]]);
        // Own 4-token match against the tenant's 3: its own.
        let mut s = SuffixProposer::default();
        s.finished(1, "t", &[0, 3, 4, 5, 70]);
        let tokens = [2, 3, 4, 5, 80, 2, 3, 4, 5];
        assert_eq!(s.propose(&[ask("t", &tokens, 1)]), vec![vec![80]]);
    }

    #[test]
    fn memory_stays_bounded_and_the_least_recently_used_tenant_goes_first() {
        let mut s = SuffixProposer::default();
        let doc: Vec<u32> = (0..20_000).collect();
        for t in 0..20 {
            s.finished(t, &format!("org-{t}"), &doc);
            // org-0 stays in use.
            s.propose(&[ask("org-0", &[1, 2, 3], 1)]);
        }
        assert!(s.held() <= TOTAL_TOKENS, "{}", s.held());
        assert!(s.tenants.contains_key("org-0"), "in use, kept");
        assert!(!s.tenants.contains_key("org-1"), "least recently used, evicted");
        // One tenant's ring wraps: old text goes, recent text stays found.
        let mut s = SuffixProposer::default();
        for k in 0..10u32 {
            let doc: Vec<u32> = (0..10_000).map(|i| k * 100_000 + i).collect();
            s.finished(1, "t", &doc);
        }
        let t = &s.tenants["t"];
        assert_eq!(t.len(), TENANT_TOKENS);
        assert!(t.short.len() <= 2 * TENANT_TOKENS + 10_000);
        assert!(s.propose(&[ask("t", &[0, 1, 2], 2)])[0].is_empty(), "overwritten");
        assert_eq!(s.propose(&[ask("t", &[900_000, 900_001, 900_002], 2)]), vec![vec![900_003, 900_004]]);
    }
}
