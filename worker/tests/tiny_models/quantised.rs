//! Quantised checkpoints as the model hub stores them, written for a tiny model after
//! each format's own description (`loader::fp8`, `loader::int4`), with the f32 twin a
//! reader must get back: FP8 projections beside `_scale` or `_scale_inv` tensors, and
//! AWQ or GPTQ 4-bit ones.

use super::Weights;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use std::path::Path;
use tessera_worker::loader::fp8::e4m3_to_f32;

/// The E4M3 byte nearest to `x` (every finite byte tried; |x| ≤ 448 here).
pub fn nearest_e4m3(x: f32) -> u8 {
    (0u8..=255)
        .filter(|&b| e4m3_to_f32(b).is_finite())
        .min_by(|&a, &b| (e4m3_to_f32(a) - x).abs().total_cmp(&(e4m3_to_f32(b) - x).abs()))
        .unwrap()
}

/// How one matrix is scaled in the checkpoint.
#[derive(Clone, Copy)]
pub enum Scales {
    Tensor,
    Row,
    /// `_scale_inv` per block of `weight_block_size`.
    Blocks(usize, usize),
    /// `_scale` per block of a compressed-tensors `block_structure`.
    ScaleBlocks(usize, usize),
}

/// One stored tensor: name, type, shape, bytes.
pub type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

/// `data` (rows × cols) in E4M3 with scales laid out as `how`: the stored tensors, and
/// the f32 values a reader must get back (byte decoded, times its scale).
pub fn quantise(name: &str, rows: usize, cols: usize, data: &[f32], how: Scales) -> (Vec<Stored>, Vec<f32>) {
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
pub fn write_fp8(dir: &Path, config: &Value, weights: &Weights, layouts: &[Scales]) -> Weights {
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
        _ => {
            let block = layouts.iter().find_map(|l| match *l {
                Scales::Blocks(r, c) => Some([r, c]),
                _ => None,
            });
            json!({"quant_method": "fp8", "weight_block_size": block.unwrap_or([128, 128])})
        }
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views = stored.iter().map(|(n, t, s, b)| (n.clone(), TensorView::new(*t, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    twin
}

/// The packing of a 4-bit checkpoint.
#[derive(Clone, Copy, PartialEq)]
pub enum Int4 {
    Awq,
    /// Groups in activation order (`g_idx`), zeros stored less one.
    Gptq,
    /// One group over all inputs (`group_size` -1), zeros stored as they are.
    GptqV2,
}

const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

pub fn words(values: impl Iterator<Item = i32>) -> Vec<u8> {
    values.flat_map(|v| v.to_le_bytes()).collect()
}

/// `w` (`n` outputs × `k` inputs) in 4 bits, asymmetric per group of `group` inputs
/// (all of them for GPTQ v2): the stored tensors and the values a reader must get back.
pub fn pack4(name: &str, n: usize, k: usize, w: &[f32], how: Int4, group: usize) -> (Vec<Stored>, Vec<f32>) {
    let prefix = name.strip_suffix(".weight").unwrap();
    let group = if how == Int4::GptqV2 { k } else { group };
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

/// Writes `weights` as an AWQ or GPTQ checkpoint (groups of `group` inputs) into `dir`;
/// returns the f32 twin's.
pub fn write_int4(dir: &Path, config: &Value, weights: &Weights, how: Int4, group: usize) -> Weights {
    let mut twin = Weights::new();
    let mut stored: Vec<Stored> = Vec::new();
    for (name, (shape, data)) in weights {
        if let ([n, k], true) = (shape.as_slice(), name.ends_with("proj.weight")) {
            let (tensors, values) = pack4(name, *n, *k, data, how, group);
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
            json!({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": true, "version": "gemm"})
        }
        Int4::Gptq => json!({"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": true, "sym": false,
            "checkpoint_format": "gptq"}),
        Int4::GptqV2 => json!({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": false, "sym": false,
            "checkpoint_format": "gptq_v2"}),
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let views = stored.iter().map(|(n, t, s, b)| (n.clone(), TensorView::new(*t, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    twin
}
