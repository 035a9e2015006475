//! Weight rows kept quantised for decode-sized products. A single sequence's decode
//! step reads every weight once and is bound by memory bandwidth; Q4_0/Q4_1 rows are 5
//! bits a weight against f32's 32, Q8_0 rows 8.5.
//!
//! At load the ggml blocks are repacked: each block's f16 scale (and Q4 offset) becomes
//! an f32 in its own array, so the hot loop converts no halves, and Q4_0 (d·(q−8))
//! becomes Q4_1's form d·q + m with m = −8d. A block's contribution to a dot product is
//! then d·Σq·x + m·Σx, with Σx per block computed once per input row.

use super::simd::multiversion;
use crate::quant::{GgmlType, f16_at};

#[derive(Debug, Clone)]
pub struct QuantRows {
    /// Two 4-bit values a byte (low nibbles first in a block), or one i8 a byte.
    nibbles: bool,
    /// Per block, row after row.
    d: Vec<f32>,
    /// Per block offset (4-bit formats).
    m: Vec<f32>,
    qs: Vec<u8>,
    blocks_per_row: usize,
}

const BLOCK: usize = 32;

impl QuantRows {
    /// Repacks `rows` rows of whole blocks, or None for formats this does not read.
    pub fn from_blocks(ty: GgmlType, bytes: &[u8], cols: usize) -> Option<Self> {
        let (nibbles, q_at, q_len) = match ty {
            GgmlType::Q4_0 => (true, 2, 16),
            GgmlType::Q4_1 => (true, 4, 16),
            GgmlType::Q8_0 => (false, 2, 32),
            _ => return None,
        };
        let blocks = bytes.chunks_exact(ty.block_bytes());
        let mut r = Self {
            nibbles,
            d: Vec::with_capacity(blocks.len()),
            m: Vec::with_capacity(if nibbles { blocks.len() } else { 0 }),
            qs: Vec::with_capacity(blocks.len() * q_len),
            blocks_per_row: cols / BLOCK,
        };
        for b in blocks {
            let d = f16_at(b, 0);
            r.d.push(d);
            match ty {
                GgmlType::Q4_0 => r.m.push(-8.0 * d),
                GgmlType::Q4_1 => r.m.push(f16_at(b, 2)),
                _ => {}
            }
            r.qs.extend_from_slice(&b[q_at..q_at + q_len]);
        }
        Some(r)
    }

    /// Per-block sums of one input row, for the Q4 offset term.
    pub fn block_sums(&self, x: &[f32]) -> Vec<f32> {
        if self.nibbles { x.chunks_exact(BLOCK).map(|c| c.iter().sum()).collect() } else { Vec::new() }
    }

    /// `Σ w[row]·x`, given `sums = block_sums(x)`.
    pub fn dot(&self, row: usize, x: &[f32], sums: &[f32]) -> f32 {
        dot_row(self, row, x, sums)
    }
}

multiversion! {
    /// Eight lanes of partial sums, scaled per block without a horizontal reduction,
    /// so the compiler keeps them in one vector register.
    fn dot_row(rows: &QuantRows, row: usize, x: &[f32], sums: &[f32]) -> f32 {
        let first = row * rows.blocks_per_row;
        let mut lanes = [0.0f32; 8];
        let mut offsets = 0.0f32;
        let q_len = if rows.nibbles { 16 } else { 32 };
        let qs = &rows.qs[first * q_len..(first + rows.blocks_per_row) * q_len];
        for (b, (q, xs)) in qs.chunks_exact(q_len).zip(x.chunks_exact(BLOCK)).enumerate() {
            let mut w = [0.0f32; BLOCK];
            if rows.nibbles {
                for j in 0..16 {
                    w[j] = (q[j] & 0xF) as f32;
                    w[j + 16] = (q[j] >> 4) as f32;
                }
                offsets += rows.m[first + b] * sums[b];
            } else {
                for j in 0..BLOCK {
                    w[j] = q[j] as i8 as f32;
                }
            }
            let mut inner = [0.0f32; 8];
            for j in 0..BLOCK {
                inner[j % 8] += w[j] * xs[j];
            }
            let d = rows.d[first + b];
            for l in 0..8 {
                lanes[l] += d * inner[l];
            }
        }
        lanes.iter().sum::<f32>() + offsets
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn dot_matches_the_dequantised_rows() {
        let seed: u64 = StdRng::from_os_rng().random();
        eprintln!("random seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let (rows, cols) = (5, 12 * BLOCK);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let mut bytes: Vec<u8> = (0..rows * cols / BLOCK * ty.block_bytes()).map(|_| rng.random()).collect();
            for b in bytes.chunks_exact_mut(ty.block_bytes()) {
                // Finite f16 scales (d, and m for Q4_1).
                b[0..2].copy_from_slice(&half::f16::from_f32(rng.random_range(-0.1..0.1)).to_le_bytes());
                b[2..4].copy_from_slice(&half::f16::from_f32(rng.random_range(-0.1..0.1)).to_le_bytes());
            }
            let q = QuantRows::from_blocks(ty, &bytes, cols).unwrap();
            let dense = dequantize(ty, &bytes);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let sums = q.block_sums(&x);
            for r in 0..rows {
                let want: f64 =
                    dense[r * cols..(r + 1) * cols].iter().zip(&x).map(|(w, x)| *w as f64 * *x as f64).sum();
                let got = q.dot(r, &x, &sums) as f64;
                assert!((got - want).abs() < 1e-4, "{ty:?} row {r}: {got} vs {want}");
            }
        }
        assert!(QuantRows::from_blocks(GgmlType::Q6K, &[0; 210], 256).is_none());
    }
}
