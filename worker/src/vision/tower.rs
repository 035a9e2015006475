//! The vision transformer (CLIP's or SigLIP's) on the worker's backend: patches
//! projected, position embeddings added, pre-norm layers of bidirectional attention and
//! MLP. Tiles of one call run as one batch, each its own sequence.

use super::config::{TowerConfig, TowerKind};
use crate::loader::{LoadError, TensorSource};
use crate::model::ModelError;
use tessera_kernels::{Backend, HostWeight, WeightData};

struct Norm<B: Backend> {
    weight: B::Buffer,
    bias: B::Buffer,
}

struct Layer<B: Backend> {
    norm1: Norm<B>,
    /// Rows: Q, then K, then V.
    qkv: B::Weight,
    qkv_bias: B::Buffer,
    out: B::Weight,
    out_bias: B::Buffer,
    norm2: Norm<B>,
    fc1: B::Weight,
    fc1_bias: B::Buffer,
    fc2: B::Weight,
    fc2_bias: B::Buffer,
}

pub struct Tower<B: Backend> {
    pub config: TowerConfig,
    /// `[hidden, 3 · patch²]`, columns in (channel, y, x) order as the convolution's.
    patch: B::Weight,
    patch_bias: Option<B::Buffer>,
    /// CLIP's class token, `[hidden]`, on the host: it is laid out with the positions.
    class: Option<Vec<f32>>,
    /// `[seq_len, hidden]`, the class token's position first where there is one.
    positions: Vec<f32>,
    pre_norm: Option<Norm<B>>,
    layers: Vec<Layer<B>>,
    post_norm: Option<Norm<B>>,
}

/// Reads tensors under one prefix, each checked against the shape the config implies.
pub(super) struct Reader<'a> {
    pub source: &'a dyn TensorSource,
    pub prefix: &'a str,
}

impl Reader<'_> {
    pub fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let full = format!("{}{name}", self.prefix);
        let found = self
            .source
            .shape(&full)
            .ok_or_else(|| LoadError::MissingTensor { file: self.source.describe().into(), tensor: full.clone() })?;
        if found != shape {
            return Err(LoadError::ShapeMismatch {
                file: self.source.describe().into(),
                tensor: full,
                expected: shape.to_vec(),
                found,
            });
        }
        Ok(self.source.load(&full)?.data)
    }

    /// A `[rows, cols]` matrix (a convolution's kernel flattened into its rows).
    pub fn matrix(&self, name: &str, shape: &[usize]) -> Result<HostWeight, LoadError> {
        let data = self.read(name, shape)?;
        let rows = shape[0];
        Ok(HostWeight { rows, cols: data.len() / rows.max(1), data: WeightData::F32(data) })
    }
}

impl<B: Backend> Tower<B> {
    /// The tower under `prefix`; only the first `layers` layers are loaded (LLaVA reads
    /// an earlier layer's output and never needs the rest).
    pub fn load(
        backend: &B,
        config: TowerConfig,
        source: &dyn TensorSource,
        prefix: &str,
        layers: usize,
        post_norm: bool,
    ) -> Result<Self, ModelError> {
        let r = Reader { source, prefix };
        let (d, f, p) = (config.hidden_size, config.intermediate_size, config.patch_size);
        let up = |v: Vec<f32>| backend.upload(&v);
        let norm = |name: &str| -> Result<Norm<B>, ModelError> {
            Ok(Norm {
                weight: up(r.read(&format!("{name}.weight"), &[d])?)?,
                bias: up(r.read(&format!("{name}.bias"), &[d])?)?,
            })
        };
        let clip = config.kind == TowerKind::Clip;
        let patch = backend.upload_weight(r.matrix("embeddings.patch_embedding.weight", &[d, 3, p, p])?)?;
        let patch_bias = match clip {
            true => None,
            false => Some(up(r.read("embeddings.patch_embedding.bias", &[d])?)?),
        };
        let class = match clip {
            true => Some(r.read("embeddings.class_embedding", &[d])?),
            false => None,
        };
        let positions = r.read("embeddings.position_embedding.weight", &[config.seq_len(), d])?;
        let pre_norm = match clip {
            true => Some(norm("pre_layrnorm")?),
            false => None,
        };
        let mut loaded = Vec::with_capacity(layers);
        for l in 0..layers {
            let n = |name: &str| format!("encoder.layers.{l}.{name}");
            let qkv: Vec<f32> = ["q_proj", "k_proj", "v_proj"]
                .iter()
                .map(|m| r.read(&n(&format!("self_attn.{m}.weight")), &[d, d]))
                .collect::<Result<Vec<_>, _>>()?
                .concat();
            let qkv_bias: Vec<f32> = ["q_proj", "k_proj", "v_proj"]
                .iter()
                .map(|m| r.read(&n(&format!("self_attn.{m}.bias")), &[d]))
                .collect::<Result<Vec<_>, _>>()?
                .concat();
            loaded.push(Layer {
                norm1: norm(&n("layer_norm1"))?,
                qkv: backend.upload_weight(HostWeight { rows: 3 * d, cols: d, data: WeightData::F32(qkv) })?,
                qkv_bias: up(qkv_bias)?,
                out: backend.upload_weight(r.matrix(&n("self_attn.out_proj.weight"), &[d, d])?)?,
                out_bias: up(r.read(&n("self_attn.out_proj.bias"), &[d])?)?,
                norm2: norm(&n("layer_norm2"))?,
                fc1: backend.upload_weight(r.matrix(&n("mlp.fc1.weight"), &[f, d])?)?,
                fc1_bias: up(r.read(&n("mlp.fc1.bias"), &[f])?)?,
                fc2: backend.upload_weight(r.matrix(&n("mlp.fc2.weight"), &[d, f])?)?,
                fc2_bias: up(r.read(&n("mlp.fc2.bias"), &[d])?)?,
            });
        }
        let post_norm = match post_norm {
            true => Some(norm("post_layernorm")?),
            false => None,
        };
        Ok(Self { config, patch, patch_bias, class, positions, pre_norm, layers: loaded, post_norm })
    }

    /// `pixels` (`[tiles, 3, image_size, image_size]`) through the tower: `[tiles ·
    /// seq_len, hidden]`, each tile's class token first where there is one.
    pub fn forward(&self, backend: &B, pixels: &[f32]) -> Result<B::Buffer, ModelError> {
        let c = &self.config;
        let (s, p, d) = (c.image_size, c.patch_size, c.hidden_size);
        let tile_floats = 3 * s * s;
        if pixels.is_empty() || !pixels.len().is_multiple_of(tile_floats) {
            return Err(ModelError::Input(format!("{} pixel values are not tiles of 3 × {s} × {s}", pixels.len())));
        }
        let tiles = pixels.len() / tile_floats;
        let patches = patch_rows(pixels, s, p);
        let n = c.patches();
        let mut x = backend.linear(&backend.upload(&patches)?, tiles * n, &self.patch, self.patch_bias.as_ref())?;
        let seq = c.seq_len();
        let mut h = match &self.class {
            None => {
                let pos: Vec<f32> = self.positions.repeat(tiles);
                backend.add_assign(&mut x, &backend.upload(&pos)?)?;
                x
            }
            Some(class) => {
                // Each tile's rows: its class token plus position 0, then its patches
                // plus theirs, scattered in after their positions are added.
                let patch_pos: Vec<f32> = self.positions[d..].repeat(tiles);
                backend.add_assign(&mut x, &backend.upload(&patch_pos)?)?;
                let mut rows = vec![0.0; tiles * seq * d];
                let first: Vec<f32> = class.iter().zip(&self.positions[..d]).map(|(a, b)| a + b).collect();
                for t in 0..tiles {
                    rows[t * seq * d..(t * seq + 1) * d].copy_from_slice(&first);
                }
                let at: Vec<u32> = (0..tiles).flat_map(|t| (1..seq).map(move |i| (t * seq + i) as u32)).collect();
                let mut h = backend.upload(&rows)?;
                backend.scatter_rows(&mut h, d, &backend.upload_index(&at)?, &x)?;
                h
            }
        };
        if let Some(norm) = &self.pre_norm {
            h = backend.layer_norm(&h, &norm.weight, &norm.bias, c.layer_norm_eps)?;
        }
        let rows = tiles * seq;
        let scale = (c.head_dim() as f32).powf(-0.5);
        for layer in &self.layers {
            let y = backend.layer_norm(&h, &layer.norm1.weight, &layer.norm1.bias, c.layer_norm_eps)?;
            let qkv = backend.linear(&y, rows, &layer.qkv, Some(&layer.qkv_bias))?;
            let [q, k, v]: [B::Buffer; 3] = backend
                .split_columns(&qkv, &[d, d, d])?
                .try_into()
                .map_err(|_| ModelError::Input("split_columns returned the wrong number of parts".into()))?;
            let attn = backend.dense_attention(&q, &k, &v, tiles, c.num_heads, c.head_dim(), scale)?;
            let o = backend.linear(&attn, rows, &layer.out, Some(&layer.out_bias))?;
            backend.add_assign(&mut h, &o)?;
            let y = backend.layer_norm(&h, &layer.norm2.weight, &layer.norm2.bias, c.layer_norm_eps)?;
            let mut f = backend.linear(&y, rows, &layer.fc1, Some(&layer.fc1_bias))?;
            backend.gelu(&mut f, c.act)?;
            let o = backend.linear(&f, rows, &layer.fc2, Some(&layer.fc2_bias))?;
            backend.add_assign(&mut h, &o)?;
        }
        if let Some(norm) = &self.post_norm {
            h = backend.layer_norm(&h, &norm.weight, &norm.bias, c.layer_norm_eps)?;
        }
        Ok(h)
    }
}

/// The patches of every tile as rows, tile by tile and row-major within it, each
/// flattened in (channel, y, x) order: a stride-`p` convolution as one product.
fn patch_rows(pixels: &[f32], s: usize, p: usize) -> Vec<f32> {
    let g = s / p;
    let mut out = Vec::with_capacity(pixels.len());
    for tile in pixels.chunks_exact(3 * s * s) {
        for py in 0..g {
            for px in 0..g {
                for c in 0..3 {
                    for y in 0..p {
                        let at = c * s * s + (py * p + y) * s + px * p;
                        out.extend_from_slice(&tile[at..at + p]);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::patch_rows;

    #[test]
    fn patches_flatten_like_the_convolution_kernel() {
        // One 4 × 4 tile in patches of 2: channel c, pixel (y, x) holds c·100 + y·10 + x.
        let pixels: Vec<f32> =
            (0..3).flat_map(|c| (0..4).flat_map(move |y| (0..4).map(move |x| (c * 100 + y * 10 + x) as f32))).collect();
        let rows = patch_rows(&pixels, 4, 2);
        assert_eq!(rows.len(), 4 * 12);
        // Patch (0, 1): x 2..4, y 0..2; channel-major, then y, then x.
        assert_eq!(&rows[12..18], &[2.0, 3.0, 12.0, 13.0, 102.0, 103.0]);
        // Patch (1, 0) begins at y 2, x 0.
        assert_eq!(rows[24], 20.0);
    }
}
