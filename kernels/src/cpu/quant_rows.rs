//! Weight rows kept quantised (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, Q6_K): 6 to 10 bits a
//! weight in memory instead of f32's 32. A product dequantises the few rows a task owns
//! into a scratch buffer and shares them across every input row (`tiles`), or, for a
//! decode step's one or two inputs, dequantises each block in registers and uses it at
//! once.
//!
//! At load the ggml blocks are repacked (`repack`) into one of three layouts of
//! 32-weight blocks with f32 scales.

use super::repack::repack;
use super::simd::multiversion;
use super::tiles::{LANES, reduce_lanes};
use crate::quant::GgmlType;

pub(super) const BLOCK: usize = 32;

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
    /// Bytes of packed values a block.
    pub(super) const fn q_len(self) -> usize {
        match self {
            Self::Nibbles => 16,
            Self::Bytes | Self::BytesHalves => 32,
        }
    }

    /// Scales (`d`) a block.
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
    /// `layout.scales()` per block, row after row.
    d: Vec<f32>,
    /// Per block offset (`Nibbles`), else empty.
    m: Vec<f32>,
    qs: Vec<u8>,
    blocks_per_row: usize,
}

impl QuantRows {
    /// Repacks rows of whole blocks, or None for formats this does not read.
    pub fn from_blocks(ty: GgmlType, bytes: &[u8], cols: usize) -> Option<Self> {
        let p = repack(ty, bytes)?;
        Some(Self { layout: p.layout, d: p.d, m: p.m, qs: p.qs, blocks_per_row: cols / BLOCK })
    }

    pub fn rows(&self) -> usize {
        self.qs.len() / self.layout.q_len() / self.blocks_per_row.max(1)
    }

    /// Rows `first..first + out.len() / cols` as f32, each weight `d·q + m` in one fused
    /// multiply-add.
    pub fn dequantize_rows(&self, first: usize, out: &mut [f32]) {
        let (q, d, m) = self.blocks(first, out.len() / self.cols());
        unpack_rows(self.layout, q, d, m, out);
    }

    /// `out[r * stride + t] = row (first + r) · x_t` for `rows` rows, without a scratch
    /// copy: each block is dequantised in registers and used at once, for the one or two
    /// input rows of a decode step. The operations are those of `dequantize_rows`
    /// followed by `tiles::dot_tile`, so the bits are too.
    pub fn dot_rows(&self, first: usize, rows: usize, x: &[f32], out: &mut [f32], stride: usize) {
        let (q, d, m) = self.blocks(first, rows);
        dot_fused(self.layout, self.blocks_per_row, q, d, m, x, out, stride);
    }

    fn cols(&self) -> usize {
        self.blocks_per_row * BLOCK
    }

    /// Packed values, scales and offsets (empty but for `Nibbles`) of `rows` rows from
    /// `first`.
    fn blocks(&self, first: usize, rows: usize) -> (&[u8], &[f32], &[f32]) {
        let blocks = first * self.blocks_per_row..(first + rows) * self.blocks_per_row;
        let (q_len, scales) = (self.layout.q_len(), self.layout.scales());
        let m = if self.layout == Layout::Nibbles { &self.m[blocks.clone()] } else { &[][..] };
        (&self.qs[blocks.start * q_len..blocks.end * q_len], &self.d[blocks.start * scales..blocks.end * scales], m)
    }
}

/// One block's 32 weights, `d·q + m` fused (m = 0 but for `Nibbles`).
#[inline(always)]
fn dequantize_block(layout: Layout, qs: &[u8], d: &[f32], m: &[f32], b: usize, out: &mut [f32; BLOCK]) {
    match layout {
        Layout::Nibbles => {
            let (q, d, m): (&[u8; 16], f32, f32) = (qs[b * 16..b * 16 + 16].try_into().expect("16 bytes"), d[b], m[b]);
            for j in 0..16 {
                out[j] = ((q[j] & 0xF) as f32).mul_add(d, m);
                out[j + 16] = ((q[j] >> 4) as f32).mul_add(d, m);
            }
        }
        Layout::Bytes | Layout::BytesHalves => {
            let q: &[u8; 32] = qs[b * 32..b * 32 + 32].try_into().expect("32 bytes");
            let (lo, hi) = if layout == Layout::Bytes { (d[b], d[b]) } else { (d[2 * b], d[2 * b + 1]) };
            for j in 0..BLOCK {
                out[j] = (q[j] as i8 as f32).mul_add(if j < 16 { lo } else { hi }, 0.0);
            }
        }
    }
}

multiversion! {
    fn unpack_rows(layout: Layout, qs: &[u8], d: &[f32], m: &[f32], out: &mut [f32]) -> () {
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            dequantize_block(layout, qs, d, m, b, o.try_into().expect("one block"));
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn dot_fused(layout: Layout, bpr: usize, qs: &[u8], d: &[f32], m: &[f32], x: &[f32], out: &mut [f32], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        unsafe { avx2::dot_fused(layout, bpr, qs, d, m, x, out, stride) };
        return;
    }
    fused_loop!(fused_row, layout, bpr, qs, d, m, x, out, stride);
}

/// Each weight row against the input rows two at a time, then one, through `$row::<T>`.
macro_rules! fused_loop {
    ($row:ident, $layout:expr, $bpr:expr, $qs:expr, $d:expr, $m:expr, $x:expr, $out:expr, $stride:expr) => {{
        let (layout, bpr, qs, d, m, x, out, stride): (Layout, usize, &[u8], &[f32], &[f32], &[f32], &mut [f32], usize) =
            ($layout, $bpr, $qs, $d, $m, $x, $out, $stride);
        let (q_len, scales) = (layout.q_len(), layout.scales());
        let (rows, k) = (qs.len() / q_len / bpr, bpr * BLOCK);
        let tokens = x.len() / k;
        for r in 0..rows {
            let blocks = r * bpr..(r + 1) * bpr;
            let qs = &qs[blocks.start * q_len..blocks.end * q_len];
            let d = &d[blocks.start * scales..blocks.end * scales];
            let m = if layout == Layout::Nibbles { &m[blocks] } else { m };
            let mut t = 0;
            while t < tokens {
                let o = &mut out[r * stride + t..];
                if t + 2 <= tokens {
                    $row::<2>(layout, qs, d, m, &x[t * k..(t + 2) * k], o);
                    t += 2;
                } else {
                    $row::<1>(layout, qs, d, m, &x[t * k..(t + 1) * k], o);
                    t += 1;
                }
            }
        }
    }};
}
use fused_loop;

/// One weight row against `T` input rows, lane by lane as `tiles` does it.
fn fused_row<const T: usize>(layout: Layout, qs: &[u8], d: &[f32], m: &[f32], x: &[f32], out: &mut [f32]) {
    let blocks = qs.len() / layout.q_len();
    let k = blocks * BLOCK;
    let mut acc = [[0.0f32; LANES]; T];
    let mut w = [0.0f32; BLOCK];
    for b in 0..blocks {
        dequantize_block(layout, qs, d, m, b, &mut w);
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
    use super::{BLOCK, LANES, Layout, reduce_lanes};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dot_fused(
        layout: Layout,
        bpr: usize,
        qs: &[u8],
        d: &[f32],
        m: &[f32],
        x: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        fused_loop!(fused_row, layout, bpr, qs, d, m, x, out, stride);
    }

    /// The portable `fused_row` with the block's 32 weights in four registers.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn fused_row<const T: usize>(layout: Layout, qs: &[u8], d: &[f32], m: &[f32], x: &[f32], out: &mut [f32]) {
        let (q_len, nibbles) = (layout.q_len(), layout == Layout::Nibbles);
        let blocks = qs.len() / q_len;
        let k = blocks * BLOCK;
        assert!(x.len() >= T * k && d.len() >= blocks * layout.scales() && (!nibbles || m.len() >= blocks));
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..blocks {
            // SAFETY: block b's bytes are qs[b*q_len..(b+1)*q_len] and its inputs
            // x[t*k + b*32..][..32], inside the lengths asserted above.
            unsafe {
                let q = qs.as_ptr().add(b * q_len);
                let mut w = [_mm256_setzero_ps(); 4];
                // Registers 0 and 1 hold weights 0..16, 2 and 3 weights 16..32.
                let (lo, hi, offset) = match layout {
                    Layout::Nibbles => (d[b], d[b], _mm256_set1_ps(m[b])),
                    Layout::Bytes => (d[b], d[b], _mm256_setzero_ps()),
                    Layout::BytesHalves => (d[2 * b], d[2 * b + 1], _mm256_setzero_ps()),
                };
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
                let (lo, hi) = (_mm256_set1_ps(lo), _mm256_set1_ps(hi));
                for v in 0..4 {
                    w[v] = _mm256_fmadd_ps(w[v], if v < 2 { lo } else { hi }, offset);
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

    /// Every format `QuantRows` reads.
    pub(crate) const FORMATS: [GgmlType; 6] =
        [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K];

    /// Random blocks of `ty` for `n` weights, with finite f16 scales where the format
    /// keeps them.
    pub(crate) fn random_blocks(rng: &mut StdRng, ty: GgmlType, n: usize) -> Vec<u8> {
        let f16_fields: &[usize] = match ty {
            GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[0],
        };
        let mut bytes: Vec<u8> = (0..n / ty.block_elems() * ty.block_bytes()).map(|_| rng.random()).collect();
        for b in bytes.chunks_exact_mut(ty.block_bytes()) {
            for &at in f16_fields {
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(rng.random_range(-0.1..0.1)).to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn dequantised_rows_match_the_reference_decoder() {
        let seed: u64 = StdRng::from_os_rng().random();
        eprintln!("random seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let (rows, cols) = (5, 2 * 256);
        for ty in FORMATS {
            let bytes = random_blocks(&mut rng, ty, rows * cols);
            let q = QuantRows::from_blocks(ty, &bytes, cols).unwrap();
            assert_eq!(q.rows(), rows);
            let dense = dequantize(ty, &bytes);
            // Rows 1..4 on their own: the offset into the blocks is right.
            let mut got = vec![0.0f32; 3 * cols];
            q.dequantize_rows(1, &mut got);
            for (i, (g, w)) in got.iter().zip(&dense[cols..4 * cols]).enumerate() {
                // Q4_K's d·q − m is one fused operation here, two roundings in ggml.
                assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{ty:?} weight {i}: {g} vs {w}");
            }
        }
        assert!(QuantRows::from_blocks(GgmlType::Q5K, &[0; 176], 256).is_none());
    }

    #[test]
    fn the_fused_product_gives_the_bits_of_dequantising_first() {
        let mut rng = StdRng::seed_from_u64(11);
        let (rows, cols, tokens) = (4, 3 * 256, 3);
        for ty in FORMATS {
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
                fused_row::<1>(q.layout, qs, d, m, &x[t * cols..(t + 1) * cols], &mut one);
                assert_eq!(one[0].to_bits(), fused[t].to_bits(), "{ty:?} portable, input {t}");
            }
        }
    }
}
