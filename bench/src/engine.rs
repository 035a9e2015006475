//! The engine offline, in-process: many requests sharing a few long system prompts,
//! run together with continuous batching, against the same requests one at a time
//! (a subset, in the same run), greedy with a fixed output length.

use crate::round;
use anyhow::Result;
use serde_json::json;
use std::time::Instant;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::engine::core::{EngineConfig, EngineCore, Request};
use tessera_worker::tokenizer::ModelTokenizer;
use tessera_worker::{load, model_cache};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = model_cache::SMOLLM2_135M_INSTRUCT.name)]
    model: String,
    #[arg(long, default_value_t = 256)]
    requests: usize,
    #[arg(long, default_value_t = 4)]
    system_prompts: usize,
    #[arg(long, default_value_t = 300)]
    system_tokens: usize,
    #[arg(long, default_value_t = 50)]
    unique_tokens: usize,
    #[arg(long, default_value_t = 128)]
    output_tokens: usize,
    /// Requests run one at a time for the sequential figure.
    #[arg(long, default_value_t = 8)]
    sequential_requests: usize,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 4096)]
    num_blocks: usize,
}

const TOPICS: [&str; 8] = ["astronomy", "cooking", "sailing", "chess", "gardening", "music", "geology", "poetry"];

/// `len` tokens of text about `topic`, starting with `lead`.
fn tokens(tok: &ModelTokenizer, lead: &str, topic: &str, len: usize) -> Result<Vec<u32>> {
    let mut text = lead.to_string();
    let mut i = 0;
    let mut ids = Vec::new();
    while ids.len() < len {
        text.push_str(&format!(" Point {i} on {topic}: practice matters, and details compound over time."));
        ids = tok.encode(&text).map_err(|e| anyhow::anyhow!("{e}"))?;
        i += 1;
    }
    ids.truncate(len);
    Ok(ids)
}

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Runs until every request finishes; returns output tokens produced.
fn drain(e: &mut EngineCore<CpuBackend>) -> Result<usize> {
    let mut n = 0;
    while e.has_work() {
        n += e.step()?.iter().filter(|o| o.token.is_some()).count();
    }
    Ok(n)
}

pub fn run(args: Args) -> Result<()> {
    let path = model_cache::resolve(&args.model)?;
    let config = EngineConfig {
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        num_blocks: args.num_blocks,
        // Offline throughput: no stream waits on a step, so prompts are not paced.
        prompt_step_percent: 0,
        ..EngineConfig::default()
    };
    let new_engine = || -> Result<EngineCore<CpuBackend>> {
        let loaded = load::load_model(CpuBackend::default(), &path)?;
        Ok(EngineCore::new(loaded.model, loaded.tokenizer, config.clone(), &args.model)?)
    };
    let mut engine = new_engine()?;
    let tok = engine.tokenizer();
    let systems: Vec<Vec<u32>> = (0..args.system_prompts)
        .map(|s| tokens(tok, &format!("System {s}: you are an expert."), TOPICS[s % TOPICS.len()], args.system_tokens))
        .collect::<Result<_>>()?;
    let requests: Vec<Request> = (0..args.requests)
        .map(|i| {
            let unique = tokens(tok, &format!("Question {i}:"), TOPICS[(i / 4) % TOPICS.len()], args.unique_tokens)?;
            let prompt = [systems[i % systems.len()].clone(), unique].concat();
            Ok(Request { ignore_eos: true, ..Request::greedy(i as u64, prompt, args.output_tokens) })
        })
        .collect::<Result<_>>()?;

    let start = Instant::now();
    for r in &requests {
        engine.add_request(r.clone())?;
    }
    let produced = drain(&mut engine)?;
    let batched_s = start.elapsed().as_secs_f64();
    let pool = engine.scheduler().pool_stats();
    let stats = engine.stats();
    drop(engine);

    let mut sequential = new_engine()?;
    let subset = args.sequential_requests.min(requests.len());
    let start = Instant::now();
    let mut seq_tokens = 0;
    for r in &requests[..subset] {
        sequential.add_request(r.clone())?;
        seq_tokens += drain(&mut sequential)?;
    }
    let sequential_s = start.elapsed().as_secs_f64();

    let (batched_tps, sequential_tps) = (produced as f64 / batched_s, seq_tokens as f64 / sequential_s);
    let out = json!({
        "bench": "engine",
        "backend": "cpu",
        "requests": args.requests,
        "system_prompts": args.system_prompts,
        "prompt_tokens_each": args.system_tokens + args.unique_tokens,
        "output_tokens_each": args.output_tokens,
        "output_tokens": produced,
        "seconds": round(batched_s),
        "output_tokens_per_s": round(batched_tps),
        "sequential_requests": subset,
        "sequential_output_tokens_per_s": round(sequential_tps),
        "speedup": round(batched_tps / sequential_tps),
        "prefix_hit_rate": if pool.queried_blocks == 0 { 0.0 } else { pool.hit_blocks as f64 / pool.queried_blocks as f64 },
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "peak_rss_bytes": peak_rss_bytes(),
    });
    println!("{out}");
    Ok(())
}
