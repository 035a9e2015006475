//! Where a vision-language checkpoint keeps its parts. The same model is saved under
//! different prefixes by different transformers releases (llava-hf's hub files say
//! `language_model.model.*` and `vision_tower.vision_model.*`, transformers 5 writes
//! `vision_tower.*`, its modules are `model.language_model.*`), so each part's prefix is
//! found by probing for a tensor it must have.

use crate::loader::{HostTensor, LoadError, TensorSource};
use std::path::Path;

/// The prefixes of one checkpoint's parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// Before `embeddings.patch_embedding.weight`.
    pub tower: String,
    /// Before the connector's own names (`proj.weight`, `linear_1.weight`).
    pub connector: String,
    /// LLaVA-NeXT's newline vector, where there is one.
    pub newline: Option<String>,
    /// Stands where a llama checkpoint says `model.`.
    pub decoder: String,
    /// The untied output head.
    pub lm_head: String,
}

impl Names {
    pub fn find(source: &dyn TensorSource) -> Result<Self, LoadError> {
        let has = |name: &str| source.shape(name).is_some();
        let first = |candidates: &[&str], probe: &str, part: &str| -> Result<String, LoadError> {
            candidates.iter().find(|p| has(&format!("{p}{probe}"))).map(|p| p.to_string()).ok_or_else(|| {
                LoadError::MissingTensor {
                    file: source.describe().into(),
                    tensor: format!("{part}: {probe} under any of {candidates:?}"),
                }
            })
        };
        let tower = first(
            &[
                "model.vision_model.",
                "vision_tower.vision_model.",
                "vision_tower.",
                "model.vision_tower.vision_model.",
                "model.vision_tower.",
            ],
            "embeddings.patch_embedding.weight",
            "the vision tower",
        )?;
        let connector = if has("model.connector.modality_projection.proj.weight") {
            "model.connector.modality_projection.".to_string()
        } else {
            first(&["multi_modal_projector.", "model.multi_modal_projector."], "linear_1.weight", "the projector")?
        };
        let newline = ["image_newline", "model.image_newline"].iter().find(|n| has(n)).map(|n| n.to_string());
        let decoder = first(
            &["model.text_model.", "language_model.model.", "model.language_model."],
            "embed_tokens.weight",
            "the decoder",
        )?;
        let lm_head = ["lm_head.weight", "language_model.lm_head.weight"]
            .iter()
            .find(|n| has(n))
            .map_or("lm_head.weight".to_string(), |n| n.to_string());
        Ok(Self { tower, connector, newline, decoder, lm_head })
    }
}

/// The checkpoint's decoder under a llama checkpoint's names, for the decoder's loader.
pub struct DecoderSource {
    inner: Box<dyn TensorSource>,
    names: Names,
}

impl DecoderSource {
    pub fn new(inner: Box<dyn TensorSource>, names: Names) -> Self {
        Self { inner, names }
    }

    fn rename(&self, name: &str) -> String {
        if name == "lm_head.weight" {
            return self.names.lm_head.clone();
        }
        match name.strip_prefix("model.") {
            Some(rest) => format!("{}{rest}", self.names.decoder),
            None => name.to_string(),
        }
    }
}

impl TensorSource for DecoderSource {
    fn describe(&self) -> &Path {
        self.inner.describe()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape(&self.rename(name))
    }

    fn load(&self, name: &str) -> Result<HostTensor, LoadError> {
        self.inner.load(&self.rename(name))
    }

    fn blocks(&self, name: &str) -> Option<(tessera_kernels::quant::GgmlType, &[u8])> {
        self.inner.blocks(&self.rename(name))
    }
}
