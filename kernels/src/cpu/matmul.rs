//! `x · wᵀ` for row-major weights, batch-invariant: a sequence gets bit-identical
//! logits alone or in any batch, so batching never changes a greedy completion.
//!
//! Tasks own a few weight rows each and multiply every input row by them
//! (`CpuWeight::dot_rows`): register tiles over f32 rows (`tiles`), quantised rows
//! dequantised once into a scratch buffer of the task's thread, or read directly for
//! a decode step's one or two inputs — the same operations on every path, so the
//! results do not depend on the batch. (Cutting the inputs into L2-sized blocks as
//! well was measured: the hardware prefetchers already stream them, and each block
//! would dequantise the rows again.)

use super::int8::Q8Rows;
use super::{Activations, CpuWeight};
use rayon::prelude::*;
use std::cell::RefCell;

/// Weight rows a task owns: two of `QuantRows`' groups of 16 and a multiple of the f32
/// tile edges, few enough that their f32 copy on the exact path (32 × 1,536 × 4 bytes
/// at most for this project's models) stays in L2.
const ROWS_PER_TASK: usize = 32;

thread_local! {
    /// Per thread: dequantised weight rows, and a task's `[rows, tokens]` results.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

pub(super) fn linear(
    x: &[f32],
    tokens: usize,
    w: &CpuWeight,
    bias: Option<&[f32]>,
    activations: Activations,
) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    if n == 0 || tokens == 0 {
        return vec![0.0; n * tokens];
    }
    if k == 0 {
        return bias.map_or_else(|| vec![0.0; n * tokens], |b| b.repeat(tokens));
    }
    // Rounded once here, not once a task: each row depends on itself alone.
    let rounded = (activations == Activations::Int8 && w.has_quantized()).then(|| Q8Rows::quantize(x, k));
    let mut out = vec![0.0f32; n * tokens];
    let columns = Columns(out.as_mut_ptr(), out.len());
    (0..n.div_ceil(ROWS_PER_TASK)).into_par_iter().for_each(|task| {
        let first = task * ROWS_PER_TASK;
        let rows = ROWS_PER_TASK.min(n - first);
        SCRATCH.with_borrow_mut(|(scratch, block)| {
            // The task's rows for every token, token by token, then copied into the
            // tokens' rows: a few contiguous columns of each.
            block.resize(rows * tokens, 0.0);
            w.dot_rows(first, rows, x, rounded.as_ref(), block, Strides { row: 1, token: rows }, scratch);
            for (t, got) in block.chunks_exact(rows).enumerate() {
                // SAFETY: tasks own disjoint column ranges `first..first + rows`.
                let dst = unsafe { columns.get(t * n + first, rows) };
                match bias {
                    Some(b) => dst.iter_mut().zip(got.iter().zip(&b[first..])).for_each(|(d, (v, b))| *d = v + b),
                    None => dst.copy_from_slice(got),
                }
            }
        })
    });
    out
}

/// Where a product's output (weight row `r`, input `t`) goes in its buffer:
/// `r · row + t · token`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Strides {
    pub row: usize,
    pub token: usize,
}

impl Strides {
    /// A row's outputs side by side, rows `stride` apart.
    pub(super) fn row_major(stride: usize) -> Self {
        Self { row: stride, token: 1 }
    }

    #[inline(always)]
    pub(super) fn at(self, r: usize, t: usize) -> usize {
        r * self.row + t * self.token
    }

    /// Whether `rows × tokens` outputs fit in `len`.
    pub(super) fn fits(self, rows: usize, tokens: usize, len: usize) -> bool {
        rows == 0 || tokens == 0 || self.at(rows - 1, tokens - 1) < len
    }
}

/// The output matrix, shared by tasks that each write their own columns of it.
struct Columns(*mut f32, usize);

// SAFETY: only `get` reaches the memory, and its callers keep their ranges disjoint.
unsafe impl Sync for Columns {}

impl Columns {
    /// `len` floats from `at`.
    ///
    /// # Safety
    /// No other live slice from this `Columns` may overlap `at..at + len`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, at: usize, len: usize) -> &mut [f32] {
        assert!(at + len <= self.1, "outside the output");
        // SAFETY: in bounds (asserted); exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
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
        let quantized = super::super::CpuBackend::default().upload_weight(HostWeight { rows, cols, data }).unwrap();
        let x: Vec<f32> = (0..80 * cols).map(|_| next()).collect();
        for (w, activations) in [
            (&dense, Activations::F32),
            (&quantized, Activations::F32),
            (&dense, Activations::Int8),
            (&quantized, Activations::Int8),
        ] {
            let alone = linear(&x[..cols], 1, w, None, activations);
            for m in [2, 3, 4, 5, 8, 13, 33, 64, 80] {
                let batch = linear(&x[..m * cols], m, w, None, activations);
                let same = batch[..rows].iter().zip(&alone).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "row 0 differs at m = {m} ({activations:?})");
            }
        }
        // Each path's products, as one row against one input computes them: the
        // rows a task copies into the output are the right ones.
        for (w, activations) in [(&dense, Activations::F32), (&quantized, Activations::Int8)] {
            let m = 5;
            let batch = linear(&x[..m * cols], m, w, None, activations);
            for t in 0..m {
                let row = &x[t * cols..(t + 1) * cols];
                let rounded = (activations == Activations::Int8).then(|| Q8Rows::quantize(row, cols));
                for r in [0, 15, 16, 37, 99] {
                    let mut one = [0.0f32];
                    w.dot_rows(r, 1, row, rounded.as_ref(), &mut one, Strides::row_major(1), &mut Vec::new());
                    assert_eq!(batch[t * rows + r].to_bits(), one[0].to_bits(), "row {r} input {t} ({activations:?})");
                }
            }
        }
        // The two paths do differ on quantised weights: the test above checks both.
        let exact = linear(&x[..cols], 1, &quantized, None, Activations::F32);
        assert_ne!(exact, linear(&x[..cols], 1, &quantized, None, Activations::Int8));
    }
}
