//! Bidirectional attention over whole sequences held in buffers (a vision tower's
//! patches): no cache, no mask. Each (sequence, head) is two matrix products through
//! `matmul::linear` — scores `Q·Kᵀ`, then `softmax(S)·V` — so the tiles and threads of
//! the decoder's products serve here too.

use super::matmul::linear;
use super::{Activations, CpuWeight, elementwise};
use crate::{KernelError, Result};

pub(super) struct Dims {
    pub seqs: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

pub(super) fn dense_attention(q: &[f32], k: &[f32], v: &[f32], d: &Dims) -> Result<Vec<f32>> {
    let width = d.heads * d.head_dim;
    if d.seqs == 0 || width == 0 || !q.len().is_multiple_of(d.seqs * width) {
        return Err(KernelError::shape(
            "dense_attention",
            format!("{} floats are not {} sequences of rows of {width}", q.len(), d.seqs),
        ));
    }
    if k.len() != q.len() || v.len() != q.len() {
        return Err(KernelError::shape(
            "dense_attention",
            format!("queries, keys and values differ in size: {}, {}, {}", q.len(), k.len(), v.len()),
        ));
    }
    let len = q.len() / (d.seqs * width);
    let mut out = vec![0.0; q.len()];
    for s in 0..d.seqs {
        let rows = s * len..(s + 1) * len;
        for h in 0..d.heads {
            let cols = h * d.head_dim..(h + 1) * d.head_dim;
            let take = |x: &[f32]| -> Vec<f32> {
                rows.clone().flat_map(|r| x[r * width + cols.start..r * width + cols.end].iter().copied()).collect()
            };
            let (qh, kh, vh) = (take(q), take(k), take(v));
            let keys = CpuWeight::f32(kh, len, d.head_dim);
            let mut scores = linear(&qh, len, &keys, None, Activations::F32);
            scores.iter_mut().for_each(|x| *x *= d.scale);
            elementwise::softmax(&mut scores, len)?;
            // Vᵀ as the weight: output column j is Σ_t p_t · v[t, j].
            let mut vt = vec![0.0; len * d.head_dim];
            for (t, row) in vh.chunks_exact(d.head_dim).enumerate() {
                for (j, x) in row.iter().enumerate() {
                    vt[j * len + t] = *x;
                }
            }
            let values = CpuWeight::f32(vt, d.head_dim, len);
            let o = linear(&scores, len, &values, None, Activations::F32);
            for (r, row) in rows.clone().zip(o.chunks_exact(d.head_dim)) {
                out[r * width + cols.start..r * width + cols.end].copy_from_slice(row);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention written out one query at a time.
    fn naive(q: &[f32], k: &[f32], v: &[f32], d: &Dims) -> Vec<f32> {
        let width = d.heads * d.head_dim;
        let len = q.len() / (d.seqs * width);
        let mut out = vec![0.0; q.len()];
        for s in 0..d.seqs {
            for h in 0..d.heads {
                for i in 0..len {
                    let at = |x: &[f32], t: usize, j: usize| x[(s * len + t) * width + h * d.head_dim + j];
                    let scores: Vec<f64> = (0..len)
                        .map(|t| {
                            (0..d.head_dim).map(|j| at(q, i, j) as f64 * at(k, t, j) as f64).sum::<f64>()
                                * d.scale as f64
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for j in 0..d.head_dim {
                        let o: f64 = (0..len).map(|t| e[t] / sum * at(v, t, j) as f64).sum();
                        out[(s * len + i) * width + h * d.head_dim + j] = o as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_attention_written_out() {
        let d = Dims { seqs: 3, heads: 2, head_dim: 5, scale: 0.4 };
        let n = d.seqs * 7 * d.heads * d.head_dim;
        let fill = |salt: u32| {
            (0..n)
                .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ salt) % 1000) as f32 / 500.0 - 1.0)
                .collect::<Vec<_>>()
        };
        let (q, k, v) = (fill(1), fill(2), fill(3));
        let got = dense_attention(&q, &k, &v, &d).unwrap();
        let want = naive(&q, &k, &v, &d);
        let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(max < 1e-5, "max difference {max}");
    }

    #[test]
    fn sequences_never_see_each_other() {
        let d = Dims { seqs: 2, heads: 1, head_dim: 4, scale: 0.5 };
        let n = 2 * 3 * 4;
        let q: Vec<f32> = (0..n).map(|i| i as f32 * 0.1).collect();
        let mut v: Vec<f32> = (0..n).map(|i| (i % 5) as f32).collect();
        let before = dense_attention(&q, &q, &v, &d).unwrap();
        v[n - 1] += 100.0; // a value of the second sequence
        let after = dense_attention(&q, &q, &v, &d).unwrap();
        assert_eq!(before[..n / 2], after[..n / 2]);
        assert_ne!(before[n / 2..], after[n / 2..]);
    }

    #[test]
    fn refuses_mismatched_shapes() {
        let d = Dims { seqs: 2, heads: 1, head_dim: 4, scale: 1.0 };
        assert!(dense_attention(&[0.0; 12], &[0.0; 12], &[0.0; 12], &d).is_err());
        assert!(dense_attention(&[0.0; 16], &[0.0; 8], &[0.0; 16], &d).is_err());
    }
}
