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

use serde_json::{Value, json};
use std::path::Path;
use tessera_kernels::cpu::CpuBackend;
use tessera_kernels::{HostWeight, WeightData};
use tessera_worker::loader::TensorSource;
use tessera_worker::loader::safetensors_dir::SafetensorsDir;
use tessera_worker::model::{Model, ModelConfig};
use tiny_models::quantised::{Int4, Scales, write_fp8, write_int4};
use tiny_models::{prefill_then_decode, random_weights, seeded_rng, temp_root, variants, write_dir};

/// Inputs per 4-bit group.
const GROUP: usize = 16;

/// The model in `dir` on the CPU's exact path.
fn load(dir: &Path) -> Model<CpuBackend> {
    let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
    Model::load(CpuBackend::exact(), config, &SafetensorsDir::open(dir).unwrap()).unwrap()
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
        let twin = write_int4(&root.join(label), &v.config, &weights, how, GROUP);
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
        twins.push(write_int4(&root.join(label), &v.config, &weights, how, GROUP));
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
    write_int4(&dir, &v.config, &weights, Int4::Awq, GROUP);
    for (key, value, said) in [("bits", json!(8), "only 4-bit"), ("version", json!("gemv"), "only \"gemm\"")] {
        set_quantization(&dir, key, value);
        let err = SafetensorsDir::open(&dir).err().expect("refused").to_string();
        assert!(err.contains(said) && err.contains(key), "{err}");
        write_int4(&dir, &v.config, &weights, Int4::Awq, GROUP);
    }
    let _ = std::fs::remove_dir_all(root);
}
