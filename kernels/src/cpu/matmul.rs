//! `x · wᵀ` for row-major weights, batch-invariant: a sequence gets bit-identical
//! logits alone or in any batch, so batching never changes a greedy completion.
//!
//! Quantised weights (Q4_0, Q4_1, Q8_0) go through `QuantRows::dot_rows` for every
//! batch size. f32 weights go through `gemm`, which computes each output row with the
//! same operations whatever the other rows are (checked below) for two rows or more; a
//! single row is padded to two.

use super::CpuWeight;
use rayon::prelude::*;

pub(super) fn linear(x: &[f32], tokens: usize, w: &CpuWeight, bias: Option<&[f32]>) -> Vec<f32> {
    let mut out = if w.quantized.is_some() {
        quantized(x, tokens, w)
    } else if tokens == 1 {
        // gemm takes a different path for one row; two identical rows take the common one.
        let mut padded = x.to_vec();
        padded.extend_from_slice(x);
        let mut two = gemm_batch(&padded, 2, w);
        two.truncate(w.rows);
        two
    } else {
        gemm_batch(x, tokens, w)
    };
    if let Some(b) = bias {
        out.chunks_mut(w.rows).for_each(|row| row.iter_mut().zip(b).for_each(|(o, b)| *o += b));
    }
    out
}

/// Tasks over blocks of weight rows, each reading its rows once for all input rows.
fn quantized(x: &[f32], tokens: usize, w: &CpuWeight) -> Vec<f32> {
    let q = w.quantized.as_ref().expect("quantised weight");
    let (n, k) = (w.rows, w.cols);
    let sums = q.block_sums(x);
    // Each task owns a slice of output columns for every token: compute it transposed
    // ([n, tokens]) so tasks write disjoint memory, then transpose back.
    let mut t = vec![0.0f32; n * tokens];
    const ROWS_PER_TASK: usize = 32;
    // Input rows in tiles that stay in L2 while a task's weight rows pass over them.
    const TOKENS_PER_TILE: usize = 32;
    let bpr = k / 32;
    t.par_chunks_mut(ROWS_PER_TASK * tokens).enumerate().for_each(|(chunk, out)| {
        for tile in (0..tokens).step_by(TOKENS_PER_TILE) {
            let end = (tile + TOKENS_PER_TILE).min(tokens);
            let (x, sums) = (&x[tile * k..end * k], sums.get(tile * bpr..end * bpr).unwrap_or(&[]));
            for (r, out_row) in out.chunks_mut(tokens).enumerate() {
                q.dot_rows(chunk * ROWS_PER_TASK + r, x, sums, &mut out_row[tile..end]);
            }
        }
    });
    if tokens == 1 {
        return t;
    }
    let mut out = vec![0.0f32; n * tokens];
    for r in 0..n {
        for tok in 0..tokens {
            out[tok * n + r] = t[r * tokens + tok];
        }
    }
    out
}

fn gemm_batch(x: &[f32], tokens: usize, w: &CpuWeight) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let mut out = vec![0.0f32; tokens * n];
    // SAFETY: the pointers cover `tokens*k`, `n*k` and `tokens*n` floats, which the
    // caller checked, and the strides below stay inside them: dst [m=tokens, n] row-major,
    // lhs x [m, k] row-major, rhs wᵀ [k, n] read through w's row-major layout.
    unsafe {
        gemm::gemm(
            tokens,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.data.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        );
    }
    out
}

/// A dot product written so the compiler vectorises it: eight independent
/// accumulators break the dependency chain of a single running sum.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_gets_the_same_bits_in_any_batch() {
        let (rows, cols) = (576, 576);
        let mut v = 0.37f32;
        let mut next = move || {
            v = (v * 3.7 + 0.11).fract();
            v - 0.5
        };
        let w = CpuWeight::f32((0..rows * cols).map(|_| next()).collect(), rows, cols);
        let x: Vec<f32> = (0..80 * cols).map(|_| next()).collect();
        let alone = linear(&x[..cols], 1, &w, None);
        for m in [2, 3, 4, 5, 8, 13, 33, 64, 80] {
            let batch = linear(&x[..m * cols], m, &w, None);
            let same = batch[..rows].iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "row 0 differs at m = {m}");
        }
    }
}
