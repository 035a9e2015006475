//! Dot products of weight rows with input rows, both contiguous along `k`, computed in
//! register tiles: three weight rows against three input rows share every load, nine
//! accumulators in flight.
//!
//! Batch invariance: each output is its own chain of fused multiply-adds — lane `l`
//! sums `k ≡ l (mod 8)` in increasing `k`, the eight lanes are then added in a fixed
//! tree, then the `k mod 8` leftovers in order — and which tile an output falls in
//! changes only what is computed beside it, never its operations. A sequence therefore
//! gets the same bits alone or in any batch. The AVX2 path and the portable one compute
//! the same fused operations (the portable one slowly where the CPU has no FMA), so
//! they agree bit for bit.

pub(super) const LANES: usize = 8;
/// Tile shape: 4 × 3 accumulators of 8 lanes plus the 3 inputs' operands fill the 16
/// vector registers of AVX2 (weights are read as memory operands of the FMAs).
const ROW_EDGE: usize = 4;
const INPUT_EDGE: usize = 3;

/// `out[r * stride + t] = w_r · x_t` for every row `w_r` of `w` and `x_t` of `x`, both
/// `k` wide.
pub(super) fn dot_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: usize) {
    let (rows, tokens) = (w.len() / k, x.len() / k);
    assert!(tokens <= stride && (rows == 0 || out.len() >= (rows - 1) * stride + tokens), "output too small");
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
        let (w, x, k, out, stride): (&[f32], &[f32], usize, &mut [f32], usize) = ($w, $x, $k, $out, $stride);
        let (rows, tokens) = (w.len() / k, x.len() / k);
        let mut t = 0;
        while t < tokens {
            let tt = (tokens - t).min(INPUT_EDGE);
            let xs = &x[t * k..(t + tt) * k];
            let mut r = 0;
            while r < rows {
                let rr = (rows - r).min(ROW_EDGE);
                let (ws, o) = (&w[r * k..(r + rr) * k], &mut out[r * stride + t..]);
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

/// `R` weight rows against `T` input rows; `out[i * stride + j]` gets row `i` · input `j`.
fn micro<const R: usize, const T: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: usize) {
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
            out[i * stride + j] = finish(&acc[i][j], &w[i][whole..], &x[j][whole..]);
        }
    }
}

/// An output from its lanes and the `k mod 8` products past them.
#[inline(always)]
fn finish(lanes: &[f32; LANES], w_tail: &[f32], x_tail: &[f32]) -> f32 {
    let mut sum = reduce_lanes(lanes);
    for (w, x) in w_tail.iter().zip(x_tail) {
        sum = w.mul_add(*x, sum);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{INPUT_EDGE, LANES, ROW_EDGE, finish};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot_tile(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: usize) {
        tile_loop!(micro, w, x, k, out, stride);
    }

    /// The portable `micro` with one 8-lane register per accumulator.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn micro<const R: usize, const T: usize>(w: &[f32], x: &[f32], k: usize, out: &mut [f32], stride: usize) {
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
                out[i * stride + j] = finish(&lanes, &w[i * k + whole..(i + 1) * k], &x[j * k + whole..(j + 1) * k]);
            }
        }
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
        dot_tile(&w, &x, k, &mut all, tokens);
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
            dot_tile(&w, &x[t * k..(t + 1) * k], k, &mut alone, 1);
            for r in 0..rows {
                assert_eq!(alone[r].to_bits(), all[r * tokens + t].to_bits(), "input {t} alone, row {r}");
            }
        }
        for r in 0..rows {
            let mut one = vec![0.0f32; tokens];
            dot_tile(&w[r * k..(r + 1) * k], &x, k, &mut one, tokens);
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
        dot_tile(&w, &x, k, &mut fast, tokens);
        let mut slow = vec![0.0f32; rows * tokens];
        for r in 0..rows {
            for t in 0..tokens {
                micro::<1, 1>(&w[r * k..(r + 1) * k], &x[t * k..(t + 1) * k], k, &mut slow[r * tokens + t..], 1);
            }
        }
        assert_eq!(
            fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
