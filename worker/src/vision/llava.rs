//! The LLaVA-1.5 and LLaVA-NeXT image processors (transformers' `LlavaImageProcessorPil`
//! and `LlavaNextImageProcessorPil`). LLaVA-1.5: the shortest side resized to
//! `shortest_edge`, a centred `crop` square cut out. NeXT first fits the image inside the
//! best of its `pinpoints` resolutions, pads it there with black (centred), cuts that into
//! `crop` squares row by row, and puts before them the whole image squashed to a square;
//! each square then goes the 1.5 way. Pixels rescaled (f64, then f32) and normalised (f32),
//! channels first — the same bits as the reference.

use super::Values;
use super::resize::{Filter, Window, resize, resize_window};
use image::{RgbImage, imageops};
use tessera_proto::vision::{best_resolution, fit_inside};

/// What `preprocessor_config.json` says (the fields these processors read).
#[derive(Debug, Clone, PartialEq)]
pub struct LlavaProcessor {
    /// `size.shortest_edge`.
    pub shortest_edge: u32,
    /// `crop_size`, square.
    pub crop: u32,
    pub resample: Filter,
    pub values: Values,
    /// NeXT's `image_grid_pinpoints`, each (height, width); empty for LLaVA-1.5.
    pub pinpoints: Vec<(u32, u32)>,
}

impl LlavaProcessor {
    /// `[tiles, 3, crop, crop]`: one tile for LLaVA-1.5; for NeXT the squashed whole
    /// image, then the grid's tiles.
    pub fn preprocess(&self, image: &RgbImage) -> Vec<f32> {
        let mut pixels = Vec::new();
        let Some(best) = best_resolution(image.height(), image.width(), &self.pinpoints) else {
            self.push(image, &mut pixels);
            return pixels;
        };
        let s = self.shortest_edge;
        self.push(&resize(image, s, s, self.resample), &mut pixels);
        let (h, w) = fit_inside(image.height(), image.width(), best);
        let fitted = resize(image, w, h, self.resample);
        // The padding is reckoned from the fitted size fitted again, as the reference does.
        let (h, w) = fit_inside(h, w, best);
        let mut canvas = RgbImage::new(best.1, best.0);
        imageops::replace(&mut canvas, &fitted, ((best.1 - w) / 2).into(), ((best.0 - h) / 2).into());
        let p = self.crop;
        for y in (0..best.0).step_by(p as usize) {
            for x in (0..best.1).step_by(p as usize) {
                self.push(&imageops::crop_imm(&canvas, x, y, p, p).to_image(), &mut pixels);
            }
        }
        pixels
    }

    /// One square: shortest side to `shortest_edge`, centre crop, then values. Only the
    /// crop is resized (a long strip's whole resize could be gigabytes).
    fn push(&self, image: &RgbImage, out: &mut Vec<f32>) {
        let (w, h) = shortest_side(image.width(), image.height(), self.shortest_edge);
        let size = self.crop;
        let window = Window {
            x: w.saturating_sub(size) / 2,
            y: h.saturating_sub(size) / 2,
            width: w.min(size),
            height: h.min(size),
        };
        let inside = resize_window(image, w, h, self.resample, window);
        self.values.push(&pad_to_square(&inside, size), out);
    }
}

/// The shortest side set to `edge`, the other in proportion, truncated.
fn shortest_side(width: u32, height: u32, edge: u32) -> (u32, u32) {
    let (short, long) = (width.min(height) as u64, width.max(height) as u64);
    let long = (edge as u64 * long / short) as u32;
    if width <= height { (edge, long) } else { (long, edge) }
}

/// `image` (no larger than `size` a side) centred on a black `size` square, its offset
/// rounded up — the reference's centre crop of an image smaller than the crop.
fn pad_to_square(image: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = image.dimensions();
    if (w, h) == (size, size) {
        return image.clone();
    }
    let mut square = RgbImage::new(size, size);
    imageops::replace(&mut square, image, (size - w).div_ceil(2).into(), (size - h).div_ceil(2).into());
    square
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
    // OpenAI CLIP's (0.26862954, 0.26130258, 0.27577711), as the f32s the reference uses.
    const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

    #[test]
    fn tiles_match_the_reference_processors() {
        let mut f = crate::vision::Fixture::open("llava_pixels.bin", b"LLAVAPX\0");
        let size = f.u32();
        let pinpoints: Vec<(u32, u32)> = (0..f.u32()).map(|_| (f.u32(), f.u32())).collect();
        let one_five = LlavaProcessor {
            shortest_edge: size,
            crop: size,
            resample: Filter::Bicubic,
            values: Values { rescale_factor: 1.0 / 255.0, mean: CLIP_MEAN, std: CLIP_STD },
            pinpoints: Vec::new(),
        };
        let next = LlavaProcessor { pinpoints, ..one_five.clone() };
        let cases = f.u32();
        assert_eq!(cases, 12);
        let mut grids = 0;
        for _ in 0..cases {
            let is_next = f.u8() == 1;
            let (w, h) = (f.u32(), f.u32());
            let image = f.rgb(w, h);
            let tiles = f.u32() as usize;
            let expected = f.f32s(tiles * 3 * (size * size) as usize);
            let got = if is_next { next.preprocess(&image) } else { one_five.preprocess(&image) };
            let what = format!("{w}x{h} next {is_next}");
            assert_eq!(got.len(), expected.len(), "{what}: tiles");
            assert_eq!(got, expected, "{what}");
            grids += usize::from(tiles > 2);
        }
        f.done();
        assert!(grids > 0, "some NeXT image is cut into more than two tiles");
    }

    #[test]
    fn a_long_strip_is_cropped_without_being_made_whole() {
        // 1 x 16384 to shortest side 336 would be 336 x 5.5 million pixels (5.5 GB) whole.
        let strip = RgbImage::from_fn(1, 16_384, |_, y| image::Rgb([(y % 251) as u8, 7, 9]));
        let p = LlavaProcessor {
            shortest_edge: 336,
            crop: 336,
            resample: Filter::Bicubic,
            values: Values { rescale_factor: 1.0 / 255.0, mean: CLIP_MEAN, std: CLIP_STD },
            pinpoints: Vec::new(),
        };
        assert_eq!(p.preprocess(&strip).len(), 3 * 336 * 336);
    }

    #[test]
    fn shortest_side_and_crop_follow_the_reference() {
        assert_eq!(shortest_side(50, 30, 16), (26, 16));
        assert_eq!(shortest_side(30, 50, 16), (16, 26));
        // A crop larger than the image pads it with black, centred.
        let small = RgbImage::from_pixel(2, 2, image::Rgb([9, 9, 9]));
        let cropped = pad_to_square(&small, 4);
        assert_eq!(cropped.dimensions(), (4, 4));
        assert_eq!((cropped.get_pixel(0, 0).0, cropped.get_pixel(1, 1).0), ([0; 3], [9; 3]));
    }
}
