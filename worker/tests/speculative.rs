//! Speculative decoding on the real models: every request gives exactly what it gives
//! without speculation — tokens, log-probabilities, text, finish, usage — whatever
//! stops, limits, grammar, thinking budget, seed or `n` it carries, under preemption
//! and beside other requests; and the engine did verify proposals (fewer steps, tokens
//! accepted), or these comparisons would prove nothing.

mod common;

use common::{qwen05_path, request, serve_config, serve_in_process, smollm2, smollm2_path};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::engine::core::{EngineConfig, EngineCore, FinishReason, Output, Request};
use tessera_worker::engine::grammar::{GrammarSource, GrammarSpec};
use tessera_worker::engine::sampler::{PromptScore, Sampled, SamplingParams};
use tessera_worker::engine::speculate::{SpecConfig, SpecMethod, SpecStats, StepCosts};
use tessera_worker::engine::thinking::ThinkingBudget;
use tessera_worker::load::load_model;

fn ngram(max_tokens: usize) -> Option<SpecConfig> {
    Some(SpecConfig { method: SpecMethod::Ngram, max_tokens, draft: None })
}

/// An engine that verifies every proposal: what it runs then does not depend on how
/// long its steps take (its own choice, from measured costs, is unit-tested).
fn engine(path: &Path, config: EngineConfig) -> (EngineCore<CpuBackend>, GrammarSource) {
    let loaded = load_model(CpuBackend::default(), path).unwrap();
    let eos: Vec<u32> = loaded.tokenizer.eos.iter().map(|t| t.id).collect();
    let grammars = GrammarSource::new(loaded.tokenizer.json.clone(), eos, loaded.model.config.vocab_size);
    let mut e = EngineCore::new(loaded.model, loaded.tokenizer, config, "model").unwrap();
    e.pin_spec_costs(Some(StepCosts::free()));
    (e, grammars)
}

/// `engine`, drafting with the model at `draft`.
fn drafting(path: &Path, draft: &Path, max_tokens: usize, config: EngineConfig) -> EngineCore<CpuBackend> {
    let loaded = load_model(CpuBackend::default(), path).unwrap();
    let draft = load_model(CpuBackend::default(), draft).unwrap().model;
    let speculative = Some(SpecConfig { method: SpecMethod::Draft, max_tokens, draft: Some("draft".into()) });
    let config = EngineConfig { speculative, ..config };
    let mut e = EngineCore::with_draft(loaded.model, draft, loaded.tokenizer, config, "model").unwrap();
    e.pin_spec_costs(Some(StepCosts::free()));
    e
}

/// One completion as its outputs told it.
#[derive(Debug, Default, Clone, PartialEq)]
struct Completion {
    tokens: Vec<Sampled>,
    text: String,
    finish: Option<FinishReason>,
    prompt_tokens: usize,
    cached_prompt_tokens: usize,
    prompt_logprobs: Vec<PromptScore>,
    /// Outputs marked the request's last.
    lasts: usize,
}

type Results = HashMap<(u64, usize), Completion>;

struct Run {
    results: Results,
    steps: u64,
    spec: Option<SpecStats>,
}

/// Runs the requests together to their ends.
fn run(e: &mut EngineCore<CpuBackend>, requests: Vec<Request>) -> Run {
    let steps = e.stats().steps;
    for r in requests {
        e.add_request(r).unwrap();
    }
    let mut results = Results::new();
    while e.has_work() {
        for out in e.step().unwrap() {
            record(&mut results, out);
        }
    }
    assert_eq!(e.scheduler().pool().num_free(), e.scheduler().pool().num_blocks(), "every block returned");
    Run { results, steps: e.stats().steps - steps, spec: e.spec_stats().cloned() }
}

fn record(results: &mut Results, out: Output) {
    let c = results.entry((out.id, out.index)).or_default();
    assert!(c.finish.is_none(), "an output after the finish: {out:?}");
    c.tokens.extend(out.token);
    c.text.push_str(&out.text);
    c.finish = out.finish;
    c.prompt_tokens = out.prompt_tokens;
    c.cached_prompt_tokens = out.cached_prompt_tokens;
    c.prompt_logprobs.extend(out.prompt_logprobs);
    c.lasts += usize::from(out.last);
}

/// The same requests without and with speculation, on fresh engines.
fn both(
    path: &Path,
    config: EngineConfig,
    requests: impl Fn(&GrammarSource, &EngineCore<CpuBackend>) -> Vec<Request>,
) -> (Run, Run) {
    let mut runs = [None, ngram(8)].into_iter().map(|speculative| {
        let (mut e, grammars) = engine(path, EngineConfig { speculative, ..config.clone() });
        let requests = requests(&grammars, &e);
        run(&mut e, requests)
    });
    (runs.next().unwrap(), runs.next().unwrap())
}

fn assert_same(off: &Results, on: &Results) {
    assert_eq!(off.len(), on.len());
    for (key, want) in off {
        let got = &on[key];
        assert_eq!(got.text, want.text, "request {key:?}");
        // Which of a request's completions ends last may change with the steps taken.
        assert_eq!(Completion { lasts: 0, ..got.clone() }, Completion { lasts: 0, ..want.clone() }, "request {key:?}");
    }
    for results in [off, on] {
        let mut lasts: HashMap<u64, usize> = HashMap::new();
        for ((id, _), c) in results {
            *lasts.entry(*id).or_default() += c.lasts;
        }
        assert!(lasts.values().all(|&n| n == 1), "one last output per request: {lasts:?}");
    }
}

/// Proposals were verified and accepted, and steps saved: the comparisons above
/// exercised speculation.
fn assert_speculated(off: &Run, on: &Run) {
    let spec = on.spec.as_ref().expect("speculation was on");
    assert!(spec.drafts > 0 && spec.accepted_tokens > 0, "{spec:?}");
    assert!(on.steps < off.steps, "{} steps with speculation, {} without", on.steps, off.steps);
    let accepted: u64 = spec.accepted_per_position.iter().sum();
    assert_eq!(accepted, spec.accepted_tokens);
}

fn encode(e: &EngineCore<CpuBackend>, text: &str) -> Vec<u32> {
    e.tokenizer().encode(text).unwrap()
}

/// Prompts that invite the model to repeat what it was given, and some that do not.
const TEXTS: [&str; 8] = [
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon.\nCopy: apple, banana,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n# The same two functions again:\ndef add(a, b):\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat",
    "<|im_start|>user\nRepeat after me: the quick brown fox jumps over the lazy dog.<|im_end|>\n<|im_start|>assistant\n",
    "Fact 7 about the sea:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
];

#[test]
fn greedy_and_seeded_outputs_are_the_same_token_for_token_with_log_probabilities() {
    let (off, on) = both(&smollm2_path(), EngineConfig::default(), |_, e| {
        let mut requests = Vec::new();
        for (i, text) in TEXTS.iter().enumerate() {
            let prompt = encode(e, text);
            requests.push(Request::greedy(i as u64, prompt.clone(), 48));
            // Log-probabilities of every accepted token, and of the prompt.
            let params = SamplingParams { logprobs: Some(5), ..SamplingParams::greedy() };
            requests.push(Request {
                params,
                prompt_logprobs: Some(3),
                ..Request::greedy(100 + i as u64, prompt.clone(), 32)
            });
            // Seeded samples: the same draws, so the same tokens; n > 1 too.
            let params = SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                seed: Some(i as u64),
                logprobs: Some(2),
                ..Default::default()
            };
            requests.push(Request { params, n: 2, ..Request::greedy(200 + i as u64, prompt, 40) });
        }
        requests
    });
    assert_same(&off.results, &on.results);
    assert_speculated(&off, &on);
}

#[test]
fn stops_limits_and_end_rules_inside_an_accepted_run_end_it_exactly_there() {
    // The model copies the list from its prompt: " cherry, date, elderberry, fig,
    // grape, honeydew, kiwi, lemon." — proposals from the prompt, accepted in runs.
    let (off, on) = both(&smollm2_path(), EngineConfig::default(), |_, e| {
        let list = encode(e, TEXTS[0]);
        let cats = encode(e, TEXTS[3]);
        let fig = *encode(e, " fig").last().unwrap();
        vec![
            // A stop string, left out or kept, met in the middle of an accepted run.
            Request { stop: vec!["grape".into()], ..Request::greedy(1, list.clone(), 40) },
            Request {
                stop: vec!["kiw".into()],
                include_stop_str_in_output: true,
                ..Request::greedy(2, list.clone(), 40)
            },
            // A stop token id inside the run.
            Request { stop_token_ids: vec![fig], ..Request::greedy(3, list.clone(), 40) },
            // Exact limits, whatever a step could have accepted past them.
            Request::greedy(4, cats.clone(), 5),
            Request::greedy(5, cats.clone(), 17),
            Request { min_tokens: 30, ignore_eos: true, ..Request::greedy(6, cats.clone(), 40) },
            Request { stop: vec!["mat".into()], min_tokens: 6, ..Request::greedy(7, cats, 40) },
        ]
    });
    assert_same(&off.results, &on.results);
    assert_speculated(&off, &on);
    let r = |id| &on.results[&(id, 0)];
    assert_eq!((r(1).text.as_str(), r(1).finish), (" cherry, date, elderberry, fig, ", Some(FinishReason::Stop)));
    assert_eq!(r(2).text, " cherry, date, elderberry, fig, grape, honeydew, kiw");
    assert!(r(3).text.ends_with("elderberry,") && r(3).finish == Some(FinishReason::Stop), "{:?}", r(3));
    assert_eq!(r(4).tokens.len(), 5);
    assert_eq!(r(5).tokens.len(), 17);
    assert_eq!(r(6).tokens.len(), 40);
    assert!(r(7).text.matches("mat").count() == 1 && r(7).text.ends_with(" on the "), "{:?}", r(7).text);
}

#[test]
fn grammars_and_thinking_budgets_hold_at_every_verified_position() {
    let close = "\n</think>\n\n";
    let (off, on) = both(&smollm2_path(), EngineConfig::default(), |grammars, e| {
        let schema = json!({"type": "object", "properties": {"days": {"type": "array", "items": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday"]}, "maxItems": 8}}, "required": ["days"], "additionalProperties": false});
        let json_prompt = encode(e, "{\"days\": [\"Monday\", \"Tuesday\", \"Monday\", \"Tuesday\"]}\nAgain as JSON:\n");
        let think = encode(
            e,
            "<|im_start|>user\nCount: one two three one two three one two three<|im_end|>\n<|im_start|>assistant\n<think>\n",
        );
        let budget = ThinkingBudget {
            inside: true,
            open: "<think>".into(),
            close: "</think>".into(),
            close_tokens: encode(e, close),
            budget: 12,
        };
        vec![
            Request {
                grammar: Some(grammars.matcher(&GrammarSpec::JsonSchema(schema.to_string())).unwrap()),
                ..Request::greedy(1, json_prompt.clone(), 60)
            },
            Request {
                grammar: Some(grammars.matcher(&GrammarSpec::JsonObject).unwrap()),
                ..Request::greedy(2, json_prompt, 40)
            },
            Request { thinking: Some(budget), ..Request::greedy(3, think, 48) },
        ]
    });
    assert_same(&off.results, &on.results);
    let spec = on.spec.as_ref().unwrap();
    assert!(spec.drafts > 0, "{spec:?}");
    let value: serde_json::Value = serde_json::from_str(&on.results[&(1, 0)].text).unwrap();
    assert!(value["days"].is_array(), "{value}");
    assert!(on.results[&(3, 0)].text.contains("</think>"), "{:?}", on.results[&(3, 0)].text);
}

#[test]
fn preemption_mid_verification_and_a_cached_prefix_change_nothing() {
    // 24 blocks for 12 sequences of up to 80 tokens: preemptions certain.
    let config = EngineConfig { num_blocks: 24, ..EngineConfig::default() };
    let (mut off, mut on) = both(&smollm2_path(), config, |_, e| {
        (0..12).map(|i| Request::greedy(i, encode(e, TEXTS[i as usize % 4]), 48)).collect()
    });
    // Whether a request's prompt finds another's blocks still cached depends on which
    // were preempted and when — on the steps taken, with or without speculation alike.
    for c in off.results.values_mut().chain(on.results.values_mut()) {
        c.cached_prompt_tokens = 0;
    }
    assert_same(&off.results, &on.results);
    assert_speculated(&off, &on);
    // A repeated prompt finds its prefix cached with speculation as without: no block
    // of a rejected proposal was ever cached under the sequence's hashes.
    let (mut e, _) = engine(&smollm2_path(), EngineConfig { speculative: ngram(8), ..EngineConfig::default() });
    let prompt = encode(&e, &TEXTS[..4].concat());
    let first = run(&mut e, vec![Request::greedy(1, prompt.clone(), 64)]);
    let mut again = prompt.clone();
    again.extend(first.results[&(1, 0)].tokens.iter().map(|s| s.token));
    let second = run(&mut e, vec![Request::greedy(2, again.clone(), 8)]);
    let cached = second.results[&(2, 0)].cached_prompt_tokens;
    assert_eq!(cached, (again.len() - 1) / 16 * 16, "prompt and output blocks were all cached");
}

#[test]
fn an_abort_mid_verification_returns_every_block() {
    let (mut e, _) = engine(&smollm2_path(), EngineConfig { speculative: ngram(8), ..EngineConfig::default() });
    for i in 0..4 {
        e.add_request(Request::greedy(i, encode(&e, TEXTS[i as usize]), 200)).unwrap();
    }
    while e.spec_stats().unwrap().drafts < 4 {
        e.step().unwrap();
    }
    for i in 0..4 {
        assert_eq!(e.abort(i).len(), 1);
    }
    assert!(!e.has_work());
    assert_eq!(e.scheduler().pool().num_free(), e.scheduler().pool().num_blocks());
}

#[test]
fn qwen_coder_edits_are_the_same_token_for_token() {
    let edit = |code: &str, ask: &str| {
        format!(
            "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\n{ask}\n\n```python\n{code}```<|im_end|>\n<|im_start|>assistant\n"
        )
    };
    let code = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n\ndef variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n";
    let (off, on) = both(&qwen05_path(), EngineConfig::default(), |_, e| {
        vec![
            Request::greedy(
                1,
                encode(e, &edit(code, "Add type hints to every function and reply with the full code.")),
                96,
            ),
            Request::greedy(
                2,
                encode(e, &edit(code, "Rename `xs` to `values` everywhere; reply with the full code.")),
                96,
            ),
            Request::greedy(
                3,
                encode(
                    e,
                    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
                ),
                48,
            ),
        ]
    });
    assert_same(&off.results, &on.results);
    assert_speculated(&off, &on);
}

#[test]
fn a_draft_model_changes_no_token_and_gives_back_its_blocks() {
    // The model drafting for itself: its guesses are the model's own greedy tokens, so
    // a greedy request accepts nearly all — unless the draft's cache, fed a step at a
    // time and cut back after each rejection, ever held the wrong keys and values.
    // Seeded samples accept fewer (a greedy guess is kept with the probability the
    // model gives it) and must come out the same. 40 blocks for 25 sequences: the model
    // preempts, the draft evicts.
    let path = smollm2_path();
    let config = EngineConfig { num_blocks: 40, ..EngineConfig::default() };
    let greedy = |grammars: &GrammarSource, e: &EngineCore<CpuBackend>| {
        let mut requests: Vec<Request> = TEXTS
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let params = SamplingParams { logprobs: Some(3), ..SamplingParams::greedy() };
                Request { params, ..Request::greedy(i as u64, encode(e, text), 40) }
            })
            .collect();
        let json = encode(e, "{\"days\": [\"Monday\", \"Tuesday\"]}\nAgain as JSON:\n");
        let grammar = Some(grammars.matcher(&GrammarSpec::JsonObject).unwrap());
        requests.push(Request { grammar, ..Request::greedy(300, json, 40) });
        requests
    };
    let seeded = |e: &EngineCore<CpuBackend>| -> Vec<Request> {
        let sample = |i: usize| SamplingParams { temperature: 0.8, seed: Some(i as u64), ..Default::default() };
        (0..TEXTS.len())
            .map(|i| Request { params: sample(i), n: 2, ..Request::greedy(100 + i as u64, encode(e, TEXTS[i]), 32) })
            .collect()
    };
    let (mut plain, grammars) = engine(&path, config.clone());
    let (g, s) = (greedy(&grammars, &plain), seeded(&plain));
    let off = [run(&mut plain, g), run(&mut plain, s)];
    let mut e = drafting(&path, &path, 4, config);
    let (g, s) = (greedy(&grammars, &e), seeded(&e));
    let first = run(&mut e, g);
    let spec = first.spec.clone().unwrap();
    assert!(spec.accepted_tokens * 10 >= spec.draft_tokens * 9, "greedy, a model drafting for itself: {spec:?}");
    let second = run(&mut e, s);
    // Under this much pressure which prompt blocks are still cached when a sequence
    // starts depends on the steps taken; everything else must match.
    let uncached = |r: &Results| -> Results {
        r.iter().map(|(k, c)| (*k, Completion { cached_prompt_tokens: 0, ..c.clone() })).collect()
    };
    for (off, on) in off.iter().zip([&first, &second]) {
        assert_same(&uncached(&off.results), &uncached(&on.results));
        assert_speculated(off, on);
    }
    assert!(first.steps * 2 < off[0].steps, "{} steps drafting, {} without", first.steps, off[0].steps);
    assert_eq!(e.spec_held_blocks(), 0, "every sequence's draft blocks came back");
}

#[test]
fn a_draft_with_another_vocabulary_is_refused() {
    let target = load_model(CpuBackend::default(), &smollm2_path()).unwrap();
    let draft = load_model(CpuBackend::default(), &qwen05_path()).unwrap().model;
    let speculative = Some(SpecConfig { method: SpecMethod::Draft, max_tokens: 4, draft: Some("qwen".into()) });
    let config = EngineConfig { speculative, ..EngineConfig::default() };
    let err = EngineCore::with_draft(target.model, draft, target.tokenizer, config, "m").err().unwrap();
    assert!(err.to_string().contains("a draft needs the model's tokenizer"), "{err}");
    // And a draft method with no draft model at all.
    let target = load_model(CpuBackend::default(), &smollm2_path()).unwrap();
    let speculative = Some(SpecConfig { method: SpecMethod::Draft, max_tokens: 4, draft: Some("qwen".into()) });
    let config = EngineConfig { speculative, ..EngineConfig::default() };
    let err = EngineCore::new(target.model, target.tokenizer, config, "m").err().unwrap();
    assert!(err.to_string().contains("needs its draft model"), "{err}");
}

#[tokio::test]
async fn a_worker_drafts_with_the_model_it_is_named_inside_its_kv_budget() {
    let bytes = 8 << 20;
    let drafting = tessera_worker::serve::ServeConfig {
        speculative: Some(SpecMethod::Draft),
        speculative_tokens: 4,
        speculative_draft: Some(smollm2_path().display().to_string()),
        ..serve_config(bytes)
    };
    let mut plain = serve_in_process(serve_config(bytes)).await;
    let mut drafted = serve_in_process(drafting.clone()).await;
    let card = |c: tessera_proto::worker::ModelCard| c.context_length;
    let alone = card(plain.get_model_card(tessera_proto::worker::ModelCardRequest {}).await.unwrap().into_inner());
    let beside = card(drafted.get_model_card(tessera_proto::worker::ModelCardRequest {}).await.unwrap().into_inner());
    // The draft's cache (as many blocks of a model of the same size) comes out of the
    // same budget: half the blocks each.
    assert!(beside * 2 <= alone && beside * 2 + 32 >= alone, "{beside} tokens beside a draft, {alone} alone");
    // And answers as the worker without one.
    let prompt = smollm2().tokenizer.encode(TEXTS[1]).unwrap();
    let answer = |mut client: tessera_proto::worker::worker_client::WorkerClient<_>| {
        let req = request("r", prompt.clone(), 24);
        async move {
            let mut stream = client.generate(req).await.unwrap().into_inner();
            let mut tokens = Vec::new();
            while let Some(r) = stream.message().await.unwrap() {
                tokens.extend(r.tokens.iter().map(|t| t.token_id));
            }
            tokens
        }
    };
    let want = answer(plain).await;
    assert_eq!(want.len(), 24);
    assert_eq!(answer(drafted).await, want);

    // A draft needs its model, and the model's tokenizer.
    let build = |config| tessera_worker::serve::build_service(&config).err().unwrap().to_string();
    let unnamed = tessera_worker::serve::ServeConfig { speculative_draft: None, ..drafting.clone() };
    let err = tokio::task::spawn_blocking(move || build(unnamed)).await.unwrap();
    assert!(err.contains("--speculative-draft"), "{err}");
    let other =
        tessera_worker::serve::ServeConfig { speculative_draft: Some(qwen05_path().display().to_string()), ..drafting };
    let err = tokio::task::spawn_blocking(move || {
        format!("{:#}", tessera_worker::serve::build_service(&other).err().unwrap())
    })
    .await
    .unwrap();
    assert!(err.contains("another tokenizer"), "{err}");
}
