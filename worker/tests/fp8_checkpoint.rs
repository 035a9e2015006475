//! FP8 checkpoints as the model hub stores them: E4M3 projections beside `_scale`
//! tensors (one per tensor, or one per row) or `_scale_inv` ones (one per block of
//! `quantization_config.weight_block_size`). A tiny model written that way loads with
//! exactly the weights of its f32 twin (each byte decoded, times its scale), so both give
//! the same logits bit for bit; scales that do not fit their tensor are a load error
//! naming it.

mod tiny_models;

use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use std::path::Path;
use tessera_kernels::cpu::CpuBackend;
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
    Blocks(usize, usize),
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
        Scales::Blocks(..) => vec![scale_rows, scale_cols],
    };
    let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    let stored = vec![
        (name.to_string(), Dtype::F8_E4M3, vec![rows, cols], bytes),
        (scale_name, Dtype::F32, scale_shape, scale_bytes),
    ];
    (stored, values)
}

/// Writes `weights` as an FP8 checkpoint (projections in E4M3, scales cycling through
/// the three layouts, the rest f32) into `dir`; returns the f32 twin's weights.
fn write_fp8(dir: &Path, config: &Value, weights: &Weights) -> Weights {
    let mut twin = Weights::new();
    let mut stored: Vec<Stored> = Vec::new();
    let layouts = [Scales::Tensor, Scales::Row, Scales::Blocks(16, 20)];
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
    assert!(next >= 3, "every layout used");
    std::fs::create_dir_all(dir).unwrap();
    let mut config = config.clone();
    config["quantization_config"] = json!({"quant_method": "fp8", "weight_block_size": [16, 20]});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views = stored.iter().map(|(n, t, s, b)| (n.clone(), TensorView::new(*t, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    twin
}

#[test]
fn an_fp8_checkpoint_loads_as_its_scaled_values() {
    let v = &variants()[0];
    let mut rng = seeded_rng();
    let weights = random_weights(&v.config, &mut rng);
    let root = temp_root("fp8");
    let twin = write_fp8(&root.join("fp8"), &v.config, &weights);
    write_dir(&root.join("f32"), &v.config, &twin);
    // The rounding is real: the twin differs from the random weights it came from.
    assert!(twin.iter().any(|(n, (_, d))| d != &weights[n].1));

    let (fp8, f32) = (load(&root.join("fp8")), load(&root.join("f32")));
    let prompt: Vec<u32> = (0..12).map(|i| (i * 5 % 64) as u32).collect();
    assert_eq!(prefill_then_decode(&fp8, &prompt, 8, 16), prefill_then_decode(&f32, &prompt, 8, 16));
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn fp8_scales_that_do_not_fit_their_tensor_are_an_error_naming_it() {
    let v = &variants()[0];
    let weights = random_weights(&v.config, &mut seeded_rng());
    let root = temp_root("fp8-bad");
    let dir = root.join("fp8");
    write_fp8(&dir, &v.config, &weights);
    // The block size the scales were cut for, replaced by one they do not fit.
    let mut config: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    config["quantization_config"]["weight_block_size"] = json!([16, 7]);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
    let source = SafetensorsDir::open(&dir).unwrap();
    let err = Model::load(CpuBackend::exact(), config, &source).err().expect("a load error").to_string();
    assert!(err.contains("proj.weight") && err.contains("scales of shape"), "{err}");
    let _ = std::fs::remove_dir_all(root);
}
