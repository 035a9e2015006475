//! Weight rows kept quantised (Q4_0, Q4_1, Q8_0): 5 (Q4) or 8.5 (Q8) bits a weight in
//! memory instead of f32's 32. A product dequantises the few rows a task owns into a
//! scratch buffer and shares them across every input row (`tiles`).
//!
//! At load the ggml blocks are repacked: each block's f16 scale (and Q4 offset) becomes
//! an f32 in its own array, so the hot loop converts no halves, and Q4_0 (d·(q−8))
//! takes Q4_1's form d·q + m with m = −8d.

use super::simd::multiversion;
use super::tiles::{LANES, reduce_lanes};
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

    pub fn rows(&self) -> usize {
        self.d.len() / self.blocks_per_row.max(1)
    }

    /// Rows `first..first + out.len() / cols` as f32, each weight `d·q + m` in one fused
    /// multiply-add.
    pub fn dequantize_rows(&self, first: usize, out: &mut [f32]) {
        let (q, d, m) = self.blocks(first, out.len() / self.cols());
        unpack_rows(self.nibbles, q, d, m, out);
    }

    /// `out[r * stride + t] = row (first + r) · x_t` for `rows` rows, without a scratch
    /// copy: each block is dequantised in registers and used at once, for the one or two
    /// input rows of a decode step. The operations are those of `dequantize_rows`
    /// followed by `tiles::dot_tile`, so the bits are too.
    pub fn dot_rows(&self, first: usize, rows: usize, x: &[f32], out: &mut [f32], stride: usize) {
        let (q, d, m) = self.blocks(first, rows);
        dot_fused(self.nibbles, self.blocks_per_row, q, d, m, x, out, stride);
    }

    fn cols(&self) -> usize {
        self.blocks_per_row * BLOCK
    }

    /// Packed values, scales and offsets (empty for Q8_0) of `rows` rows from `first`.
    fn blocks(&self, first: usize, rows: usize) -> (&[u8], &[f32], &[f32]) {
        let blocks = first * self.blocks_per_row..(first + rows) * self.blocks_per_row;
        let q_len = if self.nibbles { 16 } else { 32 };
        let m = if self.nibbles { &self.m[blocks.clone()] } else { &[][..] };
        (&self.qs[blocks.start * q_len..blocks.end * q_len], &self.d[blocks], m)
    }
}

/// One block's 32 weights, `d·q + m` fused (m = 0 for Q8_0).
#[inline(always)]
fn dequantize_block(nibbles: bool, qs: &[u8], d: &[f32], m: &[f32], b: usize, out: &mut [f32; BLOCK]) {
    if nibbles {
        let (q, d, m): (&[u8; 16], f32, f32) = (qs[b * 16..b * 16 + 16].try_into().expect("16 bytes"), d[b], m[b]);
        for j in 0..16 {
            out[j] = ((q[j] & 0xF) as f32).mul_add(d, m);
            out[j + 16] = ((q[j] >> 4) as f32).mul_add(d, m);
        }
    } else {
        let (q, d): (&[u8; 32], f32) = (qs[b * 32..b * 32 + 32].try_into().expect("32 bytes"), d[b]);
        for j in 0..BLOCK {
            out[j] = (q[j] as i8 as f32).mul_add(d, 0.0);
        }
    }
}

multiversion! {
    fn unpack_rows(nibbles: bool, qs: &[u8], d: &[f32], m: &[f32], out: &mut [f32]) -> () {
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            dequantize_block(nibbles, qs, d, m, b, o.try_into().expect("one block"));
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn dot_fused(nibbles: bool, bpr: usize, qs: &[u8], d: &[f32], m: &[f32], x: &[f32], out: &mut [f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        unsafe { avx2::dot_fused(nibbles, bpr, qs, d, m, x, out, stride) };
        return;
    }
    fused_loop!(fused_row, nibbles, bpr, qs, d, m, x, out, stride);
}

/// Each weight row against the input rows two at a time, then one, through `$row::<T>`.
macro_rules! fused_loop {
    ($row:ident, $nibbles:expr, $bpr:expr, $qs:expr, $d:expr, $m:expr, $x:expr, $out:expr, $stride:expr) => {{
        let (nibbles, bpr, qs, d, m, x, out, stride): (bool, usize, &[u8], &[f32], &[f32], &[f32], &mut [f32], usize) =
            ($nibbles, $bpr, $qs, $d, $m, $x, $out, $stride);
        let (rows, k) = (d.len() / bpr, bpr * BLOCK);
        let tokens = x.len() / k;
        let q_len = if nibbles { 16 } else { 32 };
        for r in 0..rows {
            let blocks = r * bpr..(r + 1) * bpr;
            let (qs, d) = (&qs[blocks.start * q_len..blocks.end * q_len], &d[blocks.clone()]);
            let m = if nibbles { &m[blocks] } else { m };
            let mut t = 0;
            while t < tokens {
                let o = &mut out[r * stride + t..];
                if t + 2 <= tokens {
                    $row::<2>(nibbles, qs, d, m, &x[t * k..(t + 2) * k], o);
                    t += 2;
                } else {
                    $row::<1>(nibbles, qs, d, m, &x[t * k..(t + 1) * k], o);
                    t += 1;
                }
            }
        }
    }};
}
use fused_loop;

/// One weight row against `T` input rows, lane by lane as `tiles` does it.
fn fused_row<const T: usize>(nibbles: bool, qs: &[u8], d: &[f32], m: &[f32], x: &[f32], out: &mut [f32]) {
    let k = d.len() * BLOCK;
    let mut acc = [[0.0f32; LANES]; T];
    let mut w = [0.0f32; BLOCK];
    for b in 0..d.len() {
        dequantize_block(nibbles, qs, d, m, b, &mut w);
        for (t, acc) in acc.iter_mut().enumerate() {
            let xs: &[f32; BLOCK] = x[t * k + b * BLOCK..t * k + (b + 1) * BLOCK].try_into().expect("one block");
            for v in 0..BLOCK / LANES {
                for l in 0..LANES {
                    acc[l] = w[v * LANES + l].mul_add(xs[v * LANES + l], acc[l]);
                }
            }
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        out[t] = reduce_lanes(acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, LANES, reduce_lanes};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dot_fused(
        nibbles: bool,
        bpr: usize,
        qs: &[u8],
        d: &[f32],
        m: &[f32],
        x: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        fused_loop!(fused_row, nibbles, bpr, qs, d, m, x, out, stride);
    }

    /// The portable `fused_row` with the block's 32 weights in four registers.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn fused_row<const T: usize>(nibbles: bool, qs: &[u8], d: &[f32], m: &[f32], x: &[f32], out: &mut [f32]) {
        let (blocks, q_len) = (d.len(), if nibbles { 16 } else { 32 });
        let k = blocks * BLOCK;
        assert!(qs.len() >= blocks * q_len && x.len() >= T * k && (!nibbles || m.len() >= blocks));
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..blocks {
            // SAFETY: block b's bytes are qs[b*q_len..(b+1)*q_len] and its inputs
            // x[t*k + b*32..][..32], inside the lengths asserted above.
            unsafe {
                let q = qs.as_ptr().add(b * q_len);
                let scale = _mm256_set1_ps(d[b]);
                let offset = if nibbles { _mm256_set1_ps(m[b]) } else { _mm256_setzero_ps() };
                let mut w = [_mm256_setzero_ps(); 4];
                if nibbles {
                    let bytes = _mm_loadu_si128(q as *const __m128i);
                    let mask = _mm_set1_epi8(0x0F);
                    let lo = _mm_and_si128(bytes, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                    let parts = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
                    for v in 0..4 {
                        w[v] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[v]));
                    }
                } else {
                    for v in 0..4 {
                        let bytes = _mm_loadl_epi64(q.add(v * LANES) as *const __m128i);
                        w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                    }
                }
                for v in 0..4 {
                    w[v] = _mm256_fmadd_ps(w[v], scale, offset);
                }
                for t in 0..T {
                    let p = x.as_ptr().add(t * k + b * BLOCK);
                    for v in 0..4 {
                        acc[t] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(p.add(v * LANES)), acc[t]);
                    }
                }
            }
        }
        for t in 0..T {
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t]) };
            out[t] = reduce_lanes(&lanes);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::dequantize;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Random blocks of `ty` for `n` weights, with finite f16 scales (d, and m for Q4_1).
    pub(crate) fn random_blocks(rng: &mut StdRng, ty: GgmlType, n: usize) -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..n / BLOCK * ty.block_bytes()).map(|_| rng.random()).collect();
        for b in bytes.chunks_exact_mut(ty.block_bytes()) {
            b[0..2].copy_from_slice(&half::f16::from_f32(rng.random_range(-0.1..0.1)).to_le_bytes());
            b[2..4].copy_from_slice(&half::f16::from_f32(rng.random_range(-0.1..0.1)).to_le_bytes());
        }
        bytes
    }

    #[test]
    fn dequantised_rows_match_the_reference_decoder() {
        let seed: u64 = StdRng::from_os_rng().random();
        eprintln!("random seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let (rows, cols) = (5, 12 * BLOCK);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let bytes = random_blocks(&mut rng, ty, rows * cols);
            let q = QuantRows::from_blocks(ty, &bytes, cols).unwrap();
            assert_eq!(q.rows(), rows);
            let dense = dequantize(ty, &bytes);
            // Rows 1..4 on their own: the offset into the blocks is right.
            let mut got = vec![0.0f32; 3 * cols];
            q.dequantize_rows(1, &mut got);
            for (i, (g, w)) in got.iter().zip(&dense[cols..4 * cols]).enumerate() {
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{ty:?} weight {i}: {g} vs {w}");
            }
        }
        assert!(QuantRows::from_blocks(GgmlType::Q6K, &[0; 210], 256).is_none());
    }

    #[test]
    fn the_fused_product_gives_the_bits_of_dequantising_first() {
        let mut rng = StdRng::seed_from_u64(11);
        let (rows, cols, tokens) = (4, 9 * BLOCK, 3);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let bytes = random_blocks(&mut rng, ty, rows * cols);
            let q = QuantRows::from_blocks(ty, &bytes, cols).unwrap();
            let x: Vec<f32> = (0..tokens * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut fused = vec![0.0f32; 3 * tokens];
            q.dot_rows(1, 3, &x, &mut fused, tokens);
            let mut w = vec![0.0f32; 3 * cols];
            q.dequantize_rows(1, &mut w);
            let mut tiled = vec![0.0f32; 3 * tokens];
            super::super::tiles::dot_tile(&w, &x, cols, &mut tiled, tokens);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused), bits(&tiled), "{ty:?}");
            // The portable row kernel, one input at a time, agrees too.
            let (qs, d, m) = q.blocks(1, 1);
            for t in 0..tokens {
                let mut one = [0.0f32];
                fused_row::<1>(q.nibbles, qs, d, m, &x[t * cols..(t + 1) * cols], &mut one);
                assert_eq!(one[0].to_bits(), fused[t].to_bits(), "{ty:?} portable, input {t}");
            }
        }
    }
}
