//! Each CUDA op against the CPU op on fresh random inputs. They need a GPU: without one
//! they print why and pass, unless `TESSERA_GPU_TESTS=1` makes a missing GPU a failure
//! (the documented command: `TESSERA_GPU_TESTS=1 cargo test --workspace gpu_`).
//!
//! Inputs are rounded to bf16 before either backend sees them, so the two compute the
//! same function and differ only by bf16 outputs and f32 accumulation order: the bound
//! on ‖gpu − cpu‖ / ‖cpu‖ is 1e-2 (bf16 keeps 8 bits, 2⁻⁹ ≈ 2e-3 per rounding, and a
//! few roundings compound). Every output starts as NaN (`poisoned`), so an element a
//! kernel skips fails the check.

use super::{CudaBackend, GEMV_MAX_TOKENS};
use crate::cpu::CpuBackend;
use crate::quant::{Fp8Weight, GgmlType, Int4Weight};
use crate::{AttentionShape, Backend, Gelu, HostWeight, PagedBatch, RopeStyle, WeightData};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gpu() -> Option<CudaBackend> {
    CudaBackend::for_tests().map(CudaBackend::poisoned)
}

fn rng() -> StdRng {
    let seed: u64 = StdRng::from_os_rng().random();
    eprintln!("random seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// Random values already representable in bf16.
fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32()).collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        eprintln!("element {i} is {}", got[i]);
        return f64::INFINITY;
    }
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn check(op: &str, got: &[f32], want: &[f32]) {
    let err = rel_err(got, want);
    assert!(err < 1e-2, "{op}: relative error {err}");
}

/// Whether a product of `tokens` with FP8 weights runs on FP8 tensor cores (W8A8: the
/// activations rounded to E4M3), as the backend chooses it.
fn w8a8(g: &CudaBackend, fp8: bool, tokens: usize) -> bool {
    fp8 && tokens > GEMV_MAX_TOKENS && g.k.fp8_tensor_cores.is_some()
}

#[test]
fn gpu_linear_matches_cpu_with_and_without_bias() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    for tokens in [1, 7, 64, 300] {
        let (rows, cols) = (rng.random_range(1..700), rng.random_range(1..700));
        let w = randn(&mut rng, rows * cols);
        let x = randn(&mut rng, tokens * cols);
        let bias = randn(&mut rng, rows);
        let hw = || HostWeight { rows, cols, data: WeightData::F32(w.clone()) };
        let cw = CpuBackend::exact().upload_weight(hw()).unwrap();
        let gw = g.upload_weight(hw()).unwrap();
        let want = CpuBackend::exact().linear(&x, tokens, &cw, Some(&bias)).unwrap();
        let got = g.linear(&g.upload(&x).unwrap(), tokens, &gw, Some(&g.upload(&bias).unwrap())).unwrap();
        check(&format!("linear {tokens}x[{rows}x{cols}]"), &g.download(&got).unwrap(), &want);
        let want = CpuBackend::exact().linear(&x, tokens, &cw, None).unwrap();
        let got = g.linear(&g.upload(&x).unwrap(), tokens, &gw, None).unwrap();
        check("linear without bias", &g.download(&got).unwrap(), &want);
    }
}

/// bf16 weights' decode products through gemv_bf16 instead of cuBLAS (the bench's
/// alternative): 1 to 8 tokens against the CPU, bound 1e-2 as above.
#[test]
fn gpu_bf16_gemv_matches_cpu() {
    let Some(mut g) = gpu() else { return };
    g.set_bf16_gemv(true);
    let mut rng = rng();
    for tokens in [1, 5, 8] {
        let (rows, cols) = (rng.random_range(1..700), 8 * rng.random_range(1..300));
        bf16_product_matches_cpu(&g, &mut rng, "gemv_bf16", tokens, (rows, cols));
    }
}

/// One bf16 product of random data on the GPU against the CPU's exact one.
fn bf16_product_matches_cpu(
    g: &CudaBackend,
    rng: &mut StdRng,
    what: &str,
    tokens: usize,
    (rows, cols): (usize, usize),
) {
    let w = randn(rng, rows * cols);
    let x = randn(rng, tokens * cols);
    let hw = || HostWeight { rows, cols, data: WeightData::F32(w.clone()) };
    let want = CpuBackend::exact().linear(&x, tokens, &CpuBackend::exact().upload_weight(hw()).unwrap(), None);
    let got = g.linear(&g.upload(&x).unwrap(), tokens, &g.upload_weight(hw()).unwrap(), None).unwrap();
    check(&format!("{what} {tokens}x[{rows}x{cols}]"), &g.download(&got).unwrap(), &want.unwrap());
}

/// bf16 products of many tokens through cuBLASLt instead of cublasGemmEx (the bench's
/// alternative for prefill; shapes of multiples of 8, the rest staying on GemmEx),
/// against the CPU; bound 1e-2 as above.
#[test]
fn gpu_cublaslt_products_match_cpu() {
    let Some(mut g) = gpu() else { return };
    assert!(g.set_cublaslt(true), "cuBLASLt cannot be loaded beside cuBLAS");
    let mut rng = rng();
    for (tokens, align) in [(9, 8), (64, 8), (300, 8), (70, 1)] {
        let (rows, cols) = (align * rng.random_range(1..700 / align), align * rng.random_range(1..700 / align));
        bf16_product_matches_cpu(&g, &mut rng, "cuBLASLt", tokens, (rows, cols));
    }
}

/// Weights in ggml block formats stay in them on the device and are decoded by the
/// kernels that read them: every format against the CPU's exact product (f32 weights
/// decoded from the same blocks), through the decode kernel (≤ 8 tokens) and the tiled
/// one, as an embedding table, and as a stack of parts in different formats. Bound:
/// 1e-2 (bf16 activations and outputs; the tiled kernel rounds the decoded weights to
/// bf16 for the tensor cores).
#[test]
fn gpu_block_weights_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let cpu = CpuBackend::exact();
    for ty in crate::cpu::QUANT_ROWS_FORMATS.into_iter().chain([GgmlType::Q5K]) {
        for tokens in [1, 3, 8, 9, 70] {
            let (rows, cols) = (rng.random_range(1..300), 256 * rng.random_range(1..4));
            let bytes = crate::cpu::quant_rows_test_blocks(&mut rng, ty, rows * cols);
            let hw = || HostWeight { rows, cols, data: WeightData::Blocks { ty, bytes: bytes.clone() } };
            let gw = g.upload_weight(hw()).unwrap();
            assert_eq!(gw.device_bytes(), bytes.len(), "{ty:?} is kept in its blocks");
            let x = randn(&mut rng, tokens * cols);
            let want = cpu.linear(&x, tokens, &cpu.upload_weight(hw()).unwrap(), None).unwrap();
            let got = g.linear(&g.upload(&x).unwrap(), tokens, &gw, None).unwrap();
            check(&format!("{ty:?} linear {tokens}x[{rows}x{cols}]"), &g.download(&got).unwrap(), &want);
        }
        let (vocab, dim) = (rng.random_range(2..200), 256 * rng.random_range(1..4));
        let bytes = crate::cpu::quant_rows_test_blocks(&mut rng, ty, vocab * dim);
        let hw = || HostWeight { rows: vocab, cols: dim, data: WeightData::Blocks { ty, bytes: bytes.clone() } };
        let ids: Vec<u32> = (0..11).map(|_| rng.random_range(0..vocab as u32)).collect();
        let got = g.embedding(&g.upload_index(&ids).unwrap(), &g.upload_weight(hw()).unwrap()).unwrap();
        let want = cpu.embedding(&ids, &cpu.upload_weight(hw()).unwrap()).unwrap();
        check(&format!("{ty:?} embedding"), &g.download(&got).unwrap(), &want);
        let err = g.embedding(&g.upload_index(&[vocab as u32]).unwrap(), &g.upload_weight(hw()).unwrap());
        assert!(err.is_err(), "an id past the vocabulary is refused");
    }
    // A stack of parts in two formats (a Q4_K_M file's Q and K beside its Q6_K V): each
    // part packed, its rows written among the others'.
    let cols = 512;
    let parts: Vec<HostWeight> = [(GgmlType::Q4K, 70), (GgmlType::Q6K, 30), (GgmlType::Q4K, 9)]
        .into_iter()
        .map(|(ty, rows)| {
            let bytes = crate::cpu::quant_rows_test_blocks(&mut rng, ty, rows * cols);
            HostWeight { rows, cols, data: WeightData::Blocks { ty, bytes } }
        })
        .collect();
    let packed_bytes: usize =
        parts.iter().map(|p| if let WeightData::Blocks { bytes, .. } = &p.data { bytes.len() } else { 0 }).sum();
    let hw = HostWeight { rows: 109, cols, data: WeightData::Stacked(parts) };
    let gw = g.upload_weight(hw.clone()).unwrap();
    assert_eq!(gw.device_bytes(), packed_bytes, "every part is kept in its blocks");
    let cw = cpu.upload_weight(hw).unwrap();
    for tokens in [1, 9, 70] {
        let x = randn(&mut rng, tokens * cols);
        let want = cpu.linear(&x, tokens, &cw, None).unwrap();
        let got = g.linear(&g.upload(&x).unwrap(), tokens, &gw, None).unwrap();
        check(&format!("stacked Q4_K/Q6_K linear {tokens}"), &g.download(&got).unwrap(), &want);
    }
}

/// An MLP's activation from its [gate; up] weight (`linear_silu_mul`): in one decode
/// kernel for bf16 weights (gemv_bf16_glu), ggml blocks, FP8 and 4-bit weights, and
/// composed for a stack of two formats and for 9 tokens; against the CPU's product then
/// silu_mul, bound 1e-2 as above. Which path ran shows in the bits: the fused kernel
/// takes silu of the f32 sums, the composition of sums rounded to bf16, so over 40 or
/// more outputs the two differ somewhere only when the fused kernel ran.
#[test]
fn gpu_linear_silu_mul_matches_cpu() {
    let Some(mut g) = gpu() else { return };
    g.set_bf16_gemv(true);
    let mut rng = rng();
    let cpu = CpuBackend::exact();
    let (width, cols) = (rng.random_range(40..300), 256 * rng.random_range(1..4));
    let blocks = |rng: &mut StdRng, ty, rows| HostWeight {
        rows,
        cols,
        data: WeightData::Blocks { ty, bytes: crate::cpu::quant_rows_test_blocks(rng, ty, rows * cols) },
    };
    let weights = [
        HostWeight { rows: 2 * width, cols, data: WeightData::F32(randn(&mut rng, 2 * width * cols)) },
        blocks(&mut rng, GgmlType::Q4K, 2 * width),
        blocks(&mut rng, GgmlType::Q8_0, 2 * width),
        HostWeight {
            rows: 2 * width,
            cols,
            data: WeightData::Fp8(Fp8Weight {
                bytes: (0..2 * width * cols)
                    .map(|_| rng.random_range(0..0x7eu8) | (rng.random::<u8>() & 0x80))
                    .collect(),
                scales: (0..2 * width).map(|_| rng.random_range(0.001..0.01)).collect(),
                block: [1, cols],
            }),
        },
        HostWeight {
            rows: 2 * width,
            cols,
            data: WeightData::Int4(Int4Weight {
                nibbles: (0..width * cols).map(|_| rng.random()).collect(),
                scales: (0..2 * width * cols / 128).map(|_| rng.random_range(0.001..0.1)).collect(),
                zeros: (0..2 * width * cols / 128).map(|_| rng.random_range(0..=16)).collect(),
                group: 128,
            }),
        },
        HostWeight {
            rows: 2 * width,
            cols,
            data: WeightData::Stacked(vec![
                blocks(&mut rng, GgmlType::Q4K, width),
                blocks(&mut rng, GgmlType::Q6K, width),
            ]),
        },
    ];
    for hw in weights {
        let what = match &hw.data {
            WeightData::Blocks { ty, .. } => format!("{ty:?}"),
            WeightData::Stacked(_) => "Q4K over Q6K".to_string(),
            WeightData::F32(_) => "bf16".to_string(),
            WeightData::Fp8(_) => "fp8".to_string(),
            WeightData::Int4(_) => "int4".to_string(),
        };
        let stacked = matches!(hw.data, WeightData::Stacked(_));
        let fp8 = matches!(hw.data, WeightData::Fp8(_));
        let (cw, gw) = (cpu.upload_weight(hw.clone()).unwrap(), g.upload_weight(hw).unwrap());
        for tokens in [1, 8, 9] {
            let x = randn(&mut rng, tokens * cols);
            let want = cpu.silu_mul(&cpu.linear(&x, tokens, &cw, None).unwrap(), width).unwrap();
            let gx = g.upload(&x).unwrap();
            let got = g.download(&g.linear_silu_mul(&gx, tokens, &gw, width).unwrap()).unwrap();
            let op = format!("{what} silu(gate) · up, {tokens}x[2·{width}x{cols}]");
            // Past 8 tokens FP8 goes unfused through the W8A8 product, whose bound
            // (gpu_fp8_and_int4_weights_match_cpu) holds for gate and up each: their
            // product carries both (4.3 % measured on an H200).
            let err = rel_err(&got, &want);
            assert!(err < if w8a8(&g, fp8, tokens) { 6e-2 } else { 1e-2 }, "{op}: relative error {err}");
            let composed = g.download(&g.silu_mul(&g.linear(&gx, tokens, &gw, None).unwrap(), width).unwrap()).unwrap();
            let fused = got.iter().zip(&composed).any(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(fused, tokens <= 8 && !stacked, "{op}: whether the fused kernel ran");
        }
    }
}

/// FP8 (per-row and block scales) and 4-bit weights (groups of 32 and 128, zeros up to
/// 16) stay in their layouts on the device: products through both kernels and
/// embedding rows against the CPU's, which decodes them to f32. Bound: 1e-2, as above,
/// but 4e-2 for FP8 products of many tokens on FP8 tensor cores (W8A8: the activations
/// rounded to E4M3, 2.5 % on the host emulation's uniform data).
#[test]
fn gpu_fp8_and_int4_weights_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let cpu = CpuBackend::exact();
    let (rows, cols): (usize, usize) = (rng.random_range(1..300), 128 * rng.random_range(1..4));
    let finite_e4m3 = |rng: &mut StdRng| loop {
        let b: u8 = rng.random();
        if b & 0x7f != 0x7f {
            return b;
        }
    };
    let mut weights = Vec::new();
    for block in [[1, cols], [16, 64], [128, 128]] {
        let scales = (0..rows.div_ceil(block[0]) * cols.div_ceil(block[1])).map(|_| rng.random_range(0.001..0.01));
        let scales = scales.collect();
        let bytes = (0..rows * cols).map(|_| finite_e4m3(&mut rng)).collect();
        weights.push(WeightData::Fp8(Fp8Weight { bytes, scales, block }));
    }
    for group in [32, 128] {
        let n = rows * cols.div_ceil(group);
        weights.push(WeightData::Int4(Int4Weight {
            nibbles: (0..rows * cols / 2).map(|_| rng.random()).collect(),
            scales: (0..n).map(|_| rng.random_range(0.001..0.1)).collect(),
            zeros: (0..n).map(|_| rng.random_range(0..=16)).collect(),
            group,
        }));
    }
    for data in weights {
        let hw = || HostWeight { rows, cols, data: data.clone() };
        let gw = g.upload_weight(hw()).unwrap();
        assert!(gw.device_bytes() < rows * cols * 2, "kept in its format: {} bytes", gw.device_bytes());
        let cw = cpu.upload_weight(hw()).unwrap();
        let what = match &data {
            WeightData::Fp8(w) => format!("fp8 blocks {:?}", w.block),
            WeightData::Int4(w) => format!("int4 groups of {}", w.group),
            _ => unreachable!(),
        };
        for tokens in [1, 8, 70] {
            let x = randn(&mut rng, tokens * cols);
            let want = cpu.linear(&x, tokens, &cw, None).unwrap();
            let got = g.linear(&g.upload(&x).unwrap(), tokens, &gw, None).unwrap();
            let op = format!("{what} linear {tokens}x[{rows}x{cols}]");
            let w8a8 = w8a8(&g, matches!(data, WeightData::Fp8(_)), tokens);
            let err = rel_err(&g.download(&got).unwrap(), &want);
            assert!(err < if w8a8 { 4e-2 } else { 1e-2 }, "{op}: relative error {err}");
            eprintln!("{op}: relative error {err:.4}{}", if w8a8 { " (W8A8)" } else { "" });
        }
        let ids: Vec<u32> = (0..5).map(|_| rng.random_range(0..rows as u32)).collect();
        let got = g.embedding(&g.upload_index(&ids).unwrap(), &gw).unwrap();
        check(&format!("{what} embedding"), &g.download(&got).unwrap(), &cpu.embedding(&ids, &cw).unwrap());
    }
}

#[test]
fn gpu_norms_and_residual_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let (rows, dim) = (rng.random_range(1..40), rng.random_range(1..3000));
    let x = randn(&mut rng, rows * dim);
    let y = randn(&mut rng, rows * dim);
    let w = randn(&mut rng, dim);
    let want = CpuBackend::exact().rms_norm(&x, &w, 1e-5).unwrap();
    let got = g.rms_norm(&g.upload(&x).unwrap(), &g.upload(&w).unwrap(), 1e-5).unwrap();
    check("rms_norm", &g.download(&got).unwrap(), &want);

    let mut h_cpu = x.clone();
    let want = CpuBackend::exact().add_rms_norm(&mut h_cpu, &y, &w, 1e-5).unwrap();
    let mut h = g.upload(&x).unwrap();
    let got = g.add_rms_norm(&mut h, &g.upload(&y).unwrap(), &g.upload(&w).unwrap(), 1e-5).unwrap();
    check("add_rms_norm", &g.download(&got).unwrap(), &want);
    check("add_rms_norm residual", &g.download(&h).unwrap(), &h_cpu);

    let mut h = g.upload(&x).unwrap();
    g.add_assign(&mut h, &g.upload(&y).unwrap()).unwrap();
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    check("add_assign", &g.download(&h).unwrap(), &sum);
}

#[test]
fn gpu_rope_matches_cpu_in_both_styles_at_long_positions() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let (tokens, heads, head_dim) = (9, 3, 64);
    let inv_freq: Vec<f32> = (0..head_dim / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32)).collect();
    let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..32_000)).collect();
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        let x = randn(&mut rng, tokens * heads * head_dim);
        let mut want = x.clone();
        CpuBackend::exact().rope(&mut want, &positions, heads, head_dim, &inv_freq, style).unwrap();
        let mut got = g.upload(&x).unwrap();
        g.rope(&mut got, &g.upload_index(&positions).unwrap(), heads, head_dim, &g.upload(&inv_freq).unwrap(), style)
            .unwrap();
        check(&format!("rope {style:?}"), &g.download(&got).unwrap(), &want);
    }
}

/// The fused Q/K/V step gives the very bits of split_columns, rope and write_kv, both
/// styles, whole and partial rotary, caches written only at the tokens' slots.
#[test]
fn gpu_qkv_to_cache_is_rope_then_write_kv() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let (tokens, heads, kv_heads, head_dim) = (7, 8, 2, 64);
    let shape = AttentionShape { num_heads: heads, num_kv_heads: kv_heads, head_dim, block_size: 16, scale: 0.125 };
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let positions = g.upload_index(&(0..tokens).map(|_| rng.random_range(0..32_000)).collect::<Vec<u32>>()).unwrap();
    let slots = g.upload_index(&[5, 17, 0, 31, 2, 9, 20]).unwrap();
    for (half, style) in [(32, RopeStyle::Neox), (32, RopeStyle::Interleaved), (16, RopeStyle::Neox)] {
        let inv_freq: Vec<f32> = (0..half).map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32)).collect();
        let inv_freq = g.upload(&inv_freq).unwrap();
        let qkv = g.upload(&randn(&mut rng, tokens * (qw + 2 * kw))).unwrap();
        let caches = || (g.upload(&vec![f32::NAN; 32 * kw]).unwrap(), g.upload(&vec![f32::NAN; 32 * kw]).unwrap());
        let (mut k1, mut v1) = caches();
        let q1 = g.qkv_to_cache(&qkv, &positions, &inv_freq, style, &slots, &shape, &mut k1, &mut v1).unwrap();
        let (mut k2, mut v2) = caches();
        let [mut q2, mut k, v]: [super::CudaBuffer; 3] =
            g.split_columns(&qkv, &[qw, kw, kw]).unwrap().try_into().ok().unwrap();
        g.rope(&mut q2, &positions, heads, head_dim, &inv_freq, style).unwrap();
        g.rope(&mut k, &positions, kv_heads, head_dim, &inv_freq, style).unwrap();
        g.write_kv(&k, &v, &slots, &shape, &mut k2, &mut v2).unwrap();
        for (what, a, b) in [("q", &q1, &q2), ("k cache", &k1, &k2), ("v cache", &v1, &v2)] {
            let (a, b) = (g.download(a).unwrap(), g.download(b).unwrap());
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
            assert!(same && a.len() == b.len(), "{what}, {half} pairs {style:?}: the fused step differs");
        }
    }
}

#[test]
fn gpu_elementwise_and_row_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let (rows, width) = (rng.random_range(1..50), rng.random_range(1..600));
    let gate_up = randn(&mut rng, rows * 2 * width);
    let got = g.silu_mul(&g.upload(&gate_up).unwrap(), width).unwrap();
    check("silu_mul", &g.download(&got).unwrap(), &CpuBackend::exact().silu_mul(&gate_up, width).unwrap());

    let x: Vec<f32> = randn(&mut rng, rows * width).iter().map(|v| v * 8.0).collect();
    let mut want = x.clone();
    CpuBackend::exact().softmax(&mut want, width).unwrap();
    let mut got = g.upload(&x).unwrap();
    g.softmax(&mut got, width).unwrap();
    check("softmax", &g.download(&got).unwrap(), &want);

    let widths = [rng.random_range(1..90), rng.random_range(1..90), rng.random_range(1..90)];
    let x = randn(&mut rng, rows * widths.iter().sum::<usize>());
    let want = CpuBackend::exact().split_columns(&x, &widths).unwrap();
    let got = g.split_columns(&g.upload(&x).unwrap(), &widths).unwrap();
    for (got, want) in got.iter().zip(&want) {
        assert_eq!(&g.download(got).unwrap(), want, "split_columns copies exactly");
    }

    let pick: Vec<u32> = (0..7).map(|_| rng.random_range(0..rows as u32)).collect();
    let got = g.gather_rows(&g.upload(&x).unwrap(), widths.iter().sum(), &g.upload_index(&pick).unwrap()).unwrap();
    let want = CpuBackend::exact().gather_rows(&x, widths.iter().sum(), &pick).unwrap();
    assert_eq!(g.download(&got).unwrap(), want, "gather_rows copies exactly");
    assert!(
        g.gather_rows(&g.upload(&x).unwrap(), widths.iter().sum(), &g.upload_index(&[rows as u32]).unwrap()).is_err()
    );

    let (vocab, dim) = (rng.random_range(2..500), rng.random_range(1..300));
    let table = randn(&mut rng, vocab * dim);
    let hw = || HostWeight { rows: vocab, cols: dim, data: WeightData::F32(table.clone()) };
    let ids: Vec<u32> = (0..11).map(|_| rng.random_range(0..vocab as u32)).collect();
    let got = g.embedding(&g.upload_index(&ids).unwrap(), &g.upload_weight(hw()).unwrap()).unwrap();
    let want = CpuBackend::exact().embedding(&ids, &CpuBackend::exact().upload_weight(hw()).unwrap()).unwrap();
    assert_eq!(g.download(&got).unwrap(), want, "embedding copies exactly");
    let err = g.embedding(&g.upload_index(&[vocab as u32]).unwrap(), &g.upload_weight(hw()).unwrap());
    assert!(err.is_err(), "an id past the vocabulary is refused");
}

/// The vision tower's ops: LayerNorm over an offset stream, the three GELUs, rows
/// scattered into place, and bidirectional attention over a few images of patches.
#[test]
fn gpu_vision_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let (rows, dim) = (rng.random_range(1..80), rng.random_range(1..1200));
    let x: Vec<f32> = randn(&mut rng, rows * dim).iter().map(|v| bf16::from_f32(v + 4.0).to_f32()).collect();
    let (w, b) = (randn(&mut rng, dim), randn(&mut rng, dim));
    let want = CpuBackend::exact().layer_norm(&x, &w, &b, 1e-6).unwrap();
    let got = g.layer_norm(&g.upload(&x).unwrap(), &g.upload(&w).unwrap(), &g.upload(&b).unwrap(), 1e-6).unwrap();
    check("layer_norm", &g.download(&got).unwrap(), &want);

    for kind in [Gelu::Erf, Gelu::Tanh, Gelu::Quick] {
        let x: Vec<f32> = randn(&mut rng, 5000).iter().map(|v| bf16::from_f32(v * 5.0).to_f32()).collect();
        let mut want = x.clone();
        CpuBackend::exact().gelu(&mut want, kind).unwrap();
        let mut got = g.upload(&x).unwrap();
        g.gelu(&mut got, kind).unwrap();
        check(&format!("gelu {kind:?}"), &g.download(&got).unwrap(), &want);
    }

    let mut want = randn(&mut rng, rows * dim);
    let pick: Vec<u32> = (0..rows as u32).filter(|_| rng.random_bool(0.5)).collect();
    let src = randn(&mut rng, pick.len() * dim);
    let mut got = g.upload(&want).unwrap();
    CpuBackend::exact().scatter_rows(&mut want, dim, &pick, &src).unwrap();
    g.scatter_rows(&mut got, dim, &g.upload_index(&pick).unwrap(), &g.upload(&src).unwrap()).unwrap();
    check("scatter_rows", &g.download(&got).unwrap(), &want);

    for (seqs, len, heads, head_dim) in [(1, 1, 1, 8), (3, 17, 4, 16), (2, 577, 16, 64), (1, 1024, 12, 72)] {
        let n = seqs * len * heads * head_dim;
        let scaled =
            |rng: &mut StdRng| -> Vec<f32> { randn(rng, n).iter().map(|v| bf16::from_f32(v * 3.0).to_f32()).collect() };
        let (q, k, v) = (scaled(&mut rng), scaled(&mut rng), randn(&mut rng, n));
        let scale = (head_dim as f32).powf(-0.5);
        let want = CpuBackend::exact().dense_attention(&q, &k, &v, seqs, heads, head_dim, scale).unwrap();
        let (gq, gk, gv) = (g.upload(&q).unwrap(), g.upload(&k).unwrap(), g.upload(&v).unwrap());
        let got = g.dense_attention(&gq, &gk, &gv, seqs, heads, head_dim, scale).unwrap();
        check(&format!("dense_attention {seqs}x{len} {heads}x{head_dim}"), &g.download(&got).unwrap(), &want);
    }
}

/// The same mixed batch as the CPU's reference test — a decode, a whole prefill, a
/// prefill chunk after a cached prefix, one-token sequences — over scrambled blocks,
/// and a decode-only batch whose few rows make the fast path split the keys over
/// blocks. Head sizes 64, 128 and 256 with 1, 2, 4 or 8 query heads per KV head take
/// the fast path; other head sizes and groups (3, 16) the general kernel.
#[test]
fn gpu_paged_attention_matches_cpu_over_mixed_prefill_and_decode() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let mixed = [(300usize, 1usize), (77, 77), (530, 40), (1, 1), (1000, 1)];
    let decodes = [(1000usize, 1usize), (333, 1), (2, 1)];
    for (head_dim, block_size, heads, kv_heads) in [
        (64, 16, 9, 3),
        (64, 16, 8, 4),
        (128, 16, 32, 8),
        (128, 16, 32, 4),
        (256, 16, 8, 8),
        (32, 4, 4, 4),
        (96, 8, 6, 2),
        (64, 16, 16, 1),
    ] {
        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            block_size,
            scale: (head_dim as f32).powf(-0.5),
        };
        for seqs in [&mixed[..], &decodes[..]] {
            attention_case(&g, &mut rng, &shape, seqs);
        }
    }
}

fn attention_case(g: &CudaBackend, rng: &mut StdRng, shape: &AttentionShape, seqs: &[(usize, usize)]) {
    let (head_dim, block_size) = (shape.head_dim, shape.block_size);
    let num_blocks = seqs.iter().map(|s| s.0.div_ceil(block_size)).sum::<usize>() + 7;
    let w = shape.kv_width();
    let mut free: Vec<u32> = (0..num_blocks as u32).collect();
    // A scrambled order, so the result depends on the block tables.
    for i in (1..free.len()).rev() {
        free.swap(i, rng.random_range(0..=i));
    }
    let max_blocks = seqs.iter().map(|s| s.0.div_ceil(block_size)).max().unwrap();
    let mut k_cpu = vec![0.0f32; num_blocks * shape.block_floats()];
    let mut v_cpu = k_cpu.clone();
    // The GPU's layout, a row of `w` per slot; the CPU's is its own (keys transposed
    // within each block), so each cache is checked against the layout its kernels read.
    let (mut k_rows, mut v_rows) = (k_cpu.clone(), k_cpu.clone());
    let mut k_gpu = g.zeros(k_cpu.len()).unwrap();
    let mut v_gpu = g.zeros(k_cpu.len()).unwrap();
    let (mut tables, mut starts, mut ctx) = (vec![], vec![0u32], vec![]);
    for &(context, q_len) in seqs {
        let blocks: Vec<u32> = (0..context.div_ceil(block_size)).map(|_| free.pop().unwrap()).collect();
        let k = randn(rng, context * w);
        let v = randn(rng, context * w);
        let slots: Vec<u32> =
            (0..context).map(|p| blocks[p / block_size] * block_size as u32 + (p % block_size) as u32).collect();
        CpuBackend::exact().write_kv(&k, &v, &slots, shape, &mut k_cpu, &mut v_cpu).unwrap();
        for (p, &slot) in slots.iter().enumerate() {
            let row = slot as usize * w..(slot as usize + 1) * w;
            k_rows[row.clone()].copy_from_slice(&k[p * w..(p + 1) * w]);
            v_rows[row].copy_from_slice(&v[p * w..(p + 1) * w]);
        }
        let (kg, vg, sg) = (g.upload(&k).unwrap(), g.upload(&v).unwrap(), g.upload_index(&slots).unwrap());
        g.write_kv(&kg, &vg, &sg, shape, &mut k_gpu, &mut v_gpu).unwrap();
        let mut table = blocks;
        table.resize(max_blocks, 0);
        tables.extend(table);
        starts.push(starts.last().unwrap() + q_len as u32);
        ctx.push(context as u32);
    }
    check("write_kv keys", &g.download(&k_gpu).unwrap(), &k_rows);
    check("write_kv values", &g.download(&v_gpu).unwrap(), &v_rows);
    let tokens = *starts.last().unwrap() as usize;
    // Queries large enough that the softmax is far from uniform.
    let q: Vec<f32> = randn(rng, tokens * shape.q_width()).iter().map(|v| bf16::from_f32(v * 4.0).to_f32()).collect();
    let cpu_batch = PagedBatch::<CpuBackend> {
        num_seqs: seqs.len(),
        query_start: &starts,
        context_lens: &ctx,
        block_tables: &tables,
        max_blocks_per_seq: max_blocks,
    };
    let want = CpuBackend::exact().paged_attention(&q, &k_cpu, &v_cpu, &cpu_batch, shape).unwrap();
    let (gs, gc, gt) =
        (g.upload_index(&starts).unwrap(), g.upload_index(&ctx).unwrap(), g.upload_index(&tables).unwrap());
    let gpu_batch = PagedBatch::<CudaBackend> {
        num_seqs: seqs.len(),
        query_start: &gs,
        context_lens: &gc,
        block_tables: &gt,
        max_blocks_per_seq: max_blocks,
    };
    let got = g.paged_attention(&g.upload(&q).unwrap(), &k_gpu, &v_gpu, &gpu_batch, shape).unwrap();
    let label = format!(
        "paged_attention head_dim {head_dim}, {}/{} heads, {} rows",
        shape.num_heads, shape.num_kv_heads, tokens
    );
    check(&label, &g.download(&got).unwrap(), &want);

    let bad = g.upload_index(&vec![num_blocks as u32; tables.len()]).unwrap();
    let bad_batch = PagedBatch::<CudaBackend> { block_tables: &bad, ..gpu_batch };
    assert!(g.paged_attention(&g.upload(&q).unwrap(), &k_gpu, &v_gpu, &bad_batch, shape).is_err());
}

/// Split choice of the fast attention path, on an H100's 132 multiprocessors holding 5
/// blocks each (660 at once), keys enough for 9 splits.
#[test]
fn attention_splits_fill_the_gpu_in_whole_waves() {
    let splits = |blocks| super::attention_splits(blocks, 132, 660, 9);
    // Few blocks (batch 1 and 8, 8 KV heads): until the grid is twice the GPU.
    assert_eq!(splits(8), 9);
    assert_eq!(splits(64), 5);
    // Batch 64: 512 blocks fill 78 % of one wave; 5 splits, 2,560 blocks, 97 % of four.
    assert_eq!(splits(512), 5);
    // Batch 256: 2,048 blocks leave the fourth wave a tenth full; 3 splits fill 93 %.
    assert_eq!(splits(2048), 3);
    // Already whole waves: no split.
    assert_eq!(splits(1320), 1);
    // Short contexts cap the splits; the fullest allowed is taken.
    assert_eq!(super::attention_splits(512, 132, 660, 2), 1);
    assert_eq!(super::attention_splits(2048, 132, 660, 1), 1);
}
