//! The vision path on the worker's backend: images encoded per second, and the time to
//! first token of a one-image request, at `detail: low` (one tile) and `auto` (tiles
//! and a global one). The encoder has SmolVLM2-256M's shapes with random weights (no
//! vision weights can be fetched here; the cost is the shapes': a SigLIP-B/16 tower at
//! 512 px, 1,024 patches a tile, pixel shuffle 4, 64 tokens a tile) over the real
//! SmolLM2-135M decoder, which is SmolVLM2-256M's.

use crate::round;
use anyhow::{Context, Result};
use safetensors::{Dtype, tensor::TensorView};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use tessera_kernels::Backend;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::engine::core::{EngineConfig, EngineCore, Request};
use tessera_worker::vision::Use;
use tessera_worker::vision::config::Processor;
use tessera_worker::vision::service::{ImageEncoder, ImageInput};
use tessera_worker::{device, load, model_cache};

#[derive(clap::Args)]
pub struct Args {
    /// cpu, or cuda for the encoder (the engine's decoder runs where `--device` opens).
    #[arg(long, value_enum, default_value_t = device::Device::Cpu)]
    device: device::Device,
    /// The picture's size.
    #[arg(long, default_value_t = 1024)]
    width: u32,
    #[arg(long, default_value_t = 768)]
    height: u32,
    /// Images encoded for the per-second figure at `detail: low`.
    #[arg(long, default_value_t = 4)]
    images: usize,
}

/// SmolVLM2-256M's vision tower and connector.
const HIDDEN: usize = 768;
const INTERMEDIATE: usize = 3072;
const LAYERS: usize = 12;
const HEADS: usize = 12;
const IMAGE: usize = 512;
const PATCH: usize = 16;
const SCALE: usize = 4;
/// SmolLM2-135M's width, and a token id its vocabulary has, standing for `<image>`.
const TEXT_HIDDEN: usize = 576;
const IMAGE_TOKEN: u32 = 49_151;

pub fn run(args: Args) -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_model(dir.path())?;
    match device::open(args.device, 0)? {
        device::Opened::Cpu(b) => bench(b, dir.path(), &args),
        #[cfg(feature = "cuda")]
        device::Opened::Cuda(b) => bench(*b, dir.path(), &args),
    }
}

fn bench<B: Backend + 'static>(backend: B, dir: &Path, args: &Args) -> Result<()> {
    let device = backend.name();
    let model = load::open_vision(&backend, dir, TEXT_HIDDEN)?.context("the benchmark's model has no vision half")?;
    let encoder = Arc::new(ImageEncoder::new(backend, model, 1 << 30));
    let decoder =
        load::load_model(CpuBackend::default(), &model_cache::resolve(model_cache::SMOLLM2_135M_INSTRUCT.name)?)?;
    let mut engine = EngineCore::new(decoder.model, decoder.tokenizer, EngineConfig::default(), "bench")?;
    let text =
        engine.tokenizer().encode("Describe this picture in one sentence.").map_err(|e| anyhow::anyhow!("{e}"))?;

    let mut seed = 1u64;
    let mut picture = || {
        seed += 1;
        png(args.width, args.height, seed)
    };
    // Images per second: distinct pictures (the cache never hits), one tile each.
    let mut low_ms = Vec::new();
    for _ in 0..args.images {
        let image = input(picture()?, false);
        let started = Instant::now();
        encode(&encoder, &image, (args.width, args.height), &text)?;
        low_ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    let tile_count = |split| tiles(&encoder, args.width, args.height, split);
    let mut out = json!({
        "bench": "vision",
        "device": device,
        "model": "SmolVLM2-256M shapes, random weights (SigLIP-B/16 at 512 px, 64 tokens a tile) + SmolLM2-135M",
        "picture": format!("{}x{}", args.width, args.height),
        "low_tiles": tile_count(false),
        "auto_tiles": tile_count(true),
        "low_encode_ms": low_ms.iter().map(|v| round(*v)).collect::<Vec<_>>(),
        "low_images_per_s": round(low_ms.len() as f64 / (low_ms.iter().sum::<f64>() / 1e3)),
    });
    // Time to first token of a one-image request: encode, then prefill, to the first token.
    for (name, split) in [("low", false), ("auto", true)] {
        let image = input(picture()?, split);
        let started = Instant::now();
        let (placed, tokens) = encode(&encoder, &image, (args.width, args.height), &text)?;
        let encoded = started.elapsed();
        let prompt_len = tokens.len();
        let request = Request { images: Some(Arc::new(placed)), ..Request::greedy(1, tokens, 1) };
        engine.add_request(request)?;
        while engine.has_work() {
            if engine.step()?.iter().any(|o| o.token.is_some()) {
                break;
            }
        }
        let ttft = started.elapsed();
        out[format!("{name}_prompt_tokens")] = json!(prompt_len);
        out[format!("{name}_request_encode_ms")] = json!(round(encoded.as_secs_f64() * 1e3));
        out[format!("{name}_ttft_ms")] = json!(round(ttft.as_secs_f64() * 1e3));
        while engine.has_work() {
            engine.step()?;
        }
    }
    println!("{out}");
    Ok(())
}

fn input(data: Vec<u8>, split: bool) -> ImageInput {
    let sha256 = Sha256::digest(&data).into();
    ImageInput { data, sha256, usage: Use::Image { split } }
}

/// Encodes `image` (`width` × `height`) for a prompt of `text` around its placeholder
/// tokens; the prompt is returned with the placed rows.
fn encode<B: Backend>(
    encoder: &ImageEncoder<B>,
    image: &ImageInput,
    (width, height): (u32, u32),
    text: &[u32],
) -> Result<(tessera_worker::vision::placement::PlacedImages, Vec<u32>)> {
    let split = image.usage == (Use::Image { split: true });
    let rows = tiles(encoder, width, height, split) * (IMAGE / PATCH) * (IMAGE / PATCH) / (SCALE * SCALE);
    let mut prompt = text.to_vec();
    prompt.extend(std::iter::repeat_n(IMAGE_TOKEN, rows));
    prompt.extend_from_slice(text);
    let placed = encoder.place(&prompt, std::slice::from_ref(image)).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((placed, prompt))
}

/// Tiles the processor cuts a `width` × `height` picture into, from its geometry alone.
fn tiles<B: Backend>(encoder: &ImageEncoder<B>, width: u32, height: u32, split: bool) -> usize {
    let Processor::Idefics3 { processor, .. } = &encoder.model().config.processor else { return 1 };
    let (rows, cols) = processor.geometry.grid(width, height, split);
    (rows * cols) as usize + 1
}

/// A `width` × `height` PNG of gradients and noise.
fn png(width: u32, height: u32, seed: u64) -> Result<Vec<u8>> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let img = image::RgbImage::from_fn(width, height, |x, y| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let n = (state & 63) as u32;
        image::Rgb([((x * 255 / width) + n).min(255) as u8, ((y * 255 / height) + n).min(255) as u8, (n * 4) as u8])
    });
    let mut bytes = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png)?;
    Ok(bytes)
}

/// The vision half of a SmolVLM2-256M-shaped directory, random bf16 weights.
fn write_model(dir: &Path) -> Result<()> {
    let config = json!({
        "architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm", "scale_factor": SCALE,
        "image_token_id": IMAGE_TOKEN,
        "text_config": {"model_type": "llama", "hidden_size": TEXT_HIDDEN, "intermediate_size": 1536,
                        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152},
        "vision_config": {"model_type": "smolvlm_vision", "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
                          "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "image_size": IMAGE,
                          "patch_size": PATCH, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    });
    let processor = json!({"image_seq_len": 64, "image_processor": {
        "do_image_splitting": true, "max_image_size": {"longest_edge": IMAGE}, "size": {"longest_edge": 2048},
        "resample": 1, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1.0 / 255.0,
        "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": IMAGE}}}});
    std::fs::write(dir.join("config.json"), config.to_string())?;
    std::fs::write(dir.join("processor_config.json"), processor.to_string())?;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("embeddings.patch_embedding.weight".into(), vec![HIDDEN, 3, PATCH, PATCH]),
        ("embeddings.patch_embedding.bias".into(), vec![HIDDEN]),
        ("embeddings.position_embedding.weight".into(), vec![(IMAGE / PATCH).pow(2), HIDDEN]),
        ("post_layernorm.weight".into(), vec![HIDDEN]),
        ("post_layernorm.bias".into(), vec![HIDDEN]),
    ];
    for l in 0..LAYERS {
        for (name, shape) in [
            ("self_attn.q_proj", vec![HIDDEN, HIDDEN]),
            ("self_attn.k_proj", vec![HIDDEN, HIDDEN]),
            ("self_attn.v_proj", vec![HIDDEN, HIDDEN]),
            ("self_attn.out_proj", vec![HIDDEN, HIDDEN]),
            ("mlp.fc1", vec![INTERMEDIATE, HIDDEN]),
            ("mlp.fc2", vec![HIDDEN, INTERMEDIATE]),
        ] {
            shapes.push((format!("encoder.layers.{l}.{name}.bias"), vec![shape[0]]));
            shapes.push((format!("encoder.layers.{l}.{name}.weight"), shape));
        }
        for norm in ["layer_norm1", "layer_norm2"] {
            shapes.push((format!("encoder.layers.{l}.{norm}.weight"), vec![HIDDEN]));
            shapes.push((format!("encoder.layers.{l}.{norm}.bias"), vec![HIDDEN]));
        }
    }
    let mut named: Vec<(String, Vec<usize>)> =
        shapes.into_iter().map(|(n, s)| (format!("model.vision_model.{n}"), s)).collect();
    named.push(("model.connector.modality_projection.proj.weight".into(), vec![TEXT_HIDDEN, HIDDEN * SCALE * SCALE]));
    // The decoder is loaded apart (SmolLM2's own file): its name only marks the layout.
    named.push(("model.text_model.embed_tokens.weight".into(), vec![1, 1]));
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = named
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let norm = name.contains("norm") && name.ends_with("weight");
            let bytes = (0..n)
                .flat_map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    let v = if norm { 1.0 + 0.1 * u } else { 0.04 * u };
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let views: BTreeMap<String, TensorView<'_>> = data
        .iter()
        .map(|(name, shape, bytes)| Ok((name.clone(), TensorView::new(Dtype::BF16, shape.clone(), bytes)?)))
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    Ok(())
}
