//! The engine on the real model: continuous batching gives each request exactly the
//! tokens it gets alone; prefix caching skips a shared prefix; preemption under KV
//! pressure changes nothing in the outputs; aborts return every block.

mod common;

use common::smollm2_path;
use std::collections::HashMap;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::engine::core::{EngineConfig, EngineCore, EngineError, FinishReason, Output, Request};
use tessera_worker::engine::kv_tier::TierConfig;
use tessera_worker::engine::sampler::SamplingParams;
use tessera_worker::load::load_model;

const MODEL: &str = "smollm2-135m-instruct";

fn engine(config: EngineConfig) -> EngineCore<CpuBackend> {
    let loaded = load_model(CpuBackend::default(), &smollm2_path()).unwrap();
    EngineCore::new(loaded.model, loaded.tokenizer, config, MODEL).unwrap()
}

#[derive(Debug, Default, Clone, PartialEq)]
struct Done {
    tokens: Vec<u32>,
    text: String,
    finish: Option<FinishReason>,
    cached: usize,
}

/// Steps until every request has finished; collects each one's tokens and text.
fn run_all(e: &mut EngineCore<CpuBackend>) -> HashMap<u64, Done> {
    let mut done: HashMap<u64, Done> = HashMap::new();
    while e.has_work() {
        for Output { id, token, text, finish, cached_prompt_tokens, .. } in e.step().unwrap() {
            let d = done.entry(id).or_default();
            d.tokens.extend(token.map(|t| t.token));
            d.text.push_str(&text);
            d.finish = finish;
            d.cached = cached_prompt_tokens;
        }
    }
    done
}

fn prompts(e: &EngineCore<CpuBackend>, n: usize) -> Vec<Vec<u32>> {
    let subjects = ["cats", "the sea", "Rust", "Paris", "rain", "music", "mountains", "bread"];
    (0..n)
        .map(|i| {
            let text = format!("Fact {i} about {}:", subjects[i % subjects.len()]);
            e.tokenizer().encode(&text).unwrap()
        })
        .collect()
}

#[test]
fn sixty_four_concurrent_greedy_requests_match_their_solo_runs() {
    let mut e = engine(EngineConfig::default());
    let prompts = prompts(&e, 64);
    let solo: Vec<Done> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            e.add_request(Request::greedy(i as u64, p.clone(), 8)).unwrap();
            run_all(&mut e).remove(&(i as u64)).unwrap()
        })
        .collect();
    let mut e = engine(EngineConfig::default());
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(Request::greedy(1000 + i as u64, p.clone(), 8)).unwrap();
    }
    let batched = run_all(&mut e);
    assert!(e.stats().steps < 64, "the requests ran together ({} steps)", e.stats().steps);
    for (i, want) in solo.iter().enumerate() {
        let got = &batched[&(1000 + i as u64)];
        assert_eq!(got.tokens, want.tokens, "request {i}");
        assert_eq!(got.text, want.text, "request {i}");
        assert_eq!(got.finish, want.finish);
    }
    assert_eq!(e.scheduler().pool().num_free(), EngineConfig::default().num_blocks);
}

#[test]
fn a_shared_thousand_token_prefix_is_computed_once() {
    let mut e = engine(EngineConfig::default());
    let base = "The history of the city is long and full of detail. ".repeat(120);
    let prefix: Vec<u32> = e.tokenizer().encode(&base).unwrap()[..1000].to_vec();
    let with = |suffix: &str| [prefix.clone(), e.tokenizer().encode(suffix).unwrap()].concat();
    let (first, second) = (with(" In summary,"), with(" The next chapter"));
    e.add_request(Request::greedy(1, first, 4)).unwrap();
    run_all(&mut e);
    let before = e.stats().prompt_tokens_computed;
    e.add_request(Request::greedy(2, second.clone(), 6)).unwrap();
    let warm = run_all(&mut e).remove(&2).unwrap();
    let computed = e.stats().prompt_tokens_computed - before;
    // Everything but the last partial block of the prefix came from the cache.
    assert!(warm.cached >= 1000 - 16, "cached {}", warm.cached);
    assert!(computed <= (second.len() - 1000 + 16) as u64, "computed {computed} prompt tokens");
    let mut cold = engine(EngineConfig::default());
    cold.add_request(Request::greedy(2, second, 6)).unwrap();
    let cold = run_all(&mut cold).remove(&2).unwrap();
    assert_eq!(cold.cached, 0);
    assert_eq!((warm.tokens, warm.text), (cold.tokens, cold.text));
}

#[test]
fn evicted_prefixes_come_back_from_the_second_tier_unchanged_and_survive_a_restart() {
    // A cache of 24 blocks (384 tokens); a host tier of 5 blocks over a disk tier.
    let disk = tempfile::tempdir().unwrap();
    let block = 2 * 30 * 16 * 192 * 2; // SmolLM2's layers × block tokens × KV width, in halves
    let tiers = |identity: &str| TierConfig {
        host_bytes: 5 * block,
        disk: Some((disk.path().into(), 1 << 30)),
        identity: identity.into(),
    };
    let config = |identity| EngineConfig { num_blocks: 24, kv_tiers: tiers(identity), ..EngineConfig::default() };
    let mut e = engine(config("smollm2"));
    let text = |topic: &str| format!("Notes on {topic}, written carefully and at length. ").repeat(40);
    let a: Vec<u32> = e.tokenizer().encode(&text("tides")).unwrap()[..300].to_vec();
    let b: Vec<u32> = e.tokenizer().encode(&text("glaciers")).unwrap()[..300].to_vec();
    e.add_request(Request::greedy(1, a.clone(), 4)).unwrap();
    let cold = run_all(&mut e).remove(&1).unwrap();
    // B's blocks evict most of A's: down to host memory, and from there to disk.
    e.add_request(Request::greedy(2, b, 4)).unwrap();
    run_all(&mut e);
    let tier = e.scheduler().tiers().unwrap();
    assert!(tier.blocks().0 > 0 && tier.blocks().1 > 0, "held: {:?}", tier.blocks());
    // A again: its prefix comes back from the device, host memory and disk, not computed.
    let before = e.stats().prompt_tokens_computed;
    e.add_request(Request::greedy(3, a.clone(), 4)).unwrap();
    let warm = run_all(&mut e).remove(&3).unwrap();
    let stats = e.scheduler().tiers().unwrap().stats();
    assert!(stats.host_hits > 0 && stats.disk_hits > 0, "{stats:?}");
    assert_eq!(warm.cached, 288, "every full block but the one holding the last token");
    assert_eq!(e.stats().prompt_tokens_computed - before, 12);
    assert_eq!((&warm.tokens, &warm.text), (&cold.tokens, &cold.text), "the same keys and values");
    // Stopped: what it holds goes to disk, and a new engine of the same identity finds it.
    assert!(e.persist_kv() >= 18);
    drop(e);
    let mut restarted = engine(config("smollm2"));
    restarted.add_request(Request::greedy(4, a.clone(), 4)).unwrap();
    let again = run_all(&mut restarted).remove(&4).unwrap();
    assert_eq!(again.cached, 288, "a warm restart");
    assert_eq!(again.tokens, cold.tokens);
    // Another model's (or other weights') blocks are never served.
    let mut other = engine(config("another model"));
    other.add_request(Request::greedy(5, a, 4)).unwrap();
    assert_eq!(run_all(&mut other).remove(&5).unwrap().cached, 0);
}

#[test]
fn preemption_under_kv_pressure_leaves_outputs_unchanged() {
    let config = EngineConfig::default();
    let mut roomy = engine(config.clone());
    let prompts = prompts(&roomy, 32);
    let request = |i: usize, p: &Vec<u32>| Request { ignore_eos: true, ..Request::greedy(i as u64, p.clone(), 16) };
    for (i, p) in prompts.iter().enumerate() {
        roomy.add_request(request(i, p)).unwrap();
    }
    let want = run_all(&mut roomy);
    // About four sequences' worth of blocks: each needs ceil((≈9 + 16) / 16) = 2.
    let mut tight = engine(EngineConfig { num_blocks: 8, ..config });
    for (i, p) in prompts.iter().enumerate() {
        tight.add_request(request(i, p)).unwrap();
    }
    let got = run_all(&mut tight);
    assert!(tight.stats().preemptions > 0, "the pool was tight enough to preempt");
    assert_eq!(got.len(), 32);
    for i in 0..32u64 {
        assert_eq!(got[&i].tokens, want[&i].tokens, "request {i}");
        assert_eq!(got[&i].tokens.len(), 16);
        assert_eq!(got[&i].finish, Some(FinishReason::Length));
    }
    assert_eq!(tight.scheduler().pool().num_free(), 8);
}

#[test]
fn a_tenant_beside_a_flood_gets_its_first_token_in_one_step_and_nobodys_output_changes() {
    // 24 long generations of one organization, then one short request of another.
    let config = EngineConfig { contended_batch: 8, ..EngineConfig::default() };
    let mut alone = engine(config.clone());
    let prompts = prompts(&alone, 25);
    let request = |i: usize, tenant: &str, max_tokens: usize| Request {
        ignore_eos: true,
        tenant: tenant.into(),
        ..Request::greedy(i as u64, prompts[i].clone(), max_tokens)
    };
    for i in 0..25 {
        alone.add_request(request(i, "", if i < 24 { 40 } else { 8 })).unwrap();
    }
    let want = run_all(&mut alone);

    let mut shared = engine(config);
    let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut keep = |outputs: &[Output]| {
        for o in outputs {
            got.entry(o.id).or_default().extend(o.token.as_ref().map(|t| t.token));
        }
    };
    for i in 0..24 {
        shared.add_request(request(i, "flood", 40)).unwrap();
    }
    // The flood alone: every stream in each step.
    keep(&shared.step().unwrap());
    let step = shared.step().unwrap();
    assert_eq!(step.len(), 24);
    keep(&step);
    shared.add_request(request(24, "bystander", 8)).unwrap();
    let first = shared.step().unwrap();
    assert!(first.iter().any(|o| o.id == 24 && o.token.is_some()), "its first token in the very next step");
    assert!(first.len() <= 1 + 4, "beside at most the flood's share of 8 rows: {} outputs", first.len());
    keep(&first);
    let mut bystander_left = 7;
    while shared.has_work() {
        let step = shared.step().unwrap();
        if bystander_left > 0 {
            assert!(step.len() <= 8, "steps of 8 rows while the organizations contend");
            assert!(step.iter().any(|o| o.id == 24), "the bystander runs in every step");
            bystander_left -= 1;
        }
        keep(&step);
    }
    // Fair sharing reorders work; it changes no output.
    for i in 0..25u64 {
        assert_eq!(got[&i], want[&i].tokens, "request {i}");
    }
    assert_eq!(shared.scheduler().pool().num_free(), EngineConfig::default().num_blocks);
}

#[test]
fn abort_returns_every_block_at_once() {
    let config = EngineConfig { num_blocks: 64, ..EngineConfig::default() };
    let mut e = engine(config);
    let prompts = prompts(&e, 6);
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(Request { ignore_eos: true, ..Request::greedy(i as u64, p.clone(), 100) }).unwrap();
    }
    e.step().unwrap();
    e.step().unwrap();
    assert!(e.scheduler().pool().num_free() < 64);
    for i in 0..6 {
        let outs = e.abort(i);
        assert_eq!(outs.len(), 1);
        assert_eq!((outs[0].finish, outs[0].last), (Some(FinishReason::Abort), true));
    }
    assert_eq!(e.scheduler().pool().num_free(), 64);
    assert!(!e.has_work());
    assert!(e.abort(0).is_empty(), "aborting twice is a no-op");
}

#[test]
fn seeded_sampling_is_reproducible_whatever_shares_the_batch() {
    let seeded = |id: u64, p: &Vec<u32>| Request {
        params: SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(1234), ..SamplingParams::default() },
        ignore_eos: true,
        ..Request::greedy(id, p.clone(), 12)
    };
    let mut e = engine(EngineConfig::default());
    let prompts = prompts(&e, 5);
    e.add_request(seeded(0, &prompts[0])).unwrap();
    let alone = run_all(&mut e).remove(&0).unwrap();
    for (i, p) in prompts.iter().enumerate().skip(1) {
        let other = Request {
            params: SamplingParams { temperature: 1.3, ..SamplingParams::default() },
            ..Request::greedy(10 + i as u64, p.clone(), 20)
        };
        e.add_request(other).unwrap();
    }
    e.add_request(seeded(1, &prompts[0])).unwrap();
    let crowded = run_all(&mut e).remove(&1).unwrap();
    assert_eq!(alone.tokens, crowded.tokens);
}

#[test]
fn stop_strings_and_stop_tokens_end_generation() {
    let mut e = engine(EngineConfig::default());
    let p = e.tokenizer().encode("1, 2, 3, 4, 5,").unwrap();
    e.add_request(Request { stop: vec!["8,".into()], ..Request::greedy(1, p.clone(), 30) }).unwrap();
    let out = run_all(&mut e).remove(&1).unwrap();
    assert_eq!(out.text, " 6, 7, ");
    assert_eq!(out.finish, Some(FinishReason::Stop));
    // "7" is token 39 in this vocabulary (the digits are 28 + n... checked by decoding).
    let seven = e.tokenizer().encode("7").unwrap()[0];
    e.add_request(Request { stop_token_ids: vec![seven], ..Request::greedy(2, p, 30) }).unwrap();
    let out = run_all(&mut e).remove(&2).unwrap();
    assert_eq!(out.tokens.last(), Some(&seven));
    assert_eq!(out.text, " 6, ");
    assert_eq!(out.finish, Some(FinishReason::Stop));
}

#[test]
fn vllm_extensions_min_tokens_kept_stops_and_special_tokens() {
    let mut e = engine(EngineConfig::default());
    let p = e.tokenizer().encode("1, 2, 3, 4, 5,").unwrap();
    let seven = e.tokenizer().encode("7").unwrap()[0];
    // Alone, the stop token ends the output at its fourth token and "7," at its third
    // (`stop_strings_and_stop_tokens_end_generation`); with min_tokens 6 neither may.
    e.add_request(Request { stop_token_ids: vec![seven], min_tokens: 6, ..Request::greedy(1, p.clone(), 60) }).unwrap();
    let out = run_all(&mut e).remove(&1).unwrap();
    assert!(out.tokens.len() > 6 && !out.tokens[..6].contains(&seven), "{:?}", out.text);
    e.add_request(Request { stop: vec!["7,".into()], min_tokens: 6, ..Request::greedy(6, p.clone(), 60) }).unwrap();
    let out = run_all(&mut e).remove(&6).unwrap();
    assert!(out.text.starts_with(" 6, 7, 8,") && !out.text.ends_with("7,"), "{:?}", out.text);
    assert_eq!(out.finish, Some(FinishReason::Stop), "{:?}", out.text);
    // The matched stop string kept at the end.
    e.add_request(Request {
        stop: vec!["8,".into()],
        include_stop_str_in_output: true,
        ..Request::greedy(2, p.clone(), 30)
    })
    .unwrap();
    assert_eq!(run_all(&mut e).remove(&2).unwrap().text, " 6, 7, 8,");
    // End-of-sequence, pushed to the top by a bias, is banned until min_tokens.
    let end = e.tokenizer().inner().token_to_id("<|im_end|>").unwrap();
    let biased = SamplingParams { logit_bias: vec![(end, 100.0)], ..SamplingParams::greedy() };
    e.add_request(Request { params: biased.clone(), min_tokens: 3, ..Request::greedy(3, p.clone(), 8) }).unwrap();
    let out = run_all(&mut e).remove(&3).unwrap();
    assert_eq!(out.tokens.len(), 4);
    assert!(!out.tokens[..3].contains(&end) && out.tokens[3] == end);
    assert_eq!(out.finish, Some(FinishReason::Stop));
    // Past the end with ignore_eos: the marker's text shows only when special tokens
    // are kept.
    let past_end = |id: u64, skip: bool| Request {
        params: biased.clone(),
        ignore_eos: true,
        skip_special_tokens: skip,
        ..Request::greedy(id, p.clone(), 2)
    };
    e.add_request(past_end(4, false)).unwrap();
    e.add_request(past_end(5, true)).unwrap();
    let mut outs = run_all(&mut e);
    assert_eq!(outs.remove(&4).unwrap().text, "<|im_end|><|im_end|>");
    assert_eq!(outs.remove(&5).unwrap().text, "");
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let mut e = engine(EngineConfig::default());
    let ctx = e.config().context_length;
    let cases: Vec<(Request, &str)> = vec![
        (Request::greedy(1, vec![], 4), "prompt is empty"),
        (Request::greedy(2, vec![5; ctx], 4), "context"),
        (Request::greedy(3, vec![5; 10], ctx), "max_tokens"),
        (
            Request {
                params: SamplingParams { logit_bias: vec![(49152, 1.0)], ..SamplingParams::greedy() },
                ..Request::greedy(4, vec![5], 4)
            },
            "logit_bias token id 49152",
        ),
        (
            Request {
                params: SamplingParams { logprobs: Some(21), ..SamplingParams::greedy() },
                ..Request::greedy(5, vec![5], 4)
            },
            "top_logprobs",
        ),
        (Request::greedy(6, vec![60000], 4), "outside the vocabulary"),
    ];
    for (req, want) in cases {
        let id = req.id;
        let err = e.add_request(req).unwrap_err();
        if id == 2 || id == 3 {
            assert!(matches!(err, EngineError::ContextLength(_)), "{err}");
        } else {
            assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
        }
        assert!(err.to_string().contains(want), "{err} should mention {want:?}");
    }
    assert!(!e.has_work());
}

#[test]
fn a_request_the_kv_cache_cannot_hold_is_refused_before_it_runs() {
    // 91 blocks: 1,456 tokens, less than the model's 8,192. The case: a 1,380-token
    // prompt with max_tokens 400 used to preempt and readmit itself for ever.
    let mut e = engine(EngineConfig { num_blocks: 91, ..EngineConfig::default() });
    assert_eq!((e.max_model_len(), e.config().context_length), (1456, 8192));
    let err = e.add_request(Request::greedy(1, vec![5; 1380], 400)).unwrap_err();
    assert!(matches!(err, EngineError::ContextLength(_)), "{err}");
    for want in ["max_tokens 400", "1380", "1456 tokens", "KV cache", "8192"] {
        assert!(err.to_string().contains(want), "{err} should mention {want:?}");
    }
    let err = e.add_request(Request::greedy(2, vec![5; 1456], 1)).unwrap_err();
    assert!(err.to_string().contains("the prompt has 1456 tokens"), "{err}");
    assert!(!e.has_work(), "nothing of them was queued");
}

#[test]
fn n_completions_that_do_not_fit_together_take_turns() {
    // 12 blocks: 192 tokens. Two completions of a 60-odd-token prompt that may each
    // reach 192 tokens fit only one at a time.
    let mut e = engine(EngineConfig { num_blocks: 12, ..EngineConfig::default() });
    let prompt: Vec<u32> = e.tokenizer().encode(&"The tide comes in. ".repeat(12)).unwrap();
    let max_tokens = 192 - prompt.len();
    e.add_request(Request { n: 2, ignore_eos: true, ..Request::greedy(1, prompt.clone(), max_tokens) }).unwrap();
    e.add_request(Request::greedy(2, vec![5, 6, 7, 8], 4)).unwrap();
    let mut lengths: HashMap<(u64, usize), usize> = HashMap::new();
    let mut steps = 0;
    while e.has_work() {
        steps += 1;
        for o in e.step().unwrap() {
            *lengths.entry((o.id, o.index)).or_default() += o.token.is_some() as usize;
            if o.id == 1 && o.finish.is_some() {
                assert_eq!(o.finish, Some(FinishReason::Length), "{o:?}");
            }
        }
    }
    assert_eq!((lengths[&(1, 0)], lengths[&(1, 1)]), (max_tokens, max_tokens));
    assert!(lengths[&(2, 0)] >= 1);
    assert!(e.stats().preemptions > 0, "the completions did not fit together");
    assert!(steps < 4 * max_tokens, "{steps} steps for two completions of {max_tokens}");
    assert_eq!(e.scheduler().pool().num_free(), 12);
}

#[test]
fn n_completions_share_the_prompt_blocks() {
    let mut e = engine(EngineConfig::default());
    let prompt: Vec<u32> = e.tokenizer().encode(&"Tell me about the ocean and its tides. ".repeat(6)).unwrap();
    let full_blocks = (prompt.len() - 1) / 16;
    assert!(full_blocks >= 3, "the test needs a prompt of several blocks");
    let seeded = SamplingParams { temperature: 1.0, seed: Some(9), ..SamplingParams::default() };
    let request = Request { n: 3, params: seeded, ignore_eos: true, ..Request::greedy(1, prompt.clone(), 10) };
    e.add_request(request).unwrap();
    let mut by_index: HashMap<usize, (Vec<u32>, usize)> = HashMap::new();
    let mut lasts = 0;
    while e.has_work() {
        for o in e.step().unwrap() {
            let entry = by_index.entry(o.index).or_default();
            entry.0.extend(o.token.map(|t| t.token));
            entry.1 = o.cached_prompt_tokens;
            lasts += o.last as usize;
        }
    }
    assert_eq!(lasts, 1, "exactly one output closes the request");
    assert_eq!(by_index.len(), 3);
    // The first computes the prompt; the others start from its cached blocks.
    assert_eq!(by_index[&0].1, 0);
    assert_eq!(by_index[&1].1, full_blocks * 16);
    assert_eq!(by_index[&2].1, full_blocks * 16);
    assert!(by_index.values().all(|(t, _)| t.len() == 10));
    // Seeded: each completion draws its own numbers from the request's seed.
    assert_ne!(by_index[&0].0, by_index[&1].0);
    assert_eq!(e.scheduler().pool().num_free(), EngineConfig::default().num_blocks);
}

/// Steps until `id` has its first output; returns it.
fn first_output(e: &mut EngineCore<CpuBackend>, id: u64) -> Output {
    loop {
        if let Some(o) = e.step().unwrap().into_iter().find(|o| o.id == id) {
            return o;
        }
    }
}

#[test]
fn prompt_log_probabilities_are_the_models_and_the_prefix_cache_does_not_change_them() {
    use tessera_proto::block_hash::BLOCK_TOKENS;
    use tessera_worker::model::SeqInput;
    // Chunks of 16 tokens: the prompt is scored across several steps.
    let mut e = engine(EngineConfig { max_num_batched_tokens: 16, ..EngineConfig::default() });
    let text = "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of \
                Constantinople. Its laws, roads, languages and cities still shape Europe, and historians still argue \
                about why the western half fell while the eastern half lasted another thousand years.";
    let prompt = e.tokenizer().encode(text).unwrap();
    assert!(prompt.len() > 2 * BLOCK_TOKENS, "{} tokens", prompt.len());
    let score = |e: &mut EngineCore<CpuBackend>, id: u64| {
        let r = Request { prompt_logprobs: Some(3), ..Request::greedy(id, prompt.clone(), 0) };
        e.add_request(r).unwrap();
        let o = first_output(e, id);
        assert_eq!((o.token.clone(), o.finish, o.last), (None, Some(FinishReason::Length), true), "max_tokens 0");
        o
    };
    let uncached = score(&mut e, 1);
    assert_eq!(uncached.prompt_logprobs.len(), prompt.len() - 1, "every token after the first");
    // The prompt's blocks are now in the prefix cache; a plain request uses them...
    e.add_request(Request::greedy(2, prompt.clone(), 1)).unwrap();
    assert!(first_output(&mut e, 2).cached_prompt_tokens >= 2 * BLOCK_TOKENS);
    // ...and a scoring one does not: cached blocks keep no logits, so it computes all.
    let cached = score(&mut e, 3);
    assert_eq!(cached.cached_prompt_tokens, 0);
    assert_eq!(cached.prompt_logprobs, uncached.prompt_logprobs);

    // The model's own logits for the whole prompt in one forward.
    let loaded = load_model(CpuBackend::default(), &smollm2_path()).unwrap();
    let vocab = loaded.model.config.vocab_size;
    let blocks = prompt.len().div_ceil(BLOCK_TOKENS);
    let mut kv = loaded.model.new_kv_cache(blocks, BLOCK_TOKENS).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let seq = SeqInput { tokens: &prompt, cached: 0, block_table: &table, logits: true, embeds: &[] };
    let rows = loaded.model.forward_scoring(&[seq], &mut kv, &[true]).unwrap();
    assert_eq!(rows.len(), prompt.len() * vocab);
    for (i, p) in uncached.prompt_logprobs.iter().enumerate() {
        let row = &rows[i * vocab..(i + 1) * vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let log_sum = row.iter().map(|x| (x - max).exp()).sum::<f32>().ln() + max;
        assert_eq!(p.token, prompt[i + 1]);
        assert!((p.logprob - (row[p.token as usize] - log_sum)).abs() < 1e-3, "position {}", i + 1);
        assert_eq!(p.rank, 1 + row.iter().filter(|&&x| x > row[p.token as usize]).count() as u32);
        assert_eq!(p.top.len(), 3);
        assert!(p.top.windows(2).all(|w| w[0].1 >= w[1].1), "most likely first");
        assert_eq!(p.top[0].0 == p.token, p.rank == 1);
    }
}
