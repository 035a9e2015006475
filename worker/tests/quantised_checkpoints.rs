//! Quantised checkpoints as the model hub stores them, written here for a tiny model
//! after each format's own description (`loader::fp8`, `loader::int4`):
//!
//! - FP8: E4M3 projections beside `_scale` tensors (one per tensor, or one per row) or
//!   `_scale_inv` ones (one per block of `quantization_config.weight_block_size`);
//! - AWQ and GPTQ: 4-bit projections packed eight a word with zero points and f16
//!   scales per group of 16 inputs (GPTQ's groups permuted by `g_idx`, its zeros stored
//!   less one), and GPTQ v2 with one group over all inputs.
//!
//! Each loads with exactly the weights of its f32 twin (stored values decoded, times
//! their scales), so both give the same logits bit for bit; pieces that do not fit each
//! other are a load error naming the tensor.

mod tiny_models;

use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use std::path::Path;
use tessera_kernels::cpu::CpuBackend;
use tessera_kernels::{HostWeight, WeightData};
use tessera_worker::loader::TensorSource;
use tessera_worker::loader::fp8::e4m3_to_f32;
use tessera_worker::loader::safetensors_dir::SafetensorsDir;
use tessera_worker::model::{Model, ModelConfig};
use tiny_models::{Weights, prefill_then_decode, random_weights, seeded_rng, temp_root, variants, write_dir};

/// The model in `dir` on the CPU's exact path.
fn load(dir: &Path) -> Model<CpuBackend> {
    let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
    Model::load(CpuBackend::exact(), config, &SafetensorsDir::open(dir).unwrap()).unwrap()
}

/// The E4M3 byte nearest to `x` (every finite byte tried; |x| ≤ 448 here).
fn nearest_e4m3(x: f32) -> u8 {
    (0u8..=255)
        .filter(|&b| e4m3_to_f32(b).is_finite())
        .min_by(|&a, &b| (e4m3_to_f32(a) - x).abs().total_cmp(&(e4m3_to_f32(b) - x).abs()))
        .unwrap()
}

/// How one matrix is scaled in the checkpoint.
#[derive(Clone, Copy)]
enum Scales {
    Tensor,
    Row,
    /// `_scale_inv` per block of `weight_block_size`.
    Blocks(usize, usize),
    /// `_scale` per block of a compressed-tensors `block_structure`.
    ScaleBlocks(usize, usize),
}

/// One stored tensor: name, type, shape, bytes.
type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

/// `data` (rows × cols) in E4M3 with scales laid out as `how`: the stored tensors, and
/// the f32 values a reader must get back (byte decoded, times its scale).
fn quantise(name: &str, rows: usize, cols: usize, data: &[f32], how: Scales) -> (Vec<Stored>, Vec<f32>) {
    let (block_rows, block_cols, scale_name) = match how {
        Scales::Tensor => (rows, cols, format!("{name}_scale")),
        Scales::Row => (1, cols, format!("{name}_scale")),
        Scales::Blocks(r, c) => (r, c, format!("{name}_scale_inv")),
        Scales::ScaleBlocks(r, c) => (r, c, format!("{name}_scale")),
    };
    let (scale_rows, scale_cols) = (rows.div_ceil(block_rows), cols.div_ceil(block_cols));
    let mut scales = vec![0f32; scale_rows * scale_cols];
    for (i, v) in data.iter().enumerate() {
        let s = &mut scales[i / cols / block_rows * scale_cols + i % cols / block_cols];
        *s = s.max(v.abs() / 448.0);
    }
    let scale_of = |i: usize| scales[i / cols / block_rows * scale_cols + i % cols / block_cols];
    let bytes: Vec<u8> = data.iter().enumerate().map(|(i, v)| nearest_e4m3(v / scale_of(i))).collect();
    let values = bytes.iter().enumerate().map(|(i, &b)| e4m3_to_f32(b) * scale_of(i)).collect();
    let scale_shape = match how {
        Scales::Tensor => vec![],
        Scales::Row => vec![rows, 1],
        Scales::Blocks(..) | Scales::ScaleBlocks(..) => vec![scale_rows, scale_cols],
    };
    let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    let stored = vec![
        (name.to_string(), Dtype::F8_E4M3, vec![rows, cols], bytes),
        (scale_name, Dtype::F32, scale_shape, scale_bytes),
    ];
    (stored, values)
}

/// Writes `weights` as an FP8 checkpoint (projections in E4M3, scales cycling through
/// `layouts`, the rest f32) into `dir`; returns the f32 twin's weights.
fn write_fp8(dir: &Path, config: &Value, weights: &Weights, layouts: &[Scales]) -> Weights {
    let mut twin = Weights::new();
    let mut stored: Vec<Stored> = Vec::new();
    let mut next = 0;
    for (name, (shape, data)) in weights {
        if let ([rows, cols], true) = (shape.as_slice(), name.ends_with("proj.weight")) {
            let (tensors, values) = quantise(name, *rows, *cols, data, layouts[next % layouts.len()]);
            next += 1;
            stored.extend(tensors);
            twin.insert(name.clone(), (shape.clone(), values));
        } else {
            stored.push((name.clone(), Dtype::F32, shape.clone(), data.iter().flat_map(|v| v.to_le_bytes()).collect()));
            twin.insert(name.clone(), (shape.clone(), data.clone()));
        }
    }
    assert!(next >= layouts.len(), "every layout used");
    std::fs::create_dir_all(dir).unwrap();
    let mut config = config.clone();
    config["quantization_config"] = match layouts {
        [Scales::ScaleBlocks(r, c)] => json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [r, c]}}}}),
        _ => json!({"quant_method": "fp8", "weight_block_size": [16, 20]}),
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views = stored.iter().map(|(n, t, s, b)| (n.clone(), TensorView::new(*t, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    twin
}

/// The packing of a 4-bit checkpoint.
#[derive(Clone, Copy, PartialEq)]
enum Int4 {
    Awq,
    /// Groups of 16 in activation order (`g_idx`), zeros stored less one.
    Gptq,
    /// One group over all inputs (`group_size` -1), zeros stored as they are.
    GptqV2,
}

const GROUP: usize = 16;
const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

fn words(values: impl Iterator<Item = i32>) -> Vec<u8> {
    values.flat_map(|v| v.to_le_bytes()).collect()
}

/// `w` (`n` outputs × `k` inputs) in 4 bits, asymmetric per group of inputs: the stored
/// tensors and the values a reader must get back.
fn pack4(name: &str, n: usize, k: usize, w: &[f32], how: Int4) -> (Vec<Stored>, Vec<f32>) {
    let prefix = name.strip_suffix(".weight").unwrap();
    let group = if how == Int4::GptqV2 { k } else { GROUP };
    let groups = k / group;
    // GPTQ with activation order: input row r in group g_idx[r], a permutation's.
    let g_idx: Vec<usize> = match how {
        Int4::Awq | Int4::GptqV2 => (0..k).map(|r| r / group).collect(),
        Int4::Gptq => (0..k).map(|r| (r * 7 + 3) % k / group).collect(),
    };
    let (mut lo, mut hi) = (vec![f32::MAX; groups * n], vec![f32::MIN; groups * n]);
    for o in 0..n {
        for r in 0..k {
            let i = g_idx[r] * n + o;
            (lo[i], hi[i]) = (lo[i].min(w[o * k + r]), hi[i].max(w[o * k + r]));
        }
    }
    let scales: Vec<half::f16> = lo.iter().zip(&hi).map(|(l, h)| half::f16::from_f32((h - l) / 15.0)).collect();
    // Zeros 1..=15: GPTQ's original format stores each less one in four bits.
    let zeros: Vec<i32> =
        lo.iter().zip(&scales).map(|(l, s)| ((-l / s.to_f32()).round() as i32).clamp(1, 15)).collect();
    let q: Vec<i32> = (0..k * n)
        .map(|i| {
            let (r, o) = (i / n, i % n);
            let g = g_idx[r] * n + o;
            ((w[o * k + r] / scales[g].to_f32()).round() as i32 + zeros[g]).clamp(0, 15)
        })
        .collect(); // [k, n]
    let mut values = vec![0f32; n * k];
    for r in 0..k {
        for o in 0..n {
            let g = g_idx[r] * n + o;
            values[o * k + r] = (q[r * n + o] - zeros[g]) as f32 * scales[g].to_f32();
        }
    }
    let pack = |nibbles: &mut dyn Iterator<Item = i32>| -> i32 {
        (0..8).fold(0u32, |word, i| word | ((nibbles.next().unwrap() as u32 & 0xf) << (4 * i))) as i32
    };
    let (qweight, qweight_shape): (Vec<i32>, _) = match how {
        Int4::Awq => (
            (0..k * n / 8)
                .map(|w| pack(&mut AWQ_ORDER.iter().map(|&j| q[w / (n / 8) * n + w % (n / 8) * 8 + j])))
                .collect(),
            vec![k, n / 8],
        ),
        Int4::Gptq | Int4::GptqV2 => (
            (0..k * n / 8).map(|w| pack(&mut (0..8).map(|i| q[(8 * (w / n) + i) * n + w % n]))).collect(),
            vec![k / 8, n],
        ),
    };
    let zero_of = |g: usize, c: usize, j: usize| zeros[g * n + c * 8 + j] - i32::from(how == Int4::Gptq);
    let qzeros = (0..groups * n / 8).map(|w| {
        let (g, c) = (w / (n / 8), w % (n / 8));
        match how {
            Int4::Awq => pack(&mut AWQ_ORDER.iter().map(|&j| zero_of(g, c, j))),
            Int4::Gptq | Int4::GptqV2 => pack(&mut (0..8).map(|j| zero_of(g, c, j))),
        }
    });
    let mut stored = vec![
        (format!("{prefix}.qweight"), Dtype::I32, qweight_shape, words(qweight.into_iter())),
        (format!("{prefix}.qzeros"), Dtype::I32, vec![groups, n / 8], words(qzeros)),
        (
            format!("{prefix}.scales"),
            Dtype::F16,
            vec![groups, n],
            scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
        ),
    ];
    if how == Int4::Gptq {
        stored.push((format!("{prefix}.g_idx"), Dtype::I32, vec![k], words(g_idx.iter().map(|&g| g as i32))));
    }
    (stored, values)
}

/// Writes `weights` as an AWQ or GPTQ checkpoint into `dir`; returns the f32 twin's.
fn write_int4(dir: &Path, config: &Value, weights: &Weights, how: Int4) -> Weights {
    let mut twin = Weights::new();
    let mut stored: Vec<Stored> = Vec::new();
    for (name, (shape, data)) in weights {
        if let ([n, k], true) = (shape.as_slice(), name.ends_with("proj.weight")) {
            let (tensors, values) = pack4(name, *n, *k, data, how);
            stored.extend(tensors);
            twin.insert(name.clone(), (shape.clone(), values));
        } else {
            stored.push((name.clone(), Dtype::F32, shape.clone(), data.iter().flat_map(|v| v.to_le_bytes()).collect()));
            twin.insert(name.clone(), (shape.clone(), data.clone()));
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    let mut config = config.clone();
    config["quantization_config"] = match how {
        Int4::Awq => {
            json!({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": true, "version": "gemm"})
        }
        Int4::Gptq => json!({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": true, "sym": false,
            "checkpoint_format": "gptq"}),
        Int4::GptqV2 => json!({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": false, "sym": false,
            "checkpoint_format": "gptq_v2"}),
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views = stored.iter().map(|(n, t, s, b)| (n.clone(), TensorView::new(*t, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    twin
}

/// Sets `quantization_config.KEY` in the `config.json` of `dir`.
fn set_quantization(dir: &Path, key: &str, value: Value) {
    let mut config: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config["quantization_config"][key] = value;
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

#[test]
fn awq_and_gptq_checkpoints_load_as_their_dequantised_values() {
    let v = &variants()[0];
    let weights = random_weights(&v.config, &mut seeded_rng());
    let root = temp_root("int4");
    let prompt: Vec<u32> = (0..12).map(|i| (i * 5 % 64) as u32).collect();
    for (how, label) in [(Int4::Awq, "awq"), (Int4::Gptq, "gptq"), (Int4::GptqV2, "gptq-v2")] {
        let twin = write_int4(&root.join(label), &v.config, &weights, how);
        write_dir(&root.join(format!("{label}-f32")), &v.config, &twin);
        assert!(twin.iter().any(|(n, (_, d))| d != &weights[n].1), "{label}: the rounding is real");
        let (packed, f32) = (load(&root.join(label)), load(&root.join(format!("{label}-f32"))));
        let want = prefill_then_decode(&f32, &prompt, 8, 16);
        assert_eq!(prefill_then_decode(&packed, &prompt, 8, 16), want, "{label}");
    }
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn an_fp8_checkpoint_loads_as_its_scaled_values() {
    let v = &variants()[0];
    let mut rng = seeded_rng();
    let weights = random_weights(&v.config, &mut rng);
    let root = temp_root("fp8");
    let prompt: Vec<u32> = (0..12).map(|i| (i * 5 % 64) as u32).collect();
    // Per tensor, per row and DeepSeek's `_scale_inv` blocks in one checkpoint; then
    // compressed-tensors' `_scale` blocks (20 × 20 over rows of 32 and 48: partial ones).
    let schemes: [&[Scales]; 2] =
        [&[Scales::Tensor, Scales::Row, Scales::Blocks(16, 20)], &[Scales::ScaleBlocks(20, 20)]];
    for (i, layouts) in schemes.into_iter().enumerate() {
        let (dir, twin_dir) = (root.join(format!("fp8-{i}")), root.join(format!("f32-{i}")));
        let twin = write_fp8(&dir, &v.config, &weights, layouts);
        write_dir(&twin_dir, &v.config, &twin);
        // The rounding is real: the twin differs from the random weights it came from.
        assert!(twin.iter().any(|(n, (_, d))| d != &weights[n].1));
        let (fp8, f32) = (load(&dir), load(&twin_dir));
        assert_eq!(prefill_then_decode(&fp8, &prompt, 8, 16), prefill_then_decode(&f32, &prompt, 8, 16), "scheme {i}");
    }
    let _ = std::fs::remove_dir_all(root);
}

/// The loader hands FP8 and 4-bit projections to the backend as they are stored (bytes
/// and scales; 4-bit rows of outputs), which decode to exactly the twin's values. GPTQ
/// with activation order permutes its groups and is read decoded.
#[test]
fn quantised_projections_reach_the_backend_in_their_own_form() {
    let v = &variants()[0];
    let weights = random_weights(&v.config, &mut seeded_rng());
    let root = temp_root("kept");
    let dirs = [("fp8", Some("fp8")), ("awq", Some("int4")), ("gptq", None), ("gptq-v2", Some("int4"))];
    let fp8 = write_fp8(&root.join("fp8"), &v.config, &weights, &[Scales::Tensor, Scales::Row, Scales::Blocks(16, 20)]);
    let mut twins = vec![fp8];
    for (how, label) in [(Int4::Awq, "awq"), (Int4::Gptq, "gptq"), (Int4::GptqV2, "gptq-v2")] {
        twins.push(write_int4(&root.join(label), &v.config, &weights, how));
    }
    for ((label, form), twin) in dirs.into_iter().zip(twins) {
        let source = SafetensorsDir::open(&root.join(label)).unwrap();
        let mut projections = 0;
        for (name, (shape, values)) in twin.iter().filter(|(n, _)| n.ends_with("proj.weight")) {
            let kept = source.quantised(name).unwrap();
            let got = match (&kept, form) {
                (Some(WeightData::Fp8(_)), Some("fp8")) | (Some(WeightData::Int4(_)), Some("int4")) => kept.unwrap(),
                (None, None) => continue,
                _ => panic!("{label} {name}: {kept:?}"),
            };
            let w = HostWeight { rows: shape[0], cols: shape[1], data: got };
            let decoded = w.into_f32();
            assert!(decoded.iter().zip(values).all(|(a, b)| a.to_bits() == b.to_bits()), "{label} {name}");
            projections += 1;
        }
        assert!(form.is_none() || projections >= 7, "{label}: {projections} projections kept");
    }
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn fp8_scales_that_do_not_fit_their_tensor_are_an_error_naming_it() {
    let v = &variants()[0];
    let weights = random_weights(&v.config, &mut seeded_rng());
    let root = temp_root("fp8-bad");
    let dir = root.join("fp8");
    write_fp8(&dir, &v.config, &weights, &[Scales::Tensor, Scales::Row, Scales::Blocks(16, 20)]);
    // The block size the scales were cut for, replaced by one they do not fit.
    set_quantization(&dir, "weight_block_size", json!([16, 7]));
    let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
    let source = SafetensorsDir::open(&dir).unwrap();
    let err = Model::load(CpuBackend::exact(), config, &source).err().expect("a load error").to_string();
    assert!(err.contains("proj.weight") && err.contains("scales of shape"), "{err}");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn other_widths_and_packings_are_refused_by_name() {
    let v = &variants()[0];
    let weights = random_weights(&v.config, &mut seeded_rng());
    let root = temp_root("int4-refused");
    let dir = root.join("awq");
    write_int4(&dir, &v.config, &weights, Int4::Awq);
    for (key, value, said) in [("bits", json!(8), "only 4-bit"), ("version", json!("gemv"), "only \"gemm\"")] {
        set_quantization(&dir, key, value);
        let err = SafetensorsDir::open(&dir).err().expect("refused").to_string();
        assert!(err.contains(said) && err.contains(key), "{err}");
        write_int4(&dir, &v.config, &weights, Int4::Awq);
    }
    let _ = std::fs::remove_dir_all(root);
}
