//! The Idefics3 / SmolVLM image processor (transformers' `Idefics3ImageProcessorPil`,
//! which SmolVLM's is the same as): an image's longest side scaled to `longest_edge`
//! (up or down, the other side even), then, when splitting, grown to whole multiples of
//! the encoder's tile size and cut into tiles row by row with the whole image squashed to
//! one more tile after them (the "global" tile); without splitting, the one squashed
//! tile. Each tile's 8-bit pixels rescaled (in f64, then f32) and normalised (in f32),
//! channels first — the same bits as the reference.

use super::Values;
use super::resize::{Filter, resize};
use image::RgbImage;
use tessera_proto::vision::Idefics3Geometry;

/// What `preprocessor_config.json` says (the fields this processor reads).
#[derive(Debug, Clone, PartialEq)]
pub struct Idefics3Processor {
    /// Sizes and tiles, shared with the control plane (which renders the placeholders).
    pub geometry: Idefics3Geometry,
    pub resample: Filter,
    pub values: Values,
}

/// An image made ready for the encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Tiles {
    /// The grid the image was cut into; 0 × 0 when it is one tile.
    pub rows: u32,
    pub cols: u32,
    /// `[tiles, 3, tile, tile]`, the global tile last when split.
    pub pixels: Vec<f32>,
}

impl Idefics3Processor {
    /// `image`'s tiles; `split` is the processor's `do_image_splitting` (a request's
    /// `detail: low` turns it off).
    pub fn preprocess(&self, image: &RgbImage, split: bool) -> Tiles {
        let g = &self.geometry;
        let m = g.tile;
        let (w, h) = g.scaled(image.width(), image.height());
        let scaled = resize(image, w, h, self.resample);
        let (rows, cols) = g.grid(image.width(), image.height(), split);
        let mut pixels = Vec::new();
        if !split {
            self.values.push(&resize(&scaled, m, m, self.resample), &mut pixels);
            return Tiles { rows, cols, pixels };
        }
        let (w, h) = g.grown(w, h);
        let grown = resize(&scaled, w, h, self.resample);
        for r in 0..rows {
            for c in 0..cols {
                self.values.push(&image::imageops::crop_imm(&grown, c * m, r * m, m, m).to_image(), &mut pixels);
            }
        }
        // The global tile (the grown image itself when it is one tile: same size, a copy).
        self.values.push(&resize(&grown, m, m, self.resample), &mut pixels);
        Tiles { rows, cols, pixels }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' own output (scripts/fixtures/idefics3_pixels.py).
    struct Case {
        image: RgbImage,
        split: bool,
        rows: usize,
        cols: usize,
        pixels: Vec<f32>,
    }

    fn fixture() -> (u32, u32, Vec<Case>) {
        let mut f = crate::vision::Fixture::open("idefics3_pixels.bin", b"IDF3PIX\0");
        let (longest, tile, n) = (f.u32(), f.u32(), f.u32());
        let cases = (0..n)
            .map(|_| {
                let (w, h) = (f.u32(), f.u32());
                let split = f.u8() == 1;
                let image = f.rgb(w, h);
                let (rows, cols, tiles) = (f.u32() as usize, f.u32() as usize, f.u32() as usize);
                let pixels = f.f32s(tiles * 3 * (tile * tile) as usize);
                Case { image, split, rows, cols, pixels }
            })
            .collect();
        f.done();
        (longest, tile, cases)
    }

    #[test]
    fn tiles_and_pixel_values_match_the_reference_processor() {
        let (longest_edge, tile, cases) = fixture();
        let processor = Idefics3Processor {
            geometry: Idefics3Geometry { longest_edge, tile, image_seq_len: 0 },
            resample: Filter::Lanczos,
            values: Values { rescale_factor: 1.0 / 255.0, mean: [0.5; 3], std: [0.5; 3] },
        };
        assert_eq!(cases.len(), 12);
        let mut split_any = false;
        for c in cases {
            let got = processor.preprocess(&c.image, c.split);
            let what = format!("{}x{} split {}", c.image.width(), c.image.height(), c.split);
            assert_eq!((got.rows as usize, got.cols as usize), (c.rows, c.cols), "{what}");
            assert_eq!(got.pixels.len(), c.pixels.len(), "{what}: tiles");
            let worst = got.pixels.iter().zip(&c.pixels).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            // The same bits: Pillow's resampling, then the reference's f64 and f32 steps.
            assert_eq!(worst, 0.0, "{what}");
            split_any |= c.rows > 1 || c.cols > 1;
        }
        assert!(split_any, "the fixture cuts some image into several tiles");
    }
}
