//! Image input for vision-language models: the reference processors' preprocessing,
//! reproduced exactly (`resize`: Pillow's resampling), the vision towers and connectors
//! of the Idefics3 / SmolVLM and LLaVA / LLaVA-NeXT families (`encoder`), and where
//! their checkpoints keep each part (`names`).

pub mod config;
pub mod encoder;
pub mod idefics3;
pub mod llava;
pub mod names;
pub mod placement;
pub mod resize;
pub mod service;
mod tower;

pub use config::VisionConfig;
pub use encoder::{Features, Prepared, Use, VisionModel};

/// How a processor turns 8-bit pixels into the encoder's input.
#[derive(Debug, Clone, PartialEq)]
pub struct Values {
    pub rescale_factor: f64,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Values {
    /// `tile`'s pixels appended to `out` channels first, each rescaled (in f64, then
    /// f32) and normalised (in f32), as the reference processors compute them.
    pub fn push(&self, tile: &image::RgbImage, out: &mut Vec<f32>) {
        for c in 0..3 {
            out.extend(tile.pixels().map(|p| {
                let x = (p.0[c] as f64 * self.rescale_factor) as f32;
                (x - self.mean[c]) / self.std[c]
            }));
        }
    }
}

/// Reads the fixtures the scripts under `scripts/fixtures/` write: little-endian fields
/// after a magic string.
#[cfg(test)]
pub(crate) struct Fixture {
    bytes: Vec<u8>,
    at: usize,
}

#[cfg(test)]
impl Fixture {
    pub fn open(name: &str, magic: &[u8; 8]) -> Self {
        let path = format!("{}/tests/data/vision/{name}", env!("CARGO_MANIFEST_DIR"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(&bytes[..8], magic, "{path}");
        Self { bytes, at: 8 }
    }

    pub fn take(&mut self, n: usize) -> &[u8] {
        self.at += n;
        &self.bytes[self.at - n..self.at]
    }

    pub fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }

    pub fn rgb(&mut self, width: u32, height: u32) -> image::RgbImage {
        let raw = self.take((width * height * 3) as usize).to_vec();
        image::RgbImage::from_raw(width, height, raw).unwrap()
    }

    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        self.take(n * 4).chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }

    /// Every byte was read.
    pub fn done(&self) {
        assert_eq!(self.at, self.bytes.len(), "bytes left in the fixture");
    }
}
