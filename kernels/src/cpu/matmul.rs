//! `x · wᵀ` for row-major weights, batch-invariant: a sequence gets bit-identical
//! logits alone or in any batch, so batching never changes a greedy completion.
//!
//! Tasks own a few weight rows each and multiply every input row by them
//! (`CpuWeight::dot_rows`): register tiles over f32 rows (`tiles`), quantised rows
//! dequantised once into a scratch buffer of the task's thread, or read directly for
//! a decode step's one or two inputs — the same operations on every path, so the
//! results do not depend on the batch.

use super::CpuWeight;
use rayon::prelude::*;
use std::cell::RefCell;

/// Weight rows a task owns: a multiple of the tile edge, few enough that their f32
/// copy (24 × 1,536 × 4 bytes at most for this project's models) stays in L2.
const ROWS_PER_TASK: usize = 24;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn linear(x: &[f32], tokens: usize, w: &CpuWeight, bias: Option<&[f32]>) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    if n == 0 || tokens == 0 {
        return vec![0.0; n * tokens];
    }
    if k == 0 {
        return bias.map_or_else(|| vec![0.0; n * tokens], |b| b.repeat(tokens));
    }
    // Each task owns a slice of output columns for every token: compute it transposed
    // ([n, tokens]) so tasks write disjoint memory, then transpose back.
    let mut t = vec![0.0f32; n * tokens];
    t.par_chunks_mut(ROWS_PER_TASK * tokens).enumerate().for_each(|(chunk, out)| {
        SCRATCH
            .with_borrow_mut(|scratch| w.dot_rows(chunk * ROWS_PER_TASK, out.len() / tokens, x, out, tokens, scratch))
    });
    if tokens == 1 {
        if let Some(b) = bias {
            t.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
        return t;
    }
    // Back to [tokens, n], eight tokens a task: each weight row's eight results are
    // read together, and a task writes only its own tokens.
    const TOKENS_PER_TASK: usize = 8;
    let mut out = vec![0.0f32; n * tokens];
    out.par_chunks_mut(TOKENS_PER_TASK * n).enumerate().for_each(|(chunk, out)| {
        let first = chunk * TOKENS_PER_TASK;
        for r in 0..n {
            let bias = bias.map_or(0.0, |b| b[r]);
            for (j, v) in t[r * tokens + first..][..out.len() / n].iter().enumerate() {
                out[j * n + r] = v + bias;
            }
        }
    });
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
    use crate::quant::GgmlType;
    use crate::{Backend, HostWeight, WeightData};

    #[test]
    fn a_row_gets_the_same_bits_in_any_batch() {
        let (rows, cols) = (100, 576);
        let mut v = 0.37f32;
        let mut next = move || {
            v = (v * 3.7 + 0.11).fract();
            v - 0.5
        };
        let dense = CpuWeight::f32((0..rows * cols).map(|_| next()).collect(), rows, cols);
        // Q8_0 blocks: an f16 scale of 1/64, then 32 signed bytes.
        let mut bytes = Vec::new();
        for b in 0..rows * cols / 32 {
            bytes.extend_from_slice(&half::f16::from_f32(1.0 / 64.0).to_le_bytes());
            bytes.extend((0..32).map(|j| ((b * 31 + j * 7) % 255) as u8));
        }
        let data = WeightData::Blocks { ty: GgmlType::Q8_0, bytes };
        let quantized = super::super::CpuBackend.upload_weight(HostWeight { rows, cols, data }).unwrap();
        let x: Vec<f32> = (0..80 * cols).map(|_| next()).collect();
        for w in [&dense, &quantized] {
            let alone = linear(&x[..cols], 1, w, None);
            for m in [2, 3, 4, 5, 8, 13, 33, 64, 80] {
                let batch = linear(&x[..m * cols], m, w, None);
                let same = batch[..rows].iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "row 0 differs at m = {m}");
            }
        }
    }
}
