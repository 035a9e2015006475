//! The vision path against transformers 5.23.0 on tiny random-weight models of both
//! families (`scripts/fixtures/vision_models.py` made them and recorded what they
//! compute): SmolVLM (SigLIP-style tower, pixel shuffle, tiles and a global image, a
//! 4-frame video prompt), LLaVA-1.5 (CLIP tower, layer −2, MLP projector) and LLaVA-NeXT
//! (any-resolution tiles, unpadding, newline rows). For each case:
//! - pixel values from the PNG files as the worker decodes them: max |Δ| ≤ 1e-6 (the
//!   resampler is Pillow's, bit for bit; the bound only allows for f32 printing);
//! - prompt ids, placeholders rendered by `tessera_proto::vision` and tokenized: exact;
//! - logits of the prefill at the recorded rows, the prompt run whole and in two chunks
//!   split inside the first image, and of greedy decoding after it: max |Δ| ≤ 1e-5 with
//!   logits up to ~3 (1.8e-6 measured; f32 in both, summed in other orders), and the
//!   same tokens.

use safetensors::SafeTensors;
use serde_json::Value;
use std::path::PathBuf;
use tessera_kernels::cpu::CpuBackend;
use tessera_proto::image::{ImageLimits, decode};
use tessera_proto::vision::{Idefics3Markers, llava_next_tokens};
use tessera_worker::load::{LoadedModel, load_model};
use tessera_worker::model::{KvCache, SeqInput};
use tessera_worker::vision::config::Processor;
use tessera_worker::vision::placement::{chunk, runs};
use tessera_worker::vision::{Use, VisionModel};

const LOGIT_BOUND: f32 = 1e-5;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/vision/models")
}

struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    fn open(family: &str) -> Self {
        let path = dir().join(format!("{family}.reference.safetensors"));
        Self { bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) }
    }

    fn tensor(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        (t.shape().to_vec(), t.data().to_vec())
    }

    fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, raw) = self.tensor(name);
        (shape, raw.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
    }

    fn u32s(&self, name: &str) -> Vec<u32> {
        let (_, raw) = self.tensor(name);
        raw.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32).collect()
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::MIN), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0 as u32
}

/// The prompt text with each `<image>` replaced by what the processor puts there for
/// that image (a video case's text comes already rendered).
fn render(vision: &VisionModel<CpuBackend>, text: &str, images: &[image::RgbImage], split: bool) -> String {
    let mut parts = text.split("<image>");
    let mut out = parts.next().unwrap().to_string();
    for (part, img) in parts.zip(images) {
        let placeholder = match &vision.config.processor {
            Processor::Idefics3 { processor, .. } => {
                let g = processor.geometry;
                g.placeholder(g.grid(img.width(), img.height(), split), &Idefics3Markers::default())
            }
            Processor::Llava(p) if !p.pinpoints.is_empty() => {
                let t = &vision.config.tower;
                let n = llava_next_tokens(img.height(), img.width(), &p.pinpoints, p.crop, t.grid()).unwrap();
                "<image>".repeat(n)
            }
            Processor::Llava(_) => "<image>".repeat(vision.config.tile_tokens),
        };
        out.push_str(&placeholder);
        out.push_str(part);
    }
    out
}

/// Runs the prompt in pieces ending at each of `cuts` (then the end), image rows put in
/// place, and returns the logits of every prompt token.
fn prefill(
    loaded: &LoadedModel<CpuBackend>,
    ids: &[u32],
    features: &[f32],
    cuts: &[usize],
) -> (Vec<f32>, KvCache<CpuBackend>) {
    let model = &loaded.model;
    let vision = loaded.vision.as_ref().unwrap();
    let hidden = model.config.hidden_size;
    let placed = runs(ids, vision.config.image_token_id, features.len() / hidden).unwrap();
    let blocks = ids.len().div_ceil(16) + 2;
    let mut kv = model.new_kv_cache(blocks, 16).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut logits = Vec::new();
    let mut start = 0;
    for &end in cuts.iter().chain([ids.len()].iter()) {
        let embeds = chunk(&placed, features, hidden, start, end);
        let seq =
            SeqInput { tokens: &ids[start..end], cached: start, block_table: &table, logits: true, embeds: &embeds };
        logits.extend(model.forward_scoring(&[seq], &mut kv, &[true]).unwrap());
        start = end;
    }
    (logits, kv)
}

fn check_family(family: &str) {
    let loaded = load_model(CpuBackend::exact(), &dir().join(family)).unwrap_or_else(|e| panic!("{family}: {e}"));
    let vision = loaded.vision.as_ref().expect("a vision model");
    let backend = loaded.model.backend();
    let vocab = loaded.model.config.vocab_size;
    let reference = Reference::open(family);
    let cases: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir().join(format!("{family}.cases.json"))).unwrap()).unwrap();
    assert!(!cases.is_empty());
    for (k, case) in cases.iter().enumerate() {
        let video = case["video"].as_bool().unwrap_or(false);
        let split = case["splitting"].as_bool().unwrap_or(true);
        let images: Vec<image::RgbImage> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                let bytes = std::fs::read(dir().join("images").join(f.as_str().unwrap())).unwrap();
                decode(&bytes, ImageLimits::default()).unwrap().rgb
            })
            .collect();
        let usage = if video { Use::Frame } else { Use::Image { split } };

        // Pixel values.
        let prepared: Vec<_> = images.iter().map(|img| vision.prepare(img, usage)).collect();
        let pixels: Vec<f32> = prepared.iter().flat_map(|p| p.pixels.iter().copied()).collect();
        let (_, want) = reference.f32s(&format!("{k}.pixel_values"));
        let d = max_diff(&pixels, &want);
        assert!(d <= 1e-6, "{family} case {k}: pixel values differ by {d}");

        // Prompt ids.
        let text = case["text"].as_str().unwrap();
        let rendered = if video { text.to_string() } else { render(vision, text, &images, split) };
        let ids = loaded.tokenizer.encode(&rendered).unwrap();
        let want_ids = reference.u32s(&format!("{k}.input_ids"));
        assert_eq!(ids, want_ids, "{family} case {k}: prompt ids");

        // Features, then logits with the prompt whole and cut inside the first image.
        let mut features = Vec::new();
        for p in &prepared {
            features.extend(vision.encode(backend, p).unwrap().rows);
        }
        let keep: Vec<usize> = case["keep"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let (shape, want) = reference.f32s(&format!("{k}.prefill_logits"));
        assert_eq!(shape, [keep.len(), vocab]);
        let first_image = ids.iter().position(|&t| t == vision.config.image_token_id).unwrap();
        let inside = first_image + 3;
        let mut worst = 0.0f32;
        for cuts in [&[][..], &[inside][..]] {
            let (logits, _) = prefill(&loaded, &ids, &features, cuts);
            let got: Vec<f32> = keep.iter().flat_map(|&r| logits[r * vocab..(r + 1) * vocab].iter().copied()).collect();
            let d = max_diff(&got, &want);
            assert!(d <= LOGIT_BOUND, "{family} case {k} (cut at {cuts:?}): prefill logits differ by {d}");
            worst = worst.max(d);
        }

        // Greedy decoding after the image.
        let tokens = reference.u32s(&format!("{k}.decode_tokens"));
        let (steps, want) = reference.f32s(&format!("{k}.decode_logits"));
        let (logits, mut kv) = prefill(&loaded, &ids, &features, &[]);
        let last = &logits[(ids.len() - 1) * vocab..];
        assert_eq!(argmax(last), tokens[0], "{family} case {k}: first token");
        let table: Vec<u32> = (0..kv.num_blocks as u32).collect();
        for step in 0..steps[0] {
            let pos = ids.len() + step;
            let seq = SeqInput {
                tokens: &tokens[step..step + 1],
                cached: pos,
                block_table: &table,
                logits: true,
                embeds: &[],
            };
            let got = loaded.model.forward(&[seq], &mut kv).unwrap();
            let d = max_diff(&got, &want[step * vocab..(step + 1) * vocab]);
            assert!(d <= LOGIT_BOUND, "{family} case {k}: decode step {step} logits differ by {d}");
            assert_eq!(argmax(&got), tokens[step + 1], "{family} case {k}: decode token {}", step + 1);
            worst = worst.max(d);
        }
        eprintln!(
            "{family} case {k}: {} prompt tokens, {} image rows, logits within {worst:e}",
            ids.len(),
            features.len() / vision.hidden
        );
    }
}

#[test]
fn smolvlm_matches_transformers() {
    check_family("smolvlm");
}

#[test]
fn llava_matches_transformers() {
    check_family("llava");
}

#[test]
fn llava_next_matches_transformers() {
    check_family("llava_next");
}
