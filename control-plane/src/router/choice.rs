//! Which replica serves a request: the one with the lowest cost, where cost is the
//! prompt blocks it would have to compute (those not in its prefix cache) times a
//! weight, plus its decode load — what it reported running and waiting, and the
//! requests dispatched to it since that report, counted at dispatch so that a burst
//! does not pile onto the replica that looked idle a moment ago.
//!
//! Among equal costs the replica caching the fewest blocks wins: a tenant arriving when
//! nothing is busy goes where its prefix crowds out the least, so tenants spread even
//! when they come one at a time (otherwise every new prefix would land on the first).
//!
//! The prefix index holds, for each replica, exactly the block hashes its cache holds
//! and where (its device, or its second tier, whose blocks are copied back at a tenth
//! of computing them): it starts from the snapshot that opens the replica's load stream
//! and follows the changes after it.

use std::collections::{BTreeMap, HashMap, HashSet};
use tessera_proto::block_hash::BlockHash;

/// The cached blocks of each replica of one model, and where each is held.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    by_hash: HashMap<BlockHash, HashSet<String>>,
    by_replica: HashMap<String, Held>,
}

/// A replica's blocks: on its device, or in its second tier (host memory, disk), from
/// where a prefix is copied back rather than computed.
#[derive(Debug, Default)]
struct Held {
    blocks: HashMap<BlockHash, Place>,
    on_device: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Device,
    Tier,
}

/// How much of a prompt a replica holds: its leading blocks on the device, then the
/// blocks after them in its second tier (as the worker takes them: the device's prefix,
/// then the tier's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Matched {
    pub device: usize,
    pub tier: usize,
}

impl PrefixIndex {
    /// Replaces what is known of `replica`'s cache with a snapshot: `device` on its
    /// device, `tier` in its second tier.
    pub fn reset(&mut self, replica: &str, device: &[BlockHash], tier: &[BlockHash]) {
        self.forget(replica);
        self.store(replica, device);
        self.store_in_tier(replica, tier);
    }

    /// `replica`'s device holds these blocks now.
    pub fn store(&mut self, replica: &str, hashes: &[BlockHash]) {
        self.place(replica, hashes, Place::Device);
    }

    /// `replica`'s second tier holds these blocks now (not its device).
    pub fn store_in_tier(&mut self, replica: &str, hashes: &[BlockHash]) {
        self.place(replica, hashes, Place::Tier);
    }

    fn place(&mut self, replica: &str, hashes: &[BlockHash], place: Place) {
        let mine = self.by_replica.entry(replica.to_string()).or_default();
        for &h in hashes {
            let was = mine.blocks.insert(h, place);
            if was.is_none() {
                self.by_hash.entry(h).or_default().insert(replica.to_string());
            }
            match (was, place) {
                (None | Some(Place::Tier), Place::Device) => mine.on_device += 1,
                (Some(Place::Device), Place::Tier) => mine.on_device -= 1,
                _ => {}
            }
        }
    }

    /// `replica` holds these blocks nowhere any more.
    pub fn remove(&mut self, replica: &str, hashes: &[BlockHash]) {
        let Some(mine) = self.by_replica.get_mut(replica) else { return };
        for h in hashes {
            let Some(was) = mine.blocks.remove(h) else { continue };
            if was == Place::Device {
                mine.on_device -= 1;
            }
            if let Some(holders) = self.by_hash.get_mut(h) {
                holders.remove(replica);
                if holders.is_empty() {
                    self.by_hash.remove(h);
                }
            }
        }
    }

    /// Drops a replica (gone, or its stream broke: it is re-read from a snapshot).
    pub fn forget(&mut self, replica: &str) {
        let Some(mine) = self.by_replica.remove(replica) else { return };
        for h in mine.blocks.into_keys() {
            if let Some(holders) = self.by_hash.get_mut(&h) {
                holders.remove(replica);
                if holders.is_empty() {
                    self.by_hash.remove(&h);
                }
            }
        }
    }

    /// Blocks on the replica's device.
    pub fn cached(&self, replica: &str) -> usize {
        self.by_replica.get(replica).map_or(0, |h| h.on_device)
    }

    /// How many leading blocks of a prompt (its chained block hashes) each replica
    /// holds, on its device and then in its tier. A chain breaks at the first block a
    /// replica lacks: later blocks cannot be reused without it.
    pub fn matched(&self, prompt: &[BlockHash]) -> BTreeMap<String, Matched> {
        let mut out = BTreeMap::new();
        let Some(first) = prompt.first() else { return out };
        let Some(holders) = self.by_hash.get(first) else { return out };
        for replica in holders {
            let mine = &self.by_replica[replica].blocks;
            let at = |h: &BlockHash| mine.get(h).copied();
            let device = prompt.iter().take_while(|h| at(h) == Some(Place::Device)).count();
            let tier = prompt[device..].iter().take_while(|h| at(h) == Some(Place::Tier)).count();
            out.insert(replica.clone(), Matched { device, tier });
        }
        out
    }
}

/// A replica as the choice sees it.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub id: String,
    /// Running plus waiting sequences at its last report.
    pub reported: u32,
    /// Requests sent to it since that report.
    pub dispatched: u32,
    /// Blocks its prefix cache holds.
    pub cached: usize,
}

impl Candidate {
    pub fn load(&self) -> u32 {
        self.reported + self.dispatched
    }
}

/// How a pool picks its replica: by cost (cache and load), or in turn — the baseline
/// the serving benchmark compares against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Routing {
    #[default]
    CacheAware,
    RoundRobin,
}

/// How cache and load weigh against each other.
#[derive(Debug, Clone, Copy)]
pub struct Weights {
    /// Cost of computing one prompt block, in units of one running sequence.
    pub block: f64,
    /// Cost of copying one block back from the second tier: a copy of its bytes
    /// against a forward over its tokens.
    pub tier_block: f64,
    /// A replica with this much load takes nothing more.
    pub saturated: u32,
}

impl Default for Weights {
    /// Saturated at four full batches of the worker's default 256 sequences: a replica
    /// running a full batch still queues (as vLLM does) rather than turning clients away
    /// on a report that predates a finish, and the queue stays short enough to be
    /// answered; past it, 503 with Retry-After.
    fn default() -> Self {
        Self { block: 0.5, tier_block: 0.05, saturated: 1024 }
    }
}

/// The cheapest replica for a prompt of `blocks` blocks of which `matched` are held
/// per replica; None when every candidate is saturated (the caller answers 503).
/// Ties go to the replica caching fewer blocks, then to the first candidate.
pub fn choose<'a>(
    candidates: &'a [Candidate],
    blocks: usize,
    matched: &BTreeMap<String, Matched>,
    w: Weights,
) -> Option<&'a Candidate> {
    let cost = |c: &Candidate| {
        let m = matched.get(&c.id).copied().unwrap_or_default();
        let device = m.device.min(blocks);
        let tier = m.tier.min(blocks - device);
        let uncached = blocks - device - tier;
        uncached as f64 * w.block + tier as f64 * w.tier_block + c.load() as f64
    };
    candidates
        .iter()
        .filter(|c| c.load() < w.saturated)
        .min_by(|a, b| cost(a).total_cmp(&cost(b)).then(a.cached.cmp(&b.cached)))
}

/// Round-robin's pick: turn `turn` over the candidates not saturated.
pub fn in_turn(candidates: &[Candidate], turn: usize, w: Weights) -> Option<&Candidate> {
    let open: Vec<&Candidate> = candidates.iter().filter(|c| c.load() < w.saturated).collect();
    (!open.is_empty()).then(|| open[turn % open.len()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(id: &str, reported: u32, dispatched: u32) -> Candidate {
        Candidate { id: id.into(), reported, dispatched, cached: 0 }
    }

    #[test]
    fn the_index_follows_snapshots_and_changes() {
        let mut ix = PrefixIndex::default();
        let on = |device, tier| Matched { device, tier };
        ix.reset("r1", &[1, 2, 3], &[]);
        ix.store("r2", &[1, 2]);
        assert_eq!(ix.matched(&[1, 2, 3, 4]), BTreeMap::from([("r1".into(), on(3, 0)), ("r2".into(), on(2, 0))]));
        ix.remove("r1", &[2]);
        assert_eq!(ix.matched(&[1, 2, 3]).get("r1"), Some(&on(1, 0)), "the chain breaks at the evicted block");
        // Moved to the second tier: the chain goes on there, and the device holds fewer.
        ix.store_in_tier("r2", &[2, 3]);
        assert_eq!((ix.matched(&[1, 2, 3, 4]).get("r2"), ix.cached("r2")), (Some(&on(1, 2)), 1));
        ix.store("r2", &[2]);
        assert_eq!((ix.matched(&[1, 2, 3]).get("r2"), ix.cached("r2")), (Some(&on(2, 1)), 2), "back on the device");
        // A new snapshot replaces everything known of the replica.
        ix.reset("r1", &[9], &[1]);
        assert_eq!((ix.cached("r1"), ix.matched(&[1, 2]).get("r1")), (1, Some(&on(0, 1))));
        ix.remove("r1", &[1]);
        ix.forget("r2");
        assert!(ix.matched(&[1, 2]).is_empty());
        assert!(!ix.by_hash.contains_key(&1), "no empty holder sets left behind");
    }

    #[test]
    fn cache_wins_until_load_outweighs_it() {
        let w = Weights { block: 0.5, tier_block: 0.05, saturated: 8 };
        let cands = [candidate("a", 0, 0), candidate("b", 2, 0)];
        // 20 blocks, 16 cached on b: b costs 4×0.5+2 = 4, a costs 10.
        let matched = BTreeMap::from([("b".to_string(), Matched { device: 16, tier: 0 })]);
        assert_eq!(choose(&cands, 20, &matched, w).unwrap().id, "b");
        // Dispatched requests count at once: b with 5 more is worse than a.
        let busy = [candidate("a", 0, 0), candidate("b", 2, 7)];
        assert_eq!(choose(&busy, 20, &matched, w).unwrap().id, "a");
        // Nothing cached: the least loaded.
        assert_eq!(choose(&cands, 20, &BTreeMap::new(), w).unwrap().id, "a");
        // Saturated replicas are skipped; all saturated: none.
        let full = [candidate("a", 8, 0), candidate("b", 3, 5)];
        assert!(choose(&full, 20, &matched, w).is_none());
        let one_free = [candidate("a", 8, 0), candidate("b", 1, 0)];
        assert_eq!(choose(&one_free, 1, &BTreeMap::new(), w).unwrap().id, "b");
    }

    #[test]
    fn round_robin_takes_turns_over_the_unsaturated_ignoring_the_cache() {
        let w = Weights { block: 0.5, tier_block: 0.05, saturated: 4 };
        let mut cands = [candidate("a", 0, 0), candidate("b", 4, 0), candidate("c", 1, 0)];
        cands[0].cached = 100;
        let picks: Vec<&str> = (0..4).map(|t| in_turn(&cands, t, w).unwrap().id.as_str()).collect();
        assert_eq!(picks, ["a", "c", "a", "c"], "b is saturated");
        assert!(in_turn(&[candidate("a", 4, 0)], 0, w).is_none());
    }

    #[test]
    fn equal_costs_go_to_the_emptier_cache() {
        let w = Weights::default();
        let mut cands = [candidate("a", 0, 0), candidate("b", 0, 0), candidate("c", 0, 0)];
        cands[0].cached = 40;
        cands[1].cached = 20;
        cands[2].cached = 20;
        assert_eq!(choose(&cands, 20, &BTreeMap::new(), w).unwrap().id, "b", "fewest cached, then first");
        // Cost still comes first: a holds this prompt.
        let matched = BTreeMap::from([("a".to_string(), Matched { device: 20, tier: 0 })]);
        assert_eq!(choose(&cands, 20, &matched, w).unwrap().id, "a");
    }

    #[test]
    fn a_prefix_in_the_second_tier_scores_between_the_device_and_a_miss() {
        let w = Weights::default();
        let cands = [candidate("device", 0, 0), candidate("tier", 0, 0), candidate("miss", 0, 0)];
        let all = BTreeMap::from([
            ("device".to_string(), Matched { device: 20, tier: 0 }),
            ("tier".to_string(), Matched { device: 4, tier: 16 }),
        ]);
        assert_eq!(choose(&cands, 20, &all, w).unwrap().id, "device");
        let no_device = BTreeMap::from([("tier".to_string(), Matched { device: 4, tier: 16 })]);
        assert_eq!(choose(&cands, 20, &no_device, w).unwrap().id, "tier");
        // Copying 16 blocks back (0.8) is worth a little load: not a running sequence more.
        let busy = [candidate("tier", 1, 0), candidate("miss", 0, 0)];
        assert_eq!(choose(&busy, 20, &no_device, w).unwrap().id, "tier");
        let busier = [candidate("tier", 10, 0), candidate("miss", 0, 0)];
        assert_eq!(choose(&busier, 20, &no_device, w).unwrap().id, "miss");
    }
}
