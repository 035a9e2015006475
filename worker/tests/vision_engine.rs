//! Images through the engine, on the tiny SmolVLM of `tests/data/vision/models`:
//! - the prefix cache keys blocks holding an image's tokens by the image's content: the
//!   same image with the same text hits, another image with the same text misses from
//!   the first block holding an image token on;
//! - an image cut by chunked prefill (a token budget of 16) gives the tokens it gives
//!   unchunked;
//! - the encoder cache encodes an image once, however many requests carry it at once;
//! - with speculative decoding on, an image prompt gives the tokens it gives without.

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use tessera_kernels::cpu::CpuBackend;
use tessera_proto::block_hash::BLOCK_TOKENS;
use tessera_proto::vision::Idefics3Markers;
use tessera_worker::engine::core::{EngineConfig, EngineCore, Output, Request};
use tessera_worker::engine::speculate::{SpecConfig, SpecMethod, StepCosts};
use tessera_worker::load::{LoadedModel, load_model};
use tessera_worker::vision::Use;
use tessera_worker::vision::config::Processor;
use tessera_worker::vision::placement::PlacedImages;
use tessera_worker::vision::service::{ImageEncoder, ImageError, ImageInput};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/vision/models")
}

fn loaded() -> LoadedModel<CpuBackend> {
    load_model(CpuBackend::exact(), &dir().join("smolvlm")).unwrap()
}

fn image(name: &str) -> ImageInput {
    let data = std::fs::read(dir().join("images").join(name)).unwrap();
    let sha256 = Sha256::digest(&data).into();
    ImageInput { data, sha256, usage: Use::Image { split: true } }
}

/// "User:" + the image's placeholder + a question, tokenized.
fn prompt(l: &LoadedModel<CpuBackend>, img: &ImageInput) -> Vec<u32> {
    let rgb = tessera_proto::image::decode(&img.data, Default::default()).unwrap().rgb;
    let Processor::Idefics3 { processor, .. } = &l.vision.as_ref().unwrap().config.processor else { unreachable!() };
    let g = processor.geometry;
    let placeholder = g.placeholder(g.grid(rgb.width(), rgb.height(), true), &Idefics3Markers::default());
    let text = format!("User:{placeholder}Describe the picture in one sentence.<end_of_utterance>\nAssistant:");
    l.tokenizer.encode(&text).unwrap()
}

fn run(e: &mut EngineCore<CpuBackend>) -> HashMap<u64, (Vec<u32>, usize)> {
    let mut done: HashMap<u64, (Vec<u32>, usize)> = HashMap::new();
    while e.has_work() {
        for Output { id, token, cached_prompt_tokens, .. } in e.step().unwrap() {
            let d = done.entry(id).or_default();
            d.0.extend(token.map(|t| t.token));
            d.1 = cached_prompt_tokens;
        }
    }
    done
}

struct Setup {
    engine: EngineCore<CpuBackend>,
    encoder: ImageEncoder<CpuBackend>,
    loaded_prompts: HashMap<&'static str, Vec<u32>>,
}

fn setup(config: EngineConfig) -> Setup {
    let l = loaded();
    let loaded_prompts =
        ["wide.png", "tall.png"].into_iter().map(|n| (n, prompt(&l, &image(n)))).collect::<HashMap<_, _>>();
    let LoadedModel { model, tokenizer, vision } = l;
    let encoder = ImageEncoder::new(CpuBackend::exact(), vision.unwrap(), 1 << 20);
    Setup { engine: EngineCore::new(model, tokenizer, config, "tiny-smolvlm").unwrap(), encoder, loaded_prompts }
}

fn request(s: &Setup, id: u64, prompt_of: &str, image_name: &str) -> Request {
    let prompt = s.loaded_prompts[prompt_of].clone();
    let placed = s.encoder.place(&prompt, &[image(image_name)]).unwrap();
    Request { images: Some(Arc::new(placed)), ..Request::greedy(id, prompt, 6) }
}

#[test]
fn the_prefix_cache_hits_the_same_image_and_never_another_one() {
    let mut s = setup(EngineConfig::default());
    let first = request(&s, 1, "wide.png", "wide.png");
    let image_start = first.images.as_ref().unwrap().spans[0].start;
    let len = first.prompt.len();
    s.engine.add_request(first).unwrap();
    let alone = run(&mut s.engine).remove(&1).unwrap();
    assert_eq!(alone.1, 0);

    // The same image and text: every whole block but the last token's is served.
    s.engine.add_request(request(&s, 2, "wide.png", "wide.png")).unwrap();
    let again = run(&mut s.engine).remove(&2).unwrap();
    assert_eq!(again.1, (len - 1) / BLOCK_TOKENS * BLOCK_TOKENS, "the same image hits");
    assert_eq!(again.0, alone.0);

    // Another image of the same size: the same tokens, another content. Only the
    // blocks before the first one holding an image token may be shared.
    s.engine.add_request(request(&s, 3, "wide.png", "tall.png")).unwrap_or_else(|e| panic!("{e}"));
    let other = run(&mut s.engine).remove(&3).unwrap();
    assert_eq!(other.1, image_start / BLOCK_TOKENS * BLOCK_TOKENS, "another image misses from its first block");
    assert!(other.1 < again.1);
}

#[test]
fn an_image_cut_by_chunked_prefill_gives_the_same_tokens() {
    let mut whole = setup(EngineConfig::default());
    whole.engine.add_request(request(&whole, 1, "wide.png", "wide.png")).unwrap();
    let want = run(&mut whole.engine).remove(&1).unwrap().0;
    let mut chunked = setup(EngineConfig { max_num_batched_tokens: 16, ..EngineConfig::default() });
    let r = request(&chunked, 1, "wide.png", "wide.png");
    let span = r.images.as_ref().unwrap().spans[0];
    assert!(span.start / 16 != (span.end - 1) / 16, "the image straddles a chunk boundary");
    chunked.engine.add_request(r).unwrap();
    assert_eq!(run(&mut chunked.engine).remove(&1).unwrap().0, want);
}

#[test]
fn the_encoder_cache_encodes_an_image_once_for_requests_in_flight() {
    let s = setup(EngineConfig::default());
    let prompt = s.loaded_prompts["wide.png"].clone();
    let placed: Vec<PlacedImages> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            (0..4).map(|_| scope.spawn(|| s.encoder.place(&prompt, &[image("wide.png")]).unwrap())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(s.encoder.encoded(), 1, "four requests, one encoding");
    assert!(placed.windows(2).all(|w| w[0].spans == w[1].spans));
    // Another use of the same bytes (no tiling) is another encoding.
    let low = ImageInput { usage: Use::Image { split: false }, ..image("wide.png") };
    assert!(s.encoder.place(&prompt, &[low]).is_err(), "its placeholders differ, so the prompt does not fit it");
    assert_eq!(s.encoder.encoded(), 2);
    // A wrong hash and unreadable bytes are the request's fault, named by index.
    let mut bad = image("wide.png");
    bad.sha256[0] ^= 1;
    assert_eq!(s.encoder.place(&prompt, &[bad]).unwrap_err(), ImageError::Hash { index: 0 });
    let junk = b"not an image".to_vec();
    let junk = ImageInput { sha256: Sha256::digest(&junk).into(), data: junk, usage: Use::Frame };
    assert!(matches!(s.encoder.place(&prompt, &[junk]), Err(ImageError::Unreadable { index: 0, .. })));
}

#[test]
fn speculation_gives_an_image_prompt_its_tokens() {
    let run_with = |speculative| {
        let mut s = setup(EngineConfig { speculative, ..EngineConfig::default() });
        s.engine.pin_spec_costs(Some(StepCosts::free()));
        for (id, (text, img)) in [("wide.png", "wide.png"), ("tall.png", "tall.png")].into_iter().enumerate() {
            let r = request(&s, id as u64, text, img);
            s.engine.add_request(Request { max_tokens: 24, ..r }).unwrap();
        }
        (run(&mut s.engine), s.engine.spec_stats().cloned())
    };
    let (off, _) = run_with(None);
    let (on, stats) = run_with(Some(SpecConfig { method: SpecMethod::Ngram, max_tokens: 4, draft: None }));
    assert_eq!(on, off);
    assert!(stats.unwrap().drafts > 0, "proposals were verified");
}
