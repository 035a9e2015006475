//! Constrained decoding's cost: the same greedy requests with and without a JSON
//! schema, in the same run (each twice, alternating, so drift on a shared machine
//! falls on both), and the time to compute one step's token mask over the whole
//! vocabulary, replayed along the constrained outputs — and along outputs that reason
//! first under a thinking budget whose forced close the grammar consumes (reasoning up
//! to `</think>`, then the schema), to show the budget adds nothing to a mask.

use crate::round;
use anyhow::Result;
use serde_json::json;
use std::collections::HashMap;
use std::time::Instant;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::engine::core::{EngineConfig, EngineCore, Request};
use tessera_worker::engine::grammar::{Constraint, GrammarSource, GrammarSpec};
use tessera_worker::engine::thinking::ThinkingBudget;
use tessera_worker::{load, model_cache};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = model_cache::SMOLLM2_135M_INSTRUCT.name)]
    model: String,
    #[arg(long, default_value_t = 32)]
    requests: usize,
    #[arg(long, default_value_t = 64)]
    output_tokens: usize,
}

/// Long enough that no output completes before `output_tokens`: every run then
/// produces the same number of tokens in batches of the same size.
fn schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {"readings": {"type": "array", "minItems": 64, "items": {
            "type": "object",
            "properties": {"sensor": {"type": "string", "maxLength": 12}, "value": {"type": "number"}},
            "required": ["sensor", "value"], "additionalProperties": false}}},
        "required": ["readings"], "additionalProperties": false
    })
}

pub fn run(args: Args) -> Result<()> {
    let path = model_cache::resolve(&args.model)?;
    let loaded = load::load_model(CpuBackend::default(), &path)?;
    let vocab = loaded.model.config.vocab_size;
    let eos: Vec<u32> = loaded.tokenizer.eos.iter().map(|t| t.id).collect();
    let grammars = GrammarSource::new(loaded.tokenizer.json.clone(), eos, vocab);
    let spec = GrammarSpec::JsonSchema(schema().to_string());
    let mut engine = EngineCore::new(loaded.model, loaded.tokenizer, EngineConfig::default(), &args.model)?;
    let prompts: Vec<Vec<u32>> = (0..args.requests)
        .map(|i| engine.tokenizer().encode(&format!("Station {i}: the sensor readings as JSON:\n")))
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut next_id = 0u64;
    let mut run = |engine: &mut EngineCore<CpuBackend>, constrained: bool| -> Result<(usize, f64, Vec<Vec<u32>>)> {
        let start = Instant::now();
        let mut ids = Vec::new();
        for p in &prompts {
            let grammar = if constrained { Some(grammars.matcher(&spec).map_err(anyhow::Error::msg)?) } else { None };
            let r = Request {
                ignore_eos: !constrained,
                grammar,
                ..Request::greedy(next_id, p.clone(), args.output_tokens)
            };
            ids.push(next_id);
            next_id += 1;
            engine.add_request(r)?;
        }
        let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
        while engine.has_work() {
            for o in engine.step()? {
                tokens.entry(o.id).or_default().extend(o.token.map(|t| t.token));
            }
        }
        let produced = tokens.values().map(Vec::len).sum();
        let outputs = ids.iter().map(|id| tokens.remove(id).unwrap_or_default()).collect();
        Ok((produced, start.elapsed().as_secs_f64(), outputs))
    };
    let (mut free, mut constrained) = ((0, 0.0), (0, 0.0));
    let mut outputs = Vec::new();
    for _ in 0..2 {
        let (n, s, _) = run(&mut engine, false)?;
        free = (free.0 + n, free.1 + s);
        let (n, s, o) = run(&mut engine, true)?;
        constrained = (constrained.0 + n, constrained.1 + s);
        outputs = o;
    }
    // One step's mask, along each constrained output.
    let mask_us = replay(&outputs, || grammars.matcher(&spec).map_err(anyhow::Error::msg), vocab)?;
    let pct = |p: f64| mask_us.get(((mask_us.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0);
    // The same schema after a reasoning block that a budget of 16 tokens closes.
    let lark = format!(
        "start: thought body\nthought[lazy]: /(?s:.*)<\\/think>/\nbody: GAP? json\njson: %json {}\nGAP: /[ \\t\\n]{{1,4}}/\n",
        schema()
    );
    let thinking = GrammarSpec::Lark(lark);
    let close = engine.tokenizer().encode("\n</think>\n\n").map_err(|e| anyhow::anyhow!("{e}"))?;
    let budget = ThinkingBudget {
        inside: true,
        open: "<think>".into(),
        close: "</think>".into(),
        close_tokens: close,
        budget: 16,
    };
    let mut reasoned = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut prompt = p.clone();
        prompt.extend(engine.tokenizer().encode("<think>\n").map_err(|e| anyhow::anyhow!("{e}"))?);
        let r = Request {
            grammar: Some(grammars.matcher(&thinking).map_err(anyhow::Error::msg)?),
            thinking: Some(budget.clone()),
            ..Request::greedy(next_id + i as u64, prompt, args.output_tokens)
        };
        engine.add_request(r)?;
    }
    let mut by_id: HashMap<u64, Vec<u32>> = HashMap::new();
    while engine.has_work() {
        for o in engine.step()? {
            by_id.entry(o.id).or_default().extend(o.token.map(|t| t.token));
        }
    }
    reasoned.extend(by_id.into_values());
    let budget_us = replay(&reasoned, || grammars.matcher(&thinking).map_err(anyhow::Error::msg), vocab)?;
    let bpct = |p: f64| budget_us.get(((budget_us.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0);
    let (free_tps, constrained_tps) = (free.0 as f64 / free.1, constrained.0 as f64 / constrained.1);
    println!(
        "{}",
        json!({
            "bench": "grammar", "backend": "cpu", "requests": args.requests, "output_tokens_each": args.output_tokens,
            "vocab": vocab, "unconstrained_tokens_per_s": round(free_tps), "constrained_tokens_per_s": round(constrained_tps),
            "ratio": round(constrained_tps / free_tps), "mask_steps": mask_us.len(),
            "mask_us_p50": round(pct(0.5)), "mask_us_p99": round(pct(0.99)),
            "budget_close_mask_steps": budget_us.len(), "budget_close_mask_us_p50": round(bpct(0.5)),
            "budget_close_mask_us_p99": round(bpct(0.99)),
        })
    );
    Ok(())
}

/// One step's mask time (µs) at every position of each output, sorted.
fn replay(outputs: &[Vec<u32>], matcher: impl Fn() -> Result<Constraint>, vocab: usize) -> Result<Vec<f64>> {
    let mut us = Vec::new();
    let mut logits = vec![0.0f32; vocab];
    for tokens in outputs {
        let c = matcher()?;
        for &t in tokens {
            let start = Instant::now();
            c.mask(&mut logits);
            us.push(start.elapsed().as_secs_f64() * 1e6);
            c.accept(t);
        }
    }
    us.sort_by(f64::total_cmp);
    Ok(us)
}
