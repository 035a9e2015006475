//! Prefix-block hashes: a prompt is cut into blocks of `BLOCK_TOKENS` tokens and block
//! `i`'s hash covers every token of blocks `0..=i` (each hash chains the previous one),
//! so equal hashes mean equal prefixes. The chain starts from a per-model seed, so two
//! models never share a hash. Only whole blocks are hashed: a partial block is never
//! shared.

use sha2::{Digest, Sha256};

/// Tokens per KV-cache block, and so per hashed block.
pub const BLOCK_TOKENS: usize = 16;

/// A block's hash. 64 bits: a collision among the blocks one cluster holds has a
/// probability around n²/2⁶⁵, negligible for any realistic n.
pub type BlockHash = u64;

/// Hashes prompts for one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    seed: BlockHash,
}

impl BlockHasher {
    /// `model` is the served model's name (and revision, where it has one).
    pub fn new(model: &str) -> Self {
        Self { seed: digest(b"tessera-prefix-v1", model.as_bytes()) }
    }

    /// The hash of the block after the one hashed `parent` (the seed for the first).
    pub fn next(&self, parent: Option<BlockHash>, block: &[u32]) -> BlockHash {
        debug_assert_eq!(block.len(), BLOCK_TOKENS);
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        digest(&parent.unwrap_or(self.seed).to_le_bytes(), &bytes)
    }

    /// Hashes of every whole block of `tokens`.
    pub fn hash_prefix(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut parent = None;
        tokens
            .chunks_exact(BLOCK_TOKENS)
            .map(|block| {
                let h = self.next(parent, block);
                parent = Some(h);
                h
            })
            .collect()
    }
}

fn digest(a: &[u8], b: &[u8]) -> BlockHash {
    let mut h = Sha256::new();
    h.update((a.len() as u64).to_le_bytes());
    h.update(a);
    h.update(b);
    let out = h.finalize();
    u64::from_le_bytes(out[..8].try_into().expect("sha256 gives 32 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i * 31 + salt).collect()
    }

    #[test]
    fn only_whole_blocks_are_hashed() {
        let h = BlockHasher::new("m");
        assert_eq!(h.hash_prefix(&tokens(15, 0)).len(), 0);
        assert_eq!(h.hash_prefix(&tokens(16, 0)).len(), 1);
        assert_eq!(h.hash_prefix(&tokens(47, 0)).len(), 2);
    }

    #[test]
    fn equal_prefixes_share_hashes_and_a_change_breaks_every_later_one() {
        let h = BlockHasher::new("m");
        let a = tokens(64, 0);
        let mut b = a.clone();
        b[20] += 1; // inside block 1
        let (ha, hb) = (h.hash_prefix(&a), h.hash_prefix(&b));
        assert_eq!(ha[0], hb[0]);
        assert!(ha[1..].iter().zip(&hb[1..]).all(|(x, y)| x != y));
    }

    #[test]
    fn the_same_block_hashes_differently_after_a_different_prefix() {
        let h = BlockHasher::new("m");
        let block = tokens(16, 5);
        let mut a = tokens(16, 0);
        let mut b = tokens(16, 1);
        a.extend(&block);
        b.extend(&block);
        assert_ne!(h.hash_prefix(&a)[1], h.hash_prefix(&b)[1]);
    }

    #[test]
    fn two_models_never_share_a_hash() {
        let t = tokens(32, 0);
        assert_ne!(BlockHasher::new("a").hash_prefix(&t), BlockHasher::new("b").hash_prefix(&t));
        assert_eq!(BlockHasher::new("a").hash_prefix(&t), BlockHasher::new("a").hash_prefix(&t));
    }
}
