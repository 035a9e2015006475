//! The Idefics3 / SmolVLM image processor (transformers' `Idefics3ImageProcessorPil`,
//! which SmolVLM's is the same as): an image's longest side scaled to `longest_edge`
//! (up or down, the other side even), then, when splitting, grown to whole multiples of
//! the encoder's tile size and cut into tiles row by row with the whole image squashed to
//! one more tile after them (the "global" tile); without splitting, the one squashed
//! tile. Each tile's 8-bit pixels rescaled (in f64, then f32) and normalised (in f32),
//! channels first — the same bits as the reference.

use super::resize::{Filter, resize};
use image::RgbImage;

/// What `preprocessor_config.json` says (the fields this processor reads).
#[derive(Debug, Clone, PartialEq)]
pub struct Idefics3Processor {
    /// `size.longest_edge`: the image's longest side after the first resize.
    pub longest_edge: u32,
    /// `max_image_size.longest_edge`: the encoder's square tile.
    pub tile: u32,
    pub resample: Filter,
    pub rescale_factor: f64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

/// An image made ready for the encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Tiles {
    /// The grid the image was cut into; 0 × 0 when it is one tile.
    pub rows: usize,
    pub cols: usize,
    /// `[tiles, 3, tile, tile]`, the global tile last when split.
    pub pixels: Vec<f32>,
}

impl Tiles {
    pub fn count(&self, tile: u32) -> usize {
        self.pixels.len() / (3 * tile as usize * tile as usize)
    }
}

impl Idefics3Processor {
    /// `image`'s tiles; `split` is the processor's `do_image_splitting` (a request's
    /// `detail: low` turns it off).
    pub fn preprocess(&self, image: &RgbImage, split: bool) -> Tiles {
        let (w, h) = scale_longest_side(image.width(), image.height(), self.longest_edge);
        let scaled = resize(image, w, h, self.resample);
        let m = self.tile;
        let mut pixels = Vec::new();
        if !split {
            self.push(&resize(&scaled, m, m, self.resample), &mut pixels);
            return Tiles { rows: 0, cols: 0, pixels };
        }
        let (w, h) = whole_tiles(w, h, m);
        let grown = resize(&scaled, w, h, self.resample);
        if w <= m && h <= m {
            self.push(&grown, &mut pixels);
            return Tiles { rows: 0, cols: 0, pixels };
        }
        let (rows, cols) = ((h - m) / m + 1, (w - m) / m + 1);
        for r in 0..rows {
            for c in 0..cols {
                self.push(&image::imageops::crop_imm(&grown, c * m, r * m, m, m).to_image(), &mut pixels);
            }
        }
        self.push(&resize(&grown, m, m, self.resample), &mut pixels);
        Tiles { rows: rows as usize, cols: cols as usize, pixels }
    }

    /// One tile, channels first, rescaled and normalised.
    fn push(&self, tile: &RgbImage, out: &mut Vec<f32>) {
        for c in 0..3 {
            out.extend(tile.pixels().map(|p| {
                let x = (p.0[c] as f64 * self.rescale_factor) as f32;
                (x - self.mean[c]) / self.std[c]
            }));
        }
    }
}

/// The longest side set to `longest` (the other kept in proportion, truncated, then
/// made even), then kept within 4096 a side, as the reference computes it.
fn scale_longest_side(width: u32, height: u32, longest: u32) -> (u32, u32) {
    const UPPER: u32 = 4096;
    let aspect = width as f64 / height as f64;
    let (mut w, mut h) = if width >= height {
        let h = (longest as f64 / aspect) as u32;
        (longest, h + h % 2)
    } else {
        let w = (longest as f64 * aspect) as u32;
        (w + w % 2, longest)
    };
    (w, h) = (w.max(1), h.max(1));
    let aspect = w as f64 / h as f64;
    if w >= h && w > UPPER {
        (w, h) = (UPPER, (UPPER as f64 / aspect) as u32);
    } else if h > w && h > UPPER {
        (w, h) = ((UPPER as f64 * aspect) as u32, UPPER);
    }
    (w.max(1), h.max(1))
}

/// The size grown to whole tiles along the longest side, the other side in proportion
/// rounded up to whole tiles.
fn whole_tiles(width: u32, height: u32, tile: u32) -> (u32, u32) {
    let aspect = width as f64 / height as f64;
    let up = |x: f64| (x / tile as f64).ceil() as u32 * tile;
    if width >= height {
        let w = up(width as f64);
        (w, up(((w as f64 / aspect) as u32) as f64))
    } else {
        let h = up(height as f64);
        (up(((h as f64 * aspect) as u32) as f64), h)
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
            longest_edge,
            tile,
            resample: Filter::Lanczos,
            rescale_factor: 1.0 / 255.0,
            mean: [0.5; 3],
            std: [0.5; 3],
        };
        assert_eq!(cases.len(), 12);
        let mut split_any = false;
        for c in cases {
            let got = processor.preprocess(&c.image, c.split);
            let what = format!("{}x{} split {}", c.image.width(), c.image.height(), c.split);
            assert_eq!((got.rows, got.cols), (c.rows, c.cols), "{what}");
            assert_eq!(got.pixels.len(), c.pixels.len(), "{what}: tiles");
            let worst = got.pixels.iter().zip(&c.pixels).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            // The same bits: Pillow's resampling, then the reference's f64 and f32 steps.
            assert_eq!(worst, 0.0, "{what}");
            split_any |= c.rows > 1 || c.cols > 1;
        }
        assert!(split_any, "the fixture cuts some image into several tiles");
    }

    #[test]
    fn sizes_follow_the_reference_rules() {
        // The long side set to 48, the short truncated then made even.
        assert_eq!(scale_longest_side(50, 30, 48), (48, 28));
        assert_eq!(scale_longest_side(30, 50, 48), (28, 48));
        assert_eq!(scale_longest_side(50, 1, 48), (48, 1));
        assert_eq!(scale_longest_side(9000, 100, 8192), (4096, 46));
        // Grown to whole 16-pixel tiles.
        assert_eq!(whole_tiles(48, 28, 16), (48, 32));
        assert_eq!(whole_tiles(20, 48, 16), (32, 48));
    }
}
