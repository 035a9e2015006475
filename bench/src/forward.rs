//! Forward-pass speed on the CPU: prefill tokens/s for one prompt, decode tokens/s for
//! one sequence; where llama.cpp's Python package is installed, the same two figures
//! for it on the same GGUF, the same token ids and the same number of threads, run in
//! the same process tree one after the other, and our/its ratios.

use crate::round;
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::process::Command;
use std::time::Instant;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::generate::{BLOCK_SIZE, PREFILL_CHUNK, SingleSequence, argmax};
use tessera_worker::model::{KvCache, Model, SeqInput};
use tessera_worker::{load, model_cache};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file or a known model name.
    #[arg(long, default_value = model_cache::SMOLLM2_135M_INSTRUCT.name)]
    model: String,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Tokens cached before the batched decode steps: the peer load's mean prompt, so
    /// the batch-4 / batch-1 ratio is the one its TPOT at concurrency 4 and 1 judges.
    #[arg(long, default_value_t = 224)]
    step_context: usize,
    /// Turns of batch-1 and batch-4 steps, alternated (16 steps a turn).
    #[arg(long, default_value_t = 24)]
    step_rounds: usize,
    /// Only the batched decode steps (for profiling them): no prefill, no llama.cpp.
    #[arg(long)]
    steps_only: bool,
    /// Skip the llama.cpp comparison even where it is installed.
    #[arg(long)]
    no_llama_cpp: bool,
}

const TEXT: &str = "Tessera serves language models on a cluster of machines. Each request is split \
into tokens, scheduled with others into one batch, and run through the model's layers: attention \
over the cached keys and values, then a feed-forward block. The numbers 1234 and 5678 appear here, \
as do names like Paris, Tokyo and Nairobi, so that the prompt is not one repeated token. ";

pub fn run(args: Args) -> Result<()> {
    let path = model_cache::resolve(&args.model)?;
    let loaded = load::load_model(CpuBackend::default(), &path)?;
    let model = &loaded.model;
    let text = TEXT.repeat(args.prompt_tokens / 40 + 1);
    let mut prompt = loaded.tokenizer.encode(&text).map_err(|e| anyhow::anyhow!("{e}"))?;
    anyhow::ensure!(prompt.len() >= args.prompt_tokens, "the benchmark text is too short");
    prompt.truncate(args.prompt_tokens);

    // One untimed run warms caches and the thread pool.
    SingleSequence::new(model, prompt.len())?.extend(model, &prompt[..prompt.len().min(16)])?;
    if args.steps_only {
        println!("{}", decode_steps(model, &prompt, &args)?);
        return Ok(());
    }

    let mut seq = SingleSequence::new(model, prompt.len() + args.decode_tokens)?;
    let start = Instant::now();
    let mut logits = seq.extend(model, &prompt)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..args.decode_tokens {
        logits = seq.extend(model, &[argmax(&logits)])?;
    }
    let decode_s = start.elapsed().as_secs_f64();

    let ours_prefill = prompt.len() as f64 / prefill_s;
    let ours_decode = args.decode_tokens as f64 / decode_s;
    let threads = rayon_threads();
    let mut out = json!({
        "bench": "forward",
        "model": path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "backend": "cpu",
        "threads": threads,
        "prompt_tokens": prompt.len(),
        "decode_tokens": args.decode_tokens,
        "prefill_tokens_per_s": round(ours_prefill),
        "decode_tokens_per_s": round(ours_decode),
    });
    let steps = decode_steps(model, &prompt, &args)?;
    for (key, value) in steps.as_object().into_iter().flatten() {
        out[key] = value.clone();
    }
    if !args.no_llama_cpp {
        match llama_cpp(&path, &prompt, args.decode_tokens, threads) {
            Ok(Some(theirs)) => {
                let (p, d) = (
                    theirs["prefill_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
                    theirs["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
                );
                out["llama_cpp"] = json!({"version": theirs["version"], "prefill_tokens_per_s": round(p), "decode_tokens_per_s": round(d)});
                out["prefill_ratio"] = json!(round(ours_prefill / p));
                out["decode_ratio"] = json!(round(ours_decode / d));
            }
            Ok(None) => out["llama_cpp"] = json!("not installed"),
            Err(e) => out["llama_cpp"] = json!(format!("failed: {e:#}")),
        }
    }
    println!("{out}");
    Ok(())
}

/// A decode step of 4 sequences against one of 1, each after the same `step_context`
/// tokens of the prompt: the cost of batching, with no prompt chunk in the steps. The
/// two batches take turns, `STEPS_A_TURN` steps at a time, so that both see the same
/// neighbours on a shared machine: the ratio is of their summed times, each figure
/// the mean step.
fn decode_steps(model: &Model<CpuBackend>, prompt: &[u32], args: &Args) -> Result<Value> {
    const STEPS_A_TURN: usize = 16;
    let context = &prompt[..args.step_context.clamp(1, prompt.len())];
    let (mut one, mut four) =
        (Lockstep::new(model, context, 1, STEPS_A_TURN)?, Lockstep::new(model, context, 4, STEPS_A_TURN)?);
    // A turn each, untimed: the caches and the pool warm for both.
    one.turn(model)?;
    four.turn(model)?;
    let (mut secs_one, mut secs_four) = (0.0, 0.0);
    for _ in 0..args.step_rounds.max(1) {
        secs_one += one.turn(model)?;
        secs_four += four.turn(model)?;
    }
    let steps = (args.step_rounds.max(1) * STEPS_A_TURN) as f64;
    Ok(json!({
        "decode_step_context": context.len(),
        "decode_step_ms_batch_1": round(secs_one / steps * 1e3),
        "decode_step_ms_batch_4": round(secs_four / steps * 1e3),
        "decode_step_batch_4_over_1": round(secs_four / secs_one),
    }))
}

/// `batch` sequences after the same prompt, decoding greedily in lockstep; each turn
/// runs the same steps again from the prompt's end (the cache keeps the prompt).
struct Lockstep {
    kv: KvCache<CpuBackend>,
    tables: Vec<Vec<u32>>,
    cached: usize,
    first: Vec<u32>,
    steps: usize,
}

impl Lockstep {
    fn new(model: &Model<CpuBackend>, prompt: &[u32], batch: usize, steps: usize) -> Result<Self> {
        let per_seq = (prompt.len() + steps + 1).div_ceil(BLOCK_SIZE);
        let mut kv = model.new_kv_cache(per_seq * batch, BLOCK_SIZE)?;
        let tables: Vec<Vec<u32>> =
            (0..batch).map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect()).collect();
        let mut first = Vec::with_capacity(batch);
        for table in &tables {
            let mut logits = Vec::new();
            for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
                let seq = SeqInput {
                    tokens: chunk,
                    cached: i * PREFILL_CHUNK,
                    block_table: table,
                    logits: true,
                    embeds: &[],
                };
                logits = model.forward(&[seq], &mut kv)?;
            }
            first.push(argmax(&logits));
        }
        Ok(Self { kv, tables, cached: prompt.len(), first, steps })
    }

    /// Seconds the turn's steps took.
    fn turn(&mut self, model: &Model<CpuBackend>) -> Result<f64> {
        let vocab = model.config.vocab_size;
        let mut next = self.first.clone();
        let start = Instant::now();
        for s in 0..self.steps {
            let inputs: Vec<SeqInput<'_>> = (0..next.len())
                .map(|b| SeqInput {
                    tokens: std::slice::from_ref(&next[b]),
                    cached: self.cached + s,
                    block_table: &self.tables[b],
                    logits: true,
                    embeds: &[],
                })
                .collect();
            let logits = model.forward(&inputs, &mut self.kv)?;
            for (b, n) in next.iter_mut().enumerate() {
                *n = argmax(&logits[b * vocab..(b + 1) * vocab]);
            }
        }
        Ok(start.elapsed().as_secs_f64())
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// llama.cpp's figures through llama-cpp-python, or None when it is not installed.
fn llama_cpp(path: &std::path::Path, prompt: &[u32], decode: usize, threads: usize) -> Result<Option<Value>> {
    const SCRIPT: &str = r#"
import json, sys, time
try:
    import llama_cpp
    import numpy as np
except ImportError:
    print("null"); sys.exit(0)
path, ids, decode, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + decode + 16, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
def last_logits():
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
llm.eval(ids[:16]); llm.reset()
t = time.perf_counter(); llm.eval(ids); prefill = time.perf_counter() - t
t = time.perf_counter()
for _ in range(decode):
    llm.eval([int(last_logits().argmax())])
dec = time.perf_counter() - t
print(json.dumps({"version": llama_cpp.__version__, "prefill_tokens_per_s": len(ids) / prefill,
                  "decode_tokens_per_s": decode / dec}))
"#;
    let python = std::env::var("TESSERA_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .arg("-c")
        .arg(SCRIPT)
        .arg(path)
        .arg(serde_json::to_string(prompt)?)
        .arg(decode.to_string())
        .arg(threads.to_string())
        .output()
        .context("running python3")?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).context("reading llama.cpp's figures")?;
    Ok((!v.is_null()).then_some(v))
}
