//! Paged KV cache writes and causal attention read through block tables.
//!
//! Cache layout, per layer: `[blocks, block_size, num_kv_heads, head_dim]`. The kernel
//! computes each (query row, KV head) on its own — the query heads sharing that KV head
//! together: the scores against the sequence's keys, their softmax, the weighted sum of
//! values. A row's result does not depend on the other rows of the batch.

use super::CpuBackend;
use super::matmul::dot;
use super::simd::multiversion;
use crate::error::expect_len;
use crate::paged::{HostBatch, Row};
use crate::{AttentionShape, KernelError, PagedBatch, Result};
use rayon::prelude::*;

pub(super) fn write_kv(
    k: &[f32],
    v: &[f32],
    slots: &[u32],
    shape: &AttentionShape,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
) -> Result<()> {
    let w = shape.kv_width();
    expect_len("write_kv", "keys", k.len(), slots.len() * w)?;
    expect_len("write_kv", "values", v.len(), slots.len() * w)?;
    expect_len("write_kv", "value cache", v_cache.len(), k_cache.len())?;
    let capacity = k_cache.len() / w;
    for (t, &slot) in slots.iter().enumerate() {
        let slot = slot as usize;
        if slot >= capacity {
            return Err(KernelError::shape("write_kv", format!("slot {slot} outside a cache of {capacity}")));
        }
        k_cache[slot * w..(slot + 1) * w].copy_from_slice(&k[t * w..(t + 1) * w]);
        v_cache[slot * w..(slot + 1) * w].copy_from_slice(&v[t * w..(t + 1) * w]);
    }
    Ok(())
}

pub(super) fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
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
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    rows: &'a [Row],
    batch: &'a PagedBatch<'a, CpuBackend>,
    shape: &'a AttentionShape,
}

multiversion! {
    /// Attention of flattened (query row, KV head) `i` into `o`: the query heads that
    /// share that KV head, together, so each key is read once for all of them. The
    /// common head sizes get a compile-time size, which keeps a head's running sum in
    /// registers.
    fn attend_group(t: &Attend<'_>, i: usize, o: &mut [f32]) -> () {
        match t.shape.head_dim {
            64 => attend::<64>(t, i, o),
            128 => attend::<128>(t, i, o),
            _ => attend::<0>(t, i, o),
        }
    }
}

/// `attend_group` for a head size of `HD` (0: the shape's, at run time). Two passes
/// per head: the scores and their maximum, then the softmax-weighted sum of values.
/// No closures here: they would be compiled without the AVX2 the caller gets.
#[inline(always)]
fn attend<const HD: usize>(t: &Attend<'_>, i: usize, o: &mut [f32]) {
    let shape = t.shape;
    let hd = if HD > 0 { HD } else { shape.head_dim };
    let (group, kv_heads, bs) = (shape.num_heads / shape.num_kv_heads, shape.num_kv_heads, shape.block_size);
    let (row, kv_head) = (&t.rows[i / kv_heads], i % kv_heads);
    let queries = &t.q[i * group * hd..(i + 1) * group * hd];
    let table = &t.batch.block_tables[row.seq * t.batch.max_blocks_per_seq..];
    let keys = row.keys;
    // Where each key position's vector for this KV head starts.
    let mut offsets = Vec::with_capacity(keys);
    for pos in 0..keys {
        let slot = table[pos / bs] as usize * bs + pos % bs;
        offsets.push((slot * kv_heads + kv_head) * hd);
    }
    let mut scores = vec![0.0f32; group * keys];
    for (pos, &at) in offsets.iter().enumerate() {
        let key = &t.k_cache[at..at + hd];
        for h in 0..group {
            scores[h * keys + pos] = dot(&queries[h * hd..(h + 1) * hd], key) * shape.scale;
        }
    }
    for h in 0..group {
        let scores = &mut scores[h * keys..(h + 1) * keys];
        let mut max = f32::NEG_INFINITY;
        for s in scores.iter() {
            max = max.max(*s);
        }
        let mut sum = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let out = &mut o[h * hd..(h + 1) * hd];
        weighted_sum::<HD>(scores, &offsets, t.v_cache, out);
        let inv = 1.0 / sum;
        for v in out.iter_mut() {
            *v *= inv;
        }
    }
}

/// `out = Σ scores[p] · value(p)`, each element a fused chain in key order.
#[inline(always)]
fn weighted_sum<const HD: usize>(scores: &[f32], offsets: &[usize], v_cache: &[f32], out: &mut [f32]) {
    if HD > 0 {
        let mut acc = [0.0f32; HD];
        for (s, &at) in scores.iter().zip(offsets) {
            let value: &[f32; HD] = v_cache[at..at + HD].try_into().expect("one head");
            for d in 0..HD {
                acc[d] = s.mul_add(value[d], acc[d]);
            }
        }
        out.copy_from_slice(&acc);
    } else {
        let hd = out.len();
        for (s, &at) in scores.iter().zip(offsets) {
            for (o, v) in out.iter_mut().zip(&v_cache[at..at + hd]) {
                *o = s.mul_add(*v, *o);
            }
        }
    }
}
