//! A weight matrix as the CPU keeps it, and the products of a few of its rows.

use super::QuantRows;
use super::int8::Q8Rows;
use super::matmul::Strides;
use super::tiles::dot_tile;

/// A row-major `[rows, cols]` matrix: quantised rows where the file had them in a
/// format `QuantRows` reads, f32 otherwise, or groups of rows each kept its own way.
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
    /// Parts of `cols` columns whose rows follow one another.
    Stacked(Vec<CpuWeight>),
}

impl CpuWeight {
    pub fn f32(data: Vec<f32>, rows: usize, cols: usize) -> Self {
        // A decode step streams all of it (packed rows are on huge pages already).
        super::huge_pages::advise_filled(&data);
        Self { rows, cols, storage: Storage::F32(data) }
    }

    pub fn quantized(rows_of: QuantRows, rows: usize, cols: usize) -> Self {
        Self { rows, cols, storage: Storage::Quantized(rows_of) }
    }

    /// `parts` one above the other; each has `cols` columns and their rows add up to `rows`.
    pub fn stacked(parts: Vec<CpuWeight>, rows: usize, cols: usize) -> Self {
        debug_assert!(parts.iter().all(|p| p.cols == cols) && parts.iter().map(|p| p.rows).sum::<usize>() == rows);
        Self { rows, cols, storage: Storage::Stacked(parts) }
    }

    /// Whether any row is kept in a quantised format.
    pub(super) fn has_quantized(&self) -> bool {
        match &self.storage {
            Storage::F32(_) => false,
            Storage::Quantized(_) => true,
            Storage::Stacked(parts) => parts.iter().any(CpuWeight::has_quantized),
        }
    }

    /// Whether every row is kept in a quantised format (none in f32).
    pub fn is_quantized(&self) -> bool {
        match &self.storage {
            Storage::F32(_) => false,
            Storage::Quantized(_) => true,
            Storage::Stacked(parts) => parts.iter().all(CpuWeight::is_quantized),
        }
    }

    /// Rows `first..first + n` as f32: borrowed when stored so, dequantised into
    /// `scratch` when not.
    pub fn rows_f32<'a>(&'a self, first: usize, n: usize, scratch: &'a mut Vec<f32>) -> &'a [f32] {
        let range = first * self.cols..(first + n) * self.cols;
        if let Storage::F32(data) = &self.storage {
            return &data[range];
        }
        scratch.resize(range.len(), 0.0);
        self.write_rows_f32(first, scratch);
        scratch
    }

    /// Rows `first..first + out.len() / cols` as f32 into `out`.
    fn write_rows_f32(&self, first: usize, out: &mut [f32]) {
        match &self.storage {
            Storage::F32(data) => out.copy_from_slice(&data[first * self.cols..first * self.cols + out.len()]),
            Storage::Quantized(q) => q.dequantize_rows(first, out),
            Storage::Stacked(parts) => {
                for (part, local, at) in overlapping(parts, first, out.len() / self.cols.max(1)) {
                    part.write_rows_f32(local.start, &mut out[at * self.cols..(at + local.len()) * self.cols]);
                }
            }
        }
    }

    /// `out[stride.at(r, t)] = row (first + r) · x_t` for `n` rows and every input row
    /// of `x`; quantised rows take `rounded`, `x` rounded to bytes, where given. Every
    /// path computes the same operations for any number of input rows, so the bits do
    /// not depend on the batch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dot_rows(
        &self,
        first: usize,
        n: usize,
        x: &[f32],
        rounded: Option<&Q8Rows>,
        out: &mut [f32],
        stride: Strides,
        scratch: &mut Vec<f32>,
    ) {
        match &self.storage {
            Storage::Quantized(q) => match rounded {
                Some(r) => q.dot_rows_int8(first, n, r, out, stride),
                None => dot_tile(self.rows_f32(first, n, scratch), x, self.cols, out, stride),
            },
            // Each row is computed by its own part, as it would be alone.
            Storage::Stacked(parts) => {
                for (part, local, at) in overlapping(parts, first, n) {
                    part.dot_rows(local.start, local.len(), x, rounded, &mut out[stride.at(at, 0)..], stride, scratch);
                }
            }
            Storage::F32(_) => dot_tile(self.rows_f32(first, n, scratch), x, self.cols, out, stride),
        }
    }
}

/// The parts that rows `first..first + n` of a stack fall in: each part, the rows of it
/// that are asked for, and where they start among the `n`.
fn overlapping(
    parts: &[CpuWeight],
    first: usize,
    n: usize,
) -> impl Iterator<Item = (&CpuWeight, std::ops::Range<usize>, usize)> {
    let end = first + n;
    let mut start = 0;
    parts.iter().filter_map(move |p| {
        let (lo, hi) = (start.max(first), (start + p.rows).min(end));
        let part_start = start;
        start += p.rows;
        (lo < hi).then(|| (p, lo - part_start..hi - part_start, lo - first))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant_rows_test_blocks;
    use crate::quant::GgmlType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn a_stack_gives_each_row_the_bits_of_its_own_part() {
        let mut rng = StdRng::seed_from_u64(5);
        let cols = 256;
        let part = |rng: &mut StdRng, ty: GgmlType, rows: usize| {
            let bytes = quant_rows_test_blocks(rng, ty, rows * cols);
            CpuWeight::quantized(QuantRows::from_blocks(ty, &bytes, cols).unwrap(), rows, cols)
        };
        let parts = vec![
            part(&mut rng, GgmlType::Q4K, 7),
            CpuWeight::f32((0..5 * cols).map(|_| rng.random_range(-1.0..1.0)).collect(), 5, cols),
            part(&mut rng, GgmlType::Q6K, 9),
        ];
        let stack = CpuWeight::stacked(parts.clone(), 21, cols);
        assert!(!stack.is_quantized() && parts[0].is_quantized());
        for tokens in [1, 2, 5] {
            let x: Vec<f32> = (0..tokens * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            // Rows 3..19 cross both boundaries.
            let (first, n) = (3, 16);
            let mut got = vec![0.0f32; n * tokens];
            stack.dot_rows(first, n, &x, None, &mut got, Strides::row_major(tokens), &mut Vec::new());
            let mut want = Vec::new();
            for (p, local) in [(0, 3..7), (1, 0..5), (2, 0..7)] {
                let mut o = vec![0.0f32; local.len() * tokens];
                parts[p].dot_rows(
                    local.start,
                    local.len(),
                    &x,
                    None,
                    &mut o,
                    Strides::row_major(tokens),
                    &mut Vec::new(),
                );
                want.extend(o);
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{tokens} inputs");
        }
        let mut scratch = Vec::new();
        let rows: Vec<f32> = stack.rows_f32(6, 2, &mut scratch).to_vec();
        let mut s = Vec::new();
        assert_eq!(&rows[..cols], parts[0].rows_f32(6, 1, &mut s));
        assert_eq!(&rows[cols..], parts[1].rows_f32(0, 1, &mut s));
    }
}
