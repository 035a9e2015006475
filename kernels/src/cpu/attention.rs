//! Paged KV cache writes and causal attention read through block tables.
//!
//! Cache layout, per layer: values `[blocks, block_size, num_kv_heads, head_dim]`; keys
//! `[blocks, num_kv_heads, head_dim, block_size]`, each block's keys of a head
//! transposed so a load holds one dimension of consecutive keys (`key_scores`). The
//! layout is the CPU backend's own: only these kernels read it. The kernel computes
//! each (query row, KV head) on its own — the query heads sharing that KV head
//! together: the scores against the sequence's keys, their softmax, the weighted sum
//! of values. A row's result does not depend on the other rows of the batch.

use super::CpuBackend;
use super::key_scores::{KeyTiles, key_scores};
use super::kv_store::{self, Cache, KvStore, Stored};
use super::simd::{exp, multiversion};
use crate::error::expect_len;
use crate::paged::{HostBatch, Row};
use crate::{AttentionShape, KernelError, PagedBatch, Result};
use rayon::prelude::*;

pub(super) fn write_kv(
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    shape: &AttentionShape,
    (k_cache, v_cache): (&mut [f32], &mut [f32]),
    store: KvStore,
) -> Result<()> {
    let w = shape.kv_width();
    expect_len("write_kv", "keys", k.len(), slots.len() * w)?;
    expect_len("write_kv", "values", v.len(), slots.len() * w)?;
    expect_len("write_kv", "value cache", v_cache.len(), k_cache.len())?;
    let (bs, hd) = (shape.block_size, shape.head_dim);
    // Whole blocks only: a key tile is read whole.
    let capacity = Cache::new(k_cache, store).len() / (w * bs) * bs;
    if let Some(&slot) = slots.iter().find(|&&s| s as usize >= capacity) {
        return Err(KernelError::shape("write_kv", format!("slot {slot} outside a cache of {capacity}")));
    }
    let mut key = vec![0u16; if store == KvStore::F16 { w } else { 0 }];
    for (t, &slot) in slots.iter().enumerate() {
        let slot = slot as usize;
        let (at, from) = (slot * w..(slot + 1) * w, t * w..(t + 1) * w);
        // Element (head h, dimension d) of the slot's key: in its block's tile for h,
        // row d, lane `slot % bs` — `d · bs` into the head's tile.
        let tile = (slot / bs) * bs * w + slot % bs;
        match store {
            KvStore::F32 => {
                scatter_key(&k[from.clone()], hd, bs, &mut k_cache[tile..]);
                v_cache[at].copy_from_slice(&v[from]);
            }
            KvStore::F16 => {
                kv_store::narrow(&k[from.clone()], &mut key);
                scatter_key(&key, hd, bs, &mut kv_store::as_halves_mut(k_cache)[tile..]);
                kv_store::narrow(&v[from], &mut kv_store::as_halves_mut(v_cache)[at]);
            }
        }
    }
    Ok(())
}

/// One key's elements, head after head, into its lane of the block's tiles (`tiles`
/// starts at the lane of head 0, dimension 0).
fn scatter_key<T: Copy>(key: &[T], hd: usize, bs: usize, tiles: &mut [T]) {
    for (h, head) in key.chunks_exact(hd).enumerate() {
        let tile = &mut tiles[h * hd * bs..];
        for (d, x) in head.iter().enumerate() {
            tile[d * bs] = *x;
        }
    }
}

pub(super) fn paged_attention(
    q: &[f32],
    (k_cache, v_cache): (&[f32], &[f32]),
    store: KvStore,
    batch: &PagedBatch<'_, CpuBackend>,
    shape: &AttentionShape,
) -> Result<Vec<f32>> {
    let host = HostBatch {
        num_seqs: batch.num_seqs,
        query_start: batch.query_start,
        context_lens: batch.context_lens,
        block_tables: batch.block_tables,
        max_blocks_per_seq: batch.max_blocks_per_seq,
    };
    let (k_cache, v_cache) = (Cache::new(k_cache, store), Cache::new(v_cache, store));
    let rows = host.validate(q.len(), k_cache.len(), v_cache.len(), shape)?;
    let (hd, qw) = (shape.head_dim, shape.q_width());
    let group_width = shape.num_heads / shape.num_kv_heads * hd;
    let mut out = vec![0.0f32; q.len()];
    let task = Attend { q, k_cache, v_cache, rows: &rows, batch, shape };
    // Work is keys × head_dim per (row, head); small batches stay on this thread.
    let work: usize = rows.iter().map(|r| r.keys).sum::<usize>() * shape.num_heads * hd;
    if work >= 1 << 16 {
        out.par_chunks_mut(group_width).enumerate().for_each(|(i, o)| attend_group(&task, i, o));
    } else {
        out.chunks_mut(group_width).enumerate().for_each(|(i, o)| attend_group(&task, i, o));
    }
    debug_assert_eq!(out.len(), rows.len() * qw);
    Ok(out)
}

/// Everything one (query row, head) reads.
struct Attend<'a> {
    q: &'a [f32],
    k_cache: Cache<'a>,
    v_cache: Cache<'a>,
    rows: &'a [Row],
    batch: &'a PagedBatch<'a, CpuBackend>,
    shape: &'a AttentionShape,
}

multiversion! {
    /// Attention of flattened (query row, KV head) `i` into `o`: the query heads that
    /// share that KV head, together, so each key and value is read once for all of
    /// them. Two passes: the scores and their softmax, then the weighted sum of values.
    fn attend_group(t: &Attend<'_>, i: usize, o: &mut [f32]) -> () {
        let shape = t.shape;
        let (hd, kv_heads, bs) = (shape.head_dim, shape.num_kv_heads, shape.block_size);
        let group = shape.num_heads / kv_heads;
        let (row, kv_head) = (&t.rows[i / kv_heads], i % kv_heads);
        let queries = &t.q[i * group * hd..(i + 1) * group * hd];
        let table = &t.batch.block_tables[row.seq * t.batch.max_blocks_per_seq..][..row.keys.div_ceil(bs)];
        // Where each block's key tile for this KV head starts, and each key position's
        // value vector.
        let mut tiles = Vec::with_capacity(table.len());
        let mut offsets = Vec::with_capacity(row.keys);
        for (b, &block) in table.iter().enumerate() {
            let first = block as usize * bs;
            tiles.push((first * kv_heads + kv_head * bs) * hd);
            for slot in first..first + bs.min(row.keys - b * bs) {
                offsets.push((slot * kv_heads + kv_head) * hd);
            }
        }
        let mut scores = vec![0.0f32; group * row.keys];
        let keys = KeyTiles { base: &tiles, block_size: bs, keys: row.keys };
        match t.k_cache {
            Cache::F32(k) => key_scores(queries, hd, k, &keys, shape.scale, &mut scores),
            Cache::F16(k) => key_scores(queries, hd, k, &keys, shape.scale, &mut scores),
        }
        // No closures below: they would be compiled without the AVX2 this body gets.
        let mut sums = Vec::with_capacity(group);
        for scores in scores.chunks_exact_mut(row.keys) {
            sums.push(softmax_numerators(scores));
        }
        match t.v_cache {
            Cache::F32(v) => weighted_sums(&scores, &offsets, v, hd, o),
            Cache::F16(v) => weighted_sums(&scores, &offsets, v, hd, o),
        }
        for (out, sum) in o.chunks_exact_mut(hd).zip(sums) {
            let inv = 1.0 / sum;
            for v in out.iter_mut() {
                *v *= inv;
            }
        }
    }
}

/// `exp(s - max)` in place; returns their sum (eight lanes, then `pairwise`).
#[inline(always)]
fn softmax_numerators(scores: &mut [f32]) -> f32 {
    // Sixteen running maxima, so the loop vectorises: a maximum is the same whatever
    // the order it is taken in.
    let mut maxima = [f32::NEG_INFINITY; 16];
    let chunks = scores.chunks_exact(16);
    let mut max = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, s| m.max(*s));
    for c in chunks {
        for l in 0..16 {
            maxima[l] = maxima[l].max(c[l]);
        }
    }
    for m in maxima {
        max = max.max(m);
    }
    for s in scores.iter_mut() {
        *s = exp(*s - max);
    }
    let mut lanes = [0.0f32; LANES];
    let chunks = scores.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for l in 0..LANES {
            lanes[l] += c[l];
        }
    }
    pairwise(&lanes) + tail
}

/// Values a pass of `weighted_sums` accumulates per query head: four AVX2 registers.
const VALUE_CHUNK: usize = 32;

/// `out[h] = Σ_p scores[h][p] · value(p)` for the group's heads, each element a fused
/// chain in key order. Three heads at a time share each load of a value chunk.
#[inline(always)]
fn weighted_sums<T: Stored>(scores: &[f32], offsets: &[usize], v_cache: &[T], hd: usize, out: &mut [f32]) {
    let keys = offsets.len().max(1);
    for (scores, out) in scores.chunks(3 * keys).zip(out.chunks_mut(3 * hd)) {
        match (hd % VALUE_CHUNK, out.len() / hd) {
            (0, 3) => head_sums::<T, 3>(scores, offsets, v_cache, out),
            (0, 2) => head_sums::<T, 2>(scores, offsets, v_cache, out),
            (0, _) => head_sums::<T, 1>(scores, offsets, v_cache, out),
            _ => {
                for (scores, out) in scores.chunks(keys).zip(out.chunks_mut(hd)) {
                    out.fill(0.0);
                    for (s, &at) in scores.iter().zip(offsets) {
                        for (o, v) in out.iter_mut().zip(&v_cache[at..at + hd]) {
                            *o = s.mul_add(v.widen(), *o);
                        }
                    }
                }
            }
        }
    }
}

/// `weighted_sums` for `H` heads and a head size that is a multiple of `VALUE_CHUNK`.
#[inline(always)]
fn head_sums<T: Stored, const H: usize>(scores: &[f32], offsets: &[usize], v_cache: &[T], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx512() {
        // SAFETY: the CPU has AVX-512 F and DQ, AVX2, FMA and F16C.
        unsafe { avx512::head_sums::<T, H>(scores, offsets, v_cache, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2, FMA and F16C (`has_avx2_fma` checks all three).
        unsafe { avx2::head_sums::<T, H>(scores, offsets, v_cache, out) };
        return;
    }
    portable_head_sums::<T, H>(scores, offsets, v_cache, out);
}

#[inline(always)]
fn portable_head_sums<T: Stored, const H: usize>(scores: &[f32], offsets: &[usize], v_cache: &[T], out: &mut [f32]) {
    let (keys, hd) = (offsets.len(), out.len() / H);
    for d0 in (0..hd).step_by(VALUE_CHUNK) {
        let mut acc = [[0.0f32; VALUE_CHUNK]; H];
        for (p, &at) in offsets.iter().enumerate() {
            let value = &v_cache[at + d0..at + d0 + VALUE_CHUNK];
            for (h, acc) in acc.iter_mut().enumerate() {
                let s = scores[h * keys + p];
                for d in 0..VALUE_CHUNK {
                    acc[d] = s.mul_add(value[d].widen(), acc[d]);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            out[h * hd + d0..h * hd + d0 + VALUE_CHUNK].copy_from_slice(acc);
        }
    }
}

const LANES: usize = 8;

/// Eight lanes added in the tree AVX2's horizontal adds form.
#[inline(always)]
fn pairwise(l: &[f32; LANES]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{LANES, Stored, VALUE_CHUNK};
    use std::arch::x86_64::*;

    /// `super::head_sums` with each head's chunk of sums in four registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn head_sums<T: Stored, const H: usize>(
        scores: &[f32],
        offsets: &[usize],
        v_cache: &[T],
        out: &mut [f32],
    ) {
        let (keys, hd) = (offsets.len(), out.len() / H);
        assert!(hd.is_multiple_of(VALUE_CHUNK) && scores.len() >= H * keys);
        assert!(offsets.iter().all(|&at| at + hd <= v_cache.len()), "a value outside the cache");
        const REGS: usize = VALUE_CHUNK / LANES;
        for d0 in (0..hd).step_by(VALUE_CHUNK) {
            let mut acc = [[_mm256_setzero_ps(); REGS]; H];
            for (p, &at) in offsets.iter().enumerate() {
                for (h, acc) in acc.iter_mut().enumerate() {
                    let s = _mm256_set1_ps(scores[h * keys + p]);
                    for (r, a) in acc.iter_mut().enumerate() {
                        // SAFETY: at + d0 + 32 <= at + hd, inside the cache (asserted).
                        *a = _mm256_fmadd_ps(s, unsafe { T::load8(v_cache.as_ptr().add(at + d0 + r * LANES)) }, *a);
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                for (r, a) in acc.iter().enumerate() {
                    let o = &mut out[h * hd + d0 + r * LANES..h * hd + d0 + (r + 1) * LANES];
                    // SAFETY: `o` holds 8 floats.
                    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
                }
            }
        }
    }
}

/// AVX-512: a value sum's elements are each their own chain, so sixteen lanes compute
/// the bits of eight.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Stored, VALUE_CHUNK};
    use std::arch::x86_64::*;

    const WIDE: usize = 16;

    /// `super::head_sums`: a whole 64-wide head in four registers when it divides
    /// evenly, else 32-value chunks in two.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) fn head_sums<T: Stored, const H: usize>(
        scores: &[f32],
        offsets: &[usize],
        v_cache: &[T],
        out: &mut [f32],
    ) {
        let hd = out.len() / H;
        if hd.is_multiple_of(4 * WIDE) {
            chunked::<T, H, 4>(scores, offsets, v_cache, out)
        } else {
            chunked::<T, H, { VALUE_CHUNK / WIDE }>(scores, offsets, v_cache, out)
        }
    }

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    #[inline]
    fn chunked<T: Stored, const H: usize, const REGS: usize>(
        scores: &[f32],
        offsets: &[usize],
        v_cache: &[T],
        out: &mut [f32],
    ) {
        let (keys, hd) = (offsets.len(), out.len() / H);
        let chunk = REGS * WIDE;
        assert!(hd.is_multiple_of(chunk) && scores.len() >= H * keys);
        assert!(offsets.iter().all(|&at| at + hd <= v_cache.len()), "a value outside the cache");
        for d0 in (0..hd).step_by(chunk) {
            let mut acc = [[_mm512_setzero_ps(); REGS]; H];
            for (p, &at) in offsets.iter().enumerate() {
                let mut value = [_mm512_setzero_ps(); REGS];
                for (r, v) in value.iter_mut().enumerate() {
                    // SAFETY: at + d0 + chunk <= at + hd, inside the cache (asserted).
                    *v = unsafe { T::load16(v_cache.as_ptr().add(at + d0 + r * WIDE)) };
                }
                for (h, acc) in acc.iter_mut().enumerate() {
                    let s = _mm512_set1_ps(scores[h * keys + p]);
                    for (a, v) in acc.iter_mut().zip(&value) {
                        *a = _mm512_fmadd_ps(s, *v, *a);
                    }
                }
            }
            for (h, acc) in acc.iter().enumerate() {
                for (r, a) in acc.iter().enumerate() {
                    let o = &mut out[h * hd + d0 + r * WIDE..h * hd + d0 + (r + 1) * WIDE];
                    // SAFETY: `o` holds 16 floats.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *a) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn value_sums_agree_bit_for_bit_on_either_path() {
        let mut rng = StdRng::seed_from_u64(5);
        let (keys, hd) = (19, 64);
        let scores: Vec<f32> = (0..3 * keys).map(|_| rng.random_range(0.0..1.0)).collect();
        let cache: Vec<f32> = (0..(keys + 3) * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
        let offsets: Vec<usize> = (0..keys).map(|p| ((p * 5) % (keys + 3)) * hd).collect();
        let (mut fast, mut slow) = (vec![0.0f32; 3 * hd], vec![0.0f32; 3 * hd]);
        head_sums::<f32, 3>(&scores, &offsets, &cache, &mut fast);
        portable_head_sums::<f32, 3>(&scores, &offsets, &cache, &mut slow);
        assert_eq!(bits(&fast), bits(&slow));
        let want: f64 = (0..keys).map(|p| scores[2 * keys + p] as f64 * cache[offsets[p] + 5] as f64).sum();
        assert!((fast[2 * hd + 5] as f64 - want).abs() < 1e-5);
    }

    /// The AVX-512 value sums against the AVX2 ones, key counts past every multiple of 8.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_and_avx2_paths_agree_bit_for_bit() {
        if !crate::cpu::simd::avx512_to_compare() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(3);
        for (hd, keys, group) in [
            (64, 1, 3),
            (64, 8, 3),
            (64, 29, 3),
            (32, 17, 5),
            (96, 40, 1),
            (24, 13, 4),
            (64, 33, 7),
            (128, 20, 2),
            (160, 9, 2),
        ] {
            let cache: Vec<f32> = (0..(keys + 4) * hd).map(|_| rng.random_range(-1.0..1.0)).collect();
            let offsets: Vec<usize> = (0..keys).map(|p| ((p * 3) % (keys + 4)) * hd).collect();
            if hd % VALUE_CHUNK == 0 {
                // Value sums for up to three heads at a time, as `weighted_sums` calls them.
                let heads = group.min(3);
                let scores: Vec<f32> = (0..heads * keys).map(|_| rng.random_range(0.0..1.0)).collect();
                let (mut wide, mut narrow) = (vec![0.0f32; heads * hd], vec![0.0f32; heads * hd]);
                let (s, o, c) = (&scores, &offsets, &cache);
                // SAFETY: as above.
                unsafe {
                    match heads {
                        3 => (
                            avx512::head_sums::<f32, 3>(s, o, c, &mut wide),
                            avx2::head_sums::<f32, 3>(s, o, c, &mut narrow),
                        ),
                        2 => (
                            avx512::head_sums::<f32, 2>(s, o, c, &mut wide),
                            avx2::head_sums::<f32, 2>(s, o, c, &mut narrow),
                        ),
                        _ => (
                            avx512::head_sums::<f32, 1>(s, o, c, &mut wide),
                            avx2::head_sums::<f32, 1>(s, o, c, &mut narrow),
                        ),
                    };
                }
                assert_eq!(bits(&wide), bits(&narrow), "values, head_dim {hd}, {keys} keys");
            }
        }
    }

    /// The whole kernel — offsets, scores, softmax, value sums, normalisation — on each
    /// build the dispatch can pick, over decode rows, a prefill and a chunk after a
    /// cached prefix.
    #[test]
    fn paged_attention_has_the_same_bits_on_every_build() {
        use crate::cpu::simd::{Isa, capped};
        let mut rng = StdRng::seed_from_u64(17);
        // Blocks of 4 (the portable key scores on every build), 8 (AVX2's) and 16 (AVX-512's).
        for (num_heads, num_kv_heads, head_dim, block_size) in
            [(9, 3, 64, 16), (9, 3, 64, 4), (4, 4, 24, 8), (6, 1, 32, 16), (8, 2, 96, 4)]
        {
            let shape = AttentionShape { num_heads, num_kv_heads, head_dim, block_size, scale: 0.125 };
            // (context length, query rows).
            let seqs = [(30usize, 1usize), (12, 4), (3, 3)];
            let max_blocks = 32 / block_size;
            let (mut tables, mut starts, mut contexts) = (vec![], vec![0u32], vec![]);
            let mut free: Vec<u32> = (0..3 * max_blocks as u32).rev().collect();
            free.swap(2, 3);
            for (context, rows) in seqs {
                let mut table: Vec<u32> = (0..context.div_ceil(block_size)).map(|_| free.pop().unwrap()).collect();
                table.resize(max_blocks, 0);
                tables.extend(table);
                starts.push(starts.last().unwrap() + rows as u32);
                contexts.push(context as u32);
            }
            let cache_len = 3 * max_blocks * shape.block_floats();
            let k_cache: Vec<f32> = (0..cache_len).map(|_| rng.random_range(-1.0..1.0)).collect();
            let v_cache: Vec<f32> = (0..cache_len).map(|_| rng.random_range(-1.0..1.0)).collect();
            let q: Vec<f32> = (0..8 * shape.q_width()).map(|_| rng.random_range(-1.0..1.0)).collect();
            let batch = PagedBatch {
                num_seqs: seqs.len(),
                query_start: &starts,
                context_lens: &contexts,
                block_tables: &tables,
                max_blocks_per_seq: max_blocks,
            };
            // Keys × head size × heads under the threshold past which rayon's threads,
            // which the cap does not reach, would take the rows.
            assert!((30 + (9 + 10 + 11 + 12) + (1 + 2 + 3)) * num_heads * head_dim < 1 << 16);
            let run = |isa, k: &[f32], v: &[f32], store| {
                capped(isa, || paged_attention(&q, (k, v), store, &batch, &shape).unwrap())
            };
            let wide = run(Isa::Avx512, &k_cache, &v_cache, KvStore::F32);
            for isa in [Isa::Avx2, Isa::Portable] {
                let narrow = run(isa, &k_cache, &v_cache, KvStore::F32);
                assert_eq!(bits(&wide), bits(&narrow), "{isa:?}, {num_heads} heads over {num_kv_heads} of {head_dim}");
            }

            // Half-float K/V written through `write_kv` and read by each build give the
            // bits of f32 K/V holding the same rounded values.
            let round = |c: &[f32]| c.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect::<Vec<f32>>();
            let (k_round, v_round) = (round(&k_cache), round(&v_cache));
            let w = shape.kv_width();
            let slots: Vec<u32> = (0..(cache_len / w) as u32).collect();
            let (mut k_half, mut v_half) = (
                vec![0.0f32; KvStore::F16.buffer_floats(cache_len)],
                vec![0.0f32; KvStore::F16.buffer_floats(cache_len)],
            );
            write_kv(&k_cache, &v_cache, &slots, &shape, (&mut k_half, &mut v_half), KvStore::F16).unwrap();
            let (mut k_exact, mut v_exact) = (vec![0.0f32; cache_len], vec![0.0f32; cache_len]);
            write_kv(&k_round, &v_round, &slots, &shape, (&mut k_exact, &mut v_exact), KvStore::F32).unwrap();
            let exact = run(Isa::Portable, &k_exact, &v_exact, KvStore::F32);
            assert_ne!(bits(&exact), bits(&wide), "rounding to halves changed nothing: a test of nothing");
            for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                let half = run(isa, &k_half, &v_half, KvStore::F16);
                assert_eq!(bits(&half), bits(&exact), "half-float K/V, {isa:?}, {num_heads} heads of {head_dim}");
            }
            let too_far = [slots.len() as u32];
            let e = write_kv(&k_cache[..w], &v_cache[..w], &too_far, &shape, (&mut k_half, &mut v_half), KvStore::F16);
            assert!(e.is_err(), "a slot past the half-float cache");
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }
}
