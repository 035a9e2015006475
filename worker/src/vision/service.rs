//! A request's images into features, beside the engine: decoded, hash checked, tiled
//! and encoded on a backend of the encoder's own (on a GPU: its own stream), through a
//! cache keyed by content hash and use. Requests in flight with the same image wait
//! for the one encoding rather than encode it again; finished features stay cached,
//! least recently used out first, up to a byte budget.

use super::placement::{PlacedImages, PlacementError};
use super::{Features, Use, VisionModel};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tessera_kernels::Backend;
use tessera_proto::image::{ImageLimits, decode};

/// One image of a request.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub data: Vec<u8>,
    pub sha256: [u8; 32],
    pub usage: Use,
}

/// Why a request's images cannot be used; `index` is the image's place in the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("images[{index}]: its sha256 does not match its bytes")]
    Hash { index: usize },
    #[error("images[{index}]: {reason}")]
    Unreadable { index: usize, reason: String },
    #[error("images[{index}]: the encoder failed: {reason}")]
    Encoder { index: usize, reason: String },
    #[error(transparent)]
    Placement(#[from] PlacementError),
}

/// Why one image could not be encoded (kept in its cache slot for the requests waiting
/// on it; `features` names the image's place for each).
#[derive(Debug, Clone)]
enum EncodeFailure {
    /// Its bytes are not an image we read: the request's doing.
    Unreadable(String),
    /// The tower failed on it: ours.
    Encoder(String),
}

type Key = ([u8; 32], Use);
type Slot = Arc<OnceLock<Result<Arc<Features>, EncodeFailure>>>;

struct Cache {
    slots: HashMap<Key, Slot>,
    /// Finished entries, least recently used first, with their bytes.
    order: VecDeque<(Key, usize)>,
    bytes: usize,
}

pub struct ImageEncoder<B: Backend> {
    backend: B,
    model: VisionModel<B>,
    cache: Mutex<Cache>,
    capacity_bytes: usize,
    limits: ImageLimits,
    /// Images encoded since start (cache misses that ran the tower).
    encoded: AtomicU64,
}

impl<B: Backend> ImageEncoder<B> {
    pub fn new(backend: B, model: VisionModel<B>, capacity_bytes: usize) -> Self {
        let cache = Cache { slots: HashMap::new(), order: VecDeque::new(), bytes: 0 };
        Self {
            backend,
            model,
            cache: Mutex::new(cache),
            capacity_bytes,
            limits: ImageLimits::default(),
            encoded: AtomicU64::new(0),
        }
    }

    pub fn model(&self) -> &VisionModel<B> {
        &self.model
    }

    /// Images the tower has encoded since start.
    pub fn encoded(&self) -> u64 {
        self.encoded.load(Ordering::Relaxed)
    }

    /// The prompt's images encoded (or found cached) and laid over its placeholders.
    /// Blocks while encoding: call it off the async runtime.
    pub fn place(&self, prompt: &[u32], images: &[ImageInput]) -> Result<PlacedImages, ImageError> {
        let mut encoded = Vec::with_capacity(images.len());
        for (index, image) in images.iter().enumerate() {
            if <[u8; 32]>::from(Sha256::digest(&image.data)) != image.sha256 {
                return Err(ImageError::Hash { index });
            }
            encoded.push((image.sha256, self.features(index, image)?));
        }
        PlacedImages::new(prompt, self.model.config.image_token_id, &encoded, self.model.hidden)
            .map_err(ImageError::from)
    }

    /// One image's features: cached, being encoded by another request (then waited
    /// for), or encoded now.
    fn features(&self, index: usize, image: &ImageInput) -> Result<Arc<Features>, ImageError> {
        let key = (image.sha256, image.usage);
        let slot = {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(at) = cache.order.iter().position(|(k, _)| *k == key) {
                let entry = cache.order.remove(at).expect("found above");
                cache.order.push_back(entry);
            }
            cache.slots.entry(key).or_default().clone()
        };
        let mut fresh = false;
        let result = slot.get_or_init(|| {
            fresh = true;
            self.encode(image)
        });
        match result {
            Ok(features) => {
                if fresh {
                    self.encoded.fetch_add(1, Ordering::Relaxed);
                    self.remember(key, features.rows.len() * 4);
                }
                Ok(features.clone())
            }
            Err(reason) => {
                // A failure is not cached: the slot goes, and the next request tries again.
                let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
                if cache.slots.get(&key).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                    cache.slots.remove(&key);
                }
                Err(match reason.clone() {
                    EncodeFailure::Unreadable(reason) => ImageError::Unreadable { index, reason },
                    EncodeFailure::Encoder(reason) => ImageError::Encoder { index, reason },
                })
            }
        }
    }

    fn encode(&self, image: &ImageInput) -> Result<Arc<Features>, EncodeFailure> {
        let decoded = decode(&image.data, self.limits).map_err(|e| EncodeFailure::Unreadable(e.to_string()))?;
        let prepared = self.model.prepare(&decoded.rgb, image.usage);
        self.model.encode(&self.backend, &prepared).map(Arc::new).map_err(|e| EncodeFailure::Encoder(e.to_string()))
    }

    /// Counts a finished entry against the budget, dropping the least recently used.
    fn remember(&self, key: Key, bytes: usize) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.order.push_back((key, bytes));
        cache.bytes += bytes;
        while cache.bytes > self.capacity_bytes && cache.order.len() > 1 {
            let Some((old, size)) = cache.order.pop_front() else { break };
            cache.bytes -= size;
            cache.slots.remove(&old);
        }
    }
}

/// What the gRPC service asks of an encoder, whatever its backend.
pub trait PlaceImages: Send + Sync {
    fn place(&self, prompt: &[u32], images: &[ImageInput]) -> Result<PlacedImages, ImageError>;
}

impl<B: Backend> PlaceImages for ImageEncoder<B> {
    fn place(&self, prompt: &[u32], images: &[ImageInput]) -> Result<PlacedImages, ImageError> {
        ImageEncoder::place(self, prompt, images)
    }
}
