//! Tensor parallelism on the CPU backend, one thread per rank with the in-process
//! all-reduce: n ranks give the logits of one, on tiny random models of the decoder
//! variants (f32 weights, sizes 2 and 4) and on the real SmolLM2 (Q4_1 blocks cut at
//! block boundaries, size 3), through a prefill and single-token decodes. On the exact
//! path: the served one rounds each product's inputs to bytes, where a value that the
//! ranks' other order of sums moves across a rounding boundary changes a whole step
//! of the quantum, so the tolerance here would measure rounding, not parallelism.

mod common;
mod tiny_models;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use tessera_kernels::collective::ThreadGroup;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::loader::TensorSource;
use tessera_worker::loader::gguf::GgufFile;
use tessera_worker::loader::safetensors_dir::SafetensorsDir;
use tessera_worker::model::{Model, ModelConfig};
use tiny_models::{random_weights, variants, write_dir};

/// Logits of a prefill of `prompt[..split]`, then of one decode per remaining token.
fn steps(model: &Model<CpuBackend>, prompt: &[u32], split: usize) -> Vec<Vec<f32>> {
    tiny_models::prefill_then_decode(model, prompt, split, 4)
}

/// Runs `steps` on `size` ranks at once; returns every rank's logits.
fn tensor_parallel(
    size: usize,
    config: &ModelConfig,
    open: &(dyn Fn() -> Box<dyn TensorSource> + Sync),
    prompt: &[u32],
    split: usize,
) -> Vec<Vec<Vec<f32>>> {
    std::thread::scope(|scope| {
        let ranks: Vec<_> = ThreadGroup::ranks(size)
            .into_iter()
            .map(|rank| {
                scope.spawn(move || {
                    let model =
                        Model::load_shard(CpuBackend::exact(), config.clone(), &*open(), Arc::new(rank)).unwrap();
                    assert_eq!(model.config.num_heads * size, config.num_heads);
                    steps(&model, prompt, split)
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

fn check(name: &str, size: usize, whole: &[Vec<f32>], ranks: &[Vec<Vec<f32>>], tolerance: f32) {
    for (r, logits) in ranks.iter().enumerate() {
        assert_eq!(logits, &ranks[0], "{name}: rank {r} disagrees with rank 0");
    }
    for (step, (got, want)) in ranks[0].iter().zip(whole).enumerate() {
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= tolerance * scale, "{name}, {size} ranks, step {step}: logits differ by {err} (max {scale})");
    }
}

#[test]
fn two_and_four_ranks_compute_the_logits_of_one_on_every_variant() {
    let mut rng = tiny_models::seeded_rng();
    let root = tiny_models::temp_root("tp");
    let prompt: Vec<u32> = (0..13).map(|_| rng.random_range(0..64)).collect();
    let mut checked = 0;
    for v in variants() {
        let dir = root.join(v.name);
        write_dir(&dir, &v.config, &random_weights(&v.config, &mut rng));
        let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
        let whole = steps(
            &Model::load(CpuBackend::exact(), config.clone(), &SafetensorsDir::open(&dir).unwrap()).unwrap(),
            &prompt,
            9,
        );
        let open = || Box::new(SafetensorsDir::open(&dir).unwrap()) as Box<dyn TensorSource>;
        for size in [2, 4] {
            if config.shard(size).is_err() {
                continue; // fewer KV heads than ranks (Mistral's one)
            }
            check(v.name, size, &whole, &tensor_parallel(size, &config, &open, &prompt, 9), 1e-4);
            checked += 1;
        }
    }
    assert!(checked >= 4, "only {checked} variant/size pairs could be split");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn three_ranks_of_smollm2_compute_its_logits() {
    let path = common::smollm2_path();
    let config = ModelConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let whole_model = &common::smollm2_exact().model;
    let prompt: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 260, 1345, 30, 2, 198, 1, 520];
    let whole = steps(whole_model, &prompt, 10);
    let open = || Box::new(GgufFile::open(&path).unwrap()) as Box<dyn TensorSource>;
    check("smollm2", 3, &whole, &tensor_parallel(3, &config, &open, &prompt, 10), 1e-3);
    assert!(config.shard(2).is_err(), "9 heads do not split over 2 ranks");
}

/// The engine over two ranks serves a batch of greedy requests with the tokens the
/// engine over one model gives.
#[test]
fn an_engine_over_two_ranks_generates_what_one_model_generates() {
    use tessera_worker::engine::core::{EngineConfig, EngineCore, Output, Request};
    use tessera_worker::engine::kv_tier::TierConfig;
    use tessera_worker::load::{load_model, open};
    let mut rng = StdRng::seed_from_u64(7);
    let root = std::env::temp_dir().join(format!("tessera-tp-engine-{}", std::process::id()));
    let wide = serde_json::json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024, "tie_word_embeddings": false});
    write_dir(&root, &wide, &random_weights(&wide, &mut rng));
    tiny_models::write_byte_tokenizer(&root);
    let run = |mut e: EngineCore<CpuBackend>| {
        for i in 0..12u64 {
            let prompt = e.tokenizer().encode(&format!("request {i}: {}", "abc".repeat(i as usize))).unwrap();
            e.add_request(Request::greedy(i, prompt, 10)).unwrap();
        }
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); 12];
        while e.has_work() {
            for Output { id, token, .. } in e.step().unwrap() {
                out[id as usize].extend(token.map(|t| t.token));
            }
        }
        out
    };
    let single = load_model(CpuBackend::exact(), &root).unwrap();
    let want = run(EngineCore::new(single.model, single.tokenizer, EngineConfig::default(), "tp").unwrap());
    let (config, tokenizer, source) = open(&root).unwrap();
    let ranks: Vec<Model<CpuBackend>> = ThreadGroup::ranks(2)
        .into_iter()
        .map(|rank| Model::load_shard(CpuBackend::exact(), config.clone(), &*source, Arc::new(rank)).unwrap())
        .collect();
    let engine = EngineCore::tensor_parallel(ranks, tokenizer, EngineConfig::default(), "tp").unwrap();
    assert_eq!(engine.config().num_heads, 2, "each rank runs half the heads");
    let got = run(engine);
    assert!(want.iter().all(|t| !t.is_empty()), "every request produced tokens");
    assert_eq!(got, want);

    // Over two ranks with a cache of 8 blocks and a host tier: each rank's share of a
    // block goes out and comes back, and the tokens are the same.
    let (config, tokenizer, source) = open(&root).unwrap();
    let ranks: Vec<Model<CpuBackend>> = ThreadGroup::ranks(2)
        .into_iter()
        .map(|rank| Model::load_shard(CpuBackend::exact(), config.clone(), &*source, Arc::new(rank)).unwrap())
        .collect();
    let kv_tiers = TierConfig { host_bytes: 1 << 20, disk: None, identity: "tp".into() };
    let small = EngineConfig { num_blocks: 8, kv_tiers, ..EngineConfig::default() };
    let mut e = EngineCore::tensor_parallel(ranks, tokenizer, small, "tp").unwrap();
    for pass in 0..2u64 {
        for i in 0..12u64 {
            let prompt = e.tokenizer().encode(&format!("request {i}: {}", "abc".repeat(i as usize))).unwrap();
            e.add_request(Request::greedy(pass * 100 + i, prompt, 10)).unwrap();
            let mut tokens = Vec::new();
            while e.has_work() {
                tokens.extend(e.step().unwrap().into_iter().filter_map(|o| o.token.map(|t| t.token)));
            }
            assert_eq!(tokens, want[i as usize], "pass {pass}, request {i}");
        }
    }
    assert!(e.scheduler().tiers().unwrap().stats().host_hits > 0, "prefixes came back from the host tier");
    let _ = std::fs::remove_dir_all(root);
}
