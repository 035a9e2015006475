//! A Hugging Face model directory's weights: `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. F32, F16 and BF16 tensors convert to f32; FP8 ones
//! (E4M3, E5M2) too, times their scales (`fp8`).

use super::fp8::{self, ScaleLayout};
use super::{HostTensor, LoadError, TensorSource};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    /// Tensor name → index into `shards`.
    index: HashMap<String, usize>,
    /// Rows and columns of a `_scale_inv` block (FP8 checkpoints' `weight_block_size`).
    fp8_block: [usize; 2],
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
        Ok(Self { dir: dir.into(), shards, index, fp8_block: fp8_block_size(dir)? })
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

/// `quantization_config.weight_block_size` of the directory's `config.json`, else 128 × 128.
fn fp8_block_size(dir: &Path) -> Result<[usize; 2], LoadError> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok([128, 128]) };
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| LoadError::format(&path, e.to_string()))?;
    match json.pointer("/quantization_config/weight_block_size") {
        None | Some(serde_json::Value::Null) => Ok([128, 128]),
        Some(v) => match serde_json::from_value::<[usize; 2]>(v.clone()) {
            Ok([r, c]) if r > 0 && c > 0 => Ok([r, c]),
            _ => Err(LoadError::metadata(&path, "quantization_config.weight_block_size", "not two positive integers")),
        },
    }
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
        self.view(name).ok().map(|(_, v)| v.shape().to_vec())
    }

    fn load(&self, name: &str) -> Result<HostTensor, LoadError> {
        let (path, dtype, mut tensor) = self.decode(name)?;
        if matches!(dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2) {
            let scales = [
                (format!("{name}_scale"), ScaleLayout::Exact),
                (format!("{name}_scale_inv"), ScaleLayout::Blocks(self.fp8_block)),
            ];
            if let Some((scale_name, layout)) = scales.into_iter().find(|(n, _)| self.index.contains_key(n)) {
                let (_, _, scale) = self.decode(&scale_name)?;
                fp8::apply_scales(&path, name, &tensor.shape, &mut tensor.data, &scale.shape, &scale.data, layout)?;
            }
        }
        Ok(tensor)
    }
}
