//! Weight rows kept quantised (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, Q6_K): 6 to 10 bits a
//! weight in memory instead of f32's 32. Products round their inputs to bytes and
//! multiply in integers (`int8`); the exact path dequantises the few rows a task owns
//! into a scratch buffer and shares them across every input row (`tiles`).
//!
//! At load the ggml blocks are repacked (`repack`) into one of three layouts of
//! 32-weight blocks with f32 scales, then interleaved 16 rows at a time for the integer
//! products: within a group of 16 rows (the last one padded with zero rows), block
//! after block, each 64-byte chunk holds the same 4 weights of every row — bytes
//! `4i..4i + 4` are row `i`'s — so one load feeds one `vpdpbusd` whose 16 lanes are the
//! 16 rows, and no product is ever summed across lanes. `Nibbles` chunks hold 8 weights
//! a row (chunk `c`: weights `4c..4c + 4` in the low nibbles, `16 + 4c..` in the high
//! ones); byte chunks hold `w + 128`, unsigned, as `vpdpbusd` reads them. Scales and
//! offsets follow the same order: 16 to a block (per half-block for `BytesHalves`).

use super::huge_pages::Pinned;
use super::int8::{self, Q8Rows};
use super::matmul::Strides;
use super::repack::repack;
use super::simd::multiversion;
use crate::quant::GgmlType;

pub(super) const BLOCK: usize = 32;
/// Rows interleaved together: the lanes of a 512-bit register of i32.
pub(super) const GROUP_ROWS: usize = 16;
/// A chunk: 4 bytes of each of the group's rows.
pub(super) const CHUNK: usize = 4 * GROUP_ROWS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// 16 bytes of 4-bit values a block (low nibbles are elements 0..16, high 16..32);
    /// weight d·q + m.
    Nibbles,
    /// 32 signed bytes a block; weight d·q.
    Bytes,
    /// 32 signed bytes a block, each 16 with its own d; weight d·q.
    BytesHalves,
}

impl Layout {
    /// Bytes of packed values a block of one row.
    pub(super) const fn q_len(self) -> usize {
        match self {
            Self::Nibbles => 16,
            Self::Bytes | Self::BytesHalves => 32,
        }
    }

    /// Scales (`d`) a block of one row.
    pub(super) const fn scales(self) -> usize {
        match self {
            Self::BytesHalves => 2,
            Self::Nibbles | Self::Bytes => 1,
        }
    }
}

#[derive(Debug, Clone)]
pub struct QuantRows {
    layout: Layout,
    rows: usize,
    blocks_per_row: usize,
    /// Group after group, block after block: `layout.chunks()` chunks. On huge pages,
    /// as the scales and offsets: a decode step streams them all.
    qs: Pinned<u8>,
    /// Group after group, block after block: `layout.scales()` × 16 scales.
    d: Pinned<f32>,
    /// Group after group, block after block: 16 offsets (`Nibbles`), else empty.
    m: Pinned<f32>,
}

/// One group of 16 rows: its chunks, scales and offsets, `blocks_per_row` blocks.
pub(super) struct Group<'a> {
    pub layout: Layout,
    pub blocks_per_row: usize,
    pub qs: &'a [u8],
    pub d: &'a [f32],
    pub m: &'a [f32],
}

impl QuantRows {
    /// Repacks rows of whole blocks, or None for formats this does not read.
    pub fn from_blocks(ty: GgmlType, bytes: &[u8], cols: usize) -> Option<Self> {
        let p = repack(ty, bytes)?;
        let (layout, bpr) = (p.layout, cols / BLOCK);
        let (q_len, scales) = (layout.q_len(), layout.scales());
        let rows = p.qs.len() / q_len / bpr.max(1);
        let groups = rows.div_ceil(GROUP_ROWS);
        let mut q = Self {
            layout,
            rows,
            blocks_per_row: bpr,
            qs: Pinned::zeroed(groups * bpr * GROUP_ROWS * q_len),
            d: Pinned::zeroed(groups * bpr * GROUP_ROWS * scales),
            m: Pinned::zeroed(if layout == Layout::Nibbles { groups * bpr * GROUP_ROWS } else { 0 }),
        };
        let flip = if layout == Layout::Nibbles { 0 } else { 0x80 };
        for r in 0..rows {
            let (g, i) = (r / GROUP_ROWS, r % GROUP_ROWS);
            for b in 0..bpr {
                let src = &p.qs[(r * bpr + b) * q_len..][..q_len];
                let at = (g * bpr + b) * GROUP_ROWS;
                for (c, quad) in src.chunks_exact(4).enumerate() {
                    let dst = &mut q.qs[at * q_len + c * CHUNK + 4 * i..][..4];
                    dst.iter_mut().zip(quad).for_each(|(d, s)| *d = s ^ flip);
                }
                for s in 0..scales {
                    q.d[(at * scales) + s * GROUP_ROWS + i] = p.d[(r * bpr + b) * scales + s];
                }
                if layout == Layout::Nibbles {
                    q.m[at + i] = p.m[r * bpr + b];
                }
            }
        }
        Some(q)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows `first..first + out.len() / cols` as f32, each weight `d·q + m` in one fused
    /// multiply-add.
    pub fn dequantize_rows(&self, first: usize, out: &mut [f32]) {
        let cols = self.blocks_per_row * BLOCK;
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            let r = first + r;
            let g = self.group(r / GROUP_ROWS);
            unpack_row(g.layout, g.qs, g.d, g.m, r % GROUP_ROWS, row);
        }
    }

    /// `out[stride.at(r, t)] = row (first + r) · x_t` for `rows` rows, the inputs rounded
    /// to bytes (`int8`): the serving path's product.
    pub(super) fn dot_rows_int8(&self, first: usize, rows: usize, x: &Q8Rows, out: &mut [f32], stride: Strides) {
        let tokens = x.rows();
        let mut spare = Vec::new();
        let mut r = first;
        while r < first + rows {
            let (g, i) = (r / GROUP_ROWS, r % GROUP_ROWS);
            let take = (GROUP_ROWS - i).min(first + rows - r);
            let at = stride.at(r - first, 0);
            if take == GROUP_ROWS && at < out.len() && stride.fits(GROUP_ROWS, tokens, out.len() - at) {
                int8::dot_group(&self.group(g), x, &mut out[at..], stride);
            } else {
                // Part of a group: all 16 rows into a spare block, then the ones asked for.
                spare.resize(GROUP_ROWS * tokens, 0.0);
                int8::dot_group(&self.group(g), x, &mut spare, Strides::row_major(tokens));
                for j in 0..take {
                    for t in 0..tokens {
                        out[at + stride.at(j, t)] = spare[(i + j) * tokens + t];
                    }
                }
            }
            r += take;
        }
    }

    fn group(&self, g: usize) -> Group<'_> {
        let (layout, bpr) = (self.layout, self.blocks_per_row);
        let blocks = g * bpr * GROUP_ROWS..(g + 1) * bpr * GROUP_ROWS;
        Group {
            layout,
            blocks_per_row: bpr,
            qs: &self.qs[blocks.start * layout.q_len()..blocks.end * layout.q_len()],
            d: &self.d[blocks.start * layout.scales()..blocks.end * layout.scales()],
            m: if layout == Layout::Nibbles { &self.m[blocks] } else { &[] },
        }
    }
}

multiversion! {
    /// Row `i` of a group's blocks (`qs`, `d`, `m`) as f32 into `out`.
    fn unpack_row(layout: Layout, qs: &[u8], d: &[f32], m: &[f32], i: usize, out: &mut [f32]) -> () {
        let (q_len, scales) = (layout.q_len(), layout.scales());
        for (b, w) in out.chunks_exact_mut(BLOCK).enumerate() {
            let chunks = &qs[b * GROUP_ROWS * q_len..(b + 1) * GROUP_ROWS * q_len];
            let d = &d[b * GROUP_ROWS * scales..(b + 1) * GROUP_ROWS * scales];
            match layout {
                Layout::Nibbles => {
                    let (d, m) = (d[i], m[b * GROUP_ROWS + i]);
                    for c in 0..4 {
                        for p in 0..4 {
                            let q = chunks[c * CHUNK + 4 * i + p];
                            w[4 * c + p] = ((q & 0xF) as f32).mul_add(d, m);
                            w[16 + 4 * c + p] = ((q >> 4) as f32).mul_add(d, m);
                        }
                    }
                }
                Layout::Bytes | Layout::BytesHalves => {
                    for j in 0..8 {
                        let scale = if layout == Layout::Bytes { d[i] } else { d[(j / 4) * GROUP_ROWS + i] };
                        for p in 0..4 {
                            let q = (chunks[j * CHUNK + 4 * i + p] ^ 0x80) as i8;
                            w[4 * j + p] = (q as f32).mul_add(scale, 0.0);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::dequantize;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Every format `QuantRows` reads.
    pub(crate) const FORMATS: [GgmlType; 6] =
        [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K];

    /// Random blocks of `ty` for `n` weights, with finite f16 scales where the format
    /// keeps them.
    pub(crate) fn random_blocks(rng: &mut StdRng, ty: GgmlType, n: usize) -> Vec<u8> {
        crate::quant::random_blocks(ty, n, rng.random())
    }

    #[test]
    fn dequantised_rows_match_the_reference_decoder() {
        let seed: u64 = StdRng::from_os_rng().random();
        eprintln!("random seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        // 21 rows: a whole group of 16 and a padded one.
        let (rows, cols) = (21, 2 * 256);
        for ty in FORMATS {
            let bytes = random_blocks(&mut rng, ty, rows * cols);
            let q = QuantRows::from_blocks(ty, &bytes, cols).unwrap();
            assert_eq!(q.rows(), rows);
            let dense = dequantize(ty, &bytes);
            // Rows 14..19 on their own cross the groups' boundary.
            let mut got = vec![0.0f32; 5 * cols];
            q.dequantize_rows(14, &mut got);
            for (i, (g, w)) in got.iter().zip(&dense[14 * cols..19 * cols]).enumerate() {
                // Q4_K's d·q − m is one fused operation here, two roundings in ggml.
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{ty:?} weight {i}: {g} vs {w}");
            }
        }
        assert!(QuantRows::from_blocks(GgmlType::Q5K, &[0; 176], 256).is_none());
    }
}
