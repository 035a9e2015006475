//! A Hugging Face model directory's weights: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. F32, F16 and BF16 tensors convert to f32; FP8 ones
//! (E4M3, E5M2) too, times their scales (`fp8`); a linear layer AWQ or GPTQ packed in
//! 4 bits (`int4`) reads as the `.weight` it stands for.

use super::fp8::{self, ScaleLayout};
use super::int4::{self, Packing};
use super::{HostTensor, LoadError, TensorSource};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tessera_kernels::WeightData;
use tessera_kernels::quant::Fp8Weight;

pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    /// Tensor name → index into `shards`.
    index: HashMap<String, usize>,
    /// Rows and columns of a `_scale_inv` block (FP8 checkpoints' `weight_block_size`).
    fp8_block: [usize; 2],
    /// compressed-tensors' block strategy: `_scale` per block of this many rows, columns.
    fp8_scale_block: Option<[usize; 2]>,
    /// How 4-bit layers are packed, and their group size; None unless the config says.
    int4: Option<(Packing, Option<usize>)>,
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let files = shard_files(dir)?;
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|e| LoadError::io(&path, e))?;
            // SAFETY: read-only private map; see GgufFile::open.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| LoadError::format(&path, e.to_string()))?;
            for name in st.names() {
                index.insert(name.to_string(), shards.len());
            }
            shards.push((path, map));
        }
        let quantization = quantization_config(dir)?;
        let fp8_block = fp8_block_size(dir, &quantization)?;
        let fp8_scale_block = compressed_tensors_block(dir, &quantization)?;
        let int4 = int4_packing(dir, &quantization)?;
        Ok(Self { dir: dir.into(), shards, index, fp8_block, fp8_scale_block, int4 })
    }

    /// `NAME.weight` stands for a 4-bit packed layer: its prefix and packing.
    fn packed<'n>(&self, name: &'n str) -> Option<(&'n str, Packing, Option<usize>)> {
        let prefix = name.strip_suffix(".weight")?;
        let (packing, group) = self.int4?;
        (!self.index.contains_key(name) && self.index.contains_key(&format!("{prefix}.qweight")))
            .then_some((prefix, packing, group))
    }

    /// A stored I32 tensor: its file, shape and values.
    fn ints(&self, name: &str) -> Result<(PathBuf, Vec<usize>, Vec<i32>), LoadError> {
        let (path, view) = self.view(name)?;
        if view.dtype() != Dtype::I32 {
            return Err(LoadError::UnsupportedTensorType {
                file: path.into(),
                tensor: name.into(),
                ty: format!("{:?} (4-bit packed layers store I32)", view.dtype()),
            });
        }
        let data = view.data().chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok((path.into(), view.shape().to_vec(), data))
    }

    /// A packed layer's tensors, their shapes checked against each other.
    fn packed_layer(&self, prefix: &str, group: Option<usize>) -> Result<PackedLayer, LoadError> {
        let qweight_name = format!("{prefix}.qweight");
        let (path, qweight_shape, qweight) = self.ints(&qweight_name)?;
        let packing = self.int4.map(|(p, _)| p).expect("packed layers exist only with a 4-bit config");
        let Some([n, k]) = packed_shape(&qweight_shape, packing) else {
            return Err(LoadError::BadTensor {
                file: path,
                tensor: qweight_name,
                detail: "a packed layer's qweight has two dimensions".into(),
            });
        };
        // GPTQ's group size -1: one group over all inputs.
        let group = group.unwrap_or(k).max(1);
        let groups = k.div_ceil(group);
        let (_, zeros_shape, qzeros) = self.ints(&format!("{prefix}.qzeros"))?;
        let (_, _, scales) = self.decode(&format!("{prefix}.scales"))?;
        for (what, got, want) in [("qzeros", &zeros_shape, [groups, n / 8]), ("scales", &scales.shape, [groups, n])] {
            if got.as_slice() != want {
                return Err(LoadError::BadTensor {
                    file: path,
                    tensor: format!("{prefix}.{what}"),
                    detail: format!("shape {got:?}, not the {want:?} of {k} inputs and {n} outputs"),
                });
            }
        }
        let g_idx_name = format!("{prefix}.g_idx");
        let g_idx = match self.index.contains_key(&g_idx_name) {
            true => Some(self.ints(&g_idx_name)?.2),
            false => None,
        };
        Ok(PackedLayer { path, qweight_name, packing, qweight, qzeros, scales: scales.data, g_idx, k, n, group })
    }

    /// An E4M3 matrix's bytes and scales, or None for any other tensor (E5M2 ones and
    /// FP8 without scales are read decoded).
    fn fp8_weight(&self, name: &str) -> Result<Option<Fp8Weight>, LoadError> {
        let (path, view) = self.view(name)?;
        let [rows, cols] = view.shape() else { return Ok(None) };
        if view.dtype() != Dtype::F8_E4M3 {
            return Ok(None);
        }
        let Some((scale_name, layout)) = self.fp8_scales(name) else { return Ok(None) };
        let (_, _, scale) = self.decode(&scale_name)?;
        let weight = fp8::weight(path, name, [*rows, *cols], view.data().to_vec(), &scale.shape, scale.data, layout)?;
        Ok(Some(weight))
    }

    /// The scales tensor of FP8 weight `name`, and how it divides the weight.
    fn fp8_scales(&self, name: &str) -> Option<(String, ScaleLayout)> {
        let scales = [
            (format!("{name}_scale"), self.fp8_scale_block.map_or(ScaleLayout::Exact, ScaleLayout::Blocks)),
            (format!("{name}_scale_inv"), ScaleLayout::Blocks(self.fp8_block)),
        ];
        scales.into_iter().find(|(n, _)| self.index.contains_key(n))
    }

    /// A tensor's stored values in f32, before any scales; its file and type.
    fn decode(&self, name: &str) -> Result<(PathBuf, Dtype, HostTensor), LoadError> {
        let (path, view) = self.view(name)?;
        let bytes = view.data();
        let data = match view.dtype() {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F8_E4M3 => bytes.iter().map(|&b| fp8::e4m3_to_f32(b)).collect(),
            Dtype::F8_E5M2 => bytes.iter().map(|&b| fp8::e5m2_to_f32(b)).collect(),
            other => {
                return Err(LoadError::UnsupportedTensorType {
                    file: path.into(),
                    tensor: name.into(),
                    ty: format!("{other:?}"),
                });
            }
        };
        Ok((path.into(), view.dtype(), HostTensor { shape: view.shape().to_vec(), data }))
    }

    fn view(&self, name: &str) -> Result<(&Path, safetensors::tensor::TensorView<'_>), LoadError> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor { file: self.dir.clone(), tensor: name.into() })?;
        let (path, map) = &self.shards[i];
        let st = SafeTensors::deserialize(map).map_err(|e| LoadError::format(path, e.to_string()))?;
        let view = st.tensor(name).map_err(|e| LoadError::BadTensor {
            file: path.clone(),
            tensor: name.into(),
            detail: e.to_string(),
        })?;
        Ok((path, view))
    }
}

/// The `[outputs, inputs]` of a packed layer whose `qweight` has this shape.
fn packed_shape(qweight: &[usize], packing: Packing) -> Option<[usize; 2]> {
    match (qweight, packing) {
        ([k, words], Packing::Awq) => Some([words.checked_mul(8)?, *k]),
        ([words, n], Packing::Gptq { .. }) => Some([*n, words.checked_mul(8)?]),
        _ => None,
    }
}

/// `config.json`'s `quantization_config`, if any.
fn quantization_config(dir: &Path) -> Result<serde_json::Value, LoadError> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(serde_json::Value::Null) };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| LoadError::format(&path, e.to_string()))?;
    Ok(json.get("quantization_config").cloned().unwrap_or_default())
}

/// `quantization_config.weight_block_size`, else 128 × 128.
fn fp8_block_size(dir: &Path, q: &serde_json::Value) -> Result<[usize; 2], LoadError> {
    match q.get("weight_block_size") {
        None | Some(serde_json::Value::Null) => Ok([128, 128]),
        Some(v) => match serde_json::from_value::<[usize; 2]>(v.clone()) {
            Ok([r, c]) if r > 0 && c > 0 => Ok([r, c]),
            _ => Err(LoadError::metadata(
                dir.join("config.json"),
                "quantization_config.weight_block_size",
                "not two positive integers",
            )),
        },
    }
}

/// The `block_structure` of a compressed-tensors config group whose weights use the
/// block strategy (llm-compressor's FP8_BLOCK), if any.
fn compressed_tensors_block(dir: &Path, q: &serde_json::Value) -> Result<Option<[usize; 2]>, LoadError> {
    let Some(groups) = q.get("config_groups").and_then(|g| g.as_object()) else { return Ok(None) };
    for weights in groups.values().filter_map(|g| g.get("weights")) {
        if weights.get("strategy").and_then(|s| s.as_str()) != Some("block") {
            continue;
        }
        return match weights.get("block_structure").map(|b| serde_json::from_value::<[usize; 2]>(b.clone())) {
            Some(Ok([r, c])) if r > 0 && c > 0 => Ok(Some([r, c])),
            _ => Err(LoadError::metadata(
                dir.join("config.json"),
                "quantization_config.config_groups.weights.block_structure",
                "a block strategy needs two positive integers",
            )),
        };
    }
    Ok(None)
}

/// AWQ ("gemm" packing) or GPTQ, 4 bits, and the group size (None: one group over all
/// inputs, GPTQ's -1); None for any other method. Other widths and packings are an error.
fn int4_packing(dir: &Path, q: &serde_json::Value) -> Result<Option<(Packing, Option<usize>)>, LoadError> {
    let path = dir.join("config.json");
    // HF's names, else AutoAWQ's own.
    let field = |key: &str, theirs: &str| q.get(key).or_else(|| q.get(theirs));
    let packing = match q.get("quant_method").and_then(|m| m.as_str()) {
        Some("awq") => {
            let version = q.get("version").and_then(|v| v.as_str()).unwrap_or("gemm");
            if !version.eq_ignore_ascii_case("gemm") {
                return Err(LoadError::metadata(
                    &path,
                    "quantization_config.version",
                    format!("AWQ {version:?}: only \"gemm\" packing is read"),
                ));
            }
            Packing::Awq
        }
        Some("gptq") => match q.get("checkpoint_format").and_then(|v| v.as_str()).unwrap_or("gptq") {
            "gptq" => Packing::Gptq { zero_minus_one: true },
            "gptq_v2" => Packing::Gptq { zero_minus_one: false },
            other => {
                return Err(LoadError::metadata(
                    &path,
                    "quantization_config.checkpoint_format",
                    format!("{other:?}: only \"gptq\" and \"gptq_v2\" packing is read"),
                ));
            }
        },
        _ => return Ok(None),
    };
    match field("bits", "w_bit").and_then(|b| b.as_u64()) {
        Some(4) => {}
        other => {
            return Err(LoadError::metadata(
                &path,
                "quantization_config.bits",
                format!("{other:?}: only 4-bit layers are read"),
            ));
        }
    }
    let group = match field("group_size", "q_group_size").and_then(|g| g.as_i64()) {
        Some(-1) => None,
        Some(g) if g > 0 => Some(g as usize),
        other => {
            return Err(LoadError::metadata(
                &path,
                "quantization_config.group_size",
                format!("{other:?} is not a group size"),
            ));
        }
    };
    Ok(Some((packing, group)))
}

/// The shard files: those the index names, or the single `model.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(|e| LoadError::io(&index_path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| LoadError::format(&index_path, e.to_string()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| LoadError::metadata(&index_path, "weight_map", "missing or not an object"))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for shard in map.values() {
            let name = shard
                .as_str()
                .ok_or_else(|| LoadError::metadata(&index_path, "weight_map", "a shard name is not a string"))?;
            let path = dir.join(name);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        Ok(vec![single])
    } else {
        Err(LoadError::format(dir, "no model.safetensors or model.safetensors.index.json"))
    }
}

impl TensorSource for SafetensorsDir {
    fn describe(&self) -> &Path {
        &self.dir
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        if let Some((prefix, packing, _)) = self.packed(name) {
            let (_, view) = self.view(&format!("{prefix}.qweight")).ok()?;
            return packed_shape(view.shape(), packing).map(Vec::from);
        }
        self.view(name).ok().map(|(_, v)| v.shape().to_vec())
    }

    fn load(&self, name: &str) -> Result<HostTensor, LoadError> {
        if let Some((prefix, _, group)) = self.packed(name) {
            let layer = self.packed_layer(prefix, group)?;
            let data = int4::dequantize(&layer.path, &layer.qweight_name, &layer.parts(), layer.packing)?;
            return Ok(HostTensor { shape: vec![layer.n, layer.k], data });
        }
        let (path, dtype, mut tensor) = self.decode(name)?;
        if matches!(dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2)
            && let Some((scale_name, layout)) = self.fp8_scales(name)
        {
            let (_, _, scale) = self.decode(&scale_name)?;
            fp8::apply_scales(&path, name, &tensor.shape, &mut tensor.data, &scale.shape, &scale.data, layout)?;
        }
        Ok(tensor)
    }

    fn quantised(&self, name: &str) -> Result<Option<WeightData>, LoadError> {
        if let Some((prefix, _, group)) = self.packed(name) {
            let layer = self.packed_layer(prefix, group)?;
            let repacked = int4::repack(&layer.path, &layer.qweight_name, &layer.parts(), layer.packing)?;
            return Ok(repacked.map(WeightData::Int4));
        }
        Ok(self.fp8_weight(name)?.map(WeightData::Fp8))
    }
}

/// A 4-bit packed layer's tensors, as read.
struct PackedLayer {
    path: PathBuf,
    qweight_name: String,
    packing: Packing,
    qweight: Vec<i32>,
    qzeros: Vec<i32>,
    scales: Vec<f32>,
    g_idx: Option<Vec<i32>>,
    k: usize,
    n: usize,
    group: usize,
}

impl PackedLayer {
    fn parts(&self) -> int4::Packed<'_> {
        int4::Packed {
            qweight: &self.qweight,
            qzeros: &self.qzeros,
            scales: &self.scales,
            g_idx: self.g_idx.as_deref(),
            inputs: self.k,
            outputs: self.n,
            group: self.group,
        }
    }
}
