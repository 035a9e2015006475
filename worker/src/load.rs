//! Opening a model on disk — a GGUF file or a Hugging Face directory — into the
//! decoder, its tokenizer and its chat template.

use crate::loader::TensorSource;
use crate::loader::gguf::GgufFile;
use crate::loader::safetensors_dir::SafetensorsDir;
use crate::model::{Model, ModelConfig, ModelError};
use crate::tokenizer::ModelTokenizer;
use crate::vision::names::{DecoderSource, Names};
use crate::vision::{VisionConfig, VisionModel};
use std::path::Path;
use tessera_kernels::Backend;

pub struct LoadedModel<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: ModelTokenizer,
    /// The vision encoder of a vision-language model directory.
    pub vision: Option<VisionModel<B>>,
}

pub fn load_model<B: Backend>(backend: B, path: &Path) -> Result<LoadedModel<B>, ModelError> {
    let (config, tokenizer, source) = open(path)?;
    let vision = open_vision(&backend, path, config.hidden_size)?;
    Ok(LoadedModel { model: Model::load(backend, config, &*source)?, tokenizer, vision })
}

/// The vision encoder of the model at `path` on `backend`, or None for a text-only
/// model; `hidden` is its decoder's width.
pub fn open_vision<B: Backend>(backend: &B, path: &Path, hidden: usize) -> Result<Option<VisionModel<B>>, ModelError> {
    if !path.is_dir() {
        return Ok(None);
    }
    let Some(config) = VisionConfig::read(path)? else { return Ok(None) };
    let source = SafetensorsDir::open(path)?;
    let names = Names::find(&source)?;
    Ok(Some(VisionModel::load(backend, config, &source, &names, hidden)?))
}

/// A model on disk, opened but not loaded: its shape, its tokenizer, and its tensors to
/// read (wholly, or one tensor-parallel shard at a time).
pub fn open(path: &Path) -> Result<(ModelConfig, ModelTokenizer, Box<dyn TensorSource>), ModelError> {
    if path.is_dir() {
        let config = ModelConfig::from_hf_config(&path.join("config.json"))?;
        let tokenizer = ModelTokenizer::from_hf_dir(path)?;
        let source = SafetensorsDir::open(path)?;
        // A vision-language model's decoder sits under a prefix of its own.
        if VisionConfig::read(path)?.is_some() {
            let names = Names::find(&source)?;
            return Ok((config, tokenizer, Box::new(DecoderSource::new(Box::new(source), names))));
        }
        Ok((config, tokenizer, Box::new(source)))
    } else {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let tokenizer = ModelTokenizer::from_gguf(&file)?;
        Ok((config, tokenizer, Box::new(file)))
    }
}
