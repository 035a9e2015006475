//! Dot products of weight rows with input rows, both contiguous along `k`, computed in
//! register tiles: three weight rows against three input rows share every load, nine
//! accumulators in flight.
//!
//! Batch invariance: each output is its own chain of fused multiply-adds — lane `l`
//! sums `k ≡ l (mod 8)` in increasing `k`, the eight lanes are then added in a fixed
//! tree, then the `k mod 8` leftovers in order — and which tile an output falls in
//! changes only what is computed beside it, never its operations. A sequence therefore
//! gets the same bits alone or in any batch. The AVX-512 path (two rows to a register,
//! below), the AVX2 path and the portable one compute the same fused operations (the
//! portable one slowly where the CPU has no FMA), so they agree bit for bit.

use super::matmul::Strides;

pub(super) const LANES: usize = 8;
/// Tile shape: 4 × 3 accumulators of 8 lanes plus the 3 inputs' operands fill the 16
/// vector registers of AVX2 (weights are read as memory operands of the FMAs).
const ROW_EDGE: usize = 4;
const INPUT_EDGE: usize = 3;

/// `out[stride.at(r, t)] = w_r · x_t` for every row `w_r` of `w` and `x_t` of `x`, both
/// `k` wide.
pub(super) fn dot_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: Strides) {
    let (rows, tokens) = (w.len() / k, x.len() / k);
    assert!(stride.fits(rows, tokens, out.len()), "output too small");
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx512() {
        // SAFETY: the CPU has AVX-512 F and DQ, AVX2 and FMA.
        unsafe { avx512::dot_tile(w, x, k, out, stride) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        unsafe { avx2::dot_tile(w, x, k, out, stride) };
        return;
    }
    tile_loop!(micro, w, x, k, out, stride);
}

/// Walks `w` and `x` in tiles of up to `ROW_EDGE` × `INPUT_EDGE`, calling `$micro::<R, T>` on each.
macro_rules! tile_loop {
    ($micro:ident, $w:expr, $x:expr, $k:expr, $out:expr, $stride:expr) => {{
        let (w, x, k, out, stride): (&[f32], &[f32], usize, &mut [f32], Strides) = ($w, $x, $k, $out, $stride);
        let (rows, tokens) = (w.len() / k, x.len() / k);
        let mut t = 0;
        while t < tokens {
            let tt = (tokens - t).min(INPUT_EDGE);
            let xs = &x[t * k..(t + tt) * k];
            let mut r = 0;
            while r < rows {
                let rr = (rows - r).min(ROW_EDGE);
                let (ws, o) = (&w[r * k..(r + rr) * k], &mut out[stride.at(r, t)..]);
                match (rr, tt) {
                    (4, 3) => $micro::<4, 3>(ws, xs, k, o, stride),
                    (4, 2) => $micro::<4, 2>(ws, xs, k, o, stride),
                    (4, 1) => $micro::<4, 1>(ws, xs, k, o, stride),
                    (3, 3) => $micro::<3, 3>(ws, xs, k, o, stride),
                    (3, 2) => $micro::<3, 2>(ws, xs, k, o, stride),
                    (3, 1) => $micro::<3, 1>(ws, xs, k, o, stride),
                    (2, 3) => $micro::<2, 3>(ws, xs, k, o, stride),
                    (2, 2) => $micro::<2, 2>(ws, xs, k, o, stride),
                    (2, 1) => $micro::<2, 1>(ws, xs, k, o, stride),
                    (1, 3) => $micro::<1, 3>(ws, xs, k, o, stride),
                    (1, 2) => $micro::<1, 2>(ws, xs, k, o, stride),
                    _ => $micro::<1, 1>(ws, xs, k, o, stride),
                }
                r += rr;
            }
            t += tt;
        }
    }};
}
use tile_loop;

/// `R` weight rows against `T` input rows; `out[stride.at(i, j)]` gets row `i` · input `j`.
fn micro<const R: usize, const T: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: Strides) {
    let w: [&[f32]; R] = std::array::from_fn(|i| &w[i * k..(i + 1) * k]);
    let x: [&[f32]; T] = std::array::from_fn(|j| &x[j * k..(j + 1) * k]);
    let mut acc = [[[0.0f32; LANES]; T]; R];
    let whole = k / LANES * LANES;
    let mut at = 0;
    while at < whole {
        for i in 0..R {
            for j in 0..T {
                for l in 0..LANES {
                    acc[i][j][l] = w[i][at + l].mul_add(x[j][at + l], acc[i][j][l]);
                }
            }
        }
        at += LANES;
    }
    for i in 0..R {
        for j in 0..T {
            out[stride.at(i, j)] = finish(&acc[i][j], &w[i][whole..], &x[j][whole..]);
        }
    }
}

/// An output from its lanes and the `k mod 8` products past them.
#[inline(always)]
fn finish(lanes: &[f32; LANES], w_tail: &[f32], x_tail: &[f32]) -> f32 {
    tail(reduce_lanes(lanes), w_tail, x_tail)
}

/// `sum` plus the `k mod 8` products past the lanes, in order.
#[inline(always)]
fn tail(mut sum: f32, w_tail: &[f32], x_tail: &[f32]) -> f32 {
    for (w, x) in w_tail.iter().zip(x_tail) {
        sum = w.mul_add(*x, sum);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{INPUT_EDGE, LANES, ROW_EDGE, Strides, finish};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: Strides) {
        tile_loop!(micro, w, x, k, out, stride);
    }

    /// The portable `micro` with one 8-lane register per accumulator.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn micro<const R: usize, const T: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: Strides) {
        assert!(w.len() >= R * k && x.len() >= T * k);
        let whole = k / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut xv = [_mm256_setzero_ps(); T];
        let mut at = 0;
        while at < whole {
            // SAFETY: row i (j) spans [i*k, (i+1)*k) of w (x), asserted above, and
            // at + 8 <= whole <= k.
            unsafe {
                for j in 0..T {
                    xv[j] = _mm256_loadu_ps(x.as_ptr().add(j * k + at));
                }
                for i in 0..R {
                    let wv = _mm256_loadu_ps(w.as_ptr().add(i * k + at));
                    for j in 0..T {
                        acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
                    }
                }
            }
            at += LANES;
        }
        for i in 0..R {
            for j in 0..T {
                let mut lanes = [0.0f32; LANES];
                // SAFETY: `lanes` holds 8 floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i][j]) };
                out[stride.at(i, j)] = finish(&lanes, &w[i * k + whole..(i + 1) * k], &x[j * k + whole..(j + 1) * k]);
            }
        }
    }
}

/// With AVX-512 each 16-lane register holds two weight rows' 8 lanes side by side and
/// one input's 8 lanes broadcast to both halves, so every lane runs exactly the chain of
/// fused multiply-adds of the 8-lane paths — the same bits — at twice the width, and the
/// 32 registers hold a tile of 4 row pairs × 6 inputs.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::simd::halves;
    use super::{LANES, Strides, tail};
    use std::arch::x86_64::*;

    const PAIRS: usize = 4;
    const INPUTS: usize = 6;

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(super) fn dot_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: Strides) {
        let (rows, tokens) = (w.len() / k, x.len() / k);
        let mut t = 0;
        while t < tokens {
            let tt = (tokens - t).min(INPUTS);
            let xs = &x[t * k..(t + tt) * k];
            let mut r = 0;
            while r < rows {
                let rr = (rows - r).min(2 * PAIRS);
                let (ws, o) = (&w[r * k..(r + rr) * k], &mut out[stride.at(r, t)..]);
                macro_rules! by_inputs {
                    ($p:literal) => {
                        match tt {
                            6 => micro::<$p, 6>(ws, xs, k, o, stride),
                            5 => micro::<$p, 5>(ws, xs, k, o, stride),
                            4 => micro::<$p, 4>(ws, xs, k, o, stride),
                            3 => micro::<$p, 3>(ws, xs, k, o, stride),
                            2 => micro::<$p, 2>(ws, xs, k, o, stride),
                            _ => micro::<$p, 1>(ws, xs, k, o, stride),
                        }
                    };
                }
                match rr.div_ceil(2) {
                    4 => by_inputs!(4),
                    3 => by_inputs!(3),
                    2 => by_inputs!(2),
                    _ => by_inputs!(1),
                }
                r += rr;
            }
            t += tt;
        }
    }

    /// `P` row pairs (the last one's second row repeats its first when `w` holds an odd
    /// number of rows; that result is dropped) against `T` input rows.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    #[inline]
    fn micro<const P: usize, const T: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: Strides) {
        let rows = w.len() / k;
        assert!(rows <= 2 * P && rows + 2 > 2 * P && x.len() >= T * k);
        let row = |i: usize| i.min(rows - 1) * k;
        let whole = k / LANES * LANES;
        let mut acc = [[_mm512_setzero_ps(); T]; P];
        let mut at = 0;
        while at < whole {
            // SAFETY: rows start at `row(i)` < rows * k <= w.len() and inputs at j * k,
            // j < T; each read is 8 floats from `at`, at + 8 <= whole <= k.
            unsafe {
                let mut wv = [_mm512_setzero_ps(); P];
                for (p, v) in wv.iter_mut().enumerate() {
                    *v = halves(w.as_ptr().add(row(2 * p) + at), w.as_ptr().add(row(2 * p + 1) + at));
                }
                for j in 0..T {
                    let xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x.as_ptr().add(j * k + at)));
                    for p in 0..P {
                        acc[p][j] = _mm512_fmadd_ps(wv[p], xv, acc[p][j]);
                    }
                }
            }
            at += LANES;
        }
        for p in 0..P {
            for j in 0..T {
                let v = reduce_halves(acc[p][j]);
                let sums = [_mm512_cvtss_f32(v), _mm_cvtss_f32(_mm512_extractf32x4_ps(v, 2))];
                for (h, sum) in sums.into_iter().enumerate() {
                    let i = 2 * p + h;
                    if i < rows {
                        out[stride.at(i, j)] =
                            tail(sum, &w[i * k + whole..(i + 1) * k], &x[j * k + whole..(j + 1) * k]);
                    }
                }
            }
        }
    }

    /// Each half's eight lanes summed in `reduce_lanes`' tree, into lanes 0 and 8.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn reduce_halves(a: __m512) -> __m512 {
        // s_l = a_l + a_(l+4): the 128-bit quarters swapped within each half.
        let s = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0b10_11_00_01));
        // s_0 + s_2 and s_1 + s_3.
        let u = _mm512_add_ps(s, _mm512_permute_ps(s, 0b01_00_11_10));
        // (s_0 + s_2) + (s_1 + s_3).
        _mm512_add_ps(u, _mm512_permute_ps(u, 0b10_11_00_01))
    }
}

/// The lanes' sum, in one fixed tree.
#[inline(always)]
pub(super) fn reduce_lanes(a: &[f32; LANES]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn tiles_match_f64_and_every_output_keeps_its_bits_in_any_tiling() {
        let seed: u64 = StdRng::from_os_rng().random();
        eprintln!("random seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        // k with a remainder past the 8 lanes, rows and inputs that leave partial tiles.
        let (rows, tokens, k) = (7, 11, 8 * 13 + 5);
        let w: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x: Vec<f32> = (0..tokens * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut all = vec![0.0f32; rows * tokens];
        dot_tile(&w, &x, k, &mut all, Strides::row_major(tokens));
        for r in 0..rows {
            for t in 0..tokens {
                let want: f64 = (0..k).map(|i| w[r * k + i] as f64 * x[t * k + i] as f64).sum();
                let got = all[r * tokens + t];
                assert!((got as f64 - want).abs() < 1e-4, "row {r} input {t}: {got} vs {want}");
            }
        }
        // Every input alone, and every weight row alone, gives the same bits.
        for t in 0..tokens {
            let mut alone = vec![0.0f32; rows];
            dot_tile(&w, &x[t * k..(t + 1) * k], k, &mut alone, Strides::row_major(1));
            for r in 0..rows {
                assert_eq!(alone[r].to_bits(), all[r * tokens + t].to_bits(), "input {t} alone, row {r}");
            }
        }
        for r in 0..rows {
            let mut one = vec![0.0f32; tokens];
            dot_tile(&w[r * k..(r + 1) * k], &x, k, &mut one, Strides::row_major(tokens));
            assert_eq!(
                one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                all[r * tokens..(r + 1) * tokens].iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn the_portable_build_agrees_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(7);
        let (rows, tokens, k) = (5, 4, 8 * 72 + 3);
        let w: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x: Vec<f32> = (0..tokens * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut fast = vec![0.0f32; rows * tokens];
        dot_tile(&w, &x, k, &mut fast, Strides::row_major(tokens));
        let mut slow = vec![0.0f32; rows * tokens];
        for r in 0..rows {
            for t in 0..tokens {
                micro::<1, 1>(
                    &w[r * k..(r + 1) * k],
                    &x[t * k..(t + 1) * k],
                    k,
                    &mut slow[r * tokens + t..],
                    Strides::row_major(1),
                );
            }
        }
        assert_eq!(
            fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// Every tile shape and remainder of the AVX-512 path against the AVX2 one.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_and_avx2_paths_agree_bit_for_bit() {
        if !crate::cpu::simd::avx512_to_compare() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(11);
        for k in [8, 8 * 9 + 5, 576] {
            for rows in 1..=19 {
                let tokens = 14;
                let w: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let x: Vec<f32> = (0..tokens * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                for t in 1..=tokens {
                    let (mut wide, mut narrow) = (vec![0.0f32; rows * t], vec![0.0f32; rows * t]);
                    // SAFETY: the CPU has AVX-512 F and DQ, AVX2 and FMA (checked above).
                    unsafe {
                        avx512::dot_tile(&w, &x[..t * k], k, &mut wide, Strides::row_major(t));
                        avx2::dot_tile(&w, &x[..t * k], k, &mut narrow, Strides::row_major(t));
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&wide), bits(&narrow), "k {k}, rows {rows}, inputs {t}");
                }
            }
        }
    }
}
