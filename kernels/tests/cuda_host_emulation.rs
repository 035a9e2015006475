//! `kernels/cuda/quant.cu`'s kernels for packed weights, run on the host under g++
//! (`kernels/cuda/emulation`: each CUDA thread an OS thread, warps exchanging values
//! between barriers) and judged against the CPU backend, so that where no GPU is (CI)
//! their decoding, indexing and tensor-core fragment layouts are still checked on every
//! build. The emulation is a test double for the GPU; `kernels/src/cuda/tests.rs` checks
//! the same kernels on a device.
//!
//! Every format: each row's units decoded bit for bit as the host decodes them, products
//! of 1, 3 and 8 tokens (the decode kernel) and 9 and 70 (the tiled tensor-core one, over
//! partial tiles) within 1e-2 of the CPU's exact product (bf16 activations and outputs,
//! as `cuda/tests.rs` bounds them), the same products written among a wider output's
//! rows (a part of a stacked weight), and embedding rows equal to the decoded ones
//! rounded to bf16.

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tessera_kernels::cpu::CpuBackend;
use tessera_kernels::quant::{Fp8Weight, GgmlType, Int4Weight, random_blocks};
use tessera_kernels::{Backend, HostWeight, WeightData};

const TOKENS: [usize; 5] = [1, 3, 8, 9, 70];

/// The emulation's driver, compiled once per test run.
fn driver() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda/emulation/quant_check.cpp");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("quant_check");
        let flags = ["-std=c++20", "-O1", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"];
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

    let output = Command::new(driver())
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

    let cw = cpu.upload_weight(weight).unwrap();
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
    let rows_of: Vec<f32> = ids
        .iter()
        .flat_map(|&i| want[i as usize * cols..][..cols].iter().map(|&v| bf16::from_f32(v).to_f32()))
        .collect();
    assert_eq!(read_bf16(&dir.join("emb.bf16")), rows_of, "{format}: embedding rows");
    let _ = std::fs::remove_dir_all(dir);
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
