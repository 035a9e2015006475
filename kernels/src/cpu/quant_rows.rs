//! Weight rows kept quantised (Q4_0, Q4_1, Q8_0) and multiplied without a dequantised
//! copy: decode reads 5 (Q4) or 8.5 (Q8) bits a weight instead of f32's 32.
//!
//! At load the ggml blocks are repacked: each block's f16 scale (and Q4 offset) becomes
//! an f32 in its own array, so the hot loop converts no halves, and Q4_0 (d·(q−8))
//! takes Q4_1's form d·q + m with m = −8d. A block's contribution to a dot product is
//! d·Σq·x + m·Σx, with Σx per block computed once per input row.
//!
//! Batch invariance: every input row is computed with the same operations in the same
//! order whatever the other rows are — the block's 32 products summed into 8 lanes in
//! a fixed order with fused multiply-adds, the lanes scaled and accumulated per block,
//! reduced at the end — so a sequence gets bit-identical results alone or in any batch.
//! Rows are taken four at a time to unpack each block once for four; the four are
//! independent. The portable path computes the same fused operations (slowly, where
//! the CPU has no FMA) so both paths agree bit for bit.

use crate::quant::{GgmlType, f16_at};

const BLOCK: usize = 32;

#[derive(Debug, Clone)]
pub struct QuantRows {
    /// Two 4-bit values a byte (low nibbles are elements 0..16), or one i8 a byte.
    nibbles: bool,
    /// Per block, row after row.
    d: Vec<f32>,
    /// Per block offset (4-bit formats).
    m: Vec<f32>,
    qs: Vec<u8>,
    blocks_per_row: usize,
}

impl QuantRows {
    /// Repacks rows of whole blocks, or None for formats this does not read.
    pub fn from_blocks(ty: GgmlType, bytes: &[u8], cols: usize) -> Option<Self> {
        let (nibbles, q_at, q_len) = match ty {
            GgmlType::Q4_0 => (true, 2, 16),
            GgmlType::Q4_1 => (true, 4, 16),
            GgmlType::Q8_0 => (false, 2, 32),
            _ => return None,
        };
        let blocks = bytes.chunks_exact(ty.block_bytes());
        let n = blocks.len();
        let mut r = Self {
            nibbles,
            d: Vec::with_capacity(n),
            m: Vec::with_capacity(if nibbles { n } else { 0 }),
            qs: Vec::with_capacity(n * q_len),
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

    /// Per-block sums of each input row of `x` (`cols` wide), concatenated; empty for
    /// Q8_0, which has no offset term.
    pub fn block_sums(&self, x: &[f32]) -> Vec<f32> {
        if self.nibbles { x.chunks_exact(BLOCK).map(|c| c.iter().sum()).collect() } else { Vec::new() }
    }

    /// `out[t] = Σ w[row]·x[t]` for each input row `t` of `x`, with `sums` from
    /// `block_sums(x)`.
    pub fn dot_rows(&self, row: usize, x: &[f32], sums: &[f32], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2::dot_rows(self, row, x, sums, out) };
            return;
        }
        let mut t = 0;
        while t + 4 <= out.len() {
            self.portable_group::<4>(row, x, sums, t, out);
            t += 4;
        }
        while t < out.len() {
            self.portable_group::<1>(row, x, sums, t, out);
            t += 1;
        }
    }

    fn unpack(&self, q: &[u8], w: &mut [f32; BLOCK]) {
        if self.nibbles {
            for j in 0..16 {
                w[j] = (q[j] & 0xF) as f32;
                w[j + 16] = (q[j] >> 4) as f32;
            }
        } else {
            for j in 0..BLOCK {
                w[j] = q[j] as i8 as f32;
            }
        }
    }

    /// `G` input rows from `first_x` against weight row `row`, in plain Rust.
    fn portable_group<const G: usize>(&self, row: usize, x: &[f32], sums: &[f32], first_x: usize, out: &mut [f32]) {
        let (bpr, first) = (self.blocks_per_row, row * self.blocks_per_row);
        let cols = bpr * BLOCK;
        let q_len = if self.nibbles { 16 } else { 32 };
        let mut lanes = [[0.0f32; 8]; G];
        let mut offsets = [0.0f32; G];
        let mut w = [0.0f32; BLOCK];
        for b in 0..bpr {
            self.unpack(&self.qs[(first + b) * q_len..(first + b + 1) * q_len], &mut w);
            let d = self.d[first + b];
            for g in 0..G {
                let t = first_x + g;
                let xs = &x[t * cols + b * BLOCK..t * cols + (b + 1) * BLOCK];
                // Lane l sums j = l, l+8, l+16, l+24 in that order, as the AVX2 path does.
                let mut inner = [0.0f32; 8];
                for l in 0..8 {
                    inner[l] = w[l] * xs[l];
                }
                for j in 8..BLOCK {
                    inner[j % 8] = w[j].mul_add(xs[j], inner[j % 8]);
                }
                for l in 0..8 {
                    lanes[g][l] = d.mul_add(inner[l], lanes[g][l]);
                }
                if self.nibbles {
                    offsets[g] += self.m[first + b] * sums[t * bpr + b];
                }
            }
        }
        for g in 0..G {
            out[first_x + g] = reduce(&lanes[g]) + offsets[g];
        }
    }
}

/// The lanes' sum, in the order the AVX2 path uses.
fn reduce(l: &[f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, QuantRows};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_rows(r: &QuantRows, row: usize, x: &[f32], sums: &[f32], out: &mut [f32]) {
        let m = out.len();
        let cols = r.blocks_per_row * BLOCK;
        assert!(x.len() >= m * cols && (!r.nibbles || sums.len() >= m * r.blocks_per_row));
        let mut t = 0;
        while t + 4 <= m {
            group::<4>(r, row, x, sums, t, out);
            t += 4;
        }
        while t < m {
            group::<1>(r, row, x, sums, t, out);
            t += 1;
        }
    }

    /// The block's 32 weights as four vectors of eight.
    #[inline(always)]
    fn unpack(r: &QuantRows, q: &[u8]) -> [__m256; 4] {
        // SAFETY: `q` holds 16 (nibbles) or 32 bytes, checked by the slicing caller;
        // the loads below read exactly those.
        unsafe {
            if r.nibbles {
                let bytes = _mm_loadu_si128(q.as_ptr() as *const __m128i);
                let mask = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(bytes, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
            } else {
                let f = |at: usize| {
                    let v = _mm_loadl_epi64(q.as_ptr().add(at) as *const __m128i);
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
                };
                [f(0), f(8), f(16), f(24)]
            }
        }
    }

    #[inline(always)]
    fn group<const G: usize>(r: &QuantRows, row: usize, x: &[f32], sums: &[f32], first_x: usize, out: &mut [f32]) {
        let (bpr, first) = (r.blocks_per_row, row * r.blocks_per_row);
        let cols = bpr * BLOCK;
        let q_len = if r.nibbles { 16 } else { 32 };
        let qs = &r.qs[first * q_len..(first + bpr) * q_len];
        // SAFETY: AVX2 and FMA are enabled by the caller; every load reads 8 floats inside
        // `x[t*cols + b*32 .. + 32]` for t < first_x + G ≤ rows of x, b < bpr (asserted
        // by the caller).
        unsafe {
            let mut lanes = [_mm256_setzero_ps(); G];
            let mut offsets = [0.0f32; G];
            for b in 0..bpr {
                let w = unpack(r, &qs[b * q_len..(b + 1) * q_len]);
                let d = _mm256_set1_ps(r.d[first + b]);
                for g in 0..G {
                    let t = first_x + g;
                    let p = x.as_ptr().add(t * cols + b * BLOCK);
                    let mut inner = _mm256_mul_ps(w[0], _mm256_loadu_ps(p));
                    inner = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(p.add(8)), inner);
                    inner = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(p.add(16)), inner);
                    inner = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(p.add(24)), inner);
                    lanes[g] = _mm256_fmadd_ps(d, inner, lanes[g]);
                    if r.nibbles {
                        offsets[g] += r.m[first + b] * sums[t * bpr + b];
                    }
                }
            }
            for g in 0..G {
                let mut l = [0.0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), lanes[g]);
                out[first_x + g] = super::reduce(&l) + offsets[g];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn dot_rows_match_the_dequantised_rows_and_do_not_depend_on_the_batch() {
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
            // Five input rows (a group of four and one more); the second alone must
            // give bit-identical results.
            let xs: Vec<f32> = (0..5 * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let sums = q.block_sums(&xs);
            for r in 0..rows {
                let mut got = [0.0f32; 5];
                q.dot_rows(r, &xs, &sums, &mut got);
                let mut portable = [0.0f32; 5];
                q.portable_group::<4>(r, &xs, &sums, 0, &mut portable);
                q.portable_group::<1>(r, &xs, &sums, 4, &mut portable);
                assert_eq!(got.map(f32::to_bits), portable.map(f32::to_bits), "{ty:?}: SIMD and portable paths agree");
                for t in 0..5 {
                    let x = &xs[t * cols..(t + 1) * cols];
                    let row = &dense[r * cols..(r + 1) * cols];
                    let want: f64 = row.iter().zip(x).map(|(w, x)| *w as f64 * *x as f64).sum();
                    assert!((got[t] as f64 - want).abs() < 1e-4, "{ty:?} row {r}: {} vs {want}", got[t]);
                }
                let second = &xs[cols..2 * cols];
                let mut alone = [0.0f32; 1];
                q.dot_rows(r, second, &q.block_sums(second), &mut alone);
                assert_eq!(alone[0].to_bits(), got[1].to_bits(), "{ty:?} row {r}: batch-invariant");
            }
        }
        assert!(QuantRows::from_blocks(GgmlType::Q6K, &[0; 210], 256).is_none());
    }
}
