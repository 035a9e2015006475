//! An image in a request, from the part that names it (`ImagePart`, found by
//! `api::messages::image_parts`) to what the prompt shows (`Visual`): its bytes fetched
//! (`fetch`: data URIs, and http(s) under limits and guarded against server-side
//! request forgery by `address`), then decoded (`tessera_proto::image`) so that every
//! bad image is refused here, by the part that named it, before a worker sees the
//! request. (`chat::vision` places what is loaded in a vision model's prompt.)

mod address;
mod fetch;

pub use fetch::Fetcher;

use crate::catalog::CatalogModel;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;
use tessera_proto::image::{DecodeError, ImageLimits, inspect};
use tokio::sync::Semaphore;

/// How images are fetched and what they may be (ServeConfig / ApiArgs).
#[derive(Debug, Clone)]
pub struct ImageConfig {
    /// Largest image file, in bytes (fetched or inline).
    pub max_bytes: usize,
    /// Time for a whole fetch, connection included.
    pub timeout: Duration,
    /// Redirects a fetch follows.
    pub max_redirects: usize,
    /// Fetch from loopback, private and link-local addresses too (trusted networks only).
    pub allow_internal: bool,
    /// Images (or video frames) one request may carry.
    pub max_images: usize,
    /// Their bytes together: what one message to a worker may carry, less room for the
    /// prompt (`tessera_proto::MAX_MESSAGE_BYTES`).
    pub max_total_bytes: usize,
    pub limits: ImageLimits,
}

impl Default for ImageConfig {
    fn default() -> Self {
        Self {
            max_bytes: 20_000_000,
            timeout: Duration::from_secs(10),
            max_redirects: 3,
            allow_internal: false,
            max_images: 64,
            max_total_bytes: tessera_proto::MAX_MESSAGE_BYTES - (4 << 20),
            limits: ImageLimits::default(),
        }
    }
}

/// Why an image part cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{0}")]
    BadUrl(String),
    #[error("{0}")]
    Refused(String),
    #[error("the image could not be fetched: {0}")]
    Unreachable(String),
    #[error("the image could not be fetched in time")]
    TimedOut,
    #[error("the image is larger than the limit of {}", size_words(*.0))]
    TooLarge(usize),
    #[error("{0}")]
    Decode(#[from] DecodeError),
    #[error("a request may carry at most {0} images or video frames")]
    TooMany(usize),
    #[error("the request's images together are larger than the limit of {}", size_words(*.0))]
    TooLargeTogether(usize),
}

/// Each part's place and address.
fn pairs(parts: &[ImagePart]) -> Vec<(String, String)> {
    parts.iter().map(|p| (p.param.clone(), p.url.clone())).collect()
}

fn size_words(bytes: usize) -> String {
    if bytes >= 1_000_000 { format!("{} MB", bytes / 1_000_000) } else { format!("{bytes} bytes") }
}

/// Why a request's images cannot be shown to its model, naming the part at fault
/// (`messages[0].content[1].image_url`).
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("Invalid image: {error}.")]
    Part { param: String, error: ImageError },
    #[error(
        "Image input for {model} needs vision weights: this deployment serves it from '{weights}', a text-only \
         model, so it cannot see images. Serve a vision model directory under this id to accept them."
    )]
    TextOnly { param: String, model: String, weights: String },
}

impl ImageError {
    fn at(self, param: &str) -> Refused {
        Refused::Part { param: param.to_string(), error: self }
    }
}

/// An image part of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePart {
    /// Where it is: `messages[0].content[1].image_url`.
    pub param: String,
    pub url: String,
    pub detail: Option<String>,
    /// It comes right after another image part of the same content (a video's frames
    /// do).
    pub follows: bool,
}

/// How a part asked to be seen: Idefics3 tiles an image unless told `low`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detail {
    Auto,
    Low,
    High,
}

impl Detail {
    pub fn parse(value: Option<&str>) -> Self {
        match value {
            Some("low") => Self::Low,
            Some("high") => Self::High,
            _ => Self::Auto,
        }
    }

    pub(crate) fn split(self) -> bool {
        self != Self::Low
    }
}

/// What one place of the prompt shows: an image, or a video's frames.
#[derive(Debug, Clone)]
pub enum Visual {
    Image { image: LoadedImage, detail: Detail },
    Video { frames: Vec<LoadedImage> },
}

/// An image ready for a vision model: its bytes (what travels to the worker, which
/// decodes them next to its encoder), their SHA-256 (the encoder cache's and the
/// prefix cache's key), and its size (what its token count depends on).
#[derive(Debug, Clone)]
pub struct LoadedImage {
    pub bytes: Vec<u8>,
    pub sha256: [u8; 32],
    pub format: &'static str,
    pub width: u32,
    pub height: u32,
}

/// Fetching and checking images.
#[derive(Clone)]
pub struct Images {
    fetcher: Fetcher,
    config: ImageConfig,
    /// Decodes at once, process-wide: each may hold a large image's pixels, so a
    /// request with many large images waits its turn rather than multiplying memory.
    decoding: Arc<Semaphore>,
}

impl Images {
    pub fn new(config: ImageConfig) -> anyhow::Result<Self> {
        let decoding = Arc::new(Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get().min(4))));
        Ok(Self { fetcher: Fetcher::new(config.clone())?, config, decoding })
    }

    /// Each `(param, url)` loaded, fetches at once, or the first part (in request
    /// order) that fails, as a 400 naming it.
    pub async fn load_all(&self, parts: &[(String, String)]) -> Result<Vec<LoadedImage>, Refused> {
        if let Some((param, _)) = parts.get(self.config.max_images) {
            return Err(ImageError::TooMany(self.config.max_images).at(param));
        }
        let loads = parts.iter().map(|(_, url)| self.load(url));
        let loaded = futures_util::future::join_all(loads).await;
        let loaded: Vec<LoadedImage> = loaded
            .into_iter()
            .zip(parts)
            .map(|(r, (param, _))| r.map_err(|e| e.at(param)))
            .collect::<Result<_, _>>()?;
        // Named by the part that takes the total over.
        let mut total = 0;
        for (image, (param, _)) in loaded.iter().zip(parts) {
            total += image.bytes.len();
            if total > self.config.max_total_bytes {
                return Err(ImageError::TooLargeTogether(self.config.max_total_bytes).at(param));
            }
        }
        Ok(loaded)
    }

    /// A request's images loaded, so that a bad one is named, then refused: no worker
    /// of this deployment encodes images for `model`, whose weights are text-only.
    pub async fn refuse_unseen(&self, parts: &[ImagePart], model: &CatalogModel) -> Result<(), Refused> {
        let Some(first) = parts.first().map(|p| p.param.clone()) else { return Ok(()) };
        self.load_all(&pairs(parts)).await?;
        Err(Refused::TextOnly { param: first, model: model.id.clone(), weights: model.weights.clone() })
    }

    /// A vision model's request images loaded and grouped as the prompt shows them:
    /// where the model takes `video`, a run of parts that follow one another is one
    /// video's frames; otherwise each part is an image.
    pub async fn visuals(&self, parts: &[ImagePart], video: bool) -> Result<Vec<Visual>, Refused> {
        let loaded = self.load_all(&pairs(parts)).await?;
        let mut out: Vec<Visual> = Vec::with_capacity(parts.len());
        for (part, image) in parts.iter().zip(loaded) {
            match out.last_mut() {
                Some(Visual::Video { frames }) if video && part.follows => frames.push(image),
                Some(last) if video && part.follows => {
                    let Visual::Image { image: first, .. } = last.clone() else { unreachable!("matched above") };
                    *last = Visual::Video { frames: vec![first, image] };
                }
                _ => out.push(Visual::Image { image, detail: Detail::parse(part.detail.as_deref()) }),
            }
        }
        Ok(out)
    }

    /// One image: fetched, then decoded off the async threads (its pixels are dropped:
    /// the worker decodes the same bytes again beside its encoder).
    pub async fn load(&self, url: &str) -> Result<LoadedImage, ImageError> {
        let bytes = self.fetcher.bytes(url).await?;
        let limits = self.config.limits;
        let _turn = self.decoding.acquire().await.expect("the semaphore is never closed");
        let (bytes, inspected) = tokio::task::spawn_blocking(move || {
            let inspected = inspect(&bytes, limits);
            (bytes, inspected)
        })
        .await
        .map_err(|_| DecodeError::Corrupt { format: "image", reason: "the decoder failed on it".into() })?;
        let seen = inspected?;
        let sha256 = Sha256::digest(&bytes).into();
        Ok(LoadedImage { sha256, format: seen.format, width: seen.width, height: seen.height, bytes })
    }
}
