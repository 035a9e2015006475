//! The CUDA backend under the whole model and the engine: logits against the CPU's on
//! random models of every decoder variant, and the engine's batching-invariance and
//! prefix-cache properties on the GPU. Without a GPU each test prints why and passes;
//! `TESSERA_GPU_TESTS=1 cargo test --workspace gpu_` makes a missing GPU a failure.
//!
//! The same engine checks also run on the CPU over the same tiny model, so the test
//! code itself is exercised where there is no GPU.

#![cfg(feature = "cuda")]

mod tiny_models;

use half::bf16;
use rand::Rng;
use rand::rngs::StdRng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_kernels::Backend;
use tessera_kernels::cpu::CpuBackend;
use tessera_kernels::cuda::CudaBackend;
use tessera_kernels::pick::{Draw, PickRow};
use tessera_worker::engine::core::{EngineConfig, EngineCore, FinishReason, Handoff, Output, Request};
use tessera_worker::engine::kv_tier::TierConfig;
use tessera_worker::engine::sampler::{SamplerState, SamplingParams, argmax, sample};
use tessera_worker::engine::speculate::{SpecConfig, SpecMethod, StepCosts};
use tessera_worker::engine::thinking::ThinkingBudget;
use tessera_worker::load::load_model;
use tessera_worker::loader::safetensors_dir::SafetensorsDir;
use tessera_worker::model::shard::Shard;
use tessera_worker::model::{Model, SeqInput, kv_block_bytes};
use tessera_worker::model::{ModelConfig, weights};
use tessera_worker::model_cache::{self, KnownModel};
use tiny_models::quantised::{Int4, Scales, write_fp8, write_int4};
use tiny_models::{Variant, Weights, random_weights, variants, wide, write_byte_tokenizer, write_dir};

fn gpu() -> Option<CudaBackend> {
    CudaBackend::for_tests()
}

fn rng() -> StdRng {
    tiny_models::seeded_rng()
}

/// Writes `v` with random weights already rounded to bf16, so both backends hold the
/// same numbers, and the byte-level tokenizer; returns the directory. Projections are
/// scaled to variance 1/cols, as trained models keep them: with the tiny models' fixed
/// scale a 512-wide model saturates its softmaxes and amplifies any rounding.
fn write_model(v: &Variant, rng: &mut StdRng, root: &Path) -> PathBuf {
    let mut weights = scaled_weights(v, rng);
    for (_, data) in weights.values_mut() {
        data.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
    }
    let dir = root.join(v.name);
    write_dir(&dir, &v.config, &weights);
    write_byte_tokenizer(&dir);
    dir
}

/// Random weights with projections scaled to variance 1/cols.
fn scaled_weights(v: &Variant, rng: &mut StdRng) -> Weights {
    let mut weights = random_weights(&v.config, rng);
    for (name, (shape, data)) in weights.iter_mut() {
        let scale =
            if shape.len() == 2 && !name.contains("embed") { (1.0 / shape[1] as f32).sqrt() / 0.23 } else { 1.0 };
        data.iter_mut().for_each(|x| *x *= scale);
    }
    weights
}

fn temp_root(name: &str) -> PathBuf {
    tiny_models::temp_root(&format!("gpu-{name}"))
}

/// Logits of a prefill of `prompt[..split]` then one decode per remaining token.
fn logits<B: Backend>(model: &Model<B>, prompt: &[u32], split: usize) -> Vec<Vec<f32>> {
    tiny_models::prefill_then_decode(model, prompt, split, 16)
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite GPU logits");
    let num: f64 = got.iter().zip(want).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// bf16 activations through a few layers: the relative error of the logits stays well
/// under 5e-2 (about 1e-2 seen); a wrong kernel gives errors of order 1.
#[test]
fn gpu_logits_match_cpu_for_every_decoder_variant() {
    let Some(g) = gpu() else { return };
    drop(g);
    let mut rng = rng();
    let root = temp_root("logits");
    for v in variants().into_iter().chain([wide()]) {
        let dir = write_model(&v, &mut rng, &root);
        let cpu = load_model(CpuBackend::exact(), &dir).unwrap().model;
        let gpu = load_model(CudaBackend::new(0).unwrap(), &dir).unwrap().model;
        let vocab = cpu.config.vocab_size as u32;
        let prompt: Vec<u32> = (0..40).map(|_| rng.random_range(0..vocab.min(256))).collect();
        let (want, got) = (logits(&cpu, &prompt, 30), logits(&gpu, &prompt, 30));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = rel_err(g, w);
            assert!(err < 5e-2, "{}: step {i} logits differ by {err}", v.name);
        }
    }
    let _ = std::fs::remove_dir_all(root);
}

/// Quantised checkpoints of the wide model (FP8 with per-tensor and per-row scales, FP8
/// with 128 × 128 blocks, AWQ 4-bit in groups of 32) load onto the GPU with their
/// projections packed, and give the CPU's logits on the same checkpoint within the
/// bf16 bound above.
#[test]
fn gpu_quantised_checkpoints_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let root = temp_root("quantised");
    let v = wide();
    let weights = scaled_weights(&v, &mut rng);
    let dirs = [
        ("fp8-rows", &[Scales::Tensor, Scales::Row][..], None),
        ("fp8-blocks", &[Scales::Blocks(128, 128)][..], None),
        ("awq", &[][..], Some(32)),
    ];
    for (label, layouts, group) in dirs {
        let dir = root.join(label);
        match group {
            None => drop(write_fp8(&dir, &v.config, &weights, layouts)),
            Some(group) => drop(write_int4(&dir, &v.config, &weights, Int4::Awq, group)),
        }
        write_byte_tokenizer(&dir);
        let source = SafetensorsDir::open(&dir).unwrap();
        let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
        let on_gpu = weights::load(&g, &config, &source, Shard::WHOLE).unwrap();
        for (what, w) in [("qkv", &on_gpu.layers[0].qkv), ("down", &on_gpu.layers[0].down)] {
            assert!(w.device_bytes() < w.rows * w.cols * 2, "{label}: {what} is packed ({} bytes)", w.device_bytes());
        }
        let cpu = load_model(CpuBackend::exact(), &dir).unwrap().model;
        let gpu = load_model(CudaBackend::new(0).unwrap(), &dir).unwrap().model;
        let prompt: Vec<u32> = (0..40).map(|_| rng.random_range(0..256)).collect();
        let (want, got) = (logits(&cpu, &prompt, 30), logits(&gpu, &prompt, 30));
        // FP8 prompts are prefilled W8A8 on FP8 tensor cores (activations rounded to
        // E4M3, ~2.5 % a product), and their K/V carry it into every step: a wider bound
        // there, its first measurement due on a device.
        let bound = if label.starts_with("fp8") { 0.12 } else { 5e-2 };
        let worst = got.iter().zip(&want).map(|(g, w)| rel_err(g, w)).fold(0.0, f64::max);
        eprintln!("{label}: logits within {worst:.4} of the CPU's over {} steps", got.len());
        assert!(worst < bound, "{label}: logits differ by {worst} (bound {bound})");
    }
    let _ = std::fs::remove_dir_all(root);
}

fn engine<B: Backend + 'static>(backend: B, dir: &Path, num_blocks: usize) -> EngineCore<B> {
    let loaded = load_model(backend, dir).unwrap();
    let config = EngineConfig { num_blocks, ..EngineConfig::default() };
    EngineCore::new(loaded.model, loaded.tokenizer, config, "wide").unwrap()
}

/// Steps until every request has finished; each one's tokens and cached prompt count.
fn run_all<B: Backend>(e: &mut EngineCore<B>) -> HashMap<u64, (Vec<u32>, usize)> {
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

/// Request `i` of the batching test: greedy, or every fourth one sampled with a seed.
fn mixed_request(id: u64, i: usize, prompt: &[u32]) -> Request {
    let mut r = Request::greedy(id, prompt.to_vec(), 12);
    if i % 4 == 3 {
        r.params =
            SamplingParams { temperature: 0.8, top_k: 50, top_p: 0.95, seed: Some(i as u64), ..Default::default() };
    }
    r
}

/// 32 concurrent requests, greedy and seeded samples, produce the tokens each produces
/// alone.
fn batching_invariance<B: Backend + 'static>(backend: impl Fn() -> B, dir: &Path) {
    let mut e = engine(backend(), dir, 512);
    let prompts: Vec<Vec<u32>> =
        (0..32).map(|i| e.tokenizer().encode(&format!("Fact {i} about the number {}:", i * 37)).unwrap()).collect();
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            e.add_request(mixed_request(i as u64, i, p)).unwrap();
            run_all(&mut e).remove(&(i as u64)).unwrap().0
        })
        .collect();
    let mut e = engine(backend(), dir, 512);
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(mixed_request(100 + i as u64, i, p)).unwrap();
    }
    let batched = run_all(&mut e);
    assert!(e.stats().steps < 32 * 12, "the requests ran together ({} steps)", e.stats().steps);
    for (i, want) in solo.iter().enumerate() {
        assert_eq!(&batched[&(100 + i as u64)].0, want, "request {i}");
    }
}

/// A request sharing a 1,000-token prefix with an earlier one computes at most one
/// block of it, says how much came from the cache, and gives the cold run's tokens.
fn prefix_cache<B: Backend + 'static>(backend: impl Fn() -> B, dir: &Path) {
    let mut e = engine(backend(), dir, 512);
    let prefix: String = (0..1000).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let prompt = e.tokenizer().encode(&format!("{prefix} and then?")).unwrap();
    assert!(prompt.len() > 1000);
    e.add_request(Request::greedy(1, prompt.clone(), 8)).unwrap();
    let cold = run_all(&mut e).remove(&1).unwrap();
    assert_eq!(cold.1, 0, "nothing cached before the first request");
    e.add_request(Request::greedy(2, prompt.clone(), 8)).unwrap();
    let warm = run_all(&mut e).remove(&2).unwrap();
    assert_eq!(warm.0, cold.0, "the cached prefix changes nothing in the output");
    assert!(warm.1 >= 1000 - 16, "only {} of {} prompt tokens came from the cache", warm.1, prompt.len());
}

#[test]
fn gpu_engine_batches_exactly_like_solo_runs_and_reuses_prefixes() {
    let Some(g) = gpu() else { return };
    drop(g);
    let root = temp_root("engine");
    let dir = write_model(&wide(), &mut rng(), &root);
    let open = || CudaBackend::new(0).unwrap();
    batching_invariance(open, &dir);
    prefix_cache(open, &dir);
    let _ = std::fs::remove_dir_all(root);
}

/// The same checks on the CPU: they hold there too, and CI runs this code without a GPU.
#[test]
fn cpu_engine_on_the_tiny_byte_model_batches_like_solo_runs_and_reuses_prefixes() {
    let root = temp_root("engine-cpu");
    let dir = write_model(&wide(), &mut rng(), &root);
    batching_invariance(CpuBackend::default, &dir);
    prefix_cache(CpuBackend::default, &dir);
    let _ = std::fs::remove_dir_all(root);
}

fn engine_with_tier<B: Backend + 'static>(backend: B, dir: &Path, num_blocks: usize, host_bytes: u64) -> EngineCore<B> {
    let loaded = load_model(backend, dir).unwrap();
    let kv_tiers = TierConfig { host_bytes, disk: None, identity: "wide".into() };
    let config = EngineConfig { num_blocks, kv_tiers, ..EngineConfig::default() };
    EngineCore::new(loaded.model, loaded.tokenizer, config, "wide").unwrap()
}

/// KV blocks saved in one batch (each layer half of all of them in one copy) are the
/// blocks saved one by one, and loaded in one batch into other blocks they read back
/// the same.
fn kv_blocks_round_trip<B: Backend>(model: &Model<B>) {
    let mut kv = model.new_kv_cache(24, 16).unwrap();
    let prompt: Vec<u32> = (0..128).map(|i| (i * 13 % 256) as u32).collect();
    let table: Vec<u32> = (0..8).collect();
    let seqs = [SeqInput { tokens: &prompt, cached: 0, block_table: &table, logits: false, embeds: &[] }];
    model.forward(&seqs, &mut kv).unwrap();
    let ids = [5, 1, 6, 2];
    let batch = model.save_kv_blocks(&kv, &ids).unwrap();
    for (&id, saved) in ids.iter().zip(&batch) {
        assert_eq!(&model.save_kv_blocks(&kv, &[id]).unwrap()[0], saved, "block {id}");
    }
    assert_ne!(batch[0], batch[1], "blocks hold their own tokens");
    let blocks: Vec<&[u8]> = batch.iter().map(|b| b.as_slice()).collect();
    model.load_kv_blocks(&mut kv, &[20, 17, 23, 18], &blocks).unwrap();
    assert_eq!(model.save_kv_blocks(&kv, &[20, 17, 23, 18]).unwrap(), batch);
    assert!(model.load_kv_blocks(&mut kv, &[20], &[&batch[0][1..]]).is_err(), "a short block is refused");
}

/// Prefixes evicted to the host tier come back with the tokens the big cache gives;
/// and a request handed over after its first token (its blocks exported, then
/// imported by another engine) goes on there with the tokens of one engine.
fn tier_and_handoff<B: Backend + 'static>(backend: impl Fn() -> B, dir: &Path) {
    let block = {
        let e = engine(backend(), dir, 4);
        let c = e.config();
        2 * c.num_layers * c.kv_width() * 16 * 2
    } as u64;
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| (0..200).map(|j| ((i * 31 + j * 7) % 256) as u32).collect()).collect();
    let run = |e: &mut EngineCore<B>, base: u64| -> Vec<Vec<u32>> {
        // Twice through: the second pass finds each prefix in the cache or the tier.
        (0..2)
            .flat_map(|pass| prompts.iter().enumerate().map(move |(i, p)| (pass, i, p)))
            .map(|(pass, i, p)| {
                let id = base + (pass * 10 + i) as u64;
                e.add_request(Request::greedy(id, p.clone(), 6)).unwrap();
                run_all(e).remove(&id).unwrap().0
            })
            .collect()
    };
    let want = run(&mut engine(backend(), dir, 512), 0);
    // 16 blocks: two prompts' worth; the rest moves to the host tier and back.
    let mut tiered = engine_with_tier(backend(), dir, 16, 128 * block);
    assert_eq!(run(&mut tiered, 100), want);
    let hits = tiered.scheduler().tiers().unwrap().stats().host_hits;
    assert!(hits >= 60, "prefixes came back from the host tier: {hits} blocks");

    // The handoff: the first token and 12 blocks from one engine, the rest from another.
    let mut prefill = engine(backend(), dir, 64);
    let mut decode = engine_with_tier(backend(), dir, 64, 64 * block);
    let prompt = prompts[0].clone();
    let whole = {
        let mut e = engine(backend(), dir, 64);
        e.add_request(Request::greedy(1, prompt.clone(), 10)).unwrap();
        run_all(&mut e).remove(&1).unwrap().0
    };
    prefill
        .add_request(Request { handoff: Some(Handoff { skip_blocks: 0 }), ..Request::greedy(2, prompt.clone(), 10) })
        .unwrap();
    let mut first = Vec::new();
    let mut blocks = None;
    while prefill.has_work() {
        for o in prefill.step().unwrap() {
            first.extend(o.token.map(|t| t.token));
            if o.handoff.is_some() {
                assert_eq!(o.finish, Some(FinishReason::Handoff));
                blocks = o.handoff;
            }
        }
    }
    let blocks = Arc::try_unwrap(blocks.expect("the handoff's blocks")).unwrap();
    assert_eq!((first.len(), blocks.len()), (1, 12));
    assert_eq!(decode.import_kv(blocks).unwrap(), (12, 0));
    decode.add_request(Request { resume: first.clone(), ..Request::greedy(3, prompt.clone(), 10) }).unwrap();
    let (rest, cached) = run_all(&mut decode).remove(&3).unwrap();
    assert_eq!(cached, 192, "the prompt's 12 blocks came from the prefill engine");
    assert_eq!([first, rest].concat(), whole);

    // A thinking budget of 0: the close is forced from the first token, and the handoff
    // waits for its end (a replay could not tell a close under way), then goes on the
    // same on the other engine.
    let close = prefill.tokenizer().encode("\n</think>\n\n").unwrap();
    let budget = ThinkingBudget {
        inside: true,
        open: "<think>".into(),
        close: "</think>".into(),
        close_tokens: close.clone(),
        budget: 0,
    };
    let thinking = |id, resume: Vec<u32>, handoff| Request {
        thinking: Some(budget.clone()),
        ignore_eos: true,
        resume,
        handoff,
        ..Request::greedy(id, prompt.clone(), 12)
    };
    let whole = {
        let mut e = engine(backend(), dir, 64);
        e.add_request(thinking(4, Vec::new(), None)).unwrap();
        run_all(&mut e).remove(&4).unwrap().0
    };
    assert_eq!(&whole[..close.len()], close.as_slice());
    prefill.add_request(thinking(5, Vec::new(), Some(Handoff { skip_blocks: 12 }))).unwrap();
    let first = run_all(&mut prefill).remove(&5).unwrap().0;
    assert_eq!(first, close, "handed over once the close was out");
    decode.add_request(thinking(6, first.clone(), None)).unwrap();
    let rest = run_all(&mut decode).remove(&6).unwrap().0;
    assert_eq!([first, rest].concat(), whole);
}

#[test]
fn gpu_kv_blocks_move_in_batches_through_the_tier_and_a_handoff() {
    let Some(g) = gpu() else { return };
    drop(g);
    let root = temp_root("kv-moves");
    let dir = write_model(&wide(), &mut rng(), &root);
    kv_blocks_round_trip(&load_model(CudaBackend::new(0).unwrap(), &dir).unwrap().model);
    tier_and_handoff(|| CudaBackend::new(0).unwrap(), &dir);
    let _ = std::fs::remove_dir_all(root);
}

/// The same on the CPU (CI runs this code without a GPU).
#[test]
fn cpu_kv_blocks_move_in_batches_through_the_tier_and_a_handoff() {
    let root = temp_root("kv-moves-cpu");
    let dir = write_model(&wide(), &mut rng(), &root);
    kv_blocks_round_trip(&load_model(CpuBackend::default(), &dir).unwrap().model);
    tier_and_handoff(CpuBackend::default, &dir);
    let _ = std::fs::remove_dir_all(root);
}

/// A spent thinking budget forces its close on any backend (the step that forces is
/// sampled on the host), and a request beside it in the batch gets its solo tokens.
fn thinking_budget<B: Backend + 'static>(backend: impl Fn() -> B, dir: &Path) {
    let mut e = engine(backend(), dir, 512);
    let thinking = e.tokenizer().encode("Think about the number 7:").unwrap();
    let other = e.tokenizer().encode("Fact about the number 9:").unwrap();
    let close = e.tokenizer().encode("\n</think>\n\n").unwrap();
    e.add_request(Request::greedy(1, other.clone(), 16)).unwrap();
    let solo = run_all(&mut e).remove(&1).unwrap().0;
    let budget = ThinkingBudget {
        inside: true,
        open: "<think>".into(),
        close: "</think>".into(),
        close_tokens: close.clone(),
        budget: 5,
    };
    // Past its end of sequence too: a random model's end would become the close early.
    let r = Request { thinking: Some(budget), ignore_eos: true, ..Request::greedy(2, thinking, 16) };
    e.add_request(r).unwrap();
    e.add_request(Request::greedy(3, other, 16)).unwrap();
    let done = run_all(&mut e);
    assert_eq!(&done[&2].0[5..5 + close.len()], close.as_slice(), "the close right after 5 tokens");
    assert_eq!(done[&3].0, solo, "the request beside it is unchanged");
}

#[test]
fn gpu_thinking_budget_forces_its_close_like_the_cpu() {
    let Some(g) = gpu() else { return };
    drop(g);
    let root = temp_root("thinking");
    let dir = write_model(&wide(), &mut rng(), &root);
    thinking_budget(|| CudaBackend::new(0).unwrap(), &dir);
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn cpu_thinking_budget_forces_its_close_on_the_tiny_byte_model() {
    let root = temp_root("thinking-cpu");
    let dir = write_model(&wide(), &mut rng(), &root);
    thinking_budget(CpuBackend::default, &dir);
    let _ = std::fs::remove_dir_all(root);
}

/// Speculation changes no token: the same requests (greedy and seeded samples, every
/// proposal verified) with it off and on — n-grams, and the model drafting for itself
/// (its draft forwards on the device too) — give the same tokens, and proposals were
/// verified. On a GPU a verification is a prefill-shaped chunk beside decodes that run
/// without it as graphs.
fn speculation<B: Backend + 'static>(backend: impl Fn() -> B, dir: &Path) {
    let prompts: Vec<String> = (0..8).map(|i| format!("abc abc abc {i} abc abc {i} abc abc {i} abc")).collect();
    let run = |spec: Option<SpecConfig>| {
        let loaded = load_model(backend(), dir).unwrap();
        let drafts = spec.as_ref().is_some_and(|s| s.method == SpecMethod::Draft);
        let config = EngineConfig { num_blocks: 512, speculative: spec, ..EngineConfig::default() };
        let mut e = match drafts {
            true => {
                let draft = load_model(backend(), dir).unwrap().model;
                EngineCore::with_draft(loaded.model, draft, loaded.tokenizer, config, "wide").unwrap()
            }
            false => EngineCore::new(loaded.model, loaded.tokenizer, config, "wide").unwrap(),
        };
        e.pin_spec_costs(Some(StepCosts::free()));
        for (i, p) in prompts.iter().enumerate() {
            let prompt = e.tokenizer().encode(p).unwrap();
            e.add_request(mixed_request(i as u64, i, &prompt)).unwrap();
        }
        let done = run_all(&mut e);
        assert_eq!(e.spec_held_blocks(), 0, "the draft's blocks came back");
        (done, e.spec_stats().cloned())
    };
    let (off, _) = run(None);
    let ngram = SpecConfig { method: SpecMethod::Ngram, max_tokens: 4, draft: None };
    let draft = SpecConfig { method: SpecMethod::Draft, max_tokens: 4, draft: Some("itself".into()) };
    for spec in [ngram, draft] {
        let method = spec.method;
        let (on, stats) = run(Some(spec));
        for (id, want) in &off {
            assert_eq!(on[id].0, want.0, "request {id}, {method:?}");
        }
        let stats = stats.unwrap();
        assert!(stats.drafts > 0, "{method:?}: {stats:?}");
        eprintln!("{method:?}: {} of {} proposed tokens accepted", stats.accepted_tokens, stats.draft_tokens);
    }
}

#[test]
fn gpu_speculation_gives_the_tokens_of_plain_decoding() {
    let Some(g) = gpu() else { return };
    drop(g);
    let root = temp_root("speculation");
    let dir = write_model(&wide(), &mut rng(), &root);
    speculation(|| CudaBackend::new(0).unwrap(), &dir);
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn cpu_speculation_gives_the_tokens_of_plain_decoding_on_the_tiny_byte_model() {
    let root = temp_root("speculation-cpu");
    let dir = write_model(&wide(), &mut rng(), &root);
    speculation(CpuBackend::default, &dir);
    let _ = std::fs::remove_dir_all(root);
}

/// Chat prompts of the real-model check, in SmolLM2's template.
const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paper clip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short tip for writing clean code.",
    "Who wrote the play Romeo and Juliet?",
];

/// Logits less their mean: softmax ignores a common shift, and a shift alone would
/// dominate the relative error of logits whose mean is near zero (seen on Qwen2.5: a
/// mean of -0.04 against 0.50 after int8 products, the same top tokens).
fn centred(logits: &[f32]) -> Vec<f32> {
    let mean = logits.iter().map(|&x| x as f64).sum::<f64>() / logits.len().max(1) as f64;
    logits.iter().map(|&x| (x as f64 - mean) as f32).collect()
}

/// 32 greedy tokens (past any end of sequence) for each prompt, all in one batch.
fn greedy_32<B: Backend>(mut e: EngineCore<B>, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(Request { ignore_eos: true, ..Request::greedy(i as u64, p.clone(), 32) }).unwrap();
    }
    let mut done = run_all(&mut e);
    (0..prompts.len() as u64).map(|i| done.remove(&i).unwrap().0).collect()
}

/// A real model (SmolLM2-135M-Instruct, Q4_1; on the GPU also Qwen2.5-Coder-0.5B-Instruct
/// when it is in the cache) against the CPU's exact path (f32 over the dequantised
/// weights) on 8 chat prompts (ChatML, both models' template). Both lossy paths (bf16
/// weights and activations on the GPU; int8 products on the CPU's served path) stay near
/// it: the logits of a prefill and 8 decode steps within `max_err` relative (L2, each less
/// its mean; a wrong kernel gives errors of order 1), the same top token at 85 % of those
/// steps, the same first greedy token on 6 of the 8 prompts, and 32 identical greedy
/// tokens (batched on each backend) on at least `min_identical` prompts: a small model's
/// logits hold near ties that any rounding can flip, after which the two texts part (the
/// CPU's served path kept 3 of 8 on SmolLM2). The figures go to stderr as one JSON line
/// before any assertion. The model must be in the cache: a GPU machine without network
/// gets it with `scripts/model-parts`.
fn real_model_against_the_exact_cpu<B: Backend + 'static>(
    model: &KnownModel,
    label: &str,
    backend: impl Fn() -> B,
    max_err: f64,
    min_identical: usize,
) {
    let path = model_cache::resolve(model.name)
        .unwrap_or_else(|e| panic!("{e}: a GPU machine gets {} with scripts/model-parts", model.file_name));
    let exact = load_model(CpuBackend::exact(), &path).unwrap();
    let tested = load_model(backend(), &path).unwrap();
    let prompts: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| exact.tokenizer.encode(&format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")).unwrap())
        .collect();
    let (mut worst, mut steps, mut same_top) = (0f64, 0, 0);
    for p in &prompts {
        let split = p.len() - 8;
        let (want, got) = (logits(&exact.model, p, split), logits(&tested.model, p, split));
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max(rel_err(&centred(g), &centred(w)));
            steps += 1;
            same_top += usize::from(argmax(g) == argmax(w));
        }
    }
    drop((exact, tested));
    let want = greedy_32(engine(CpuBackend::exact(), &path, 256), &prompts);
    let got = greedy_32(engine(backend(), &path, 256), &prompts);
    let parted: Vec<Option<usize>> =
        got.iter().zip(&want).map(|(g, w)| g.iter().zip(w).position(|(a, b)| a != b)).collect();
    let identical = parted.iter().filter(|p| p.is_none()).count();
    let same_first = parted.iter().filter(|p| **p != Some(0)).count();
    eprintln!(
        "{}",
        serde_json::json!({
            "check": "real_model_against_exact_cpu", "backend": label,
            "model": path.file_name().map(|n| n.to_string_lossy()),
            "logits_rel_err_max": worst, "steps": steps, "same_top_token": same_top,
            "greedy_32_identical": identical, "prompts": prompts.len(), "first_difference": parted,
        })
    );
    assert!(worst < max_err, "{label}: logits differ from the exact CPU's by up to {worst}");
    assert!(same_top * 100 >= steps * 85, "{label}: the top token agrees at {same_top} of {steps} steps");
    assert!(same_first >= 6, "{label}: the first greedy token agrees on {same_first} prompts: {parted:?}");
    assert!(identical >= min_identical, "{label}: 32 greedy tokens identical on {identical} prompts: {parted:?}");
}

#[test]
fn gpu_real_model_matches_the_cpu() {
    let Some(g) = gpu() else { return };
    drop(g);
    // Most of the prompts, as issue 28 asks.
    let gpu = || CudaBackend::new(0).unwrap();
    real_model_against_the_exact_cpu(&model_cache::SMOLLM2_135M_INSTRUCT, "cuda", gpu, 0.25, 5);
    // Qwen2.5-Coder-0.5B (Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K) where it was sent too: 491 MB.
    let qwen = model_cache::QWEN25_CODER_05B_INSTRUCT;
    if model_cache::cache_dir().join(qwen.file_name).exists() {
        // On the H100 (2026-11-27): logits within 0.51 (the CPU's int8 path: 0.10), 71 of
        // 72 top tokens the same, 4 of 8 greedy runs whole (the others part at tokens 9
        // to 26). Qwen2.5's residual stream carries outlier channels that bf16 rounds
        // coarsely (the likely cause, not yet shown); the bound stays loose until the GPU
        // keeps that stream in f32.
        real_model_against_the_exact_cpu(&qwen, "cuda", gpu, 0.6, 4);
    }
}

/// The same check of the CPU's served path (int8 products, half-float KV): CI runs the
/// check's code, and the GPU's figures have the CPU's beside them.
#[test]
fn cpu_served_path_on_the_real_model_matches_the_exact_cpu() {
    // Its rayon partition follows the core count: not fewer than 2 of 8 anywhere.
    real_model_against_the_exact_cpu(&model_cache::SMOLLM2_135M_INSTRUCT, "cpu", CpuBackend::default, 0.25, 2);
}

/// The KV cache a GPU engine gets is sized in bf16 elements; the CPU's in halves on
/// the served path, f32 on the exact one.
#[test]
fn gpu_kv_blocks_cost_two_bytes_per_element() {
    let bytes = |element| kv_block_bytes(element, 2, 64, 16);
    assert_eq!(bytes(CudaBackend::ELEMENT_BYTES), 2 * 2 * 64 * 16 * 2);
    assert_eq!(bytes(CpuBackend::default().kv_element_bytes()), 2 * 2 * 64 * 16 * 2);
    assert_eq!(bytes(CpuBackend::exact().kv_element_bytes()), 2 * 2 * 64 * 16 * 4);
}

/// Decode steps through captured graphs (3 sequences padded to a graph of 4) give the
/// logits of the op-by-op path at every step: the padding row writes only to the
/// scratch block, and the graph's inputs follow each step's positions and tables.
#[test]
fn gpu_decode_graphs_match_op_by_op_steps() {
    let Some(g) = gpu() else { return };
    drop(g);
    let mut rng = rng();
    let root = temp_root("graphs");
    let dir = write_model(&wide(), &mut rng, &root);
    let model = load_model(CudaBackend::new(0).unwrap(), &dir).unwrap().model;
    let prompts: Vec<Vec<u32>> =
        [5usize, 40, 17].iter().map(|&n| (0..n).map(|_| rng.random_range(0..256)).collect()).collect();
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (0..8).map(|b| s * 8 + b).collect()).collect();
    let scratch = 24;
    let mut eager = model.new_kv_cache(scratch as usize + 1, 16).unwrap();
    let mut graphed = model.new_kv_cache(scratch as usize + 1, 16).unwrap();
    for kv in [&mut eager, &mut graphed] {
        let seqs: Vec<SeqInput<'_>> = (0..3)
            .map(|s| SeqInput { tokens: &prompts[s], cached: 0, block_table: &tables[s], logits: false, embeds: &[] })
            .collect();
        model.forward(&seqs, kv).unwrap();
    }
    model.capture_decode_graphs(&mut graphed, scratch, &[1, 4]).unwrap();
    assert_eq!(graphed.graphs.as_ref().unwrap().batch_sizes(), vec![1, 4]);
    let mut next: Vec<u32> = vec![7, 8, 9];
    for step in 0..6 {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let seqs: Vec<SeqInput<'_>> = (0..3)
            .map(|s| SeqInput {
                tokens: &toks[s],
                cached: prompts[s].len() + step,
                block_table: &tables[s],
                logits: true,
                embeds: &[],
            })
            .collect();
        let want = model.forward_on_device(&seqs, &mut eager).unwrap().unwrap();
        let want = model.backend().download(&want).unwrap();
        assert!(model.decode_with_graph(&seqs, &mut graphed).unwrap().is_some(), "step {step} ran as a graph");
        let got = model.forward(&seqs, &mut graphed).unwrap();
        let err = rel_err(&got, &want);
        assert!(err < 1e-2, "step {step}: graph logits differ by {err}");
        let vocab = model.config.vocab_size;
        next = (0..3).map(|s| argmax(&want[s * vocab..(s + 1) * vocab]) as u32).collect();
    }
    let _ = std::fs::remove_dir_all(root);
}

/// Tensor parallelism over NCCL, one GPU per rank: as many ranks as there are GPUs (up
/// to 4, the wide model's KV heads allow 2) give the logits of the unsplit model. With
/// one GPU the group has one rank, which still runs every NCCL all-reduce.
#[test]
fn gpu_tensor_parallel_over_nccl_matches_one_model() {
    use std::sync::Arc;
    use tessera_kernels::cuda::NcclRank;
    use tessera_worker::load::open;
    let Some(g) = gpu() else { return };
    drop(g);
    let size = CudaBackend::device_count().clamp(1, 2);
    let mut rng = rng();
    let root = temp_root("nccl");
    let dir = write_model(&wide(), &mut rng, &root);
    let whole = load_model(CudaBackend::new(0).unwrap(), &dir).unwrap().model;
    let prompt: Vec<u32> = (0..30).map(|_| rng.random_range(0..256)).collect();
    let want = logits(&whole, &prompt, 20);
    drop(whole);
    let (config, _, source) = open(&dir).unwrap();
    let backends: Vec<CudaBackend> = (0..size).map(|i| CudaBackend::new(i).unwrap()).collect();
    let comms = NcclRank::group(&backends.iter().collect::<Vec<_>>()).unwrap();
    let ranks: Vec<Model<CudaBackend>> = backends
        .into_iter()
        .zip(comms)
        .map(|(b, c)| Model::load_shard(b, config.clone(), &*source, Arc::new(c)).unwrap())
        .collect();
    let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks.iter().map(|m| scope.spawn(|| logits(m, &prompt, 20))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    eprintln!("{size} NCCL ranks");
    for (step, (g, w)) in got[0].iter().zip(&want).enumerate() {
        let err = rel_err(g, w);
        assert!(err < 2e-2, "{size} ranks, step {step}: logits differ by {err}");
    }
    let _ = std::fs::remove_dir_all(root);
}

/// Greedy decoding on the GPU picks the CPU sampler's token with its log-probability
/// and top alternatives, under repetition, frequency and presence penalties and logit
/// bias, for rows that ask for 0, 5 or 20 alternatives or none.
#[test]
fn gpu_device_pick_matches_the_cpu_sampler() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    for vocab in [5000usize, 128_256] {
        let rows = 8;
        let logits: Vec<f32> = (0..rows * vocab).map(|_| rng.random_range(-8.0f32..8.0)).collect();
        let mut params = Vec::new();
        let mut gpu_rows = Vec::new();
        let mut want = Vec::new();
        for r in 0..rows {
            let p = SamplingParams {
                repetition_penalty: [1.0, 1.3][r % 2],
                frequency_penalty: [0.0, 0.5, 1.5][r % 3],
                presence_penalty: [0.0, 0.8][(r / 2) % 2],
                logit_bias: if r % 4 == 1 {
                    vec![(rng.random_range(0..vocab as u32), 30.0), (7, -100.0)]
                } else {
                    vec![]
                },
                logprobs: [None, Some(0), Some(5), Some(20)][r % 4],
                ..SamplingParams::greedy()
            };
            let prompt: Vec<u32> = (0..50).map(|_| rng.random_range(0..vocab as u32)).collect();
            let output: Vec<u32> = (0..20).map(|_| rng.random_range(0..vocab as u32)).collect();
            let mut state = SamplerState::new(p.clone(), &prompt);
            output.iter().for_each(|&t| state.push(t));
            let mut row = logits[r * vocab..(r + 1) * vocab].to_vec();
            gpu_rows.push(state.device_row().expect("a greedy row"));
            want.push(sample(&mut row, &mut state));
            params.push(p);
        }
        let got =
            g.device_pick(&g.upload(&logits).unwrap(), vocab, &gpu_rows).unwrap().expect("CUDA picks on the device");
        for (r, (got, want)) in got.iter().zip(&want).enumerate() {
            assert_eq!(got.token, want.token, "vocab {vocab} row {r} ({:?})", params[r]);
            match (got.logprob, want.logprob) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-3, "row {r}: logprob {a} vs {b}"),
                (a, b) => assert_eq!(a.is_some(), b.is_some(), "row {r}"),
            }
            assert_eq!(got.top_logprobs.len(), want.top_logprobs.len(), "row {r}");
            for ((ta, la), (tb, lb)) in got.top_logprobs.iter().zip(&want.top_logprobs) {
                assert_eq!(ta, tb, "row {r}: top tokens");
                assert!((la - lb).abs() < 1e-3, "row {r}: top logprob {la} vs {lb}");
            }
        }
    }
    assert!(
        g.device_pick(&g.upload(&[0.0; 4]).unwrap(), 4, &[PickRow { top_logprobs: Some(21), ..Default::default() }])
            .is_err()
    );
}

/// Sampled rows drawn on the GPU (temperature, top-k, top-p, min-p, after penalties and
/// bias; greedy rows in the same batch) pick the CPU sampler's token for the same
/// uniform draw. Tolerance: the two sum probabilities differently (f32 along the sorted
/// row on the CPU, 2^-40 fixed point on the GPU), so a draw within rounding of a
/// boundary between two tokens may land on either; at most 1 in 500 may differ. Equal
/// logits are taken in index order on both.
/// The same batch drawn again, and a row drawn alone, give the same tokens.
#[test]
fn gpu_sampled_draws_match_the_cpu_sampler() {
    let Some(g) = gpu() else { return };
    let mut rng = rng();
    let (mut draws, mut differ) = (0, 0);
    for vocab in [5000usize, 128_256] {
        for round in 0..8 {
            let rows = 64;
            // Peaked rows (a few likely tokens) and flat ones; half the rounds in bf16, as
            // a model's logits come, where equal logits are common.
            let spread = [2.0f32, 8.0][round % 2];
            let tie = |x: f32| if round % 4 >= 2 { bf16::from_f32(x).to_f32() } else { x };
            let logits: Vec<f32> = (0..rows * vocab).map(|_| tie(rng.random_range(-spread..spread))).collect();
            let (mut params, mut device_rows, mut want) = (vec![], vec![], vec![]);
            for r in 0..rows {
                let p = SamplingParams {
                    temperature: [0.0, 0.5, 1.0, 1.7][r % 4],
                    top_k: [-1, 1, 20, 1000, 7][r % 5],
                    top_p: [1.0, 0.9, 0.5][r % 3],
                    min_p: [0.0, 0.0, 0.05, 0.3][(r / 3) % 4],
                    repetition_penalty: [1.0, 1.3][(r / 5) % 2],
                    frequency_penalty: [0.0, 0.5][(r / 7) % 2],
                    logit_bias: if r % 6 == 1 { vec![(rng.random_range(0..vocab as u32), 3.0)] } else { vec![] },
                    seed: Some(rng.random()),
                    ..Default::default()
                };
                let prompt: Vec<u32> = (0..30).map(|_| rng.random_range(0..vocab as u32)).collect();
                let mut state = SamplerState::new(p.clone(), &prompt);
                let row = state.device_row().expect("no grammar: a device row");
                assert_eq!(row.draw.is_some(), p.temperature > 0.0);
                want.push(sample(&mut logits[r * vocab..(r + 1) * vocab].to_vec(), &mut state).token);
                device_rows.push(row);
                params.push(p);
            }
            let on_gpu = g.upload(&logits).unwrap();
            let got: Vec<u32> =
                g.device_pick(&on_gpu, vocab, &device_rows).unwrap().unwrap().iter().map(|p| p.token).collect();
            for r in 0..rows {
                if params[r].temperature > 0.0 {
                    draws += 1;
                }
                if got[r] != want[r] {
                    differ += 1;
                    eprintln!("vocab {vocab} round {round} row {r}: GPU {} CPU {} ({:?})", got[r], want[r], params[r]);
                }
            }
            let again: Vec<u32> =
                g.device_pick(&on_gpu, vocab, &device_rows).unwrap().unwrap().iter().map(|p| p.token).collect();
            assert_eq!(again, got, "the same draws pick the same tokens");
            let r = 6; // sampled, top_k 20: alone, from its own row of logits
            let alone = g.upload(&logits[r * vocab..(r + 1) * vocab]).unwrap();
            let solo = g.device_pick(&alone, vocab, &device_rows[r..r + 1]).unwrap().unwrap();
            assert_eq!(solo[0].token, got[r], "row {r} drawn alone");
        }
    }
    eprintln!("{differ} of {draws} sampled draws differ from the CPU's");
    assert!(draws >= 700, "{draws} draws");
    assert!(differ * 500 <= draws, "{differ} of {draws} draws differ from the CPU's");
    let bad = PickRow {
        draw: Some(Draw { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, uniform: 1.0 }),
        ..Default::default()
    };
    assert!(g.device_pick(&g.upload(&[0.0; 4]).unwrap(), 4, &[bad]).is_err(), "uniform must be below 1");
}

/// The vision path on the GPU: each tiny reference model of `vision_reference.rs`
/// (SmolVLM's SigLIP-style tower with pixel shuffle, tiles and video frames; LLaVA-1.5's
/// CLIP at layer −2 with its MLP projector; LLaVA-NeXT's tiles), every case's images
/// encoded on both backends from the same pixels: features within 3e-2 of the exact
/// CPU's (relative; bf16 activations through every layer of the tower and projector),
/// then a prompt holding the GPU's features run through the language model on the GPU
/// against the CPU's features on the CPU: last-token logits within 5e-2.
#[test]
fn gpu_vision_towers_match_cpu_on_the_tiny_reference_models() {
    use tessera_proto::image::{ImageLimits, decode};
    use tessera_worker::vision::Use;
    let Some(_) = gpu() else { return };
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vision/models");
    for family in ["smolvlm", "llava", "llava_next"] {
        let cpu = load_model(CpuBackend::exact(), &models.join(family)).unwrap();
        let gpu = load_model(CudaBackend::new(0).unwrap(), &models.join(family)).unwrap();
        let (cv, gv) = (cpu.vision.as_ref().unwrap(), gpu.vision.as_ref().unwrap());
        let cases = std::fs::read_to_string(models.join(format!("{family}.cases.json"))).unwrap();
        let cases: Vec<serde_json::Value> = serde_json::from_str(&cases).unwrap();
        for (k, case) in cases.iter().enumerate() {
            let usage = match case["video"].as_bool().unwrap_or(false) {
                true => Use::Frame,
                false => Use::Image { split: case["splitting"].as_bool().unwrap_or(true) },
            };
            let (mut want, mut got) = (Vec::new(), Vec::new());
            for file in case["images"].as_array().unwrap() {
                let bytes = std::fs::read(models.join("images").join(file.as_str().unwrap())).unwrap();
                let prepared = cv.prepare(&decode(&bytes, ImageLimits::default()).unwrap().rgb, usage);
                want.extend(cv.encode(cpu.model.backend(), &prepared).unwrap().rows);
                got.extend(gv.encode(gpu.model.backend(), &prepared).unwrap().rows);
            }
            let err = rel_err(&got, &want);
            eprintln!("{family} case {k}: {} image rows, features within {err:.4}", want.len() / cv.hidden);
            assert!(err < 3e-2, "{family} case {k}: features differ by {err}");

            // A prompt of a few tokens around the image rows, each backend's own.
            let hidden = cpu.model.config.hidden_size;
            let image = cv.config.image_token_id;
            let text: Vec<u32> = (1..).filter(|&t| t != image).take(5).collect();
            let mut ids = text[..3].to_vec();
            ids.extend(std::iter::repeat_n(image, want.len() / hidden));
            ids.extend(&text[3..]);
            let err =
                rel_err(&image_prompt(&gpu.model, &ids, image, &got), &image_prompt(&cpu.model, &ids, image, &want));
            eprintln!("{family} case {k}: last-token logits within {err:.4}");
            assert!(err < 5e-2, "{family} case {k}: logits differ by {err}");
        }
    }
}

/// The last token's logits of `ids` run whole, its `image` tokens taking `features`' rows.
fn image_prompt<B: Backend>(model: &Model<B>, ids: &[u32], image: u32, features: &[f32]) -> Vec<f32> {
    use tessera_worker::vision::placement::{chunk, runs};
    let hidden = model.config.hidden_size;
    let placed = runs(ids, image, features.len() / hidden).unwrap();
    let embeds = chunk(&placed, features, hidden, 0, ids.len());
    let blocks = ids.len().div_ceil(16) + 1;
    let mut kv = model.new_kv_cache(blocks, 16).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let seq = SeqInput { tokens: ids, cached: 0, block_table: &table, logits: true, embeds: &embeds };
    model.forward(&[seq], &mut kv).unwrap()
}

/// `--device cuda` without a usable GPU stops with one line that says why; `--device
/// auto` then runs on the CPU. (On a GPU machine both run on the GPU.)
#[test]
fn device_flags_name_the_missing_gpu_in_one_line_and_auto_falls_back() {
    let root = temp_root("device-flags");
    let dir = write_model(&wide(), &mut rng(), &root);
    let run = |device: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tessera-worker"))
            .args(["generate", "--prompt", "hi", "--max-tokens", "3", "--json", "--device", device, "--model"])
            .arg(&dir)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap()
    };
    let auto = run("auto");
    assert!(auto.status.success(), "{}", String::from_utf8_lossy(&auto.stderr));
    let out: serde_json::Value = serde_json::from_slice(&auto.stdout).unwrap();
    assert_eq!(out["output_token_ids"].as_array().unwrap().len(), 3);
    let cuda = run("cuda");
    if CudaBackend::device_count() == 0 {
        let stderr = String::from_utf8_lossy(&cuda.stderr);
        assert!(!cuda.status.success());
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
        assert!(stderr.contains("--device cuda") && stderr.contains("CUDA"), "{stderr}");
    } else {
        assert!(cuda.status.success(), "{}", String::from_utf8_lossy(&cuda.stderr));
    }
    let _ = std::fs::remove_dir_all(root);
}
