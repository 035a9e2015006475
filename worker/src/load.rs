//! Opening a model on disk — a GGUF file or a Hugging Face directory — into the
//! decoder, its tokenizer and its chat template.

use crate::loader::TensorSource;
use crate::loader::gguf::GgufFile;
use crate::loader::safetensors_dir::SafetensorsDir;
use crate::model::{Model, ModelConfig, ModelError};
use crate::tokenizer::ModelTokenizer;
use std::path::Path;
use tessera_kernels::Backend;

pub struct LoadedModel<B: Backend> {
    pub model: Model<B>,
    pub tokenizer: ModelTokenizer,
}

pub fn load_model<B: Backend>(backend: B, path: &Path) -> Result<LoadedModel<B>, ModelError> {
    let (config, tokenizer, source) = open(path)?;
    Ok(LoadedModel { model: Model::load(backend, config, &*source)?, tokenizer })
}

/// A model on disk, opened but not loaded: its shape, its tokenizer, and its tensors to
/// read (wholly, or one tensor-parallel shard at a time).
pub fn open(path: &Path) -> Result<(ModelConfig, ModelTokenizer, Box<dyn TensorSource>), ModelError> {
    if path.is_dir() {
        let config = ModelConfig::from_hf_config(&path.join("config.json"))?;
        let tokenizer = ModelTokenizer::from_hf_dir(path)?;
        Ok((config, tokenizer, Box::new(SafetensorsDir::open(path)?)))
    } else {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let tokenizer = ModelTokenizer::from_gguf(&file)?;
        Ok((config, tokenizer, Box::new(file)))
    }
}
