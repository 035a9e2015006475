//! Image bytes as requests carry them, decoded the one way both processes read them:
//! the format sniffed from the bytes (never from a name or a content type), only PNG,
//! JPEG, WebP and GIF (its first frame), EXIF orientation applied, alpha dropped
//! rather than composited (as PIL's `convert("RGB")`, which the reference processors
//! use), with limits on size so a small file cannot claim gigabytes of pixels.

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits, RgbImage};
use std::io::Cursor;

/// What an image may be, before any pixel is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Longest side, in pixels.
    pub max_side: u32,
    /// Bytes the decoder may allocate.
    pub max_alloc: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        // 16k a side covers any camera; 512 MiB of decoder memory any such image.
        Self { max_side: 16_384, max_alloc: 512 << 20 }
    }
}

/// Why bytes are not an image we read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the data is not an image (expected PNG, JPEG, WebP or GIF)")]
    NotAnImage,
    #[error("{0} images are not supported (send PNG, JPEG, WebP or GIF)")]
    Unsupported(&'static str),
    #[error("the image is {width}x{height} pixels; the limit is {max} a side")]
    TooLarge { width: u32, height: u32, max: u32 },
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
    match image::guess_format(bytes) {
        Ok(ImageFormat::Png) => Ok("PNG"),
        Ok(ImageFormat::Jpeg) => Ok("JPEG"),
        Ok(ImageFormat::WebP) => Ok("WebP"),
        Ok(ImageFormat::Gif) => Ok("GIF"),
        Ok(other) => Err(DecodeError::Unsupported(other.extensions_str().first().copied().unwrap_or("these"))),
        Err(_) => Err(DecodeError::NotAnImage),
    }
}

/// Decodes `bytes` within `limits`.
pub fn decode(bytes: &[u8], limits: ImageLimits) -> Result<Decoded, DecodeError> {
    let format = sniff(bytes)?;
    let corrupt = |e: image::ImageError| DecodeError::Corrupt { format, reason: e.to_string() };
    let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|_| DecodeError::NotAnImage)?;
    let mut decoder = reader.into_decoder().map_err(corrupt)?;
    let (width, height) = decoder.dimensions();
    if width.max(height) > limits.max_side {
        return Err(DecodeError::TooLarge { width, height, max: limits.max_side });
    }
    if width == 0 || height == 0 {
        return Err(DecodeError::Corrupt { format, reason: "it has no pixels".into() });
    }
    let mut l = Limits::default();
    l.max_image_width = Some(limits.max_side);
    l.max_image_height = Some(limits.max_side);
    l.max_alloc = Some(limits.max_alloc);
    decoder.set_limits(l).map_err(corrupt)?;
    // A file without EXIF reads as upright; one whose EXIF is unreadable too.
    let orientation = decoder.orientation().unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut image = DynamicImage::from_decoder(decoder).map_err(corrupt)?;
    image.apply_orientation(orientation);
    Ok(Decoded { format, rgb: image.into_rgb8() })
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
        assert_eq!(decode(&png, small).unwrap_err(), DecodeError::TooLarge { width: 8, height: 8, max: 7 });
    }

    #[test]
    fn a_decompression_bomb_is_refused_by_its_header() {
        // A PNG header claiming 100000 x 100000 pixels over a few bytes of data.
        let mut bytes = Vec::new();
        image::codecs::png::PngEncoder::new(&mut bytes)
            .write_image(&[0; 3], 1, 1, image::ExtendedColorType::Rgb8)
            .unwrap();
        // IHDR's width and height sit at bytes 16..24; its CRC no longer matches, which
        // is also refused — either way no 30 GB buffer is asked for.
        bytes[16..20].copy_from_slice(&100_000u32.to_be_bytes());
        bytes[20..24].copy_from_slice(&100_000u32.to_be_bytes());
        assert!(decode(&bytes, ImageLimits::default()).is_err());
    }
}
