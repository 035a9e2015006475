//! The KV-cache block pool: which physical blocks are in use, by how many sequences,
//! and which hold a full block of a known prefix (automatic prefix caching).
//!
//! Invariants:
//! - a block is either referenced (`refs > 0`) or in the free queue, never both;
//! - a block with a hash is in `cached` under that hash, and only one block per hash;
//! - the free queue is in eviction order: allocation takes the head; a freed block goes
//!   to the tail, so unreferenced cached blocks are evicted least recently used first;
//! - a prefix hit on a free cached block takes it out of the queue (it is in use again).
//!
//! Plain synchronous data: the engine thread owns it; no locks.

use std::collections::HashMap;
use tessera_proto::block_hash::BlockHash;

pub type BlockId = u32;

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    refs: u32,
    hash: Option<BlockHash>,
    // Free-queue links (NONE at the ends or when not queued).
    prev: u32,
    next: u32,
    queued: bool,
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Full prompt blocks looked up in the cache.
    pub queried_blocks: u64,
    /// Of those, found.
    pub hit_blocks: u64,
}

/// What changed in the cache, for the router's prefix index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvEvents {
    pub stored: Vec<BlockHash>,
    pub removed: Vec<BlockHash>,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    free: usize,
    cached: HashMap<BlockHash, BlockId>,
    stats: PoolStats,
    events: KvEvents,
    /// Cached blocks handed out again since the last `take_evicted`, when a second tier
    /// wants their contents (None: nobody does).
    evicted: Option<Vec<(BlockId, BlockHash)>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NONE as usize, "too many blocks");
        let mut pool = Self {
            blocks: vec![Block { refs: 0, hash: None, prev: NONE, next: NONE, queued: false }; num_blocks],
            head: NONE,
            tail: NONE,
            free: 0,
            cached: HashMap::new(),
            stats: PoolStats::default(),
            events: KvEvents::default(),
            evicted: None,
        };
        for id in 0..num_blocks as u32 {
            pool.push_tail(id);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free, cached or not).
    pub fn num_free(&self) -> usize {
        self.free
    }

    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.free
    }

    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    /// Every hash the cache holds now (in no particular order): what a new watcher of
    /// the cache starts from, before the changes that follow.
    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        self.cached.keys().copied().collect()
    }

    /// The cache changes since the last call.
    pub fn take_events(&mut self) -> KvEvents {
        std::mem::take(&mut self.events)
    }

    /// Keeps a list of the cached blocks `allocate` evicts (their contents are still
    /// there until the next forward writes them), for a second tier to copy.
    pub fn track_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The blocks evicted since the last call, in order, with the hash each held.
    pub fn take_evicted(&mut self) -> Vec<(BlockId, BlockHash)> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Every cached block and its hash, the least recently used first (those free in
    /// eviction order, then those in use).
    pub fn cached_by_age(&self) -> Vec<(BlockId, BlockHash)> {
        let mut out = Vec::with_capacity(self.cached.len());
        let mut id = self.head;
        while id != NONE {
            let b = &self.blocks[id as usize];
            if let Some(h) = b.hash {
                out.push((id, h));
            }
            id = b.next;
        }
        out.extend(self.cached.iter().filter(|&(_, &id)| self.blocks[id as usize].refs > 0).map(|(&h, &id)| (id, h)));
        out
    }

    /// Forgets what block `id` holds (its copy-in failed: it holds something else), so
    /// that no prefix is served from it.
    pub fn uncache(&mut self, id: BlockId) {
        if let Some(h) = self.blocks[id as usize].hash.take() {
            self.cached.remove(&h);
            self.events.removed.push(h);
        }
    }

    /// Whether a block holds `hash` now.
    pub fn holds(&self, hash: BlockHash) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Takes `n` blocks with one reference each, evicting the least recently used
    /// cached ones as needed; None (and nothing taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            if let Some(h) = self.blocks[id as usize].hash.take() {
                self.cached.remove(&h);
                self.events.removed.push(h);
                if let Some(evicted) = &mut self.evicted {
                    evicted.push((id, h));
                }
            }
            self.blocks[id as usize].refs = 1;
            out.push(id);
        }
        Some(out)
    }

    /// How many of `hashes` lead a prefix cached on the device (not counted as a query).
    pub fn cached_prefix_len(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.cached.contains_key(h)).count()
    }

    /// The blocks holding the longest cached prefix of `hashes` (a prompt's full blocks,
    /// in order), each with one more reference. Counts toward the hit statistics.
    pub fn take_cached_prefix(&mut self, hashes: &[BlockHash]) -> Vec<BlockId> {
        self.stats.queried_blocks += hashes.len() as u64;
        let mut out = Vec::new();
        for h in hashes {
            let Some(&id) = self.cached.get(h) else { break };
            self.add_ref(id);
            out.push(id);
        }
        self.stats.hit_blocks += out.len() as u64;
        out
    }

    /// One more reference to a block in use (a fork sharing it, `n` > 1).
    pub fn add_ref(&mut self, id: BlockId) {
        if self.blocks[id as usize].queued {
            self.unlink(id);
        }
        self.blocks[id as usize].refs += 1;
    }

    /// Records that `id` now holds the full block hashed `hash`. If another block already
    /// holds it (two sequences computed the same prefix at once), `id` stays uncached.
    pub fn cache(&mut self, id: BlockId, hash: BlockHash) {
        let block = &self.blocks[id as usize];
        debug_assert!(block.refs > 0, "caching a free block");
        if block.hash.is_some() || self.cached.contains_key(&hash) {
            return;
        }
        self.blocks[id as usize].hash = Some(hash);
        self.cached.insert(hash, id);
        self.events.stored.push(hash);
    }

    /// Drops one reference from each block. Pass a sequence's blocks last to first: the
    /// tail of a prefix is then evicted before its head, which more requests share. A
    /// freed block that holds no cached prefix goes to the head of the queue, to be
    /// handed out before any that does (speculation frees such blocks every step).
    pub fn release(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let block = &mut self.blocks[id as usize];
            assert!(block.refs > 0, "block {id} released more often than taken");
            block.refs -= 1;
            if block.refs == 0 {
                match block.hash {
                    Some(_) => self.push_tail(id),
                    None => self.push_head(id),
                }
            }
        }
    }

    pub fn refs(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].refs
    }

    fn push_tail(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(!b.queued);
        b.queued = true;
        b.prev = self.tail;
        b.next = NONE;
        if self.tail == NONE {
            self.head = id;
        } else {
            self.blocks[self.tail as usize].next = id;
        }
        self.tail = id;
        self.free += 1;
    }

    fn push_head(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(!b.queued);
        b.queued = true;
        b.prev = NONE;
        b.next = self.head;
        if self.head == NONE {
            self.tail = id;
        } else {
            self.blocks[self.head as usize].prev = id;
        }
        self.head = id;
        self.free += 1;
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.queued);
            b.queued = false;
            (std::mem::replace(&mut b.prev, NONE), std::mem::replace(&mut b.next, NONE))
        };
        if prev == NONE {
            self.head = next
        } else {
            self.blocks[prev as usize].next = next
        }
        if next == NONE {
            self.tail = prev
        } else {
            self.blocks[next as usize].prev = prev
        }
        self.free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_block_without_a_prefix_is_handed_out_before_cached_ones() {
        let mut pool = BlockPool::new(3);
        let b = pool.allocate(3).unwrap();
        pool.cache(b[0], 7);
        pool.release([b[0]]);
        // An empty block freed after the cached one: taken first, the prefix survives.
        pool.release([b[1]]);
        assert_eq!(pool.allocate(1).unwrap(), vec![b[1]]);
        assert_eq!(pool.cached_hashes(), vec![7]);
        pool.release([b[2], b[1]]);
        assert_eq!(pool.allocate(2).unwrap(), vec![b[1], b[2]]);
        assert_eq!(pool.take_events().removed, Vec::<BlockHash>::new());
    }

    #[test]
    fn allocation_takes_free_blocks_and_fails_whole_when_short() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.allocate(2), None);
        assert_eq!(pool.num_free(), 1, "a failed allocation takes nothing");
        pool.release(a.into_iter().rev());
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn a_released_cached_block_is_found_again_until_evicted() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate(2).unwrap();
        pool.cache(a[0], 100);
        pool.cache(a[1], 101);
        pool.release(a.iter().rev().copied());
        // Still cached while free.
        let hit = pool.take_cached_prefix(&[100, 101, 102]);
        assert_eq!(hit, a);
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.stats(), PoolStats { queried_blocks: 3, hit_blocks: 2 });
        pool.release(hit.iter().rev().copied());
        // Allocating everything evicts them, least recently used first.
        let all = pool.allocate(3).unwrap();
        assert_eq!(all[0], 2, "the never-cached block goes first");
        assert_eq!(pool.take_cached_prefix(&[100]), Vec::<BlockId>::new());
        let events = pool.take_events();
        assert_eq!(events.stored, vec![100, 101]);
        assert_eq!(events.removed, vec![101, 100], "the tail of the prefix was freed first");
        assert_eq!(pool.take_events(), KvEvents::default());
    }

    #[test]
    fn shared_blocks_return_to_the_pool_with_the_last_reference() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate(1).unwrap();
        pool.add_ref(a[0]);
        assert_eq!(pool.refs(a[0]), 2);
        pool.release(a.clone());
        assert_eq!(pool.num_free(), 1);
        pool.release(a);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn the_prefix_stops_at_the_first_miss() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).unwrap();
        pool.cache(a[0], 1);
        pool.cache(a[2], 3);
        assert_eq!(pool.take_cached_prefix(&[1, 2, 3]), vec![a[0]]);
    }

    #[test]
    fn a_hash_is_cached_once() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(2).unwrap();
        pool.cache(a[0], 7);
        pool.cache(a[1], 7);
        pool.release(a.clone());
        assert_eq!(pool.take_cached_prefix(&[7]), vec![a[0]]);
        assert_eq!(pool.take_events().stored, vec![7]);
    }

    #[test]
    fn random_operations_keep_the_counts_consistent() {
        // A small deterministic walk over allocate / cache / hit / release.
        let mut pool = BlockPool::new(16);
        let mut held: Vec<Vec<BlockId>> = Vec::new();
        let mut x = 12345u64;
        for step in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 4 {
                0 => {
                    if let Some(b) = pool.allocate((x >> 8) as usize % 4 + 1) {
                        for (i, &id) in b.iter().enumerate() {
                            pool.cache(id, (x >> 16) % 8 + i as u64);
                        }
                        held.push(b);
                    }
                }
                1 => held.push(pool.take_cached_prefix(&[(x >> 16) % 8, (x >> 20) % 8])),
                _ => {
                    if !held.is_empty() {
                        let b = held.swap_remove((x >> 8) as usize % held.len());
                        pool.release(b.into_iter().rev());
                    }
                }
            }
            let referenced: usize = (0..16).filter(|&id| pool.refs(id) > 0).count();
            assert_eq!(pool.num_used(), referenced, "step {step}");
            let total_refs: u32 = (0..16).map(|id| pool.refs(id)).sum();
            assert_eq!(total_refs as usize, held.iter().map(Vec::len).sum::<usize>(), "step {step}");
        }
    }
}
