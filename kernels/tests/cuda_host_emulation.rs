//! CUDA kernels run on the host under g++ (`kernels/cuda/emulation`: each CUDA thread a
//! fiber, warps exchanging values between barriers) and judged against the CPU, so
//! that where no GPU is (CI) their decoding, indexing, warp-wide steps and tensor-core
//! fragment layouts are still checked on every build, and, under g++'s alignment
//! sanitizer, that no vector load is misaligned (x86 would load it; a GPU faults). The emulation is a test double for
//! the GPU; `kernels/src/cuda/tests.rs` and `worker/tests/gpu.rs` check the same kernels
//! on a device.
//!
//! `quant.cu`'s kernels for packed weights, every format: each row's units decoded bit for bit as the host decodes them, products
//! of 1, 3 and 8 tokens (the decode kernel) and 9 and 70 (the tiled tensor-core one, over
//! partial tiles) within 1e-2 of the CPU's exact product (bf16 activations and outputs,
//! as `cuda/tests.rs` bounds them), the decode kernel over a [gate; up] weight to
//! silu(gate) · up likewise, the same products written among a wider output's
//! rows (a part of a stacked weight), and embedding rows equal to the decoded ones
//! rounded to bf16.
//!
//! `elementwise.cu`'s qkv_to_cache: RoPE within a bf16 step of a plain rotation, both
//! styles, whole and partial; values and unrotated dimensions copied bit for bit; the
//! cache written at exactly the tokens' slots.
//!
//! `prefill.cu`'s tiled attention on the tensor cores: a prefill chunk over cached keys
//! (two tiles, the second partial), a decode row and a whole prompt in one batch, head
//! sizes 64 and 128, within 1e-2 of attention computed plainly in f64.
//!
//! `sampling.cu`'s pick, split over 1 to 7 blocks a row, f32 and bf16 logits: every
//! greedy and drawn token equal to a plain sort-and-walk of the row in the same fixed
//! point (`reference_pick`).

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tessera_kernels::cpu::CpuBackend;
use tessera_kernels::quant::{Fp8Weight, GgmlType, Int4Weight, e4m3_to_f32, random_blocks};
use tessera_kernels::{Backend, HostWeight, WeightData};

const TOKENS: [usize; 5] = [1, 3, 8, 9, 70];

/// An emulation driver (`cuda/emulation/*_check.cpp`, by name), compiled once per test run.
fn driver(name: &'static str) -> &'static Path {
    static QUANT: OnceLock<PathBuf> = OnceLock::new();
    static PICK: OnceLock<PathBuf> = OnceLock::new();
    static QKV: OnceLock<PathBuf> = OnceLock::new();
    static PREFILL: OnceLock<PathBuf> = OnceLock::new();
    let cell = match name {
        "quant_check" => &QUANT,
        "pick_check" => &PICK,
        "qkv_check" => &QKV,
        _ => &PREFILL,
    };
    cell.get_or_init(|| {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("cuda/emulation/{name}.cpp"));
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        // x86 loads misaligned words as gladly as aligned ones; the GPU faults on them,
        // so the sanitizer stops a driver at the first.
        let flags = [
            "-std=c++20",
            "-O1",
            "-ffp-contract=off",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-unknown-pragmas",
            "-fsanitize=alignment",
            "-fno-sanitize-recover=alignment",
        ];
        let status =
            Command::new("g++").args(flags).arg("-pthread").arg("-o").arg(&out).arg(&source).status().unwrap_or_else(
                |e| panic!("g++ is needed to emulate the CUDA kernels (scripts/test installs it): {e}"),
            );
        assert!(status.success(), "g++ could not build {}", source.display());
        out
    })
}

fn rng() -> StdRng {
    let seed: u64 = StdRng::from_os_rng().random();
    eprintln!("random seed {seed}");
    StdRng::seed_from_u64(seed)
}

fn bytes_of<T: Copy>(v: &[T], to: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

fn read_bf16(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Runs the driver on `data` as `format` and checks everything it wrote.
fn check(format: &str, rows: usize, cols: usize, data: WeightData, rng: &mut StdRng) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("emulation-{}", format.replace(':', "-")));
    std::fs::create_dir_all(&dir).unwrap();
    let put = |name: &str, bytes: Vec<u8>| std::fs::write(dir.join(name), bytes).unwrap();
    let f32s = |v: &[f32]| bytes_of(v, |x| x.to_le_bytes().to_vec());
    match &data {
        WeightData::Blocks { bytes, .. } => put("w.bin", bytes.clone()),
        WeightData::Fp8(w) => {
            put("w.bin", w.bytes.clone());
            put("scales.f32", f32s(&w.scales));
        }
        WeightData::Int4(w) => {
            put("w.bin", w.nibbles.clone());
            put("scales.f32", f32s(&w.scales));
            put("zeros.u8", w.zeros.clone());
        }
        other => panic!("not a packed weight: {other:?}"),
    }
    let most = TOKENS.iter().max().copied().unwrap_or(1);
    let x: Vec<f32> = (0..most * cols).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32()).collect();
    put("x.bf16", bytes_of(&x, |v| bf16::from_f32(v).to_le_bytes().to_vec()));
    let ids: Vec<u32> = vec![0, rows as u32 - 1, rng.random_range(0..rows as u32)];
    put("ids.u32", bytes_of(&ids, |v| v.to_le_bytes().to_vec()));

    let output = Command::new(driver("quant_check"))
        .arg(&dir)
        .arg(format)
        .arg(rows.to_string())
        .arg(cols.to_string())
        .args(TOKENS.map(|t| t.to_string()))
        .output()
        .unwrap();
    assert!(output.status.success(), "{format}: {}", String::from_utf8_lossy(&output.stderr));

    let cpu = CpuBackend::exact();
    let weight = HostWeight { rows, cols, data };
    let want = weight.clone().into_f32();
    let decoded: Vec<f32> = std::fs::read(dir.join("decoded.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let differ = decoded.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!((decoded.len(), differ), (want.len(), 0), "{format}: decoded weights differ from the host's");

    let cw = cpu.upload_weight(weight.clone()).unwrap();
    for tokens in TOKENS {
        let got = read_bf16(&dir.join(format!("out_{tokens}.bf16")));
        let want = cpu.linear(&x[..tokens * cols].to_vec(), tokens, &cw, None).unwrap();
        let err = rel_err(&got, &want);
        assert!(err < 1e-2, "{format}: {tokens} tokens × [{rows}, {cols}]: relative error {err}");
        // Written 2 rows into an output 5 rows wider: the same rows, nothing around them.
        let wide = read_bf16(&dir.join(format!("wide_{tokens}.bf16")));
        for (t, (line, rows_got)) in wide.chunks_exact(rows + 5).zip(got.chunks_exact(rows)).enumerate() {
            let same = line[2..2 + rows].iter().zip(rows_got).all(|(a, b)| a.to_bits() == b.to_bits());
            let around = line[..2].iter().chain(&line[2 + rows..]).all(|v| v.is_nan());
            assert!(same && around, "{format}: {tokens} tokens into a wider output, token {t}");
        }
    }
    let written = Written { dir: &dir, format, rows, cols, x: &x, cw: &cw, cpu: &cpu };
    check_glu(written);
    if let WeightData::Fp8(_) = &weight.data {
        check_fp8_tensor_cores(written);
    }
    let rows_of: Vec<f32> = ids
        .iter()
        .flat_map(|&i| want[i as usize * cols..][..cols].iter().map(|&v| bf16::from_f32(v).to_f32()))
        .collect();
    assert_eq!(read_bf16(&dir.join("emb.bf16")), rows_of, "{format}: embedding rows");
    let _ = std::fs::remove_dir_all(dir);
}

/// A driver run's directory and what its outputs are judged against: the weight's
/// shape, the activations it took, the weight on the CPU and the CPU.
#[derive(Clone, Copy)]
struct Written<'a> {
    dir: &'a Path,
    format: &'a str,
    rows: usize,
    cols: usize,
    x: &'a [f32],
    cw: &'a <CpuBackend as Backend>::Weight,
    cpu: &'a CpuBackend,
}

/// The decode kernels' fused MLP activation (`gemv_glu_*`, `gemv_bf16_glu`): the weight's
/// rows as [gate; up], silu(gate) · up for 1, 3 and 8 tokens within 1e-2 of the CPU's
/// exact product through its silu_mul (the same bound as the plain product: one bf16
/// rounding of the output, f32 sums).
fn check_glu(written: Written) {
    let Written { dir, format, rows, cols, x, cw, cpu } = written;
    assert!(rows.is_multiple_of(2), "{format}: a [gate; up] weight has an even number of rows");
    for tokens in TOKENS.into_iter().filter(|&t| t <= 8) {
        let got = read_bf16(&dir.join(format!("glu_{tokens}.bf16")));
        let product = cpu.linear(&x[..tokens * cols].to_vec(), tokens, cw, None).unwrap();
        let want = cpu.silu_mul(&product, rows / 2).unwrap();
        let err = rel_err(&got, &want);
        assert!(err < 1e-2, "{format}: silu(gate) · up, {tokens} tokens × [{rows}, {cols}]: relative error {err}");
    }
}

/// The W8A8 path of FP8 weights: every activation quantised to a nearest E4M3 byte of
/// x / scale with the token's largest magnitude at 448, and the tensor-core product
/// within 4e-2 of the CPU's exact one. The bound is the activations' rounding: E4M3 keeps
/// 3 mantissa bits (relative steps of 1/8 to 1/16: 2.5 % RMS on these uniform activations, which does not
/// shrink in a sum of many terms of random sign); the weights are exact as stored.
fn check_fp8_tensor_cores(written: Written) {
    let Written { dir, format, rows, cols, x, cw, cpu } = written;
    let e4m3: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    for tokens in TOKENS.into_iter().filter(|&t| t > 8) {
        let xq = std::fs::read(dir.join(format!("xq_{tokens}.u8"))).unwrap();
        let xs: Vec<f32> = std::fs::read(dir.join(format!("xs_{tokens}.f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!((xq.len(), xs.len()), (tokens * cols, tokens), "{format}: quantised activations");
        for t in 0..tokens {
            let row = &x[t * cols..][..cols];
            let top = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                (xs[t] - top / 448.0).abs() <= 1e-6 * top,
                "{format}: token {t}'s scale {} for a top of {top}",
                xs[t]
            );
            for (c, (&q, &v)) in xq[t * cols..][..cols].iter().zip(row).enumerate() {
                let want = v * (448.0 / top);
                let nearest = e4m3.iter().filter(|b| b.is_finite()).map(|b| (b - want).abs()).fold(f32::MAX, f32::min);
                let got = (e4m3[q as usize] - want).abs();
                assert!(got <= nearest, "{format}: token {t} column {c}: {want} became {} ", e4m3[q as usize]);
            }
        }
        let got = read_bf16(&dir.join(format!("tc_{tokens}.bf16")));
        let want = cpu.linear(&x[..tokens * cols].to_vec(), tokens, cw, None).unwrap();
        let err = rel_err(&got, &want);
        assert!(err < 4e-2, "{format}: W8A8, {tokens} tokens × [{rows}, {cols}]: relative error {err}");
        eprintln!("{format}: W8A8, {tokens} tokens: relative error {err:.4}");
    }
}

#[test]
fn ggml_block_kernels_match_the_cpu_on_the_host_emulation() {
    let mut rng = rng();
    // 70 rows: neither whole warps' blocks of 4 nor whole tiles of 64.
    let (rows, cols) = (70, 512);
    let formats = [
        ("q4_0", GgmlType::Q4_0),
        ("q4_1", GgmlType::Q4_1),
        ("q5_0", GgmlType::Q5_0),
        ("q8_0", GgmlType::Q8_0),
        ("q4_k", GgmlType::Q4K),
        ("q5_k", GgmlType::Q5K),
        ("q6_k", GgmlType::Q6K),
    ];
    for (name, ty) in formats {
        let bytes = random_blocks(ty, rows * cols, rng.random());
        check(name, rows, cols, WeightData::Blocks { ty, bytes }, &mut rng);
    }
}

#[test]
fn fp8_and_int4_kernels_match_the_cpu_on_the_host_emulation() {
    let mut rng = rng();
    let (rows, cols): (usize, usize) = (70, 384);
    for block in [[1, cols], [16, 64], [128, 128]] {
        let bytes = (0..rows * cols)
            .map(|_| {
                loop {
                    let b: u8 = rng.random();
                    if b & 0x7f != 0x7f {
                        break b; // E4M3's NaN is no weight
                    }
                }
            })
            .collect();
        let scales = (0..rows.div_ceil(block[0]) * cols.div_ceil(block[1])).map(|_| rng.random_range(0.001..0.01));
        let w = Fp8Weight { bytes, scales: scales.collect(), block };
        check(&format!("fp8:{}:{}", block[0], block[1]), rows, cols, WeightData::Fp8(w), &mut rng);
    }
    for group in [32, 128] {
        let n = rows * cols.div_ceil(group);
        let w = Int4Weight {
            nibbles: (0..rows * cols / 2).map(|_| rng.random()).collect(),
            scales: (0..n).map(|_| rng.random_range(0.001..0.1)).collect(),
            zeros: (0..n).map(|_| rng.random_range(0..=16)).collect(),
            group,
        };
        check(&format!("int4:{group}"), rows, cols, WeightData::Int4(w), &mut rng);
    }
}

/// The log-probabilities' kernels over the same rows (split as the pick): each row's
/// max exactly, its log-sum-exp within 1e-5 of an f64 sum, its top 20 in order (value,
/// then index) exactly; rows of numbers only (the last three hold -inf or NaN).
fn check_logprob_parts(dir: &Path, splits: &str, logits: &[f32], vocab: usize) {
    let f32s = |name: String| -> Vec<f32> {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    };
    let maxes = f32s(format!("max_{splits}.f32"));
    let lses = f32s(format!("lse_{splits}.f32"));
    let top: Vec<u32> = f32s(format!("top_{splits}.u32")).into_iter().map(f32::to_bits).collect();
    for r in 0..15 {
        let row = &logits[r * vocab..][..vocab];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = row.iter().map(|&l| ((l - m) as f64).exp()).sum::<f64>().ln();
        assert_eq!(maxes[r], m, "{splits} splits, row {r}: max");
        assert!((lses[r] as f64 - lse).abs() < 1e-5, "{splits} splits, row {r}: lse {} vs {lse}", lses[r]);
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        assert_eq!(&top[r * 20..][..20], &order[..20], "{splits} splits, row {r}: top 20");
    }
}

/// A row's draw as `cuda/sampling.rs` uploads it; temperature 0 is greedy.
#[derive(Debug, Clone, Copy)]
struct Params {
    temperature: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    uniform: f32,
}

/// Logit bits whose unsigned order is the floats' (sampling.cu's order_key).
fn order_key(l: f32) -> u32 {
    let b = l.to_bits();
    if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 }
}

/// The pick the kernels make, the plain way: the greedy token is the first of the
/// largest logits (NaN never; token 0 for a row of NaNs). A draw sorts the row by key, then
/// index; keeps the top k; weighs each token exp((l - max) / T) in 2^-40 fixed point;
/// keeps the prefix whose weights first reach top_p of the kept total; zeroes tokens under
/// min_p of the top; and walks to where the weights first reach uniform of what is left
/// (nothing left: the greedy token).
fn reference_pick(row: &[f32], p: Params) -> u32 {
    // The first of the largest (by float comparison: -0 equals +0), NaN never.
    let greedy = (0..row.len())
        .filter(|&i| !row[i].is_nan())
        .fold(None, |best: Option<usize>, i| match best {
            Some(j) if row[j] >= row[i] => Some(j),
            _ => Some(i),
        })
        .map_or(0, |i| i as u32);
    if p.temperature.is_nan() || p.temperature <= 0.0 {
        return greedy;
    }
    let max = row.iter().copied().filter(|l| !l.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let weight = |l: f32, min_p: f32| -> u64 {
        let w = ((l - max) / p.temperature).exp();
        if w >= min_p { (w * 1_099_511_627_776.0f32) as u64 } else { 0 } // NaN too
    };
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(order_key(row[i])), i));
    let mut kept = order.len();
    if p.top_k > 0 && (p.top_k as usize) < kept {
        kept = p.top_k as usize;
    }
    // Where the kept tokens' weights first reach `share` of their total.
    let walk = |kept: usize, min_p: f32, share: f32| -> Option<usize> {
        let total: u64 = order[..kept].iter().map(|&i| weight(row[i], min_p)).sum();
        if total == 0 {
            return None;
        }
        let target = ((share as f64 * total as f64) as u64).max(1);
        let mut acc = 0;
        order[..kept].iter().position(|&i| {
            acc += weight(row[i], min_p);
            acc >= target
        })
    };
    if p.top_p < 1.0
        && let Some(j) = walk(kept, 0.0, p.top_p)
    {
        kept = j + 1;
    }
    walk(kept, p.min_p, p.uniform).map_or(greedy, |j| order[j] as u32)
}

#[test]
fn pick_kernels_match_a_sort_and_walk_on_the_host_emulation() {
    let mut rng = rng();
    // Not a multiple of the blocks, so chunks end short.
    let (rows, vocab, threads) = (18usize, 601usize, 64);
    let splits = ["1", "7"];
    let mut params = Vec::new();
    for r in 0..rows {
        let mut p = Params {
            temperature: [0.0, 0.5, 1.0, 1.7][r % 4],
            top_k: [0, 1, 20, 1000, 7, vocab as u32 + 5][r % 6],
            top_p: [1.0, 0.9, 0.5, 0.0][r % 4 / 2 + (r / 9) * 2],
            min_p: [0.0, 0.05, 0.3][r % 3],
            uniform: rng.random_range(0.0..1.0),
        };
        if r % 4 == 0 {
            p.temperature = [0.0, 0.8][r / 4 % 2]; // greedy and drawn rows side by side
        }
        if r == 5 {
            p.uniform = 0.0;
        }
        if r == 9 {
            p.uniform = 0.999_999;
        }
        params.push(p);
    }
    for logit_type in ["f32", "bf16"] {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("emulation-pick-{logit_type}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut logits = Vec::with_capacity(rows * vocab);
        for r in 0..rows {
            // Peaked and flat rows; in f32, runs of equal logits too (bf16 ties anyway).
            let spread = [2.0f32, 12.0][r % 2];
            let mut row: Vec<f32> = (0..vocab).map(|_| rng.random_range(-spread..spread)).collect();
            if r % 3 == 0 {
                let v = row[0];
                for i in (0..vocab).step_by(97) {
                    row[i] = v;
                }
            }
            match r {
                // Every logit -inf: nothing to draw, the greedy token (the first) stands.
                15 => row.fill(f32::NEG_INFINITY),
                // NaNs are never the greedy pick; a row of them picks token 0.
                16 => {
                    // All below zero but -0 (first) and +0: the greedy pick is the -0.
                    row.iter_mut().for_each(|l| *l = -l.abs() - 1.0);
                    (row[3], row[7], row[11]) = (-0.0, 0.0, f32::NAN);
                }
                17 => row.fill(f32::NAN),
                _ => {}
            }
            if logit_type == "bf16" {
                row.iter_mut().for_each(|l| *l = bf16::from_f32(*l).to_f32());
            }
            logits.extend(row);
        }
        // NaN rows are greedy only: what a draw makes of NaN is no sampler's contract.
        let mut params = params.clone();
        params[16].temperature = 0.0;
        params[17].temperature = 0.0;
        let bytes = match logit_type {
            "f32" => bytes_of(&logits, |v| v.to_le_bytes().to_vec()),
            _ => bytes_of(&logits, |v| bf16::from_f32(v).to_le_bytes().to_vec()),
        };
        std::fs::write(dir.join(format!("logits.{logit_type}")), bytes).unwrap();
        let words: Vec<u32> = params
            .iter()
            .flat_map(|p| [p.temperature.to_bits(), p.top_k, p.top_p.to_bits(), p.min_p.to_bits(), p.uniform.to_bits()])
            .collect();
        std::fs::write(dir.join("params.u32"), bytes_of(&words, |v| v.to_le_bytes().to_vec())).unwrap();

        let output = Command::new(driver("pick_check"))
            .arg(&dir)
            .arg(logit_type)
            .args([rows, vocab, threads].map(|v| v.to_string()))
            .args(splits)
            .output()
            .unwrap();
        assert!(output.status.success(), "{logit_type}: {}", String::from_utf8_lossy(&output.stderr));
        let want: Vec<u32> = (0..rows).map(|r| reference_pick(&logits[r * vocab..][..vocab], params[r])).collect();
        // The checks have teeth: draws differ from the greedy pick on most drawn rows.
        let drawn_elsewhere = (0..rows)
            .filter(|&r| params[r].temperature > 0.0)
            .filter(|&r| {
                want[r] != reference_pick(&logits[r * vocab..][..vocab], Params { temperature: 0.0, ..params[r] })
            })
            .count();
        assert!(drawn_elsewhere >= 5, "{logit_type}: only {drawn_elsewhere} draws leave the greedy token");
        assert_eq!((want[15], want[16], want[17]), (0, want[16], 0));
        assert_eq!(want[16], 3, "a NaN is never the greedy pick, and -0 equals +0");
        for s in splits {
            let got: Vec<u32> = std::fs::read(dir.join(format!("tokens_{s}.u32")))
                .unwrap()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            for r in 0..rows {
                assert_eq!(got[r], want[r], "{logit_type}, {s} splits, row {r}: {:?}", params[r]);
            }
            if logit_type == "f32" {
                check_logprob_parts(&dir, s, &logits, vocab);
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn qkv_to_cache_matches_a_plain_rotation_on_the_host_emulation() {
    let mut rng = rng();
    let (tokens, heads, kv_heads, head_dim, capacity) = (5usize, 4usize, 2usize, 16usize, 12usize);
    let all = heads + 2 * kv_heads;
    // Whole and partial rotary, in both styles.
    for (half, neox) in [(8usize, true), (8, false), (4, true), (4, false)] {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("emulation-qkv-{half}-{neox}"));
        std::fs::create_dir_all(&dir).unwrap();
        let qkv: Vec<f32> =
            (0..tokens * all * head_dim).map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)).to_f32()).collect();
        let positions: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..5000)).collect();
        let slots: Vec<u32> = vec![7, 0, 11, 3, 4];
        let inv_freq: Vec<f32> = (0..half).map(|i| 10_000f32.powf(-((2 * i) as f32) / head_dim as f32)).collect();
        let le = |v: &[u32]| bytes_of(v, |x| x.to_le_bytes().to_vec());
        std::fs::write(dir.join("qkv.bf16"), bytes_of(&qkv, |v| bf16::from_f32(v).to_le_bytes().to_vec())).unwrap();
        std::fs::write(dir.join("positions.u32"), le(&positions)).unwrap();
        std::fs::write(dir.join("slots.u32"), le(&slots)).unwrap();
        std::fs::write(dir.join("inv_freq.f32"), bytes_of(&inv_freq, |v| v.to_le_bytes().to_vec())).unwrap();
        let sizes = [tokens, heads, kv_heads, head_dim, half, usize::from(neox), capacity];
        let output = Command::new(driver("qkv_check")).arg(&dir).args(sizes.map(|v| v.to_string())).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let (q, k_cache, v_cache) = (
            read_bf16(&dir.join("q.bf16")),
            read_bf16(&dir.join("k_cache.bf16")),
            read_bf16(&dir.join("v_cache.bf16")),
        );
        let _ = std::fs::remove_dir_all(&dir);

        // Head h of token t, rotated plainly in f32: rope's pairs (i, i + half) or (2i, 2i + 1).
        let rotated = |t: usize, h: usize| -> Vec<f32> {
            let mut x = qkv[(t * all + h) * head_dim..][..head_dim].to_vec();
            for i in 0..half {
                let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
                let (s, c) = (positions[t] as f32 * inv_freq[i]).sin_cos();
                let (x0, x1) = (x[a], x[b]);
                (x[a], x[b]) = (x0 * c - x1 * s, x0 * s + x1 * c);
            }
            x
        };
        // Within one bf16 rounding (2⁻⁸ of the pair's size) plus the sine's.
        let close = |got: &[f32], want: &[f32], input: &[f32], what: &str| {
            for d in 0..head_dim {
                let scale = input[d].abs() + input[d ^ 1].abs() + input[(d + half) % head_dim].abs();
                assert!((got[d] - want[d]).abs() <= scale / 128.0 + 1e-6, "{what} dim {d}: {} vs {}", got[d], want[d]);
                if d >= 2 * half {
                    assert_eq!(got[d].to_bits(), input[d].to_bits(), "{what} dim {d}: unrotated, copied");
                }
            }
        };
        for t in 0..tokens {
            for h in 0..heads {
                let input = &qkv[(t * all + h) * head_dim..][..head_dim];
                close(&q[(t * heads + h) * head_dim..][..head_dim], &rotated(t, h), input, &format!("q t{t} h{h}"));
            }
            for g in 0..kv_heads {
                let at = (slots[t] as usize * kv_heads + g) * head_dim;
                let input = &qkv[(t * all + heads + g) * head_dim..][..head_dim];
                close(&k_cache[at..][..head_dim], &rotated(t, heads + g), input, &format!("k t{t} g{g}"));
                let value = &qkv[(t * all + heads + kv_heads + g) * head_dim..][..head_dim];
                let same = v_cache[at..][..head_dim].iter().zip(value).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "v t{t} g{g}: copied bit for bit");
            }
        }
        for slot in (0..capacity as u32).filter(|s| !slots.contains(s)) {
            let at = slot as usize * kv_heads * head_dim;
            assert!(k_cache[at..][..kv_heads * head_dim].iter().all(|v| v.is_nan()), "slot {slot} left alone");
            assert!(v_cache[at..][..kv_heads * head_dim].iter().all(|v| v.is_nan()), "slot {slot} left alone");
        }
    }
}

#[test]
fn prefill_attention_matches_plain_attention_on_the_host_emulation() {
    let mut rng = rng();
    let (heads, kv_heads, block_size) = (4usize, 2usize, 16usize);
    // (new rows, context): a chunk after 30 cached tokens, a decode row, a whole prompt.
    let seqs = [(70usize, 100usize), (1, 37), (20, 20)];
    let max_blocks = seqs.iter().map(|s| s.1.div_ceil(block_size)).max().unwrap();
    let physical = seqs.len() * max_blocks + 3;
    for head_dim in [64usize, 128] {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("emulation-prefill-{head_dim}"));
        std::fs::create_dir_all(&dir).unwrap();
        let round = |v: f32| bf16::from_f32(v).to_f32();
        let rows: usize = seqs.iter().map(|s| s.0).sum();
        let q: Vec<f32> = (0..rows * heads * head_dim).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
        let cache = physical * block_size * kv_heads * head_dim;
        let k: Vec<f32> = (0..cache).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
        let v: Vec<f32> = (0..cache).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
        // Each sequence's blocks scattered over the cache.
        let mut free: Vec<u32> = (0..physical as u32).collect();
        let mut tables = vec![0u32; seqs.len() * max_blocks];
        for (s, &(_, ctx)) in seqs.iter().enumerate() {
            for b in 0..ctx.div_ceil(block_size) {
                tables[s * max_blocks + b] = free.swap_remove(rng.random_range(0..free.len()));
            }
        }
        let mut starts = vec![0u32];
        let mut tiles = Vec::new();
        for (s, &(n, _)) in seqs.iter().enumerate() {
            starts.push(starts[s] + n as u32);
            tiles.extend((0..n).step_by(64).flat_map(|r0| [s as u32, r0 as u32]));
        }
        let contexts: Vec<u32> = seqs.iter().map(|s| s.1 as u32).collect();
        let le = |v: &[u32]| bytes_of(v, |x| x.to_le_bytes().to_vec());
        let b16 = |v: &[f32]| bytes_of(v, |x| bf16::from_f32(x).to_le_bytes().to_vec());
        for (name, bytes) in [
            ("q.bf16", b16(&q)),
            ("k_cache.bf16", b16(&k)),
            ("v_cache.bf16", b16(&v)),
            ("query_start.u32", le(&starts)),
            ("context_lens.u32", le(&contexts)),
            ("block_tables.u32", le(&tables)),
            ("tiles.u32", le(&tiles)),
        ] {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        let scale = (head_dim as f32).powf(-0.5);
        let args = [head_dim, heads, kv_heads, block_size, max_blocks].map(|v| v.to_string());
        let output =
            Command::new(driver("prefill_check")).arg(&dir).args(args).arg(scale.to_string()).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let got = read_bf16(&dir.join("out.bf16"));
        let _ = std::fs::remove_dir_all(&dir);

        let mut want = vec![0f32; got.len()];
        for (s, &(n, ctx)) in seqs.iter().enumerate() {
            for i in 0..n {
                let row = starts[s] as usize + i;
                let pos = ctx - n + i;
                for h in 0..heads {
                    let g = h / (heads / kv_heads);
                    let at = |j: usize| {
                        let slot = tables[s * max_blocks + j / block_size] as usize * block_size + j % block_size;
                        (slot * kv_heads + g) * head_dim
                    };
                    let qh = &q[(row * heads + h) * head_dim..][..head_dim];
                    let scores: Vec<f64> = (0..=pos)
                        .map(|j| qh.iter().zip(&k[at(j)..][..head_dim]).map(|(a, b)| (a * b) as f64).sum::<f64>())
                        .map(|x| x * scale as f64)
                        .collect();
                    let top = scores.iter().copied().fold(f64::MIN, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|x| (x - top).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for d in 0..head_dim {
                        let val: f64 = (0..=pos).map(|j| weights[j] * v[at(j) + d] as f64).sum();
                        want[(row * heads + h) * head_dim + d] = (val / total) as f32;
                    }
                }
            }
        }
        let err = rel_err(&got, &want);
        eprintln!("prefill attention, head_dim {head_dim}: relative error {err:.5}");
        assert!(err < 1e-2, "head_dim {head_dim}: relative error {err}");
    }
}

/// quant.cu's gemv_bf16, the alternative to cuBLAS for bf16 weights' decode products:
/// 1, 3 and 8 tokens within 1e-2 of the CPU's product (bf16 outputs, f32 sums).
#[test]
fn bf16_gemv_matches_the_cpu_on_the_host_emulation() {
    let mut rng = rng();
    // Rows (and halves, for the fused MLP activation) not whole blocks of 4 warps,
    // columns not whole 256-wide warp strides.
    let (rows, cols) = (38usize, 584usize);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("emulation-bf16");
    std::fs::create_dir_all(&dir).unwrap();
    let round = |v: f32| bf16::from_f32(v).to_f32();
    let w: Vec<f32> = (0..rows * cols).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
    let x: Vec<f32> = (0..8 * cols).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
    let b16 = |v: &[f32]| bytes_of(v, |x| bf16::from_f32(x).to_le_bytes().to_vec());
    std::fs::write(dir.join("w.bin"), b16(&w)).unwrap();
    std::fs::write(dir.join("x.bf16"), b16(&x)).unwrap();
    let output = Command::new(driver("quant_check"))
        .arg(&dir)
        .args(["bf16", &rows.to_string(), &cols.to_string(), "1", "3", "8"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let cpu = CpuBackend::exact();
    let cw = cpu.upload_weight(HostWeight { rows, cols, data: WeightData::F32(w) }).unwrap();
    for tokens in [1, 3, 8] {
        let got = read_bf16(&dir.join(format!("out_{tokens}.bf16")));
        let want = cpu.linear(&x[..tokens * cols].to_vec(), tokens, &cw, None).unwrap();
        let err = rel_err(&got, &want);
        assert!(err < 1e-2, "{tokens} tokens: relative error {err}");
    }
    check_glu(Written { dir: &dir, format: "bf16", rows, cols, x: &x, cw: &cw, cpu: &cpu });
    let _ = std::fs::remove_dir_all(dir);
}
