//! Image resizing with Pillow's numerics, bit for bit. The reference vision processors
//! (transformers' PIL backend) resize 8-bit RGB with `PIL.Image.resize` and nothing
//! else; general-purpose resizers (the `image` crate's, `fast_image_resize`) filter in
//! another order or precision and land a level or two away, which moves every pixel
//! value the encoder sees. So this follows Pillow's method:
//!
//! - per axis, `scale = in / out` and the filter stretched by `max(scale, 1)` (it
//!   averages over the source pixels an output pixel covers when shrinking);
//! - output pixel `x` weighs source pixels `[xmin, xmin + n)` around its centre
//!   `(x + 0.5) · scale`, the weights computed in f64, normalised to sum 1, then rounded
//!   to integers with 22 fractional bits (half away from zero);
//! - sums start at one half (`1 << 21`) and are shifted back and clamped to 0..=255;
//! - one pass writes 8-bit pixels, which the other reads: horizontal first (over only
//!   the rows the vertical pass reads), unless height shrinks by more than twice what
//!   width loses (Pillow 13); a pass whose size does not change is skipped, and an
//!   unchanged size is a copy.

use image::RgbImage;

/// Pillow's resampling filters (numbered as `PIL.Image.Resampling`, as processor
/// configurations write them), nearest-neighbour excepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Lanczos = 1,
    Bilinear = 2,
    Bicubic = 3,
    Box = 4,
    Hamming = 5,
}

impl Filter {
    /// A processor configuration's `resample` value.
    pub fn from_pil(value: u8) -> Option<Self> {
        Some(match value {
            1 => Self::Lanczos,
            2 => Self::Bilinear,
            3 => Self::Bicubic,
            4 => Self::Box,
            5 => Self::Hamming,
            _ => return None,
        })
    }

    /// How far from its centre the filter reaches, in source pixels at scale 1.
    fn support(self) -> f64 {
        match self {
            Self::Box => 0.5,
            Self::Bilinear | Self::Hamming => 1.0,
            Self::Bicubic => 2.0,
            Self::Lanczos => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Self::Box => {
                if x > -0.5 && x <= 0.5 {
                    1.0
                } else {
                    0.0
                }
            }
            Self::Bilinear => (1.0 - x.abs()).max(0.0),
            Self::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let px = x * std::f64::consts::PI;
                    // Single-precision constants, as Pillow writes them.
                    px.sin() / px * (0.54f32 as f64 + 0.46f32 as f64 * px.cos())
                }
            }
            Self::Bicubic => {
                // Keys' cubic with a = -0.5.
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
                } else {
                    0.0
                }
            }
            Self::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let px = x * std::f64::consts::PI;
    px.sin() / px
}

/// Fractional bits of the integer weights: 8-bit pixels times weights and their sum
/// stay inside an i32 (as in Pillow).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// One axis's weights: output `i` reads `len[i]` source pixels from `first[i]`, with
/// weights `weights[i * taps..][..len[i]]`.
struct Axis {
    first: Vec<usize>,
    len: Vec<usize>,
    taps: usize,
    weights: Vec<i32>,
}

impl Axis {
    /// The weights of outputs `window` (of `output`) over `input` source pixels.
    fn new(input: usize, output: usize, filter: Filter, window: std::ops::Range<usize>) -> Self {
        let scale = input as f64 / output as f64;
        let stretch = scale.max(1.0);
        let inverse = 1.0 / stretch;
        let support = filter.support() * stretch;
        let taps = support.ceil() as usize * 2 + 1;
        let n_out = window.len();
        let mut axis = Self { first: vec![0; n_out], len: vec![0; n_out], taps, weights: vec![0; n_out * taps] };
        let mut w = vec![0.0f64; taps];
        for (k, i) in window.enumerate() {
            let centre = (i as f64 + 0.5) * scale;
            // Truncated toward zero, then clamped, as Pillow's C casts do.
            let lo = ((centre - support + 0.5) as i64).max(0) as usize;
            let hi = ((centre + support + 0.5) as i64).min(input as i64) as usize;
            let n = hi.saturating_sub(lo).min(taps);
            let mut total = 0.0;
            for (j, w) in w[..n].iter_mut().enumerate() {
                *w = filter.weight((j as f64 + lo as f64 - centre + 0.5) * inverse);
                total += *w;
            }
            for (j, w) in w[..n].iter().enumerate() {
                let normalised = if total != 0.0 { w / total } else { *w };
                let scaled = normalised * (1u32 << PRECISION_BITS) as f64;
                axis.weights[k * taps + j] = if scaled < 0.0 { (scaled - 0.5) as i32 } else { (scaled + 0.5) as i32 };
            }
            axis.first[k] = lo;
            axis.len[k] = n;
        }
        axis
    }

    /// The window's output `i` from the source values `at(first + j)`.
    #[inline]
    fn apply(&self, i: usize, at: impl Fn(usize) -> u8) -> u8 {
        let mut sum: i32 = 1 << (PRECISION_BITS - 1);
        let (first, weights) = (self.first[i], &self.weights[i * self.taps..][..self.len[i]]);
        for (j, &w) in weights.iter().enumerate() {
            sum += at(first + j) as i32 * w;
        }
        (sum >> PRECISION_BITS).clamp(0, 255) as u8
    }
}

/// `image` resized to `width` × `height` as `PIL.Image.resize((width, height), filter)`
/// resizes an RGB image.
pub fn resize(image: &RgbImage, width: u32, height: u32, filter: Filter) -> RgbImage {
    let (width, height) = (width.max(1), height.max(1));
    resize_window(image, width, height, filter, Window { x: 0, y: 0, width, height })
}

/// A rectangle of an image: its top-left corner and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub x: u32,
    pub y: u32,
    pub width: u32,
    pub height: u32,
}

/// `window` of `image` resized to `width` × `height`: the pixels `resize` would give
/// there, without making the rest (a long strip resized and centre-cropped would
/// otherwise be made whole first). `window` lies inside `width` × `height`.
pub fn resize_window(image: &RgbImage, width: u32, height: u32, filter: Filter, window: Window) -> RgbImage {
    let (w_in, h_in) = (image.width() as usize, image.height() as usize);
    let (w_out, h_out) = (width.max(1) as usize, height.max(1) as usize);
    let (x, y) = (window.x as usize, window.y as usize);
    let (cw, ch) =
        ((window.width as usize).min(w_out - x.min(w_out)), (window.height as usize).min(h_out - y.min(h_out)));
    if (w_in, h_in) == (w_out, h_out) || w_in == 0 || h_in == 0 || cw == 0 || ch == 0 {
        return image::imageops::crop_imm(image, x as u32, y as u32, cw as u32, ch as u32).to_image();
    }
    let src = image.as_raw();
    let columns = (w_out != w_in).then(|| Axis::new(w_in, w_out, filter, x..x + cw));
    let rows = (h_out != h_in).then(|| Axis::new(h_in, h_out, filter, y..y + ch));
    let out = match (columns, rows) {
        (Some(columns), None) => horizontal(src, w_in, y..y + ch, &columns),
        (None, Some(rows)) => vertical(src, w_in, 0, &rows, x..x + cw),
        (Some(columns), Some(rows)) => {
            // Pillow 13 runs the vertical pass first when height shrinks by more than
            // twice what width loses (Pillow PR #9549); the order changes the 8-bit
            // rounding between the passes, so it is followed exactly.
            if h_out < h_in && (h_in - h_out) as i64 > 2 * (w_in as i64 - w_out as i64) {
                let tall = vertical(src, w_in, 0, &rows, 0..w_in);
                horizontal(&tall, w_in, 0..ch, &columns)
            } else {
                // Only the source rows the vertical pass reads.
                let from = rows.first[0];
                let to = rows.first[ch - 1] + rows.len[ch - 1];
                let wide = horizontal(src, w_in, from..to, &columns);
                vertical(&wide, cw, from, &rows, 0..cw)
            }
        }
        (None, None) => unreachable!("an unchanged size returned above"),
    };
    RgbImage::from_raw(cw as u32, ch as u32, out).expect("the buffer has the window's size")
}

/// Rows `rows` of `src` (`width` pixels each) resampled along x.
fn horizontal(src: &[u8], width: usize, rows: std::ops::Range<usize>, columns: &Axis) -> Vec<u8> {
    let w_out = columns.first.len();
    let mut out = vec![0u8; rows.len() * w_out * 3];
    for (line, y) in out.chunks_exact_mut(w_out * 3).zip(rows) {
        let row = &src[y * width * 3..][..width * 3];
        for x in 0..w_out {
            for c in 0..3 {
                line[x * 3 + c] = columns.apply(x, |p| row[p * 3 + c]);
            }
        }
    }
    out
}

/// Columns `columns` of `src` (`width` pixels a row, its first row being source row
/// `first_row`) resampled along y.
fn vertical(src: &[u8], width: usize, first_row: usize, rows: &Axis, columns: std::ops::Range<usize>) -> Vec<u8> {
    let cw = columns.len();
    let mut out = vec![0u8; rows.first.len() * cw * 3];
    for (y, line) in out.chunks_exact_mut(cw * 3).enumerate() {
        for (e, v) in line.iter_mut().enumerate() {
            let at = columns.start * 3 + e;
            *v = rows.apply(y, |p| src[(p - first_row) * width * 3 + at]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pillow's resizes (scripts/fixtures/pil_resize.py).
    fn fixture() -> (RgbImage, Vec<(Filter, RgbImage)>) {
        let mut f = crate::vision::Fixture::open("pil_resize.bin", b"PILRSZ1\0");
        let (w, h) = (f.u32(), f.u32());
        let source = f.rgb(w, h);
        let cases = (0..f.u32())
            .map(|_| {
                let filter = Filter::from_pil(f.u8()).unwrap();
                let (w, h) = (f.u32(), f.u32());
                (filter, f.rgb(w, h))
            })
            .collect();
        f.done();
        (source, cases)
    }

    #[test]
    fn every_filter_and_size_matches_pillow_bit_for_bit() {
        let (source, cases) = fixture();
        assert_eq!(cases.len(), 70);
        for (filter, expected) in cases {
            let got = resize(&source, expected.width(), expected.height(), filter);
            let differing = got.as_raw().iter().zip(expected.as_raw()).filter(|(a, b)| a != b).count();
            assert_eq!(differing, 0, "{filter:?} to {}x{}", expected.width(), expected.height());
        }
    }

    #[test]
    fn a_window_is_the_same_pixels_as_a_crop_of_the_whole() {
        let (source, cases) = fixture();
        for (filter, expected) in cases {
            let (w, h) = expected.dimensions();
            let window = Window { x: w / 3, y: h / 4, width: w.div_ceil(2), height: h.div_ceil(2) };
            let got = resize_window(&source, w, h, filter, window);
            let crop = image::imageops::crop_imm(&expected, window.x, window.y, window.width, window.height).to_image();
            assert_eq!(got, crop, "{filter:?} to {w}x{h}");
        }
    }

    #[test]
    fn shrinking_averages_and_enlarging_interpolates() {
        // Two columns, black and white: halved to one column they average to mid-grey
        // under every filter, whatever its shape.
        let img = RgbImage::from_fn(2, 1, |x, _| image::Rgb([(x * 255) as u8; 3]));
        for f in [Filter::Bilinear, Filter::Bicubic, Filter::Lanczos, Filter::Box, Filter::Hamming] {
            assert_eq!(resize(&img, 1, 1, f).get_pixel(0, 0).0, [128; 3], "{f:?}");
        }
        let wide = resize(&img, 8, 1, Filter::Bilinear);
        let row: Vec<u8> = (0..8).map(|x| wide.get_pixel(x, 0).0[0]).collect();
        assert!(row.windows(2).all(|p| p[0] <= p[1]) && row[0] == 0 && row[7] == 255, "{row:?}");
    }
}
