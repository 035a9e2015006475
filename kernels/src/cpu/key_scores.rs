//! Scores of a group of query heads against a sequence's keys.
//!
//! The CPU cache keeps each block's keys of one KV head transposed, `[head_dim,
//! block_size]` (values stay a row per key), so one load holds one dimension of 16 (or
//! 8) consecutive keys: the lanes are keys, a key's score is one fused chain over the
//! dimensions in order, `s = fma(q[d], k[d], s)` from 0, times the scale — nothing is
//! added across lanes. The same chain on every build and whatever keys are computed
//! beside it: a key's score depends on its query and itself alone.
//!
//! (Keys stored a row each cost a reduction across lanes per key and head, and
//! shuffles to share one with another key: about 8 multiply-adds a cycle against 12-16
//! here, on the batch decode steps where attention is a quarter of the time.)

use super::kv_store::Stored;

/// Where a sequence's keys lie for one KV head: `base[b]` is where block `b`'s
/// `[head_dim, block_size]` tile starts; key `p` is lane `p % block_size` of block
/// `p / block_size`.
pub(super) struct KeyTiles<'a> {
    pub base: &'a [usize],
    pub block_size: usize,
    pub keys: usize,
}

impl KeyTiles<'_> {
    /// Where dimension 0 of key `p` lies (dimension `d` is `d · block_size` on).
    #[inline(always)]
    fn key(&self, p: usize) -> usize {
        self.base[p / self.block_size] + p % self.block_size
    }
}

/// `scores[h * keys + p] = scale · (query h · key p)` for the `queries.len() / hd` heads.
pub(super) fn key_scores<T: Stored>(
    queries: &[f32],
    hd: usize,
    k_cache: &[T],
    tiles: &KeyTiles<'_>,
    scale: f32,
    scores: &mut [f32],
) {
    let (keys, bs) = (tiles.keys, tiles.block_size);
    let group = queries.len() / hd;
    assert!(hd > 0 && queries.len() == group * hd && scores.len() >= group * keys);
    assert!(tiles.base.len() >= keys.div_ceil(bs), "a block table too short for its keys");
    // Whole tiles are read (the lanes past the last key too): each must be in the cache.
    assert!(tiles.base[..keys.div_ceil(bs)].iter().all(|&b| b + hd * bs <= k_cache.len()), "a key outside the cache");
    #[cfg(target_arch = "x86_64")]
    if bs.is_multiple_of(16) && super::simd::has_avx512() {
        // SAFETY: the CPU has AVX-512 F, AVX2, FMA and F16C; tiles in bounds (asserted).
        unsafe { avx512::key_scores(queries, hd, k_cache, tiles, scale, scores) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if bs.is_multiple_of(8) && super::simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2, FMA and F16C; tiles in bounds (asserted).
        unsafe { avx2::key_scores(queries, hd, k_cache, tiles, scale, scores) };
        return;
    }
    portable(queries, hd, k_cache, tiles, scale, scores);
}

/// One key and one head at a time, for any CPU and block size.
fn portable<T: Stored>(
    queries: &[f32],
    hd: usize,
    k_cache: &[T],
    tiles: &KeyTiles<'_>,
    scale: f32,
    scores: &mut [f32],
) {
    let (keys, bs) = (tiles.keys, tiles.block_size);
    for p in 0..keys {
        let at = tiles.key(p);
        for (h, query) in queries.chunks_exact(hd).enumerate() {
            let mut s = 0.0f32;
            for (d, q) in query.iter().enumerate() {
                s = q.mul_add(k_cache[at + d * bs].widen(), s);
            }
            scores[h * keys + p] = s * scale;
        }
    }
}

/// A module `$name` with `key_scores` for one vector width: `$lanes` keys to a
/// register (`$load` widens them), `$units` registers of keys against up to four heads
/// at a time — up to `4 · $units` independent chains, enough to keep the FMA units
/// busy through their latency.
macro_rules! vector_key_scores {
    ($name:ident, $features:literal, $reg:ty, $lanes:literal, $units:literal,
     $load:ident, $zero:ident, $set1:ident, $fmadd:ident, $mul:ident, $store:ident) => {
        #[cfg(target_arch = "x86_64")]
        mod $name {
            use super::{KeyTiles, Stored};
            use std::arch::x86_64::*;

            const LANES: usize = $lanes;
            const UNITS: usize = $units;

            /// # Safety
            /// The CPU has the module's features; `tiles.block_size` is a multiple of
            /// `LANES`, and `key_scores` checked the tiles lie in the cache and `scores`
            /// is long enough.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn key_scores<T: Stored>(
                queries: &[f32],
                hd: usize,
                k_cache: &[T],
                tiles: &KeyTiles<'_>,
                scale: f32,
                scores: &mut [f32],
            ) {
                let keys = tiles.keys;
                let group = queries.len() / hd;
                let mut h = 0;
                while h < group {
                    let (q, s) = (&queries[h * hd..], &mut scores[h * keys..]);
                    for first in (0..keys).step_by(LANES * UNITS) {
                        // SAFETY: as promised by the caller; heads h.. exist.
                        unsafe {
                            match group - h {
                                1 => units::<T, 1>(q, hd, k_cache, tiles, first, scale, s),
                                2 => units::<T, 2>(q, hd, k_cache, tiles, first, scale, s),
                                3 => units::<T, 3>(q, hd, k_cache, tiles, first, scale, s),
                                _ => units::<T, 4>(q, hd, k_cache, tiles, first, scale, s),
                            }
                        }
                    }
                    h += (group - h).min(4);
                }
            }

            /// Keys `first..first + LANES · UNITS` (those below `keys`) against heads
            /// `0..G` of `queries`.
            ///
            /// # Safety
            /// As for `key_scores`.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn units<T: Stored, const G: usize>(
                queries: &[f32],
                hd: usize,
                k_cache: &[T],
                tiles: &KeyTiles<'_>,
                first: usize,
                scale: f32,
                scores: &mut [f32],
            ) {
                let (keys, bs) = (tiles.keys, tiles.block_size);
                assert!(queries.len() >= G * hd && scores.len() >= (G - 1) * keys + keys);
                // A unit past the last key reads the first one again, and is not stored.
                let starts: [usize; UNITS] = std::array::from_fn(|u| first + u * LANES);
                let at = starts.map(|s| tiles.key(if s < keys { s } else { first }));
                let mut acc: [[$reg; UNITS]; G] = [[$zero(); UNITS]; G];
                for d in 0..hd {
                    // SAFETY: each unit's lanes lie in one tile (LANES divides the block
                    // size), whose every dimension is in the cache (the caller's
                    // promise); d < hd.
                    unsafe {
                        let k = at.map(|a| T::$load(k_cache.as_ptr().add(a + d * bs)));
                        for (g, acc) in acc.iter_mut().enumerate() {
                            let q = $set1(*queries.get_unchecked(g * hd + d));
                            for (a, k) in acc.iter_mut().zip(&k) {
                                *a = $fmadd(q, *k, *a);
                            }
                        }
                    }
                }
                let scale = $set1(scale);
                for (g, acc) in acc.iter().enumerate() {
                    for (u, a) in acc.iter().enumerate() {
                        let start = starts[u];
                        if start >= keys {
                            break;
                        }
                        let mut lanes = [0.0f32; LANES];
                        // SAFETY: `lanes` holds LANES floats.
                        unsafe { $store(lanes.as_mut_ptr(), $mul(*a, scale)) };
                        let n = (keys - start).min(LANES);
                        scores[g * keys + start..g * keys + start + n].copy_from_slice(&lanes[..n]);
                    }
                }
            }
        }
    };
}

vector_key_scores!(
    avx512,
    "avx512f,avx2,fma,f16c",
    __m512,
    16,
    4,
    load16,
    _mm512_setzero_ps,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    _mm512_mul_ps,
    _mm512_storeu_ps
);
vector_key_scores!(
    avx2,
    "avx2,fma,f16c",
    __m256,
    8,
    2,
    load8,
    _mm256_setzero_ps,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    _mm256_mul_ps,
    _mm256_storeu_ps
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::{Isa, capped};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Blocks scattered through a cache of `blocks` tiles, as block tables leave them.
    fn scattered(blocks: usize, bs: usize, hd: usize, used: usize) -> Vec<usize> {
        (0..used).map(|b| ((b * 5 + 3) % blocks) * hd * bs).collect()
    }

    #[test]
    fn a_keys_score_is_one_chain_on_every_build_whatever_is_beside_it() {
        let mut rng = StdRng::seed_from_u64(11);
        for (hd, bs, keys, group) in [
            (64, 16, 1usize, 3),
            (64, 16, 77, 3),
            (64, 32, 130, 3),
            (24, 8, 21, 7),
            (20, 4, 13, 2),
            (64, 16, 64, 5),
            (32, 16, 200, 1),
        ] {
            let blocks = keys.div_ceil(bs) + 3;
            let queries: Vec<f32> = (0..group * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let cache: Vec<f32> = (0..blocks * hd * bs).map(|_| rng.random_range(-1.0..1.0)).collect();
            let base = scattered(blocks, bs, hd, keys.div_ceil(bs));
            let tiles = KeyTiles { base: &base, block_size: bs, keys };
            let run = |isa| {
                let mut s = vec![0.0f32; group * keys];
                capped(isa, || key_scores(&queries, hd, &cache, &tiles, 0.125, &mut s));
                s.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let (wide, avx2, slow) = (run(Isa::Avx512), run(Isa::Avx2), run(Isa::Portable));
            assert_eq!(wide, slow, "AVX-512 against portable: hd {hd}, block {bs}, {keys} keys");
            assert_eq!(avx2, slow, "AVX2 against portable: hd {hd}, block {bs}, {keys} keys");
            for p in 0..keys {
                let at = base[p / bs] + p % bs;
                for h in 0..group {
                    let q = &queries[h * hd..(h + 1) * hd];
                    let chain = (0..hd).fold(0.0f32, |s, d| q[d].mul_add(cache[at + d * bs], s)) * 0.125;
                    assert_eq!(chain.to_bits(), slow[h * keys + p], "key {p} head {h}: not the chain");
                    let exact: f64 = (0..hd).map(|d| q[d] as f64 * cache[at + d * bs] as f64).sum::<f64>() * 0.125;
                    assert!((f32::from_bits(slow[h * keys + p]) as f64 - exact).abs() < 1e-5);
                }
            }
        }
    }

    #[test]
    fn half_float_keys_score_as_the_floats_they_hold() {
        let mut rng = StdRng::seed_from_u64(12);
        let (hd, bs, keys, group) = (64, 16, 45, 3);
        let queries: Vec<f32> = (0..group * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
        let halves: Vec<u16> =
            (0..4 * hd * bs).map(|_| half::f16::from_f32(rng.random_range(-1.0..1.0)).to_bits()).collect();
        let floats: Vec<f32> = halves.iter().map(|h| h.widen()).collect();
        let base = scattered(4, bs, hd, 3);
        let tiles = KeyTiles { base: &base, block_size: bs, keys };
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            let (mut a, mut b) = (vec![0.0f32; group * keys], vec![0.0f32; group * keys]);
            capped(isa, || key_scores(&queries, hd, &halves, &tiles, 0.125, &mut a));
            capped(isa, || key_scores(&queries, hd, &floats, &tiles, 0.125, &mut b));
            assert_eq!(a, b, "{isa:?}");
        }
    }
}
