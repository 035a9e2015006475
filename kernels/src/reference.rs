//! Naive f64 versions of every op, written for obviousness, and the tests that hold the
//! CPU backend to them on fresh random inputs. Error bounds are stated per op: f32
//! accumulation over `k` terms of O(1) values drifts by roughly `k · 2⁻²⁴` relative.

use crate::cpu::{CpuBackend, CpuWeight};
use crate::{AttentionShape, Backend, Gelu, HostWeight, PagedBatch, RopeStyle, WeightData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn rng() -> StdRng {
    let seed: u64 = StdRng::from_os_rng().random();
    // Printed so a failure can be replayed by pasting the seed here.
    eprintln!("random seed {seed}");
    StdRng::seed_from_u64(seed)
}

fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

fn linear_ref(x: &[f32], tokens: usize, w: &CpuWeight, bias: Option<&[f32]>) -> Vec<f64> {
    let mut scratch = Vec::new();
    let data = w.rows_f32(0, w.rows, &mut scratch);
    let mut out = vec![0.0; tokens * w.rows];
    for t in 0..tokens {
        for r in 0..w.rows {
            let mut s = bias.map_or(0.0, |b| b[r] as f64);
            for c in 0..w.cols {
                s += x[t * w.cols + c] as f64 * data[r * w.cols + c] as f64;
            }
            out[t * w.rows + r] = s;
        }
    }
    out
}

#[test]
fn linear_matches_reference_for_decode_and_batched_shapes() {
    let mut rng = rng();
    for tokens in [1, 3, 4, 5, 17, 64] {
        let (rows, cols) = (rng.random_range(1..300), rng.random_range(1..300));
        let w = CpuWeight::f32(randn(&mut rng, rows * cols), rows, cols);
        let x = randn(&mut rng, tokens * cols);
        let bias = randn(&mut rng, rows);
        let got = CpuBackend::exact().linear(&x, tokens, &w, Some(&bias)).unwrap();
        let want = linear_ref(&x, tokens, &w, Some(&bias));
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-4, "tokens {tokens} [{rows}x{cols}]: error {err}");
    }
}

#[test]
fn linear_over_quantised_rows_matches_the_dequantised_product() {
    let mut rng = rng();
    for ty in crate::cpu::QUANT_ROWS_FORMATS {
        let (rows, cols, tokens) =
            (rng.random_range(1..80), ty.block_elems() * rng.random_range(1..5), rng.random_range(1..40));
        let bytes = crate::cpu::quant_rows_test_blocks(&mut rng, ty, rows * cols);
        let dense = CpuWeight::f32(crate::quant::dequantize(ty, &bytes), rows, cols);
        let w = CpuBackend::exact()
            .upload_weight(HostWeight { rows, cols, data: WeightData::Blocks { ty, bytes } })
            .unwrap();
        let x = randn(&mut rng, tokens * cols);
        let got = CpuBackend::exact().linear(&x, tokens, &w, None).unwrap();
        // The bound is for O(1) weights; random K-quant scales and mins make them up to ~100.
        let scale = dense.rows_f32(0, rows, &mut Vec::new()).iter().fold(1.0f32, |a, w| a.max(w.abs())) as f64;
        let err = max_abs_diff(&got, &linear_ref(&x, tokens, &dense, None));
        assert!(err < 1e-4 * scale, "{ty:?} {tokens} x [{rows}x{cols}]: error {err} (weights up to {scale})");
    }
}

#[test]
fn linear_rejects_wrong_input_size() {
    let w = CpuWeight::f32(vec![0.0; 6], 2, 3);
    assert!(CpuBackend::exact().linear(&vec![0.0; 5], 2, &w, None).is_err());
}

#[test]
fn rms_norm_matches_reference() {
    let mut rng = rng();
    let (rows, d) = (7, 576);
    let x = randn(&mut rng, rows * d);
    let w = randn(&mut rng, d);
    let got = CpuBackend::exact().rms_norm(&x, &w, 1e-5).unwrap();
    let mut want = vec![0.0; rows * d];
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
        for c in 0..d {
            want[r * d + c] = row[c] as f64 / (ms + 1e-5).sqrt() * w[c] as f64;
        }
    }
    let err = max_abs_diff(&got, &want);
    assert!(err < 1e-5, "error {err}");
}

#[test]
fn layer_norm_matches_reference() {
    let mut rng = rng();
    let (rows, d) = (6, 768);
    // An offset mean, as a residual stream has: the variance must not come from E[x²] − E[x]².
    let x: Vec<f32> = randn(&mut rng, rows * d).iter().map(|v| v * 3.0 + 20.0).collect();
    let (w, b) = (randn(&mut rng, d), randn(&mut rng, d));
    let got = CpuBackend::exact().layer_norm(&x, &w, &b, 1e-6).unwrap();
    let mut want = vec![0.0; rows * d];
    for r in 0..rows {
        let row: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|v| *v as f64).collect();
        let mean = row.iter().sum::<f64>() / d as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
        for c in 0..d {
            want[r * d + c] = (row[c] - mean) / (var + 1e-6).sqrt() * w[c] as f64 + b[c] as f64;
        }
    }
    let err = max_abs_diff(&got, &want);
    assert!(err < 1e-4, "error {err}");
    assert!(CpuBackend::exact().layer_norm(&x, &w, &b[1..].to_vec(), 1e-6).is_err());
}

#[test]
fn gelu_variants_match_their_formulas() {
    let mut rng = rng();
    let x: Vec<f32> = randn(&mut rng, 4096).iter().map(|v| v * 6.0).collect();
    type Formula = fn(f64) -> f64;
    let cases: [(Gelu, Formula); 3] = [
        (Gelu::Erf, |v| 0.5 * v * (1.0 + libm::erf(v / 2f64.sqrt()))),
        (Gelu::Tanh, |v| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())),
        (Gelu::Quick, |v| v / (1.0 + (-1.702 * v).exp())),
    ];
    for (kind, f) in cases {
        let mut got = x.clone();
        CpuBackend::exact().gelu(&mut got, kind).unwrap();
        let want: Vec<f64> = x.iter().map(|v| f(*v as f64)).collect();
        let err = max_abs_diff(&got, &want);
        assert!(err < 2e-6, "{kind:?}: error {err}");
    }
    // The three differ: a tower run with the wrong one would not pass its fixture.
    let (mut a, mut b) = (vec![1.0f32], vec![1.0f32]);
    CpuBackend::exact().gelu(&mut a, Gelu::Erf).unwrap();
    CpuBackend::exact().gelu(&mut b, Gelu::Quick).unwrap();
    assert!((a[0] - b[0]).abs() > 1e-3);
}

#[test]
fn scatter_rows_overwrites_only_the_named_rows() {
    let mut x: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let src = vec![-1.0, -2.0, -3.0, -4.0, -5.0, -6.0];
    CpuBackend::exact().scatter_rows(&mut x, 3, &vec![3, 1], &src).unwrap();
    assert_eq!(x, [0.0, 1.0, 2.0, -4.0, -5.0, -6.0, 6.0, 7.0, 8.0, -1.0, -2.0, -3.0]);
    assert!(CpuBackend::exact().scatter_rows(&mut x, 3, &vec![4], &src[..3].to_vec()).is_err());
    assert!(CpuBackend::exact().scatter_rows(&mut x, 3, &vec![0], &src).is_err());
}

fn rope_ref(x: &[f32], positions: &[u32], heads: usize, hd: usize, inv_freq: &[f32], style: RopeStyle) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|v| *v as f64).collect();
    let half = inv_freq.len();
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * hd;
            for i in 0..half {
                let (a, b) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let theta = p as f64 * inv_freq[i] as f64;
                let (x0, x1) = (x[base + a] as f64, x[base + b] as f64);
                out[base + a] = x0 * theta.cos() - x1 * theta.sin();
                out[base + b] = x0 * theta.sin() + x1 * theta.cos();
            }
        }
    }
    out
}

#[test]
fn rope_matches_reference_in_both_styles() {
    let mut rng = rng();
    let (tokens, heads, hd) = (9, 3, 64);
    let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 10000f64.powf(-2.0 * i as f64 / hd as f64) as f32).collect();
    let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..2048)).collect();
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        let x = randn(&mut rng, tokens * heads * hd);
        let mut got = x.clone();
        CpuBackend::exact().rope(&mut got, &positions, heads, hd, &inv_freq, style).unwrap();
        // Angles up to 2048 rad in f32 carry ~1e-4 absolute phase error.
        let err = max_abs_diff(&got, &rope_ref(&x, &positions, heads, hd, &inv_freq, style));
        assert!(err < 1e-3, "{style:?}: error {err}");
    }
}

#[test]
fn silu_mul_matches_reference() {
    let mut rng = rng();
    let (rows, width) = (5, 100);
    let x: Vec<f32> = randn(&mut rng, rows * 2 * width).iter().map(|v| v * 8.0).collect();
    let got = CpuBackend::exact().silu_mul(&x, width).unwrap();
    let mut want = vec![0.0; rows * width];
    for r in 0..rows {
        for c in 0..width {
            let (g, u) = (x[r * 2 * width + c] as f64, x[r * 2 * width + width + c] as f64);
            want[r * width + c] = g / (1.0 + (-g).exp()) * u;
        }
    }
    let err = max_abs_diff(&got, &want);
    assert!(err < 1e-4, "error {err}");
}

#[test]
fn softmax_matches_reference_even_with_large_logits() {
    let mut rng = rng();
    let (rows, cols) = (4, 1000);
    let x: Vec<f32> = randn(&mut rng, rows * cols).iter().map(|v| v * 80.0).collect();
    let mut got = x.clone();
    CpuBackend::exact().softmax(&mut got, cols).unwrap();
    let mut want = vec![0.0; rows * cols];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
        let sum: f64 = row.iter().map(|v| (*v as f64 - max).exp()).sum();
        for c in 0..cols {
            want[r * cols + c] = (row[c] as f64 - max).exp() / sum;
        }
    }
    let err = max_abs_diff(&got, &want);
    assert!(err < 1e-6, "error {err}");
}

#[test]
fn embedding_and_gather_pick_rows_and_reject_bad_ids() {
    let mut rng = rng();
    let data = randn(&mut rng, 10 * 4);
    let table = CpuWeight::f32(data.clone(), 10, 4);
    let got = CpuBackend::exact().embedding(&vec![3, 0, 9], &table).unwrap();
    assert_eq!(&got[0..4], &data[12..16]);
    assert_eq!(&got[4..8], &data[0..4]);
    assert_eq!(&got[8..12], &data[36..40]);
    assert!(CpuBackend::exact().embedding(&vec![10], &table).is_err());
    let rows = CpuBackend::exact().gather_rows(&got, 4, &vec![2, 0]).unwrap();
    assert_eq!(&rows[0..4], &got[8..12]);
    assert_eq!(&rows[4..8], &got[0..4]);
    assert!(CpuBackend::exact().gather_rows(&got, 4, &vec![3]).is_err());
}

#[test]
fn split_columns_cuts_each_row_into_groups() {
    let x: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let parts = CpuBackend::exact().split_columns(&x, &[3, 1, 2]).unwrap();
    assert_eq!(parts, vec![vec![0.0, 1.0, 2.0, 6.0, 7.0, 8.0], vec![3.0, 9.0], vec![4.0, 5.0, 10.0, 11.0]]);
    assert!(CpuBackend::exact().split_columns(&x, &[5]).is_err());
}

/// Dense causal attention in f64 over each sequence's full K/V (no cache, no paging).
fn attention_ref(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], q_lens: &[usize], s: &AttentionShape) -> Vec<f64> {
    let (hd, group) = (s.head_dim, s.num_heads / s.num_kv_heads);
    let mut out = vec![0.0; q.len()];
    let mut row = 0;
    for (seq, &ql) in q_lens.iter().enumerate() {
        let ctx = ks[seq].len() / s.kv_width();
        for i in 0..ql {
            let pos = ctx - ql + i;
            for h in 0..s.num_heads {
                let qv = &q[(row * s.num_heads + h) * hd..][..hd];
                let kvh = h / group;
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let k = &ks[seq][(j * s.num_kv_heads + kvh) * hd..][..hd];
                        qv.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * s.scale as f64
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                for (j, sc) in scores.iter().enumerate() {
                    let p = (sc - max).exp() / sum;
                    let v = &vs[seq][(j * s.num_kv_heads + kvh) * hd..][..hd];
                    for d in 0..hd {
                        out[(row * s.num_heads + h) * hd + d] += p * v[d] as f64;
                    }
                }
            }
            row += 1;
        }
    }
    out
}

#[test]
fn paged_attention_matches_dense_reference_over_mixed_prefill_and_decode() {
    let mut rng = rng();
    // Head sizes in whole value chunks of 32 and not; query heads per KV head in threes
    // and with one or two left over.
    for head_dim in [24, 32, 64, 128] {
        for (num_heads, num_kv_heads) in [(6, 2), (8, 2), (5, 1), (2, 2)] {
            paged_attention_case(&mut rng, head_dim, num_heads, num_kv_heads);
        }
    }
}

fn paged_attention_case(rng: &mut StdRng, head_dim: usize, num_heads: usize, num_kv_heads: usize) {
    let scale = (head_dim as f32).powf(-0.5);
    let shape = AttentionShape { num_heads, num_kv_heads, head_dim, block_size: 4, scale };
    // (context length, query rows): a decode, a whole prefill, a prefill chunk after a
    // cached prefix, and a one-token sequence.
    let seqs = [(13usize, 1usize), (9, 9), (21, 7), (1, 1)];
    let num_blocks = 32;
    let w = shape.kv_width();
    let mut k_cache = vec![f32::NAN; num_blocks * shape.block_floats()];
    let mut v_cache = k_cache.clone();
    // Hand out blocks in a scrambled order so the test depends on the block tables.
    let mut free: Vec<u32> = (0..num_blocks as u32).rev().collect();
    free.swap(3, 17);
    let max_blocks = 8;
    let (mut tables, mut ks, mut vs, mut q_lens, mut starts, mut ctx) =
        (vec![], vec![], vec![], vec![], vec![0u32], vec![]);
    for &(context, q_len) in &seqs {
        let blocks: Vec<u32> = (0..context.div_ceil(shape.block_size)).map(|_| free.pop().unwrap()).collect();
        let k = randn(rng, context * w);
        let v = randn(rng, context * w);
        let slots: Vec<u32> = (0..context)
            .map(|p| blocks[p / shape.block_size] * shape.block_size as u32 + (p % shape.block_size) as u32)
            .collect();
        CpuBackend::exact().write_kv(&k, &v, &slots, &shape, &mut k_cache, &mut v_cache).unwrap();
        let mut table = blocks.clone();
        table.resize(max_blocks, 0);
        tables.extend(table);
        ks.push(k);
        vs.push(v);
        q_lens.push(q_len);
        starts.push(starts.last().unwrap() + q_len as u32);
        ctx.push(context as u32);
    }
    let tokens = *starts.last().unwrap() as usize;
    let q = randn(rng, tokens * shape.q_width());
    let batch = PagedBatch {
        num_seqs: seqs.len(),
        query_start: &starts,
        context_lens: &ctx,
        block_tables: &tables,
        max_blocks_per_seq: max_blocks,
    };
    let got = CpuBackend::exact().paged_attention(&q, &k_cache, &v_cache, &batch, &shape).unwrap();
    let err = max_abs_diff(&got, &attention_ref(&q, &ks, &vs, &q_lens, &shape));
    assert!(err < 1e-5, "head_dim {head_dim}, {num_heads} heads over {num_kv_heads}: error {err}");
}

#[test]
fn paged_attention_rejects_tables_that_point_outside_the_cache() {
    let shape = AttentionShape { num_heads: 2, num_kv_heads: 1, head_dim: 4, block_size: 2, scale: 0.5 };
    let k_cache = vec![0.0; 2 * shape.block_floats()];
    let q = vec![0.0; shape.q_width()];
    let (starts, ctx, tables) = (vec![0, 1], vec![3], vec![0, 5]);
    let batch = PagedBatch::<CpuBackend> {
        num_seqs: 1,
        query_start: &starts,
        context_lens: &ctx,
        block_tables: &tables,
        max_blocks_per_seq: 2,
    };
    let err = CpuBackend::exact().paged_attention(&q, &k_cache, &k_cache, &batch, &shape).unwrap_err();
    assert!(err.to_string().contains("block 5"), "{err}");
    let too_long = vec![9];
    let batch = PagedBatch::<CpuBackend> { context_lens: &too_long, ..batch };
    assert!(CpuBackend::exact().paged_attention(&q, &k_cache, &k_cache, &batch, &shape).is_err());
}
