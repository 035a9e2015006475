//! Why a model could not be loaded. Every variant names the file, and the tensor or key
//! where there is one, so an operator can tell a bad download from a bad model.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{file}: {source}")]
    Io { file: PathBuf, source: std::io::Error },
    #[error("{file}: file ends early while reading {what}")]
    Truncated { file: PathBuf, what: String },
    #[error("{file}: not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic { file: PathBuf, found: [u8; 4] },
    #[error("{file}: GGUF version {version} is not supported (only 2 and 3)")]
    UnsupportedVersion { file: PathBuf, version: u32 },
    #[error("{file}: tensor {tensor}: tensor type {ty} is not supported")]
    UnsupportedTensorType { file: PathBuf, tensor: String, ty: String },
    #[error("{file}: tensor {tensor} is missing")]
    MissingTensor { file: PathBuf, tensor: String },
    #[error("{file}: tensor {tensor} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch { file: PathBuf, tensor: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{file}: architecture {arch:?} is not supported (llama, mistral, qwen2 are)")]
    UnsupportedArchitecture { file: PathBuf, arch: String },
    #[error("{file}: {key}: {detail}")]
    Metadata { file: PathBuf, key: String, detail: String },
    #[error("{file}: tensor {tensor}: {detail}")]
    BadTensor { file: PathBuf, tensor: String, detail: String },
    #[error("{file}: {detail}")]
    Format { file: PathBuf, detail: String },
}

impl LoadError {
    pub(crate) fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { file: file.into(), source }
    }
    pub(crate) fn metadata(file: impl Into<PathBuf>, key: &str, detail: impl Into<String>) -> Self {
        Self::Metadata { file: file.into(), key: key.to_string(), detail: detail.into() }
    }
    pub(crate) fn format(file: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        Self::Format { file: file.into(), detail: detail.into() }
    }
}
