//! Loading a decoder's weights onto a backend: each tensor checked against the shape
//! the config implies, Q/K/V and gate/up fused so each takes one matrix product.

use super::ModelError;
use super::config::{LayerTensor, ModelConfig, Tensor};
use super::shard::{self, Shard};
use crate::loader::{LoadError, TensorSource};
use tessera_kernels::{Backend, HostWeight, WeightData};

pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Buffer,
    /// Rows: Q, then K, then V.
    pub qkv: B::Weight,
    pub qkv_bias: Option<B::Buffer>,
    pub o: B::Weight,
    pub ffn_norm: B::Buffer,
    /// Rows: gate, then up.
    pub gate_up: B::Weight,
    pub down: B::Weight,
}

pub struct Weights<B: Backend> {
    pub embed: B::Weight,
    /// None when tied to `embed`.
    pub lm_head: Option<B::Weight>,
    pub final_norm: B::Buffer,
    pub layers: Vec<LayerWeights<B>>,
    pub inv_freq: B::Buffer,
}

impl<B: Backend> Weights<B> {
    pub fn lm_head(&self) -> &B::Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Reads tensors by role, checking names and shapes.
struct Reader<'a> {
    config: &'a ModelConfig,
    source: &'a dyn TensorSource,
}

impl Reader<'_> {
    fn has(&self, t: Tensor) -> bool {
        self.source.shape(&self.config.tensor_name(t)).is_some()
    }

    /// The tensor's name, once it is known to exist with the shape the config implies.
    fn checked_name(&self, t: Tensor) -> Result<String, LoadError> {
        let name = self.config.tensor_name(t);
        let file = self.source.describe().to_path_buf();
        let expected = self.config.tensor_shape(t);
        let found = self
            .source
            .shape(&name)
            .ok_or_else(|| LoadError::MissingTensor { file: file.clone(), tensor: name.clone() })?;
        if found != expected {
            return Err(LoadError::ShapeMismatch { file, tensor: name, expected, found });
        }
        Ok(name)
    }

    fn read(&self, t: Tensor) -> Result<Vec<f32>, LoadError> {
        Ok(self.source.load(&self.checked_name(t)?)?.data)
    }

    /// The row-wise concatenation of `parts` as one `[rows, cols]` matrix: their raw
    /// blocks where the file stores them so (the backend then chooses how to hold
    /// them), stacked as `shard::stack` does. Rows are whole blocks, so block rows
    /// concatenate like f32 rows.
    fn matrix(&self, parts: &[Tensor], rows: usize, cols: usize) -> Result<HostWeight, LoadError> {
        let mut weights = Vec::with_capacity(parts.len());
        for &p in parts {
            let name = self.checked_name(p)?;
            let data = match self.source.blocks(&name) {
                Some((ty, bytes)) => WeightData::Blocks { ty, bytes: bytes.to_vec() },
                None => match self.source.quantised(&name)? {
                    Some(data) => data,
                    None => WeightData::F32(self.source.load(&name)?.data),
                },
            };
            weights.push(HostWeight { rows: self.config.tensor_shape(p)[0], cols, data });
        }
        let w = shard::stack(weights);
        debug_assert_eq!(w.rows, rows);
        Ok(w)
    }
}

/// Loads `shard`'s part of the weights (all of them for `Shard::WHOLE`), checking each
/// tensor against the full model's `config`.
pub fn load<B: Backend>(
    backend: &B,
    config: &ModelConfig,
    source: &dyn TensorSource,
    shard: Shard,
) -> Result<Weights<B>, ModelError> {
    let r = Reader { config, source };
    let (d, q, kv, ffn) = (config.hidden_size, config.q_width(), config.kv_width(), config.intermediate_size);
    let embed = backend.upload_weight(r.matrix(&[Tensor::Embed], config.vocab_size, d)?)?;
    let lm_head = match (r.has(Tensor::LmHead), config.tie_word_embeddings) {
        (_, Some(true)) | (false, None) => None,
        // Present, or required by `tie_word_embeddings: false` (then read names it missing).
        _ => Some(backend.upload_weight(r.matrix(&[Tensor::LmHead], config.vocab_size, d)?)?),
    };
    let divisors = if r.has(Tensor::RopeFreqs) { Some(r.read(Tensor::RopeFreqs)?) } else { None };
    let inv_freq = backend.upload(&config.inv_freq(divisors.as_deref()))?;
    // The rows of each part that belong to this rank, stacked: Q, K, V or gate, up.
    let row_parts = |parts: &[(Tensor, usize)]| -> Result<HostWeight, LoadError> {
        if shard == Shard::WHOLE {
            let tensors: Vec<Tensor> = parts.iter().map(|p| p.0).collect();
            return r.matrix(&tensors, parts.iter().map(|p| p.1).sum(), d);
        }
        let sliced = parts
            .iter()
            .map(|&(t, n)| Ok(shard::rows(r.matrix(&[t], n, d)?, shard.range(n))))
            .collect::<Result<Vec<_>, LoadError>>()?;
        Ok(shard::stack(sliced))
    };
    // This rank's columns of a row-parallel projection.
    let column_part = |t: Tensor, cols: usize| -> Result<HostWeight, LoadError> {
        let w = r.matrix(&[t], d, cols)?;
        Ok(if shard == Shard::WHOLE { w } else { shard::columns(w, shard.range(cols)) })
    };
    let bias_part = |t: Tensor, n: usize| -> Result<Vec<f32>, LoadError> { Ok(r.read(t)?[shard.range(n)].to_vec()) };
    let mut layers = Vec::with_capacity(config.num_layers);
    for l in 0..config.num_layers {
        let t = |p| Tensor::Layer(l, p);
        use LayerTensor::*;
        let qkv_bias = if config.attention_bias {
            let bias = [bias_part(t(QBias), q)?, bias_part(t(KBias), kv)?, bias_part(t(VBias), kv)?].concat();
            Some(backend.upload(&bias)?)
        } else {
            None
        };
        layers.push(LayerWeights {
            attn_norm: backend.upload(&r.read(t(AttnNorm))?)?,
            qkv: backend.upload_weight(row_parts(&[(t(Q), q), (t(K), kv), (t(V), kv)])?)?,
            qkv_bias,
            o: backend.upload_weight(column_part(t(O), q)?)?,
            ffn_norm: backend.upload(&r.read(t(FfnNorm))?)?,
            gate_up: backend.upload_weight(row_parts(&[(t(Gate), ffn), (t(Up), ffn)])?)?,
            down: backend.upload_weight(column_part(t(Down), ffn)?)?,
        });
    }
    Ok(Weights { embed, lm_head, final_norm: backend.upload(&r.read(Tensor::FinalNorm)?)?, layers, inv_freq })
}
