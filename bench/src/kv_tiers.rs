//! The second KV tier on multi-turn chat: many conversations, each turn resending its
//! whole history, taken in turn so that the working set is several times the device's
//! cache. Each request runs alone (time to first token is its prefill, or the copy of
//! its history back), on engines of the same cache: no second tier, a host-memory tier,
//! a disk tier; then the disk tier's engine stopped and a new one started on the same
//! folder (a warm restart) against a restart without one. Prefix hit rate (prompt
//! tokens served from the cache or the tier, of all prompt tokens) and TTFT p50/p99 for
//! each, and the bytes and time the tier moved. Last, streams decoding while every
//! conversation's next turn arrives with its history on disk: the streams' gaps
//! between tokens with the disk tier's blocks read ahead of their prompts' steps,
//! against each read in its step.

use crate::{percentile, round};
use anyhow::Result;
use serde_json::{Value, json};
use std::time::Instant;
use tessera_kernels::Backend;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::engine::core::{EngineConfig, EngineCore, Request};
use tessera_worker::engine::kv_tier::TierConfig;
use tessera_worker::{load, model_cache};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = model_cache::SMOLLM2_135M_INSTRUCT.name)]
    model: String,
    #[arg(long, default_value_t = 16)]
    conversations: usize,
    /// Turns of each conversation before the restart; one more after it.
    #[arg(long, default_value_t = 8)]
    turns: usize,
    /// Tokens of the system prompt each conversation starts with (its own).
    #[arg(long, default_value_t = 200)]
    system_tokens: usize,
    /// Tokens of each user message.
    #[arg(long, default_value_t = 24)]
    user_tokens: usize,
    /// Tokens of each reply (generated, and resent in the history).
    #[arg(long, default_value_t = 16)]
    reply_tokens: usize,
    /// The conversations' histories at their longest over the device cache: the cache
    /// is sized from it.
    #[arg(long, default_value_t = 4.0)]
    working_set_over_cache: f64,
}

/// One engine's run over the turns: time to first token of each request, and the prompt
/// tokens served from the cache or the tier of all prompt tokens.
struct Run {
    ttft_ms: Vec<f64>,
    cached: usize,
    prompt: usize,
}

impl Run {
    fn report(&self) -> Value {
        json!({
            "requests": self.ttft_ms.len(),
            "prefix_hit_rate": round(self.cached as f64 / self.prompt.max(1) as f64),
            "ttft_p50_ms": round(percentile(&self.ttft_ms, 0.5)),
            "ttft_p99_ms": round(percentile(&self.ttft_ms, 0.99)),
        })
    }
}

/// The conversations' histories, turn by turn: what each request sends.
struct Chats {
    histories: Vec<Vec<u32>>,
    user: Vec<Vec<Vec<u32>>>,
}

/// Runs `turns` (a range) of every conversation, one request at a time, conversations
/// in turn; each reply joins its history.
fn run_turns(
    e: &mut EngineCore<CpuBackend>,
    chats: &mut Chats,
    turns: std::ops::Range<usize>,
    reply: usize,
) -> Result<Run> {
    let mut run = Run { ttft_ms: Vec::new(), cached: 0, prompt: 0 };
    let mut id = 0;
    for turn in turns {
        for c in 0..chats.histories.len() {
            let prompt = [chats.histories[c].clone(), chats.user[c][turn].clone()].concat();
            id += 1;
            let started = Instant::now();
            e.add_request(Request { ignore_eos: true, ..Request::greedy(id, prompt.clone(), reply) })?;
            let mut first = None;
            let mut out = Vec::new();
            while e.has_work() {
                for o in e.step()? {
                    if let Some(t) = o.token {
                        first.get_or_insert_with(|| (started.elapsed(), o.cached_prompt_tokens));
                        out.push(t.token);
                    }
                }
            }
            let (ttft, cached) = first.ok_or_else(|| anyhow::anyhow!("request {id} produced nothing"))?;
            run.ttft_ms.push(ttft.as_secs_f64() * 1e3);
            run.cached += cached;
            run.prompt += prompt.len();
            chats.histories[c] = [prompt, out].concat();
        }
    }
    Ok(run)
}

pub fn run(args: Args) -> Result<()> {
    let path = model_cache::resolve(&args.model)?;
    let disk = tempfile::tempdir()?;
    // Every conversation's history at its longest, and a cache that holds a fraction.
    let longest = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens);
    let working_set = args.conversations * longest;
    let num_blocks = (working_set as f64 / args.working_set_over_cache / 16.0).ceil() as usize;
    let new_engine = |tiers: TierConfig, num_blocks: usize| -> Result<EngineCore<CpuBackend>> {
        let loaded = load::load_model(CpuBackend::default(), &path)?;
        let config = EngineConfig { num_blocks, kv_tiers: tiers, ..EngineConfig::default() };
        Ok(EngineCore::new(loaded.model, loaded.tokenizer, config, &args.model)?)
    };
    let load_average = crate::peer::load_average();
    let block_bytes = {
        let loaded = load::load_model(CpuBackend::default(), &path)?;
        let c = &loaded.model.config;
        tessera_worker::model::kv_block_bytes(loaded.model.backend().kv_element_bytes(), c.num_layers, c.kv_width(), 16)
            as u64
    };
    // Enough tier for every conversation's history after the restart's turn too.
    let tier_blocks = args.conversations * (longest + args.user_tokens + args.reply_tokens).div_ceil(16) + 16;
    let tier_bytes = tier_blocks as u64 * block_bytes;
    let identity = format!("{} benchmark", args.model);
    let host = TierConfig { host_bytes: tier_bytes, disk: None, identity: identity.clone() };
    let on_disk = TierConfig { host_bytes: 0, disk: Some((disk.path().into(), tier_bytes)), identity };

    let chats = |e: &EngineCore<CpuBackend>| -> Result<Chats> {
        let tok = e.tokenizer();
        let text = |lead: String, len: usize| -> Result<Vec<u32>> {
            let mut text = lead;
            let mut ids = Vec::new();
            while ids.len() < len {
                text.push_str(" and then some more words about it, said plainly");
                ids = tok.encode(&text).map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            ids.truncate(len);
            Ok(ids)
        };
        Ok(Chats {
            histories: (0..args.conversations)
                .map(|c| text(format!("System {c}: you help with project {c}."), args.system_tokens))
                .collect::<Result<_>>()?,
            user: (0..args.conversations)
                .map(|c| (0..=args.turns).map(|t| text(format!("User {c}, turn {t}:"), args.user_tokens)).collect())
                .collect::<Result<_>>()?,
        })
    };

    let mut lines = serde_json::Map::new();
    // On a CPU the cache is host memory too: the same memory given to the cache instead
    // is what a host tier competes with there.
    let runs = [
        ("no_tier", TierConfig::default(), num_blocks),
        ("host_tier", host, num_blocks),
        ("disk_tier", on_disk.clone(), num_blocks),
        ("cache_with_the_tiers_memory", TierConfig::default(), num_blocks + tier_blocks),
    ];
    for (name, tiers, blocks) in runs {
        let mut e = new_engine(tiers, blocks)?;
        let mut c = chats(&e)?;
        let started = Instant::now();
        let run = run_turns(&mut e, &mut c, 0..args.turns, args.reply_tokens)?;
        let mut report = run.report();
        report["seconds"] = json!(round(started.elapsed().as_secs_f64()));
        if let Some(t) = e.scheduler().tiers() {
            let s = t.stats();
            report["tier_hits"] = json!({"host": s.host_hits, "disk": s.disk_hits});
            report["offloaded_bytes"] = json!(s.offloaded_bytes);
            report["onloaded_bytes"] = json!(s.onloaded_bytes);
        }
        if name == "disk_tier" {
            // A restart: what the cache holds goes to disk, and a new engine starts on
            // it; against the same last turn on an engine with nothing kept.
            let persisted = e.persist_kv();
            drop(e);
            // The streams beside disk hits, each run on a fresh copy of the folder, in
            // the order ABBA so that neither way always runs first.
            let last: Vec<Vec<u32>> = (0..args.conversations)
                .map(|i| [c.histories[i].clone(), c.user[i][args.turns].clone()].concat())
                .collect();
            let (mut ahead, mut in_step) = (Vec::new(), Vec::new());
            for read_ahead in [true, false, false, true] {
                let copy = tempfile::tempdir()?;
                copy_tree(disk.path(), copy.path())?;
                let config = TierConfig { disk: Some((copy.path().into(), tier_bytes)), ..on_disk.clone() };
                let mut e = new_engine(config, num_blocks)?;
                let run = streams_beside(&mut e, read_ahead, &last, args.reply_tokens)?;
                if read_ahead { &mut ahead } else { &mut in_step }.push(run);
            }
            lines.insert("streams_beside_disk_hits_read_ahead".into(), Beside::report(&ahead));
            lines.insert("streams_beside_disk_hits_read_in_step".into(), Beside::report(&in_step));
            let last = args.turns..args.turns + 1;
            let mut cold_chats = Chats { histories: c.histories.clone(), user: c.user.clone() };
            let mut warm = new_engine(on_disk.clone(), num_blocks)?;
            let mut warm_report = run_turns(&mut warm, &mut c, last.clone(), args.reply_tokens)?.report();
            warm_report["persisted_blocks"] = json!(persisted);
            lines.insert("restart_warm".into(), warm_report);
            drop(warm);
            let mut cold = new_engine(TierConfig::default(), num_blocks)?;
            let cold_run = run_turns(&mut cold, &mut cold_chats, last, args.reply_tokens)?;
            lines.insert("restart_cold".into(), cold_run.report());
        }
        lines.insert(name.into(), report);
    }
    let p50 = |k: &str| lines[k]["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN);
    let gap = |k: &str, q: &str| lines[k][q].as_f64().unwrap_or(f64::NAN);
    let (ahead, in_step) = ("streams_beside_disk_hits_read_ahead", "streams_beside_disk_hits_read_in_step");
    let out = json!({
        "bench": "kv_tiers",
        "backend": "cpu",
        "cpu_path": tessera_kernels::cpu::dispatched_path(),
        "conversations": args.conversations,
        "turns": args.turns,
        "device_cache_tokens": num_blocks * 16,
        "working_set_tokens": working_set,
        "working_set_over_cache": round(working_set as f64 / (num_blocks * 16) as f64),
        "prefix_hit_rate_ceiling": round(ceiling(&args)),
        "tier_bytes": tier_bytes,
        "runs": lines,
        "ttft_p50_ratio_host_tier": round(p50("host_tier") / p50("no_tier")),
        "ttft_p50_ratio_disk_tier": round(p50("disk_tier") / p50("no_tier")),
        "ttft_p50_ratio_cache_with_the_tiers_memory": round(p50("cache_with_the_tiers_memory") / p50("no_tier")),
        "ttft_p50_ratio_warm_restart": round(p50("restart_warm") / p50("restart_cold")),
        "stream_gap_p99_ratio_read_ahead": round(gap(ahead, "gap_p99_ms") / gap(in_step, "gap_p99_ms")),
        "stream_gap_max_ratio_read_ahead": round(gap(ahead, "gap_max_ms") / gap(in_step, "gap_max_ms")),
        "load_average_before": load_average,
    });
    println!("{out}");
    Ok(())
}

/// The prefix hit rate of the turns with a cache that never forgets: each turn reuses
/// the full blocks of the turn before and its reply, the first turn nothing.
fn ceiling(args: &Args) -> f64 {
    let prompt = |t: usize| args.system_tokens + t * (args.user_tokens + args.reply_tokens) + args.user_tokens;
    let total: usize = (0..args.turns).map(prompt).sum();
    let reused: usize = (1..args.turns).map(|t| (prompt(t - 1) + args.reply_tokens) / 16 * 16).sum();
    reused as f64 / total as f64
}

/// One run of `streams_beside`: the gaps between the streams' tokens, the prompts'
/// times to first token (ms), and the blocks the disk tier gave back.
struct Beside {
    gaps: Vec<f64>,
    ttft: Vec<f64>,
    disk_hits: u64,
    disk_errors: u64,
}

impl Beside {
    /// The runs' figures pooled.
    fn report(runs: &[Beside]) -> Value {
        let gaps: Vec<f64> = runs.iter().flat_map(|r| r.gaps.iter().copied()).collect();
        let ttft: Vec<f64> = runs.iter().flat_map(|r| r.ttft.iter().copied()).collect();
        json!({
            "runs": runs.len(),
            "stream_gaps": gaps.len(),
            "gap_p50_ms": round(percentile(&gaps, 0.5)),
            "gap_p99_ms": round(percentile(&gaps, 0.99)),
            "gap_max_ms": round(gaps.iter().copied().fold(0.0, f64::max)),
            "prompts": ttft.len(),
            "prompt_ttft_p50_ms": round(percentile(&ttft, 0.5)),
            "prompt_ttft_max_ms": round(ttft.iter().copied().fold(0.0, f64::max)),
            "disk_hits": runs.iter().map(|r| r.disk_hits).collect::<Vec<_>>(),
            "disk_errors": runs.iter().map(|r| r.disk_errors).sum::<u64>(),
        })
    }
}

/// Four streams decoding (96 tokens each) when `prompts` arrive all at once, each
/// asking `reply` tokens; the engine's disk tier reading their blocks ahead of their
/// steps, or each in its step. The gaps between the streams' tokens (the steps they
/// waited on) and the prompts' time to first token.
fn streams_beside(
    e: &mut EngineCore<CpuBackend>,
    read_ahead: bool,
    prompts: &[Vec<u32>],
    reply: usize,
) -> Result<Beside> {
    if !read_ahead {
        e.set_kv_read_ahead(0);
    }
    const STREAMS: u64 = 4;
    let stream_prompt: Vec<u32> = (0..24).map(|i| 1000 + i).collect();
    for s in 0..STREAMS {
        e.add_request(Request { ignore_eos: true, ..Request::greedy(s, stream_prompt.clone(), 96) })?;
    }
    // The streams' prompts computed: they decode from here on.
    let mut started = std::collections::HashSet::new();
    while started.len() < STREAMS as usize {
        started.extend(e.step()?.iter().filter(|o| o.token.is_some() && o.id < STREAMS).map(|o| o.id));
    }
    let arrived = Instant::now();
    for (i, p) in prompts.iter().enumerate() {
        e.add_request(Request { ignore_eos: true, ..Request::greedy(100 + i as u64, p.clone(), reply) })?;
    }
    let mut gaps = Vec::new();
    let mut ttft = Vec::new();
    let mut last = Instant::now();
    let mut seen = std::collections::HashSet::new();
    while e.has_work() {
        let outputs = e.step()?;
        let now = Instant::now();
        if outputs.iter().any(|o| o.id < STREAMS && o.token.is_some()) {
            gaps.push((now - last).as_secs_f64() * 1e3);
            last = now;
        }
        for o in outputs.iter().filter(|o| o.id >= STREAMS && o.token.is_some()) {
            if seen.insert(o.id) {
                ttft.push((now - arrived).as_secs_f64() * 1e3);
            }
        }
    }
    let s = e.scheduler().tiers().map(|t| t.stats()).unwrap_or_default();
    Ok(Beside { gaps, ttft, disk_hits: s.disk_hits, disk_errors: s.disk_errors })
}

/// Copies the files under `from` into `to` (a disk tier's folder: one level of
/// folders), each then written out and dropped from the page cache, so that reading it
/// back goes to the disk, as a block that sat there a while would.
fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            std::fs::create_dir_all(&target)?;
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
            drop_from_page_cache(&std::fs::File::open(&target)?)?;
        }
    }
    Ok(())
}

/// Writes `file` out and asks the kernel to forget its pages.
#[cfg(target_os = "linux")]
fn drop_from_page_cache(file: &std::fs::File) -> Result<()> {
    use std::os::fd::AsRawFd;
    file.sync_all()?;
    // SAFETY: a plain advice call on an open descriptor; it changes no memory.
    let advised = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    anyhow::ensure!(advised == 0, "posix_fadvise: error {advised}");
    Ok(())
}

/// Elsewhere the files stay cached (the figures then say less).
#[cfg(not(target_os = "linux"))]
fn drop_from_page_cache(file: &std::fs::File) -> Result<()> {
    Ok(file.sync_all()?)
}
