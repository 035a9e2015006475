//! Reading model files: GGUF (quantised or not) and Hugging Face safetensors
//! directories (FP8 ones too), each behind `TensorSource`, which hands out tensors as f32.

mod error;
pub mod fp8;
pub mod gguf;
pub mod gguf_writer;
pub mod int4;
pub mod safetensors_dir;

pub use error::LoadError;
use std::path::Path;
use tessera_kernels::WeightData;
use tessera_kernels::quant::GgmlType;

/// A tensor on the host in f32, row-major, outermost dimension first.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Where weights come from, by the file format's own tensor names.
pub trait TensorSource {
    /// The file or directory, for error messages.
    fn describe(&self) -> &Path;
    /// A tensor's shape, without reading its data.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// A tensor, converted to f32.
    fn load(&self, name: &str) -> Result<HostTensor, LoadError>;
    /// A tensor's raw ggml blocks, for formats that store them (GGUF).
    fn blocks(&self, _name: &str) -> Option<(GgmlType, &[u8])> {
        None
    }
    /// A matrix kept in its checkpoint's 8-bit or 4-bit form with its scales, for
    /// checkpoints that store one (FP8, AWQ, GPTQ); None reads it with `load`.
    fn quantised(&self, _name: &str) -> Result<Option<WeightData>, LoadError> {
        Ok(None)
    }
}
