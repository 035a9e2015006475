//! A weight matrix as the CPU keeps it, and the products of a few of its rows.

use super::QuantRows;
use super::tiles::dot_tile;

/// Input rows up to which a product reads quantised rows directly instead of
/// dequantising them once into a scratch buffer: below it, the scratch copy costs more
/// than it saves.
const FUSED_MAX_TOKENS: usize = 2;

/// A row-major `[rows, cols]` matrix: quantised rows where the file had them in a
/// format `QuantRows` reads, f32 otherwise.
#[derive(Debug, Clone)]
pub struct CpuWeight {
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
}

#[derive(Debug, Clone)]
enum Storage {
    F32(Vec<f32>),
    Quantized(QuantRows),
}

impl CpuWeight {
    pub fn f32(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        Self { rows, cols, storage: Storage::F32(data) }
    }

    pub fn quantized(rows_of: QuantRows, rows: usize, cols: usize) -> Self {
        Self { rows, cols, storage: Storage::Quantized(rows_of) }
    }

    /// Rows `first..first + n` as f32: borrowed when stored so, dequantised into
    /// `scratch` when not.
    pub fn rows_f32<'a>(&'a self, first: usize, n: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        let range = first * self.cols..(first + n) * self.cols;
        match &self.storage {
            Storage::F32(data) => &data[range],
            Storage::Quantized(q) => {
                scratch.resize(range.len(), 0.0);
                q.dequantize_rows(first, scratch);
                scratch
            }
        }
    }

    /// `out[r * stride + t] = row (first + r) · x_t` for `n` rows and every input row
    /// of `x`. Every path computes the same operations, so the bits do not depend on
    /// how many input rows there are.
    pub fn dot_rows(&self, first: usize, n: usize, x: &[f32], out: &mut [f32], stride: usize, scratch: &mut Vec<f32>) {
        let tokens = x.len() / self.cols;
        match &self.storage {
            Storage::Quantized(q) if tokens <= FUSED_MAX_TOKENS => q.dot_rows(first, n, x, out, stride),
            _ => dot_tile(self.rows_f32(first, n, scratch), x, self.cols, out, stride),
        }
    }
}
