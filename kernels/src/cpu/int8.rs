//! Products of quantised weight rows with inputs rounded to 8 bits, as llama.cpp runs
//! its quantised formats: each input row is cut into blocks of 32 and each block
//! rounded to signed bytes with a scale of its own, so a block's products are integer
//! dot products and the floats come in once a block, not once a weight. On AVX-512
//! VNNI one `vpdpbusd` multiplies 4 weights of 16 rows (`QuantRows`' interleaved
//! groups) by the same 4 inputs, broadcast: 64 multiply-adds, and the 16 lanes are the
//! 16 rows' sums, so nothing is ever added across lanes.
//!
//! Each output, row `r` · input row `t`, is this chain and no other, whatever is
//! computed beside it (batch invariance) and on every build (the AVX-512, AVX2 and
//! portable paths agree bit for bit): for each block `b`, the exact integer sum `S` of
//! its 32 products (two, `S₀` and `S₁`, for `BytesHalves`' half-blocks), then, into two
//! accumulators (two independent chains where a block has two terms; `Bytes` has one),
//!
//! - `Nibbles`: `acc₀ = fma(S, d_w·d_x, acc₀)` and `acc₁ = fma(m_w, d_x·Σq, acc₁)`;
//! - `Bytes`: `acc₀ = fma(S, d_w·d_x, acc₀)`;
//! - `BytesHalves`: `acc₀ = fma(S₀, d_w₀·d_x, acc₀)` and `acc₁ = fma(S₁, d_w₁·d_x, acc₁)`;
//!
//! and the output is `acc₀ + acc₁`. A row's rounding depends on that row alone.
//!
//! Accuracy: rounding moves each input by at most half its block's scale, so a product
//! is off by at most Σ|w|·d_x/2 over its blocks (tested below), the error llama.cpp's
//! CPU path makes on the same files.

use super::matmul::Strides;
use super::quant_rows::{BLOCK, CHUNK, GROUP_ROWS, Group, Layout};
use super::simd::multiversion;

/// Input rows rounded to bytes, block by block.
#[derive(Debug, Clone)]
pub(crate) struct Q8Rows {
    blocks_per_row: usize,
    /// `k` per row.
    qs: Vec<i8>,
    /// Per row and block: the block's scale.
    d: Vec<f32>,
    /// Per row and block: scale · Σq, the block's sum for `Nibbles`' offsets.
    sums: Vec<f32>,
    /// Per row and half-block: −128 · Σq, which turns products with signed weights
    /// stored as unsigned `w + 128` back into `w · q`.
    offsets: Vec<i32>,
}

impl Q8Rows {
    /// `x`'s rows of `k` (a multiple of 32), each block scaled so its largest magnitude
    /// becomes 127, rounded half to even.
    pub(crate) fn quantize(x: &[f32], k: usize) -> Self {
        assert!(k.is_multiple_of(BLOCK) && k > 0 && x.len().is_multiple_of(k), "rows of whole blocks");
        let blocks = x.len() / BLOCK;
        let mut q = Self {
            blocks_per_row: k / BLOCK,
            qs: vec![0; x.len()],
            d: vec![0.0; blocks],
            sums: vec![0.0; blocks],
            offsets: vec![0; 2 * blocks],
        };
        #[cfg(target_arch = "x86_64")]
        if super::simd::has_avx512_vnni() {
            // SAFETY: the CPU has the AVX-512 features `avx512::quantize_blocks` needs.
            unsafe { avx512::quantize_blocks(x, &mut q.qs, &mut q.d, &mut q.sums, &mut q.offsets) };
            return q;
        }
        quantize_blocks(x, &mut q.qs, &mut q.d, &mut q.sums, &mut q.offsets);
        q
    }

    pub(crate) fn rows(&self) -> usize {
        self.d.len() / self.blocks_per_row
    }
}

/// `127 / amax`, or 0 where that is not finite (an all-zero, subnormal or infinite
/// block), so every product is within a byte or NaN.
fn inverse(amax: f32) -> f32 {
    let inv = 127.0 / amax;
    if inv.is_finite() { inv } else { 0.0 }
}

multiversion! {
    fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [f32], offsets: &mut [i32]) -> () {
        for (b, xs) in x.chunks_exact(BLOCK).enumerate() {
            let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = inverse(amax);
            let q = &mut qs[b * BLOCK..(b + 1) * BLOCK];
            for (q, v) in q.iter_mut().zip(xs) {
                *q = (v * inv).round_ties_even() as i8;
            }
            let half = |h: usize| q[16 * h..16 * (h + 1)].iter().map(|&v| v as i32).sum::<i32>();
            let (lo, hi) = (half(0), half(1));
            d[b] = scale;
            sums[b] = scale * (lo + hi) as f32;
            offsets[2 * b] = -128 * lo;
            offsets[2 * b + 1] = -128 * hi;
        }
    }
}

/// `out[stride.at(i, t)] = row i · input t` for the group's 16 rows and every row of `x`.
pub(super) fn dot_group(g: &Group<'_>, x: &Q8Rows, out: &mut [f32], stride: Strides) {
    let (bpr, tokens) = (g.blocks_per_row, x.rows());
    assert_eq!(x.blocks_per_row, bpr, "inputs and weights of different widths");
    assert!(stride.fits(GROUP_ROWS, tokens, out.len()), "output too small");
    let scales = g.layout.scales();
    assert!(
        g.qs.len() == bpr * GROUP_ROWS * g.layout.q_len()
            && g.d.len() == bpr * GROUP_ROWS * scales
            && (g.layout != Layout::Nibbles || g.m.len() == bpr * GROUP_ROWS)
    );
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx512_vnni() {
        // SAFETY: the CPU has the features the AVX-512 path is compiled for; the
        // lengths are as asserted above.
        unsafe { avx512::dot_group(g, x, out, stride) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA; the lengths are as asserted above.
        unsafe { avx2::dot_group(g, x, out, stride) };
        return;
    }
    portable_group(g, x, out, stride);
}

multiversion! {
    fn portable_group(g: &Group<'_>, x: &Q8Rows, out: &mut [f32], stride: Strides) -> () {
        let (layout, bpr, qs, d, m) = (g.layout, g.blocks_per_row, g.qs, g.d, g.m);
        let (q_len, scales) = (layout.q_len(), layout.scales());
        for t in 0..x.rows() {
            for i in 0..GROUP_ROWS {
                let mut acc = [0.0f32; 2];
                for b in 0..bpr {
                    let at = t * bpr + b;
                    let xq = &x.qs[at * BLOCK..(at + 1) * BLOCK];
                    let chunks = &qs[b * GROUP_ROWS * q_len..(b + 1) * GROUP_ROWS * q_len];
                    let ds = &d[b * GROUP_ROWS * scales..(b + 1) * GROUP_ROWS * scales];
                    // Weight `4c + p` of row i, as stored (`w + 128` for bytes).
                    let quad = |c: usize, p: usize| chunks[c * CHUNK + 4 * i + p] as i32;
                    let dx = x.d[at];
                    match layout {
                        Layout::Nibbles => {
                            let mut s = 0;
                            for c in 0..4 {
                                for p in 0..4 {
                                    s += (quad(c, p) & 0xF) * xq[4 * c + p] as i32;
                                    s += (quad(c, p) >> 4) * xq[16 + 4 * c + p] as i32;
                                }
                            }
                            acc[0] = (s as f32).mul_add(ds[i] * dx, acc[0]);
                            acc[1] = m[b * GROUP_ROWS + i].mul_add(x.sums[at], acc[1]);
                        }
                        Layout::Bytes | Layout::BytesHalves => {
                            let mut s = [x.offsets[2 * at], x.offsets[2 * at + 1]];
                            for c in 0..8 {
                                for p in 0..4 {
                                    s[c / 4] += quad(c, p) * xq[4 * c + p] as i32;
                                }
                            }
                            if layout == Layout::Bytes {
                                acc[0] = ((s[0] + s[1]) as f32).mul_add(ds[i] * dx, acc[0]);
                            } else {
                                acc[0] = (s[0] as f32).mul_add(ds[i] * dx, acc[0]);
                                acc[1] = (s[1] as f32).mul_add(ds[GROUP_ROWS + i] * dx, acc[1]);
                            }
                        }
                    }
                }
                out[stride.at(i, t)] = acc[0] + acc[1];
            }
        }
    }
}

/// The group's 16 rows in the 16 lanes of each register, up to `INPUTS` input rows at
/// a time sharing every chunk loaded (and unpacked).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BLOCK, CHUNK, GROUP_ROWS, Group, Layout, Q8Rows, Strides};
    use std::arch::x86_64::*;

    const INPUTS: usize = 4;

    /// `super::quantize_blocks`, a block in two registers: the same operations, so the
    /// same bits (a maximum and an integer sum do not depend on their order), NaN and
    /// infinite inputs included: the maximum skips NaN as `f32::max` does, and a NaN
    /// product rounds to 0 as `as i8` makes it.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
    pub(super) fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [f32], offsets: &mut [i32]) {
        let blocks = x.len() / BLOCK;
        assert!(qs.len() == x.len() && d.len() == blocks && sums.len() == blocks && offsets.len() == 2 * blocks);
        for b in 0..blocks {
            // SAFETY: block b's 32 inputs and 32 bytes lie inside `x` and `qs` (asserted).
            unsafe {
                let v = [_mm512_loadu_ps(x.as_ptr().add(b * BLOCK)), _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + 16))];
                // `max_ps` returns its second operand where either is NaN.
                let first = _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps());
                let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[1]), first));
                let scale = amax / 127.0;
                let inv = _mm512_set1_ps(super::inverse(amax));
                let mut half = [0i32; 2];
                for (h, v) in v.into_iter().enumerate() {
                    let rounded = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                        _mm512_mul_ps(v, inv),
                    );
                    let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(rounded, rounded);
                    let q = _mm512_maskz_cvtps_epi32(ordered, rounded);
                    _mm_storeu_si128(qs.as_mut_ptr().add(b * BLOCK + 16 * h).cast(), _mm512_cvtepi32_epi8(q));
                    half[h] = _mm512_reduce_add_epi32(q);
                }
                d[b] = scale;
                sums[b] = scale * (half[0] + half[1]) as f32;
                offsets[2 * b] = -128 * half[0];
                offsets[2 * b + 1] = -128 * half[1];
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
    pub(super) fn dot_group(g: &Group<'_>, x: &Q8Rows, out: &mut [f32], stride: Strides) {
        let tokens = x.rows();
        let mut t = 0;
        while t < tokens {
            let tt = (tokens - t).min(INPUTS);
            match tt {
                4 => micro::<4>(g, x, t, out, stride),
                3 => micro::<3>(g, x, t, out, stride),
                2 => micro::<2>(g, x, t, out, stride),
                _ => micro::<1>(g, x, t, out, stride),
            }
            t += tt;
        }
    }

    /// `Layout`s as const parameters, so each kernel is compiled for one.
    const NIBBLES: u8 = 0;
    const BYTES: u8 = 1;
    const BYTES_HALVES: u8 = 2;

    /// The 16 rows against inputs `t0..t0 + T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
    #[inline]
    fn micro<const T: usize>(g: &Group<'_>, x: &Q8Rows, t0: usize, out: &mut [f32], stride: Strides) {
        match g.layout {
            Layout::Nibbles => blocks::<T, NIBBLES>(g, x, t0, out, stride),
            Layout::Bytes => blocks::<T, BYTES>(g, x, t0, out, stride),
            Layout::BytesHalves => blocks::<T, BYTES_HALVES>(g, x, t0, out, stride),
        }
    }

    /// The blocks one after another into the two chains of sums (`block` has this one
    /// call site, so it is inlined and the sums stay in registers).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
    #[inline]
    fn blocks<const T: usize, const L: u8>(g: &Group<'_>, x: &Q8Rows, t0: usize, out: &mut [f32], stride: Strides) {
        let bpr = g.blocks_per_row;
        assert!(x.rows() >= t0 + T && stride.fits(GROUP_ROWS, t0 + T, out.len()));
        let mut acc = [[_mm512_setzero_ps(); 2]; T];
        for b in 0..bpr {
            prefetch::<L>(g, b + PREFETCH_BLOCKS);
            // SAFETY: b < bpr, and `x` holds rows t0..t0 + T (asserted above).
            unsafe { block::<T, L>(g, x, t0, b, &mut acc) };
        }
        for (t, [a0, a1]) in acc.into_iter().enumerate() {
            let sums = _mm512_add_ps(a0, a1);
            if stride.row == 1 {
                // The 16 rows side by side: one store (in `out`, as asserted above).
                // SAFETY: outputs stride.at(0..16, t0 + t) lie in `out` (asserted).
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(stride.at(0, t0 + t)), sums) };
                continue;
            }
            let mut rows = [0.0f32; GROUP_ROWS];
            // SAFETY: `rows` holds 16 floats.
            unsafe { _mm512_storeu_ps(rows.as_mut_ptr(), sums) };
            for (i, v) in rows.into_iter().enumerate() {
                out[stride.at(i, t0 + t)] = v;
            }
        }
    }

    /// Blocks ahead of the one being multiplied whose weights are asked for: 2 KB of
    /// chunks (4 KB for bytes), 100-200 ns of a core's share of the memory bandwidth.
    /// At one input a block is a few instructions and the loads themselves run far
    /// enough ahead; at four, the reorder window fills with arithmetic and holds only
    /// a few blocks' loads, so the weights stream slower than memory gives them (a
    /// decode step of 4 sequences took 1.5× one of 1 without this, 1.4× with it).
    const PREFETCH_BLOCKS: usize = 8;

    /// Asks for block `b`'s chunks, scales and offsets. Past the group's end it names
    /// the next group's (the groups lie one after another) or nothing: a prefetch does
    /// not fault, and the addresses are computed without being dereferenced.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
    #[inline]
    fn prefetch<const L: u8>(g: &Group<'_>, b: usize) {
        let q_len = if L == NIBBLES { 16 } else { 32 };
        let scales = if L == BYTES_HALVES { 2 } else { 1 };
        let chunks = g.qs.as_ptr().wrapping_add(b * GROUP_ROWS * q_len);
        for line in 0..q_len / 4 {
            _mm_prefetch::<_MM_HINT_T0>(chunks.wrapping_add(64 * line).cast());
        }
        let d = g.d.as_ptr().wrapping_add(b * GROUP_ROWS * scales);
        for line in 0..scales {
            _mm_prefetch::<_MM_HINT_T0>(d.wrapping_add(GROUP_ROWS * line).cast());
        }
        if L == NIBBLES {
            _mm_prefetch::<_MM_HINT_T0>(g.m.as_ptr().wrapping_add(b * GROUP_ROWS).cast());
        }
    }

    /// Block `b` of the 16 rows against inputs `t0..t0 + T`, into `acc`.
    ///
    /// # Safety
    /// `b` is below the group's blocks a row, and `x` holds rows `t0..t0 + T`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma")]
    #[inline]
    unsafe fn block<const T: usize, const L: u8>(
        g: &Group<'_>,
        x: &Q8Rows,
        t0: usize,
        b: usize,
        acc: &mut [[__m512; 2]; T],
    ) {
        let q_len = if L == NIBBLES { 16 } else { 32 };
        let scales = if L == BYTES_HALVES { 2 } else { 1 };
        // SAFETY (all loads below): block b < bpr of the group's chunks, scales and
        // offsets (lengths checked by `dot_group`'s caller), and of input rows
        // t0 + t < x.rows(); 4-byte input reads at 4c < 32 within a block.
        unsafe {
            let zero = _mm512_setzero_si512();
            let chunks = g.qs.as_ptr().add(b * GROUP_ROWS * q_len);
            let mut w = [zero; 8];
            if L == NIBBLES {
                let nibble = _mm512_set1_epi8(0x0F);
                for c in 0..4 {
                    let v = _mm512_loadu_si512(chunks.add(c * CHUNK) as *const _);
                    w[c] = _mm512_and_si512(v, nibble);
                    w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                }
            } else {
                for (c, w) in w.iter_mut().enumerate() {
                    *w = _mm512_loadu_si512(chunks.add(c * CHUNK) as *const _);
                }
            }
            let ds = g.d.as_ptr().add(b * GROUP_ROWS * scales);
            let dw0 = _mm512_loadu_ps(ds);
            let dw1 = if L == BYTES_HALVES { _mm512_loadu_ps(ds.add(GROUP_ROWS)) } else { dw0 };
            let m = if L == NIBBLES { _mm512_loadu_ps(g.m.as_ptr().add(b * GROUP_ROWS)) } else { dw0 };
            for (t, [a0, a1]) in acc.iter_mut().enumerate() {
                let at = (t0 + t) * x.blocks_per_row + b;
                let xq = x.qs.as_ptr().add(at * BLOCK) as *const i32;
                let xb = |c: usize| _mm512_set1_epi32(xq.add(c).read_unaligned());
                let dx = _mm512_set1_ps(*x.d.get_unchecked(at));
                if L == NIBBLES {
                    // Integer sums are exact in any order: one chain where the inputs
                    // give enough of them to cover the latency, two where they do not.
                    let s = if T >= 3 {
                        let mut s = _mm512_dpbusd_epi32(zero, w[0], xb(0));
                        for c in 1..8 {
                            s = _mm512_dpbusd_epi32(s, w[c], xb(c));
                        }
                        s
                    } else {
                        let (mut s0, mut s1) = (zero, zero);
                        for c in (0..8).step_by(2) {
                            s0 = _mm512_dpbusd_epi32(s0, w[c], xb(c));
                            s1 = _mm512_dpbusd_epi32(s1, w[c + 1], xb(c + 1));
                        }
                        _mm512_add_epi32(s0, s1)
                    };
                    let s = _mm512_cvtepi32_ps(s);
                    *a0 = _mm512_fmadd_ps(s, _mm512_mul_ps(dw0, dx), *a0);
                    *a1 = _mm512_fmadd_ps(m, _mm512_set1_ps(*x.sums.get_unchecked(at)), *a1);
                } else {
                    let mut s0 = _mm512_set1_epi32(*x.offsets.get_unchecked(2 * at));
                    let mut s1 = _mm512_set1_epi32(*x.offsets.get_unchecked(2 * at + 1));
                    for c in 0..4 {
                        s0 = _mm512_dpbusd_epi32(s0, w[c], xb(c));
                        s1 = _mm512_dpbusd_epi32(s1, w[c + 4], xb(c + 4));
                    }
                    if L == BYTES {
                        let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                        *a0 = _mm512_fmadd_ps(s, _mm512_mul_ps(dw0, dx), *a0);
                    } else {
                        *a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(dw0, dx), *a0);
                        *a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(dw1, dx), *a1);
                    }
                }
            }
        }
    }
}

/// The AVX2 build: each half of the group (8 rows, one 256-bit register of 32-bit
/// lanes) against up to `INPUTS` inputs at a time, sharing every chunk loaded. AVX2 has
/// no `vpdpbusd`: `vpmaddubsw` multiplies unsigned bytes by signed ones and adds
/// neighbours into 16 bits (saturating), and `vpmaddwd` by ones adds those into 32: the
/// same sums of 4 products. Nothing saturates: nibbles (0..15) times inputs (−127..127)
/// stay within 2·15·127; for bytes, the stored `w + 128` becomes `w` again, and its
/// magnitude (0..128) multiplies the input given `w`'s sign, within 2·128·127 < 2¹⁵.
/// Those sums are `w·q` directly, which the other builds reach through `(w + 128)·q`
/// and the −128·Σq offsets: the same integers, so the same bits after them.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, CHUNK, GROUP_ROWS, Group, Layout, Q8Rows, Strides};
    use std::arch::x86_64::*;

    const INPUTS: usize = 2;
    const HALF: usize = GROUP_ROWS / 2;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_group(g: &Group<'_>, x: &Q8Rows, out: &mut [f32], stride: Strides) {
        let tokens = x.rows();
        for h in 0..2 {
            let mut t = 0;
            while t < tokens {
                let tt = (tokens - t).min(INPUTS);
                match (tt, g.layout) {
                    (2, Layout::Nibbles) => blocks::<2, NIBBLES>(g, x, h, t, out, stride),
                    (2, Layout::Bytes) => blocks::<2, BYTES>(g, x, h, t, out, stride),
                    (2, Layout::BytesHalves) => blocks::<2, BYTES_HALVES>(g, x, h, t, out, stride),
                    (_, Layout::Nibbles) => blocks::<1, NIBBLES>(g, x, h, t, out, stride),
                    (_, Layout::Bytes) => blocks::<1, BYTES>(g, x, h, t, out, stride),
                    (_, Layout::BytesHalves) => blocks::<1, BYTES_HALVES>(g, x, h, t, out, stride),
                }
                t += tt;
            }
        }
    }

    const NIBBLES: u8 = 0;
    const BYTES: u8 = 1;
    const BYTES_HALVES: u8 = 2;

    /// Rows `8h..8h + 8` against inputs `t0..t0 + T`, block after block.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn blocks<const T: usize, const L: u8>(
        g: &Group<'_>,
        x: &Q8Rows,
        h: usize,
        t0: usize,
        out: &mut [f32],
        stride: Strides,
    ) {
        assert!(x.rows() >= t0 + T && stride.fits(GROUP_ROWS, t0 + T, out.len()));
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for b in 0..g.blocks_per_row {
            // SAFETY: b < blocks_per_row, h < 2, and `x` holds rows t0..t0 + T.
            unsafe { block::<T, L>(g, x, h, t0, b, &mut acc) };
        }
        for (t, [a0, a1]) in acc.into_iter().enumerate() {
            let mut rows = [0.0f32; HALF];
            // SAFETY: `rows` holds 8 floats.
            unsafe { _mm256_storeu_ps(rows.as_mut_ptr(), _mm256_add_ps(a0, a1)) };
            for (i, v) in rows.into_iter().enumerate() {
                out[stride.at(HALF * h + i, t0 + t)] = v;
            }
        }
    }

    /// Sums of 4 products per 32-bit lane: unsigned bytes `u` by signed bytes `s`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn dot4(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// Block `b` of rows `8h..8h + 8` against inputs `t0..t0 + T`, into `acc`.
    ///
    /// # Safety
    /// `b` is below the group's blocks a row, `h` < 2, and `x` holds rows `t0..t0 + T`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn block<const T: usize, const L: u8>(
        g: &Group<'_>,
        x: &Q8Rows,
        h: usize,
        t0: usize,
        b: usize,
        acc: &mut [[__m256; 2]; T],
    ) {
        let q_len = if L == NIBBLES { 16 } else { 32 };
        let scales = if L == BYTES_HALVES { 2 } else { 1 };
        // SAFETY (all loads below): block b < bpr of the group's chunks (32 bytes at
        // 32h within each 64-byte chunk), scales and mins, and of input rows
        // t0 + t < x.rows(); 4-byte input reads at 4c < 32 within a block.
        unsafe {
            let chunks = g.qs.as_ptr().add(b * GROUP_ROWS * q_len + HALF * 4 * h);
            let load = |c: usize| _mm256_loadu_si256(chunks.add(c * CHUNK) as *const _);
            let flip = _mm256_set1_epi8(-128);
            // Weights as multiplied: nibbles as they are; bytes as |w| (unsigned) and
            // w itself, whose sign the inputs take.
            let mut w = [_mm256_setzero_si256(); 8];
            if L == NIBBLES {
                let nibble = _mm256_set1_epi8(0x0F);
                for c in 0..4 {
                    let v = load(c);
                    w[c] = _mm256_and_si256(v, nibble);
                    w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                }
            } else {
                for (c, w) in w.iter_mut().enumerate() {
                    *w = _mm256_xor_si256(load(c), flip);
                }
            }
            let ds = g.d.as_ptr().add(b * GROUP_ROWS * scales + HALF * h);
            let dw0 = _mm256_loadu_ps(ds);
            let dw1 = if L == BYTES_HALVES { _mm256_loadu_ps(ds.add(GROUP_ROWS)) } else { dw0 };
            let m = if L == NIBBLES { _mm256_loadu_ps(g.m.as_ptr().add(b * GROUP_ROWS + HALF * h)) } else { dw0 };
            for (t, [a0, a1]) in acc.iter_mut().enumerate() {
                let at = (t0 + t) * x.blocks_per_row + b;
                let xq = x.qs.as_ptr().add(at * BLOCK) as *const i32;
                let xb = |c: usize| _mm256_set1_epi32(xq.add(c).read_unaligned());
                let dx = _mm256_set1_ps(*x.d.get_unchecked(at));
                if L == NIBBLES {
                    let mut s = dot4(w[0], xb(0));
                    for c in 1..8 {
                        s = _mm256_add_epi32(s, dot4(w[c], xb(c)));
                    }
                    let s = _mm256_cvtepi32_ps(s);
                    *a0 = _mm256_fmadd_ps(s, _mm256_mul_ps(dw0, dx), *a0);
                    *a1 = _mm256_fmadd_ps(m, _mm256_set1_ps(*x.sums.get_unchecked(at)), *a1);
                } else {
                    let signed = |c: usize| dot4(_mm256_abs_epi8(w[c]), _mm256_sign_epi8(xb(c), w[c]));
                    let (mut s0, mut s1) = (signed(0), signed(4));
                    for c in 1..4 {
                        s0 = _mm256_add_epi32(s0, signed(c));
                        s1 = _mm256_add_epi32(s1, signed(c + 4));
                    }
                    if L == BYTES {
                        let s = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
                        *a0 = _mm256_fmadd_ps(s, _mm256_mul_ps(dw0, dx), *a0);
                    } else {
                        *a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(dw0, dx), *a0);
                        *a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(dw1, dx), *a1);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::QuantRows;
    use crate::cpu::quant_rows::tests::{FORMATS, random_blocks};
    use crate::quant::dequantize;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn rounding_keeps_each_input_within_half_its_block_scale() {
        let mut rng = StdRng::seed_from_u64(3);
        let k = 96;
        let mut x: Vec<f32> = (0..2 * k).map(|_| rng.random_range(-3.0..3.0)).collect();
        x[k..k + 32].fill(0.0);
        // Block 5: a scale of 1, and ties that round to even.
        x[160..164].copy_from_slice(&[127.0, 0.5, 1.5, -2.5]);
        x[164..192].fill(0.25);
        // Garbage in, the same on every build: NaN and infinite inputs, and a block too
        // small for its inverse scale to be finite.
        let mut odd = x.clone();
        odd[3] = f32::NAN;
        odd[40] = f32::INFINITY;
        odd[64..96].fill(1e-39);
        let fast = Q8Rows::quantize(&odd, k);
        let slow = super::super::simd::capped(super::super::simd::Isa::Portable, || Q8Rows::quantize(&odd, k));
        assert_eq!((&fast.qs, &fast.offsets), (&slow.qs, &slow.offsets));
        assert!(fast.qs[64..96].iter().all(|q| *q == 0) && fast.qs[3] == 0);
        let q = Q8Rows::quantize(&x, k);
        assert_eq!(q.qs[160..164], [127, 0, 2, -2]);
        let portable = super::super::simd::capped(super::super::simd::Isa::Portable, || Q8Rows::quantize(&x, k));
        assert_eq!((&portable.qs, &portable.offsets), (&q.qs, &q.offsets), "the portable build's bytes");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&portable.d), bits(&portable.sums)), (bits(&q.d), bits(&q.sums)), "and scales");
        for (b, xs) in x.chunks_exact(BLOCK).enumerate() {
            let d = q.d[b];
            let mut total = 0;
            for (j, v) in xs.iter().enumerate() {
                let got = q.qs[b * BLOCK + j];
                total += got as i32;
                assert!((got as f32 * d - v).abs() <= d / 2.0 * (1.0 + 1e-6), "block {b} element {j}");
            }
            assert!(xs.iter().all(|v| *v == 0.0) || q.qs[b * BLOCK..(b + 1) * BLOCK].iter().any(|v| v.abs() == 127));
            assert_eq!(q.sums[b], d * total as f32);
            assert_eq!(q.offsets[2 * b] + q.offsets[2 * b + 1], -128 * total);
        }
        assert_eq!(q.d[3], 0.0, "the all-zero block");
    }

    /// Each format against f64 on the dequantised weights and the unrounded inputs,
    /// within the rounding bound of the header; every build and every tiling gives
    /// the same bits as one row against one input.
    #[test]
    fn products_are_within_the_rounding_bound_and_the_same_bits_in_any_tile() {
        let seed: u64 = StdRng::from_os_rng().random();
        eprintln!("random seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        // 9 blocks a row; 21 rows, one
        // group of 16 and a padded one; 6 inputs, a tile of 4 and one of 2.
        let (rows, k, tokens) = (21, 9 * BLOCK, 6);
        for ty in FORMATS {
            let cols = if ty.block_elems() == 256 { 2 * 256 } else { k };
            let bytes = random_blocks(&mut rng, ty, rows * cols);
            let w = QuantRows::from_blocks(ty, &bytes, cols).unwrap();
            let dense = dequantize(ty, &bytes);
            let x: Vec<f32> = (0..tokens * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let q = Q8Rows::quantize(&x, cols);
            let mut all = vec![0.0f32; rows * tokens];
            w.dot_rows_int8(0, rows, &q, &mut all, Strides::row_major(tokens));
            for r in 0..rows {
                for t in 0..tokens {
                    let (wr, xr) = (&dense[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let bound: f64 = wr
                        .iter()
                        .enumerate()
                        .map(|(j, a)| a.abs() as f64 * q.d[(t * cols + j) / BLOCK] as f64 / 2.0)
                        .sum::<f64>()
                        * 1.001
                        + 1e-4 * wr.iter().zip(xr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum::<f64>();
                    let got = all[r * tokens + t] as f64;
                    assert!((got - exact).abs() <= bound, "{ty:?} row {r} input {t}: {got} vs {exact} (bound {bound})");
                    // One row against one input, portably: the same bits.
                    let one = Q8Rows::quantize(xr, cols);
                    let mut alone = [0.0f32];
                    super::super::simd::capped(super::super::simd::Isa::Portable, || {
                        w.dot_rows_int8(r, 1, &one, &mut alone, Strides::row_major(1))
                    });
                    assert_eq!(alone[0].to_bits(), all[r * tokens + t].to_bits(), "{ty:?} row {r} input {t} alone");
                }
            }
        }
    }
}
