//! `x · wᵀ` for row-major weights. Batched shapes go to `gemm`; a handful of rows
//! (decode) is bound by reading the weight once, so it runs as parallel dot products
//! over weight rows instead.

use super::CpuWeight;
use rayon::prelude::*;

/// Below this many input rows, stream the weight once with dot products.
const DOT_ROWS: usize = 4;

pub(super) fn linear(x: &[f32], tokens: usize, w: &CpuWeight, bias: Option<&[f32]>) -> Vec<f32> {
    let mut out = if tokens <= DOT_ROWS { small_batch(x, tokens, w) } else { gemm_batch(x, tokens, w) };
    if let Some(b) = bias {
        out.chunks_mut(w.rows).for_each(|row| row.iter_mut().zip(b).for_each(|(o, b)| *o += b));
    }
    out
}

fn small_batch(x: &[f32], tokens: usize, w: &CpuWeight) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let sums: Vec<Vec<f32>> = match &w.quantized {
        Some(q) => x.chunks_exact(k).map(|row| q.block_sums(row)).collect(),
        None => Vec::new(),
    };
    let row_dot = |r: usize, tok: usize| {
        let x = &x[tok * k..(tok + 1) * k];
        match &w.quantized {
            Some(q) => q.dot(r, x, &sums[tok]),
            None => dot(&w.data[r * k..(r + 1) * k], x),
        }
    };
    // Each task owns a slice of output columns for every token: compute it transposed
    // ([n, tokens]) so tasks write disjoint memory, then transpose back.
    let mut t = vec![0.0f32; n * tokens];
    const ROWS_PER_TASK: usize = 64;
    t.par_chunks_mut(ROWS_PER_TASK * tokens).enumerate().for_each(|(chunk, out)| {
        let first = chunk * ROWS_PER_TASK;
        for (r, out_row) in out.chunks_mut(tokens).enumerate() {
            for (tok, o) in out_row.iter_mut().enumerate() {
                *o = row_dot(first + r, tok);
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
