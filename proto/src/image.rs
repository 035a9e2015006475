//! Image bytes as requests carry them, decoded the one way both processes read them:
//! the format sniffed from the bytes (never from a name or a content type), only PNG,
//! JPEG, WebP and GIF (its first frame), EXIF orientation applied, alpha dropped
//! rather than composited (as PIL's `convert("RGB")`, which the reference processors
//! use), with limits on size so a small file cannot claim gigabytes of pixels.

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits, RgbImage};
use std::io::Cursor;

/// What an image may be, judged from its header before any pixel is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Longest side, in pixels.
    pub max_side: u32,
    /// Pixels in all (40 million: a large camera's photo); the decoder may allocate
    /// four bytes a pixel and a little more.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self { max_side: 16_384, max_pixels: 40_000_000 }
    }
}

/// Why bytes are not an image we read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the data is not an image (expected PNG, JPEG, WebP or GIF)")]
    NotAnImage,
    #[error("{0} images are not supported (send PNG, JPEG, WebP or GIF)")]
    Unsupported(&'static str),
    #[error("the image is {width}x{height} pixels; the limit is {max_side} a side and {max_pixels} pixels")]
    TooLarge { width: u32, height: u32, max_side: u32, max_pixels: u64 },
    #[error("the {format} image cannot be decoded: {reason}")]
    Corrupt { format: &'static str, reason: String },
}

/// A decoded image: its format and its pixels, RGB, rows top to bottom.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub format: &'static str,
    pub rgb: RgbImage,
}

/// The format the bytes' signature names, if it is one we read.
pub fn sniff(bytes: &[u8]) -> Result<&'static str, DecodeError> {
    kind(bytes).map(|(_, name)| name)
}

fn kind(bytes: &[u8]) -> Result<(ImageFormat, &'static str), DecodeError> {
    match image::guess_format(bytes) {
        Ok(f @ ImageFormat::Png) => Ok((f, "PNG")),
        Ok(f @ ImageFormat::Jpeg) => Ok((f, "JPEG")),
        Ok(f @ ImageFormat::WebP) => Ok((f, "WebP")),
        Ok(f @ ImageFormat::Gif) => Ok((f, "GIF")),
        Ok(other) => Err(DecodeError::Unsupported(other.extensions_str().first().copied().unwrap_or("these"))),
        Err(_) => Err(DecodeError::NotAnImage),
    }
}

/// An image's format and size (as shown: EXIF orientation applied), its bytes having
/// been decoded whole to prove them readable; the pixels are not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inspected {
    pub format: &'static str,
    pub width: u32,
    pub height: u32,
}

/// Decodes `bytes` within `limits`.
pub fn decode(bytes: &[u8], limits: ImageLimits) -> Result<Decoded, DecodeError> {
    let (format, image, orientation) = decode_raw(bytes, limits)?;
    let mut image = image;
    image.apply_orientation(orientation);
    Ok(Decoded { format, rgb: image.into_rgb8() })
}

/// What `decode` would give, without converting or turning the pixels.
pub fn inspect(bytes: &[u8], limits: ImageLimits) -> Result<Inspected, DecodeError> {
    use image::metadata::Orientation::{Rotate90, Rotate90FlipH, Rotate270, Rotate270FlipH};
    let (format, image, orientation) = decode_raw(bytes, limits)?;
    let (w, h) = (image.width(), image.height());
    let (width, height) =
        if matches!(orientation, Rotate90 | Rotate270 | Rotate90FlipH | Rotate270FlipH) { (h, w) } else { (w, h) };
    Ok(Inspected { format, width, height })
}

fn decode_raw(
    bytes: &[u8],
    limits: ImageLimits,
) -> Result<(&'static str, DynamicImage, image::metadata::Orientation), DecodeError> {
    let (image_format, format) = kind(bytes)?;
    let corrupt = |e: image::ImageError| DecodeError::Corrupt { format, reason: e.to_string() };
    let mut decoder = ImageReader::with_format(Cursor::new(bytes), image_format).into_decoder().map_err(corrupt)?;
    let (width, height) = decoder.dimensions();
    if width.max(height) > limits.max_side || width as u64 * height as u64 > limits.max_pixels {
        return Err(DecodeError::TooLarge { width, height, max_side: limits.max_side, max_pixels: limits.max_pixels });
    }
    if width == 0 || height == 0 {
        return Err(DecodeError::Corrupt { format, reason: "it has no pixels".into() });
    }
    let mut l = Limits::default();
    l.max_image_width = Some(limits.max_side);
    l.max_image_height = Some(limits.max_side);
    l.max_alloc = Some(limits.max_pixels * 4 + (16 << 20));
    decoder.set_limits(l).map_err(corrupt)?;
    // A file without EXIF reads as upright; one whose EXIF is unreadable too.
    let orientation = decoder.orientation().unwrap_or(image::metadata::Orientation::NoTransforms);
    let image = DynamicImage::from_decoder(decoder).map_err(corrupt)?;
    Ok((format, image, orientation))
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageEncoder, Rgba, RgbaImage};

    fn picture(w: u32, h: u32) -> RgbaImage {
        RgbaImage::from_fn(w, h, |x, y| Rgba([(x * 7) as u8, (y * 13) as u8, (x * y) as u8, (x + y) as u8]))
    }

    fn encoded(format: ImageFormat, img: &RgbaImage) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        match format {
            // JPEG has no alpha.
            ImageFormat::Jpeg => DynamicImage::ImageRgba8(img.clone()).to_rgb8().write_to(&mut out, format).unwrap(),
            _ => img.write_to(&mut out, format).unwrap(),
        }
        out.into_inner()
    }

    #[test]
    fn each_format_decodes_to_its_pixels_without_alpha() {
        let img = picture(37, 29);
        let rgb = DynamicImage::ImageRgba8(img.clone()).to_rgb8();
        for (format, name) in [(ImageFormat::Png, "PNG"), (ImageFormat::WebP, "WebP"), (ImageFormat::Gif, "GIF")] {
            let d = decode(&encoded(format, &img), ImageLimits::default()).unwrap();
            assert_eq!(d.format, name);
            assert_eq!(d.rgb.dimensions(), (37, 29), "{name}");
            if format != ImageFormat::Gif {
                // Lossless: alpha dropped, colour kept exactly (GIF quantises to a palette).
                assert_eq!(d.rgb, rgb, "{name}");
            }
        }
        let jpeg = decode(&encoded(ImageFormat::Jpeg, &img), ImageLimits::default()).unwrap();
        assert_eq!((jpeg.format, jpeg.rgb.dimensions()), ("JPEG", (37, 29)));
    }

    #[test]
    fn a_gif_reads_as_its_first_frame() {
        use image::codecs::gif::GifEncoder;
        use image::{Delay, Frame};
        let frame = |v: u8| {
            Frame::from_parts(
                RgbaImage::from_pixel(4, 3, Rgba([v, v, v, 255])),
                0,
                0,
                Delay::from_numer_denom_ms(100, 1),
            )
        };
        let mut bytes = Vec::new();
        GifEncoder::new(&mut bytes).encode_frames([frame(200), frame(10)]).unwrap();
        let d = decode(&bytes, ImageLimits::default()).unwrap();
        assert_eq!(d.rgb.get_pixel(0, 0).0, [200, 200, 200]);
    }

    #[test]
    fn what_is_not_a_readable_image_says_why() {
        let png = encoded(ImageFormat::Png, &picture(8, 8));
        assert_eq!(decode(b"hello, world", ImageLimits::default()).unwrap_err(), DecodeError::NotAnImage);
        // BMP and TIFF signatures: images, of formats we do not take.
        for header in [&b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0"[..], b"II*\0\x08\0\0\0"] {
            assert!(matches!(decode(header, ImageLimits::default()), Err(DecodeError::Unsupported(_))), "{header:?}");
        }
        // A PNG cut short.
        let cut = decode(&png[..png.len() / 2], ImageLimits::default()).unwrap_err();
        assert!(matches!(cut, DecodeError::Corrupt { format: "PNG", .. }), "{cut:?}");
        // Larger than allowed: refused from the header, before any pixel is allocated.
        let small = ImageLimits { max_side: 7, ..ImageLimits::default() };
        assert!(matches!(decode(&png, small), Err(DecodeError::TooLarge { width: 8, height: 8, .. })));
        let few = ImageLimits { max_pixels: 63, ..ImageLimits::default() };
        assert!(matches!(inspect(&png, few), Err(DecodeError::TooLarge { .. })));
        let seen = inspect(&png, ImageLimits::default()).unwrap();
        assert_eq!((seen.format, seen.width, seen.height), ("PNG", 8, 8));
    }

    #[test]
    fn a_decompression_bomb_is_refused_by_its_header() {
        // A valid PNG header claiming 100000 x 100000 pixels over a few bytes of data:
        // refused as too large, before any buffer is asked for.
        let mut bytes = Vec::new();
        image::codecs::png::PngEncoder::new(&mut bytes)
            .write_image(&[0; 3], 1, 1, image::ExtendedColorType::Rgb8)
            .unwrap();
        // IHDR: length (8..12), type (12..16), width and height (16..24), ..., CRC (29..33).
        bytes[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        bytes[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        let crc = crc32(&bytes[12..29]);
        bytes[29..33].copy_from_slice(&crc.to_be_bytes());
        let e = decode(&bytes, ImageLimits::default()).unwrap_err();
        assert!(matches!(e, DecodeError::TooLarge { width: 100_000, height: 100_000, .. }), "{e:?}");
    }

    /// PNG's CRC-32 (ISO 3309), bit by bit: the test's own header must be valid.
    fn crc32(data: &[u8]) -> u32 {
        let mut crc = u32::MAX;
        for &b in data {
            crc ^= b as u32;
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
            }
        }
        !crc
    }
}
