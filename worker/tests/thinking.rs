//! Thinking budgets on the real model: a spent budget forces the family's closing
//! marker and the answer follows; an end of output picked while reasoning closes the
//! block instead; under a grammar the forced tokens are consumed like sampled ones
//! and the answer still validates.

mod common;

use common::smollm2_path;
use serde_json::Value;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::engine::core::{EngineConfig, EngineCore, FinishReason, Output, Request};
use tessera_worker::engine::grammar::{GrammarSource, GrammarSpec};
use tessera_worker::engine::thinking::ThinkingBudget;
use tessera_worker::load::load_model;

const CLOSE: &str = "\n</think>\n\n";

struct Setup {
    engine: EngineCore<CpuBackend>,
    grammars: GrammarSource,
}

fn setup() -> Setup {
    let loaded = load_model(CpuBackend::default(), &smollm2_path()).unwrap();
    let eos: Vec<u32> = loaded.tokenizer.eos.iter().map(|t| t.id).collect();
    let grammars = GrammarSource::new(loaded.tokenizer.json.clone(), eos, loaded.model.config.vocab_size);
    let engine = EngineCore::new(loaded.model, loaded.tokenizer, EngineConfig::default(), "smollm2").unwrap();
    Setup { engine, grammars }
}

/// A chat prompt whose assistant turn opens a reasoning block, as model A's does.
fn thinking_prompt(e: &EngineCore<CpuBackend>, question: &str) -> Vec<u32> {
    let text = format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n");
    e.tokenizer().encode(&text).unwrap()
}

fn budget(e: &EngineCore<CpuBackend>, budget: usize) -> ThinkingBudget {
    ThinkingBudget {
        inside: true,
        open: "<think>".into(),
        close: "</think>".into(),
        close_tokens: e.tokenizer().encode(CLOSE).unwrap(),
        budget,
    }
}

/// Runs one request to its end: its tokens, text and finish.
fn run(e: &mut EngineCore<CpuBackend>, r: Request) -> (Vec<u32>, String, Option<FinishReason>) {
    e.add_request(r).unwrap();
    let (mut tokens, mut text, mut finish) = (Vec::new(), String::new(), None);
    while e.has_work() {
        for Output { token, text: t, finish: f, .. } in e.step().unwrap() {
            tokens.extend(token.map(|t| t.token));
            text.push_str(&t);
            finish = f;
        }
    }
    (tokens, text, finish)
}

#[test]
fn a_spent_budget_closes_the_block_and_an_answer_follows() {
    let Setup { mut engine, .. } = setup();
    let e = &mut engine;
    let prompt = thinking_prompt(e, "Describe the history of Rome in detail.");
    let close = e.tokenizer().encode(CLOSE).unwrap();
    for b in [0, 5, 24] {
        let r = Request { thinking: Some(budget(e, b)), ..Request::greedy(b as u64, prompt.clone(), 80) };
        let (tokens, text, _) = run(e, r);
        // The close is exactly the forced tokens, right after `b` reasoning tokens.
        assert_eq!(&tokens[b..b + close.len()], close.as_slice(), "budget {b}: {text:?}");
        let (reasoning, answer) = text.split_once("</think>").unwrap();
        assert!(!reasoning.contains("</think>"), "one block");
        assert!(!answer.trim().is_empty(), "budget {b}: an answer follows the forced close: {text:?}");
    }
    // Without a budget the same model reasons on to the limit: the budget is what closed it.
    let (_, text, finish) = run(e, Request::greedy(9, prompt, 80));
    assert!(!text.contains("</think>") && finish == Some(FinishReason::Length), "{text:?}");
}

#[test]
fn an_end_picked_while_reasoning_becomes_the_close_and_the_answer_is_not_empty() {
    let Setup { mut engine, .. } = setup();
    let e = &mut engine;
    // SmolLM2 ends this one after a few tokens, inside the block it never closes.
    let prompt = thinking_prompt(e, "Name three colours.");
    let (_, alone, finish) = run(e, Request::greedy(1, prompt.clone(), 200));
    assert_eq!(finish, Some(FinishReason::Stop), "the model ends on its own: {alone:?}");
    assert!(!alone.contains("</think>"));
    let r = Request { thinking: Some(budget(e, 1000)), ..Request::greedy(2, prompt, 200) };
    let (_, text, _) = run(e, r);
    assert!(text.starts_with(alone.trim_end()), "the reasoning is the model's own: {text:?}");
    let (_, answer) = text.split_once("</think>").unwrap_or_else(|| panic!("closed: {text:?}"));
    assert!(!answer.trim().is_empty(), "{text:?}");
}

#[test]
fn under_a_grammar_the_forced_close_is_consumed_and_the_answer_validates() {
    let Setup { mut engine, grammars } = setup();
    let e = &mut engine;
    let lark = "start: thought body\nthought[lazy]: /(?s:.*)<\\/think>/\nbody: GAP? json\n\
                json: %json {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}\n\
                GAP: /[ \\t\\n]{1,4}/\n";
    let prompt = thinking_prompt(e, "Which city is the capital of France? Answer in JSON.");
    let grammar = grammars.matcher(&GrammarSpec::Lark(lark.into())).unwrap();
    let r = Request { grammar: Some(grammar), thinking: Some(budget(e, 12)), ..Request::greedy(1, prompt, 100) };
    let (tokens, text, finish) = run(e, r);
    assert_eq!(finish, Some(FinishReason::Stop), "{text:?}");
    let close = e.tokenizer().encode(CLOSE).unwrap();
    assert_eq!(&tokens[12..12 + close.len()], close.as_slice(), "{text:?}");
    let (_, answer) = text.split_once("</think>").unwrap();
    let v: Value = serde_json::from_str(answer.trim()).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(v["city"].is_string(), "{v}");
}
