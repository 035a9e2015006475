//! Row-wise and elementwise ops: embedding, RMSNorm, LayerNorm, RoPE, SiLU·up, GELU,
//! softmax, gather and scatter of rows.

use super::CpuWeight;
use super::simd::{exp, multiversion};
use crate::error::expect_len;
use crate::{Gelu, KernelError, Result, RopeStyle};
use rayon::prelude::*;
use std::sync::Arc;

/// Below this many output floats an op runs on the calling thread: handing a single
/// decode row to the thread pool costs more than the work.
const PAR_MIN: usize = 1 << 14;

/// Calls `f` on each output row of `ow` floats with its input row of `iw` items, on the
/// thread pool only when there is enough work.
pub(super) fn zip_rows<T: Sync>(
    out: &mut [f32],
    ow: usize,
    input: &[T],
    iw: usize,
    f: impl Fn(&mut [f32], &[T]) + Sync + Send,
) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(ow).zip(input.par_chunks(iw)).for_each(|(o, i)| f(o, i));
    } else {
        out.chunks_mut(ow).zip(input.chunks(iw)).for_each(|(o, i)| f(o, i));
    }
}

pub(super) fn embedding(ids: &[u32], table: &CpuWeight) -> Result<Vec<f32>> {
    let d = table.cols;
    let mut out = vec![0.0; ids.len() * d];
    let mut scratch = Vec::new();
    for (row, &id) in out.chunks_mut(d).zip(ids) {
        let id = id as usize;
        if id >= table.rows {
            return Err(KernelError::shape("embedding", format!("token id {id} >= vocabulary size {}", table.rows)));
        }
        row.copy_from_slice(table.rows_f32(id, 1, &mut scratch));
    }
    Ok(out)
}

pub(super) fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Result<Vec<f32>> {
    let d = weight.len();
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(KernelError::shape("rms_norm", format!("input of {} floats is not rows of {d}", x.len())));
    }
    let mut out = vec![0.0; x.len()];
    zip_rows(&mut out, d, x, d, |o, row| {
        // Eight running sums (`dot`) rather than one: the compiler may vectorise them.
        let mean_sq = super::matmul::dot(row, row) / d as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    });
    Ok(out)
}

pub(super) fn rope(
    x: &mut [f32],
    positions: &[u32],
    heads: usize,
    head_dim: usize,
    inv_freq: &[f32],
    style: RopeStyle,
) -> Result<()> {
    expect_len("rope", "input", x.len(), positions.len() * heads * head_dim)?;
    let half = inv_freq.len();
    if 2 * half > head_dim {
        return Err(KernelError::shape("rope", format!("{half} frequencies for head_dim {head_dim}")));
    }
    if half == 0 {
        return Ok(());
    }
    // The table leaves the thread-local before the rows are rotated: a thread waiting
    // on the pool may run another forward's step meanwhile, and its RoPE here.
    let angles = ROTATIONS.with_borrow_mut(|table| table.for_batch(positions, inv_freq));
    zip_rows(x, heads * head_dim, &angles, 2 * half, |token, angles| {
        let (cos, sin) = angles.split_at(half);
        for head in token.chunks_mut(head_dim) {
            match style {
                RopeStyle::Interleaved => {
                    for ((pair, c), s) in head[..2 * half].chunks_exact_mut(2).zip(cos).zip(sin) {
                        let (x0, x1) = (pair[0], pair[1]);
                        pair[0] = x0 * c - x1 * s;
                        pair[1] = x0 * s + x1 * c;
                    }
                }
                RopeStyle::Neox => {
                    let (first, second) = head.split_at_mut(half);
                    for (((x0, x1), c), s) in first.iter_mut().zip(&mut second[..half]).zip(cos).zip(sin) {
                        (*x0, *x1) = (*x0 * c - *x1 * s, *x0 * s + *x1 * c);
                    }
                }
            }
        }
    });
    Ok(())
}

thread_local! {
    /// The last batch's rotations: a forward rotates queries and keys at the same
    /// positions in every layer, and the sines and cosines were most of RoPE's time.
    static ROTATIONS: std::cell::RefCell<Rotations> = const {
        std::cell::RefCell::new(Rotations { positions: Vec::new(), inv_freq: Vec::new(), angles: None })
    };
}

/// Each position's `cos(p·f)` then `sin(p·f)` for the frequencies `f`, and what they
/// were computed for.
struct Rotations {
    positions: Vec<u32>,
    inv_freq: Vec<f32>,
    angles: Option<Arc<[f32]>>,
}

impl Rotations {
    /// The table for these positions and frequencies, recomputed only when either
    /// differs from the last call's (bit for bit: the same table, the same results).
    fn for_batch(&mut self, positions: &[u32], inv_freq: &[f32]) -> Arc<[f32]> {
        let same_freq = self.inv_freq.len() == inv_freq.len()
            && self.inv_freq.iter().zip(inv_freq).all(|(a, b)| a.to_bits() == b.to_bits());
        match &self.angles {
            Some(angles) if self.positions == positions && same_freq => angles.clone(),
            _ => {
                let half = inv_freq.len();
                let mut angles = vec![0.0f32; positions.len() * 2 * half];
                for (row, &pos) in angles.chunks_exact_mut(2 * half).zip(positions) {
                    let (cos, sin) = row.split_at_mut(half);
                    for ((c, s), f) in cos.iter_mut().zip(sin).zip(inv_freq) {
                        (*s, *c) = (pos as f32 * f).sin_cos();
                    }
                }
                self.positions.clear();
                self.positions.extend_from_slice(positions);
                self.inv_freq.clear();
                self.inv_freq.extend_from_slice(inv_freq);
                self.angles.insert(angles.into()).clone()
            }
        }
    }
}

pub(super) fn silu_mul(gate_up: &[f32], width: usize) -> Result<Vec<f32>> {
    if width == 0 || !gate_up.len().is_multiple_of(2 * width) {
        return Err(KernelError::shape(
            "silu_mul",
            format!("input of {} floats is not rows of 2×{width}", gate_up.len()),
        ));
    }
    let rows = gate_up.len() / (2 * width);
    let mut out = vec![0.0; rows * width];
    zip_rows(&mut out, width, gate_up, 2 * width, |o, row| {
        let (gate, up) = row.split_at(width);
        silu_row(o, gate, up);
    });
    Ok(out)
}

multiversion! {
    /// `o = silu(gate) · up`, vectorised through `simd::exp`.
    fn silu_row(o: &mut [f32], gate: &[f32], up: &[f32]) -> () {
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + exp(-g)) * u;
        }
    }
}

pub(super) fn softmax(x: &mut [f32], cols: usize) -> Result<()> {
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(KernelError::shape("softmax", format!("input of {} floats is not rows of {cols}", x.len())));
    }
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(cols).for_each(softmax_row);
    } else {
        x.chunks_mut(cols).for_each(softmax_row);
    }
    Ok(())
}

/// Numerically stable softmax of one row, in place.
pub(crate) fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

pub(super) fn gather_rows(x: &[f32], cols: usize, rows: &[u32]) -> Result<Vec<f32>> {
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(KernelError::shape("gather_rows", format!("input of {} floats is not rows of {cols}", x.len())));
    }
    let n = x.len() / cols;
    let mut out = Vec::with_capacity(rows.len() * cols);
    for &r in rows {
        let r = r as usize;
        if r >= n {
            return Err(KernelError::shape("gather_rows", format!("row {r} of {n}")));
        }
        out.extend_from_slice(&x[r * cols..(r + 1) * cols]);
    }
    Ok(out)
}

pub(super) fn split_columns(x: &[f32], widths: &[usize]) -> Result<Vec<Vec<f32>>> {
    let total: usize = widths.iter().sum();
    if total == 0 || !x.len().is_multiple_of(total) {
        return Err(KernelError::shape("split_columns", format!("input of {} floats is not rows of {total}", x.len())));
    }
    let rows = x.len() / total;
    let mut outs: Vec<Vec<f32>> = widths.iter().map(|w| Vec::with_capacity(rows * w)).collect();
    for row in x.chunks_exact(total) {
        let mut at = 0;
        for (out, &w) in outs.iter_mut().zip(widths) {
            out.extend_from_slice(&row[at..at + w]);
            at += w;
        }
    }
    Ok(outs)
}

pub(super) fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32) -> Result<Vec<f32>> {
    let d = weight.len();
    expect_len("layer_norm", "bias", bias.len(), d)?;
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(KernelError::shape("layer_norm", format!("input of {} floats is not rows of {d}", x.len())));
    }
    let mut out = vec![0.0; x.len()];
    zip_rows(&mut out, d, x, d, |o, row| {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for (((o, v), w), b) in o.iter_mut().zip(row).zip(weight).zip(bias) {
            *o = (v - mean) * inv * w + b;
        }
    });
    Ok(out)
}

pub(super) fn gelu(x: &mut [f32], kind: Gelu) {
    let f = match kind {
        Gelu::Erf => |v: f32| 0.5 * v * (1.0 + libm::erff(v * std::f32::consts::FRAC_1_SQRT_2)),
        Gelu::Tanh => |v: f32| {
            const C: f32 = 0.797_884_6; // sqrt(2/π)
            0.5 * v * (1.0 + (C * (v + 0.044_715 * v * v * v)).tanh())
        },
        Gelu::Quick => |v: f32| v / (1.0 + (-1.702 * v).exp()),
    };
    if x.len() >= PAR_MIN {
        x.par_iter_mut().for_each(|v| *v = f(*v));
    } else {
        x.iter_mut().for_each(|v| *v = f(*v));
    }
}

pub(super) fn scatter_rows(x: &mut [f32], cols: usize, rows: &[u32], src: &[f32]) -> Result<()> {
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(KernelError::shape("scatter_rows", format!("input of {} floats is not rows of {cols}", x.len())));
    }
    expect_len("scatter_rows", "source", src.len(), rows.len() * cols)?;
    let n = x.len() / cols;
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
        return Err(KernelError::shape("scatter_rows", format!("row {r} of {n}")));
    }
    for (&r, row) in rows.iter().zip(src.chunks_exact(cols)) {
        x[r as usize * cols..(r as usize + 1) * cols].copy_from_slice(row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RoPE written out, a position and a frequency at a time: what `rope` computed
    /// before it kept a table.
    fn rotated(x: &[f32], positions: &[u32], heads: usize, hd: usize, inv_freq: &[f32], style: RopeStyle) -> Vec<f32> {
        let (mut out, half) = (x.to_vec(), inv_freq.len());
        for (t, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                let head = &mut out[(t * heads + h) * hd..][..hd];
                for (i, f) in inv_freq.iter().enumerate() {
                    let (sin, cos) = (p as f32 * f).sin_cos();
                    let (a, b) = match style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        }
        out
    }

    /// Calls one after another on one thread, as a forward's layers make them: each
    /// rotates by its own positions and frequencies (a table kept from the call before
    /// is never reused for others), with the same bits as computing every angle anew —
    /// batches large enough for the thread pool too, and rotary dimensions fewer than
    /// the head's.
    #[test]
    fn rotations_follow_each_calls_positions_and_frequencies_bit_for_bit() {
        let freqs = |n: usize, base: f32| (0..n).map(|i| base.powf(-(i as f32) / n as f32)).collect::<Vec<f32>>();
        let (heads, hd) = (3, 64);
        let many: Vec<u32> = (0..200).map(|i| (i * 37 % 1500) as u32).collect();
        let calls: [(Vec<u32>, Vec<f32>); 6] = [
            (vec![5, 6, 7], freqs(32, 10_000.0)),
            (vec![5, 6, 8], freqs(32, 10_000.0)),
            (vec![5, 6, 8], freqs(32, 500_000.0)),
            (vec![5, 6], freqs(32, 500_000.0)),
            (many.clone(), freqs(32, 10_000.0)),
            (many, freqs(16, 10_000.0)),
        ];
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            for (positions, inv_freq) in &calls {
                let x: Vec<f32> =
                    (0..positions.len() * heads * hd).map(|i| ((i * 7919 % 201) as f32 - 100.0) * 0.01).collect();
                let mut got = x.clone();
                rope(&mut got, positions, heads, hd, inv_freq, style).unwrap();
                let want = rotated(&x, positions, heads, hd, inv_freq, style);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{style:?} at {} positions, {} frequencies",
                    positions.len(),
                    inv_freq.len()
                );
            }
        }
    }
}
