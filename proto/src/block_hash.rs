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
        self.next_with_images(parent, block, &[])
    }

    /// `next` for a block holding tokens of the images whose content hashes are
    /// `images`: the same placeholder tokens with another image hash differently.
    pub fn next_with_images(&self, parent: Option<BlockHash>, block: &[u32], images: &[[u8; 32]]) -> BlockHash {
        debug_assert_eq!(block.len(), BLOCK_TOKENS);
        let mut bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        images.iter().for_each(|h| bytes.extend_from_slice(h));
        digest(&parent.unwrap_or(self.seed).to_le_bytes(), &bytes)
    }

    /// Hashes of every whole block of `tokens`.
    pub fn hash_prefix(&self, tokens: &[u32]) -> Vec<BlockHash> {
        self.hash_prompt(tokens, &[])
    }

    /// Hashes of every whole block of a prompt whose `images` take the token ranges
    /// they name.
    pub fn hash_prompt(&self, tokens: &[u32], images: &[ImageSpan]) -> Vec<BlockHash> {
        let mut hashes = Vec::with_capacity(tokens.len() / BLOCK_TOKENS);
        self.extend(&mut hashes, tokens, images);
        hashes
    }

    /// Extends `hashes` (those of the first blocks of `tokens`) over every whole block.
    pub fn extend(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32], images: &[ImageSpan]) {
        while hashes.len() < tokens.len() / BLOCK_TOKENS {
            let b = hashes.len();
            let range = b * BLOCK_TOKENS..(b + 1) * BLOCK_TOKENS;
            let inside: Vec<[u8; 32]> =
                images.iter().filter(|i| i.start < range.end && range.start < i.end).map(|i| i.sha256).collect();
            let h = self.next_with_images(hashes.last().copied(), &tokens[range], &inside);
            hashes.push(h);
        }
    }
}

/// Where each image sits in a prompt whose runs of `image_token` are filled, in order,
/// by images of `tokens[i]` tokens each (hashes `sha256[i]`): from its first token to
/// its last. None when the prompt's image tokens are not as many as the images'.
pub fn image_spans(prompt: &[u32], image_token: u32, images: &[(usize, [u8; 32])]) -> Option<Vec<ImageSpan>> {
    let positions: Vec<usize> = prompt.iter().enumerate().filter(|(_, t)| **t == image_token).map(|(i, _)| i).collect();
    if positions.len() != images.iter().map(|i| i.0).sum::<usize>() {
        return None;
    }
    let mut first = 0;
    let mut spans = Vec::with_capacity(images.len());
    for &(tokens, sha256) in images {
        if tokens == 0 {
            return None;
        }
        spans.push(ImageSpan { start: positions[first], end: positions[first + tokens - 1] + 1, sha256 });
        first += tokens;
    }
    Some(spans)
}

/// The tokens `start..end` of a prompt that stand for one image, and the SHA-256 of
/// the image's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpan {
    pub start: usize,
    pub end: usize,
    pub sha256: [u8; 32],
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
    fn blocks_holding_an_image_hash_by_its_content() {
        let h = BlockHasher::new("m");
        let t = tokens(48, 0);
        // The image takes tokens 20..30: block 1 only.
        let span = |b: u8| ImageSpan { start: 20, end: 30, sha256: [b; 32] };
        let (a, b) = (h.hash_prompt(&t, &[span(1)]), h.hash_prompt(&t, &[span(2)]));
        assert_eq!(a[0], b[0]);
        assert!(a[1..].iter().zip(&b[1..]).all(|(x, y)| x != y), "another image changes its block and all later");
        assert_eq!(a, h.hash_prompt(&t, &[span(1)]), "the same image hashes the same");
        assert_eq!(h.hash_prompt(&t, &[]), h.hash_prefix(&t));
        assert_ne!(a[1], h.hash_prefix(&t)[1], "an image's block never matches text alone");
    }

    #[test]
    fn image_spans_run_from_first_to_last_token() {
        // Token 9 is the image token: image A takes 4 (across a marker), B takes 1.
        let prompt = [1, 9, 9, 9, 2, 9, 9, 3];
        let spans = image_spans(&prompt, 9, &[(4, [1; 32]), (1, [2; 32])]).unwrap();
        assert_eq!((spans[0].start, spans[0].end, spans[1].start, spans[1].end), (1, 6, 6, 7));
        assert!(image_spans(&prompt, 9, &[(4, [1; 32])]).is_none());
    }

    #[test]
    fn two_models_never_share_a_hash() {
        let t = tokens(32, 0);
        assert_ne!(BlockHasher::new("a").hash_prefix(&t), BlockHasher::new("b").hash_prefix(&t));
        assert_eq!(BlockHasher::new("a").hash_prefix(&t), BlockHasher::new("a").hash_prefix(&t));
    }
}
