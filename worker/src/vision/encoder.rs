//! An image into the decoder's rows: the family's processor makes tiles, the tower
//! encodes them on the worker's backend, the connector maps them to the decoder's width
//! in the order of the prompt's placeholder tokens.

use super::config::{Connector, Processor, TowerKind, VisionConfig};
use super::names::Names;
use super::tower::{Reader, Tower};
use crate::loader::TensorSource;
use crate::model::ModelError;
use image::RgbImage;
use tessera_kernels::Backend;
use tessera_proto::vision::{Idefics3Geometry, best_resolution, unpadded};

/// How a picture enters the prompt, which decides how it is tiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Use {
    /// An image; `split` is Idefics3's tiling (`detail` low turns it off; LLaVA ignores it).
    Image { split: bool },
    /// A frame of a video: never split, SmolVLM2's video size.
    Frame,
}

/// Tiles ready for the tower.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// `[tiles, 3, image_size, image_size]`.
    pub pixels: Vec<f32>,
    /// The picture's size before any resize (LLaVA-NeXT cuts its padding by it).
    pub width: u32,
    pub height: u32,
}

/// An image's features: `tokens` rows of the decoder's width, in placeholder order.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    pub rows: Vec<f32>,
    pub tokens: usize,
}

enum Projection<B: Backend> {
    /// Idefics3: one matrix over `scale_factor`² patches folded into a row.
    Shuffle { proj: B::Weight, scale_factor: usize },
    /// LLaVA: `linear_2(act(linear_1(x)))`, NeXT's newline row on the host.
    Mlp { l1: B::Weight, b1: B::Buffer, l2: B::Weight, b2: B::Buffer, newline: Option<Vec<f32>> },
}

pub struct VisionModel<B: Backend> {
    pub config: VisionConfig,
    tower: Tower<B>,
    projection: Projection<B>,
    /// The decoder's width.
    pub hidden: usize,
}

impl<B: Backend> VisionModel<B> {
    pub fn load(
        backend: &B,
        config: VisionConfig,
        source: &dyn TensorSource,
        names: &Names,
        hidden: usize,
    ) -> Result<Self, ModelError> {
        let d = config.tower.hidden_size;
        let (tower, projection) = match &config.connector {
            Connector::PixelShuffle { scale_factor } => {
                let tower =
                    Tower::load(backend, config.tower.clone(), source, &names.tower, config.tower.num_layers, true)?;
                let r = Reader { source, prefix: &names.connector };
                let proj =
                    backend.upload_weight(r.matrix("proj.weight", &[hidden, d * scale_factor * scale_factor])?)?;
                (tower, Projection::Shuffle { proj, scale_factor: *scale_factor })
            }
            Connector::Mlp { layers, next, .. } => {
                let tower = Tower::load(backend, config.tower.clone(), source, &names.tower, *layers, false)?;
                let r = Reader { source, prefix: &names.connector };
                let newline = match (next, &names.newline) {
                    (true, Some(name)) => Some(Reader { source, prefix: "" }.read(name, &[hidden])?),
                    (true, None) => {
                        return Err(ModelError::Input("a LLaVA-NeXT checkpoint without image_newline".into()));
                    }
                    (false, _) => None,
                };
                let projection = Projection::Mlp {
                    l1: backend.upload_weight(r.matrix("linear_1.weight", &[hidden, d])?)?,
                    b1: backend.upload(&r.read("linear_1.bias", &[hidden])?)?,
                    l2: backend.upload_weight(r.matrix("linear_2.weight", &[hidden, hidden])?)?,
                    b2: backend.upload(&r.read("linear_2.bias", &[hidden])?)?,
                    newline,
                };
                (tower, projection)
            }
        };
        Ok(Self { config, tower, projection, hidden })
    }

    /// `image` as its processor tiles it for `usage`.
    pub fn prepare(&self, image: &RgbImage, usage: Use) -> Prepared {
        let pixels = match (&self.config.processor, usage) {
            (Processor::Idefics3 { processor, .. }, Use::Image { split }) => processor.preprocess(image, split).pixels,
            (Processor::Idefics3 { processor, video, .. }, Use::Frame) => {
                let longest_edge = video.map_or(processor.geometry.tile, |v| v.longest_edge);
                let geometry = Idefics3Geometry { longest_edge, ..processor.geometry };
                super::idefics3::Idefics3Processor { geometry, ..processor.clone() }.preprocess(image, false).pixels
            }
            (Processor::Llava(p), _) => p.preprocess(image),
        };
        Prepared { pixels, width: image.width(), height: image.height() }
    }

    /// Prepared tiles through the tower and the connector.
    pub fn encode(&self, backend: &B, prepared: &Prepared) -> Result<Features, ModelError> {
        let t = &self.config.tower;
        let tiles = prepared.pixels.len() / (3 * t.image_size * t.image_size);
        let h = self.tower.forward(backend, &prepared.pixels)?;
        match &self.projection {
            Projection::Shuffle { proj, scale_factor } => {
                let rows = backend.gather_rows(
                    &h,
                    t.hidden_size,
                    &backend.upload_index(&shuffle(tiles, t.grid(), *scale_factor))?,
                )?;
                let tokens = tiles * t.patches() / (scale_factor * scale_factor);
                let out = backend.linear(&rows, tokens, proj, None)?;
                Ok(Features { rows: backend.download(&out)?, tokens })
            }
            Projection::Mlp { l1, b1, l2, b2, newline } => {
                let Connector::Mlp { drop_first, act, .. } = self.config.connector else {
                    unreachable!("an MLP projection is loaded for the MLP connector")
                };
                let seq = t.seq_len();
                let skip = usize::from(drop_first);
                let keep: Vec<u32> =
                    (0..tiles).flat_map(|i| (i * seq + skip..(i + 1) * seq).map(|r| r as u32)).collect();
                let x = backend.gather_rows(&h, t.hidden_size, &backend.upload_index(&keep)?)?;
                let mut y = backend.linear(&x, keep.len(), l1, Some(b1))?;
                backend.gelu(&mut y, act)?;
                let out = backend.download(&backend.linear(&y, keep.len(), l2, Some(b2))?)?;
                match newline {
                    Some(newline) => self.pack_next(out, newline, prepared),
                    None => Ok(Features { tokens: keep.len(), rows: out }),
                }
            }
        }
    }

    /// LLaVA-NeXT: the base tile's rows, then the grid tiles' rows as one feature grid
    /// with the padding cut away, each row ended by the newline row.
    fn pack_next(&self, rows: Vec<f32>, newline: &[f32], p: &Prepared) -> Result<Features, ModelError> {
        let (t, d) = (&self.config.tower, self.hidden);
        let Processor::Llava(processor) = &self.config.processor else {
            unreachable!("NeXT's connector comes with its processor")
        };
        let g = t.grid();
        let per_tile = g * g * d;
        let (bh, bw) = best_resolution(p.height, p.width, &processor.pinpoints)
            .ok_or_else(|| ModelError::Input("a LLaVA-NeXT processor without resolutions".into()))?;
        let (nph, npw) = ((bh / processor.crop) as usize, (bw / processor.crop) as usize);
        if rows.len() != (1 + nph * npw) * per_tile {
            return Err(ModelError::Input(format!("{} feature floats for a {nph} x {npw} grid", rows.len())));
        }
        let (cur_h, cur_w) = (nph * g, npw * g);
        let (keep_rows, keep_cols) = unpadded(p.height, p.width, cur_h, cur_w);
        let mut out = rows[..per_tile].to_vec();
        for y in keep_rows {
            for x in keep_cols.clone() {
                let tile = 1 + (y / g) * npw + x / g;
                let at = tile * per_tile + ((y % g) * g + x % g) * d;
                out.extend_from_slice(&rows[at..at + d]);
            }
            out.extend_from_slice(newline);
        }
        Ok(Features { tokens: out.len() / d, rows: out })
    }

    /// Whether the tower has a class token (tests and the benchmark describe it).
    pub fn tower_kind(&self) -> TowerKind {
        self.config.tower.kind
    }
}

/// Idefics3's pixel shuffle as a row order: reading the tower's rows in this order,
/// each run of `s`² rows is one output row (`s` × `s` neighbouring patches, row by row),
/// output rows row-major over the grid shrunk `s` times.
fn shuffle(tiles: usize, grid: usize, s: usize) -> Vec<u32> {
    let n = grid * grid;
    let mut order = Vec::with_capacity(tiles * n);
    for t in 0..tiles {
        for i in 0..grid / s {
            for j in 0..grid / s {
                for l in 0..s {
                    for k in 0..s {
                        order.push((t * n + (i * s + l) * grid + j * s + k) as u32);
                    }
                }
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::shuffle;

    #[test]
    fn pixel_shuffle_folds_each_square_of_patches_into_one_row() {
        // A 4 x 4 grid, s = 2: output row 1 is the square at patch rows 0-1, columns 2-3.
        let order = shuffle(2, 4, 2);
        assert_eq!(&order[4..8], &[2, 3, 6, 7]);
        // Output row 2: patch rows 2-3, columns 0-1; the second tile starts at 16.
        assert_eq!(&order[8..12], &[8, 9, 12, 13]);
        assert_eq!(order[16], 16);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..32).collect::<Vec<u32>>());
    }
}
