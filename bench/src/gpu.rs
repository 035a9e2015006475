//! `tessera-bench gpu`: the CUDA backend on a Llama-3-8B-shaped model with random bf16
//! weights made on the device. One JSON line per case: the device's copy bandwidth and
//! bf16 matrix ceiling (measured here, not taken from a datasheet), products with
//! quantised weights kept packed (ggml blocks, FP8, 4-bit) against their own memory
//! floor, decode steps at
//! several batch sizes against the memory-bandwidth floor (weights plus KV read once per
//! step), prefill against the matrix ceiling, and the paged-attention kernel alone
//! against its bandwidth floor, and picking tokens from a step's logits (greedy and
//! sampled on the device, or downloaded for the host) against one read of them, and a
//! second KV tier's batched block copies against the bus's page-locked bandwidth. Times
//! are medians of host-clocked, synchronised runs
//! after warm-up, so launch overhead counts: decode runs op by op and as a CUDA graph.
//! `--weights q4_k` (or `q8_0`, `fp8`, `int4`) holds the model's matrices packed, made
//! on the host, and judges decode against the packed bytes' floor.

use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::time::Instant;
use tessera_kernels::cuda::{CudaBackend, CudaBuffer, CudaWeight};
use tessera_kernels::pick::{Draw, PickRow};
use tessera_kernels::quant::{Fp8Weight, GgmlType, Int4Weight, random_blocks};
use tessera_kernels::{AttentionShape, Backend, HostWeight, PagedBatch, WeightData};
use tessera_worker::model::weights::{LayerWeights, Weights};
use tessera_worker::model::{KvCache, Model, ModelConfig, SeqInput};

#[derive(clap::Args)]
pub struct Args {
    /// Layers of the Llama-3-8B shape (it has 32); fewer for a quick run.
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// Tokens already in each sequence's cache when a decode step runs.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
    batches: Vec<usize>,
    /// Prompt tokens per prefill forward, in sequences of `--context` tokens.
    #[arg(long, default_value_t = 8192)]
    prefill_tokens: usize,
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// How the model's matrices are held on the device: bf16, or packed as a quantised
    /// checkpoint stores them (the decode floor is then the packed bytes).
    #[arg(long, value_enum, default_value = "bf16")]
    weights: WeightKind,
    /// Decode steps' products with bf16 weights through the backend's gemv_bf16
    /// kernel instead of cuBLAS.
    #[arg(long)]
    bf16_gemv: bool,
    /// The model's bf16 products of more than 8 tokens (prefill) through cuBLASLt
    /// instead of cublasGemmEx.
    #[arg(long)]
    cublaslt: bool,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum WeightKind {
    Bf16,
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q8_0")]
    Q8_0,
    /// E4M3 with a scale per row.
    Fp8,
    /// 4-bit in groups of 128.
    Int4,
}

/// A packed weight's format, for random data.
#[derive(Clone, Copy, Debug)]
enum Packing {
    Blocks(GgmlType),
    /// E4M3 with scale blocks of this shape (`[1, cols]`: a scale per row).
    Fp8([usize; 2]),
    /// 4-bit in groups of 128.
    Int4,
}

impl Packing {
    fn name(self) -> String {
        match self {
            Packing::Blocks(ty) => format!("{ty:?}"),
            Packing::Fp8([1, _]) => "fp8_per_row".into(),
            Packing::Fp8([r, c]) => format!("fp8_{r}x{c}"),
            Packing::Int4 => "int4_g128".into(),
        }
    }

    /// Random `[rows, cols]` data in this format, reproducible from `seed`: quants from
    /// hashed bits (E4M3's NaN bytes made finite), scales small enough that products
    /// keep their scale.
    fn random(self, rows: usize, cols: usize, seed: u64) -> WeightData {
        let bytes = |n: usize| {
            let salt = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) as usize;
            (0..n).map(move |i: usize| ((i ^ salt).wrapping_mul(2_654_435_761) >> 13) as u8)
        };
        let scale = 0.2 / (cols as f32).sqrt();
        match self {
            Packing::Blocks(ty) => WeightData::Blocks { ty, bytes: random_blocks(ty, rows * cols, seed) },
            Packing::Fp8(block) => WeightData::Fp8(Fp8Weight {
                bytes: bytes(rows * cols).map(|b| if b & 0x7f == 0x7f { b ^ 1 } else { b }).collect(),
                scales: vec![scale / 64.0; rows.div_ceil(block[0]) * cols.div_ceil(block[1].min(cols))],
                block: [block[0], block[1].min(cols)],
            }),
            Packing::Int4 => WeightData::Int4(Int4Weight {
                nibbles: bytes(rows * cols / 2).collect(),
                scales: vec![scale / 8.0; rows * cols.div_ceil(128)],
                zeros: vec![8; rows * cols.div_ceil(128)],
                group: 128,
            }),
        }
    }
}

const BLOCK: usize = 16;

pub fn run(args: Args) -> Result<()> {
    let mut g = CudaBackend::new(0).context("the gpu benchmark needs a CUDA GPU")?;
    let device = g.device_name();
    let line = |mut v: serde_json::Value| {
        v["bench"] = json!("gpu");
        v["device"] = json!(device);
        println!("{v}");
    };

    let bandwidth = g.copy_bandwidth(4 << 30, 10)?;
    line(json!({"case": "copy_bandwidth", "bytes_per_s": round(bandwidth)}));
    // The bf16 ceiling through cublasGemmEx and through cuBLASLt's heuristic: the
    // better is the one prefill is judged against.
    let mut ceiling = matmul_ceiling(&g, args.reps)?;
    line(json!({"case": "matmul_ceiling", "library": "cublas", "m_n_k": 8192, "flop_per_s": round(ceiling)}));
    if g.set_cublaslt(true) {
        let lt = matmul_ceiling(&g, args.reps)?;
        line(json!({"case": "matmul_ceiling", "library": "cublaslt", "m_n_k": 8192, "flop_per_s": round(lt)}));
        ceiling = ceiling.max(lt);
    }
    g.set_cublaslt(args.cublaslt);
    packed_products(&mut g, bandwidth, ceiling, args.reps, &line)?;
    g.set_bf16_gemv(args.bf16_gemv);

    let config = llama3_8b_config(args.layers)?;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let blocks_per_seq = (args.context + 1).div_ceil(BLOCK);
    let packing = match args.weights {
        WeightKind::Bf16 => None,
        WeightKind::Q4K => Some(Packing::Blocks(GgmlType::Q4K)),
        WeightKind::Q8_0 => Some(Packing::Blocks(GgmlType::Q8_0)),
        WeightKind::Fp8 => Some(Packing::Fp8([1, usize::MAX])),
        WeightKind::Int4 => Some(Packing::Int4),
    };
    let (model, weight_bytes) = random_model(g, config.clone(), packing)?;
    let g = model.backend();
    // Every sequence's blocks, and one scratch block last for padded graph rows.
    let seq_blocks = max_batch.max(args.prefill_tokens.div_ceil(args.context)) * blocks_per_seq;
    let kv_floats = (seq_blocks + 1) * BLOCK * config.kv_width();
    let mut kv = KvCache {
        block_size: BLOCK,
        num_blocks: kv_floats / (BLOCK * config.kv_width()),
        layers: (0..config.num_layers)
            .map(|l| {
                Ok((
                    g.random_buffer(kv_floats, 1000 + 2 * l as u64, 1.0)?,
                    g.random_buffer(kv_floats, 1001 + 2 * l as u64, 1.0)?,
                ))
            })
            .collect::<Result<_>>()?,
        graphs: None,
    };
    let kv_token_bytes = (2 * config.num_layers * config.kv_width() * 2) as f64;

    for &batch in &args.batches {
        let tables: Vec<Vec<u32>> =
            (0..batch).map(|s| (0..blocks_per_seq).map(|b| (s * blocks_per_seq + b) as u32).collect()).collect();
        let tokens: Vec<[u32; 1]> = (0..batch).map(|s| [(s * 7919 % config.vocab_size) as u32]).collect();
        let seqs: Vec<SeqInput<'_>> = (0..batch)
            .map(|s| SeqInput {
                tokens: &tokens[s],
                cached: args.context,
                block_table: &tables[s],
                logits: true,
                embeds: &[],
            })
            .collect();
        let bytes = weight_bytes + batch as f64 * (args.context + 1) as f64 * kv_token_bytes;
        let floor = bytes / bandwidth;
        for graphs in [false, true] {
            if graphs {
                model.capture_decode_graphs(&mut kv, seq_blocks as u32, &[batch])?;
            }
            let step = median(args.reps, || {
                if graphs {
                    model.decode_with_graph(&seqs, &mut kv)?.context("no graph for the batch")?;
                } else {
                    model.forward_on_device(&seqs, &mut kv)?;
                }
                Ok(g.synchronize()?)
            })?;
            line(
                json!({"case": "decode", "weights": format!("{:?}", args.weights), "bf16_gemv": args.bf16_gemv, "batch": batch, "context": args.context, "layers": config.num_layers,
                "cuda_graph": graphs, "step_ms": round(step * 1e3), "floor_ms": round(floor * 1e3),
                "floor_over_step": round(floor / step), "output_tokens_per_s": round(batch as f64 / step)}),
            );
        }
        kv.graphs = None;
    }

    // Prefill: whole prompts of `context` tokens, logits for each one's last token.
    let n = args.prefill_tokens.div_ceil(args.context);
    let tables: Vec<Vec<u32>> =
        (0..n).map(|s| (0..blocks_per_seq).map(|b| (s * blocks_per_seq + b) as u32).collect()).collect();
    let prompts: Vec<Vec<u32>> =
        (0..n).map(|s| (0..args.context).map(|t| ((s * 131 + t * 17) % config.vocab_size) as u32).collect()).collect();
    let seqs: Vec<SeqInput<'_>> = (0..n)
        .map(|s| SeqInput { tokens: &prompts[s], cached: 0, block_table: &tables[s], logits: true, embeds: &[] })
        .collect();
    let time = median(args.reps.min(5), || {
        model.forward_on_device(&seqs, &mut kv)?;
        Ok(g.synchronize()?)
    })?;
    let tokens = n * args.context;
    // Attention scores and values: 2 products of q_width per (query, key) pair, causal.
    let attention_flops =
        (config.num_layers * n) as f64 * 4.0 * config.q_width() as f64 * (args.context as f64).powi(2) / 2.0;
    let flops = 2.0 * matmul_params(&config) as f64 * tokens as f64 + attention_flops;
    line(
        json!({"case": "prefill", "tokens": tokens, "sequences": n, "layers": config.num_layers, "cublaslt": args.cublaslt,
        "time_ms": round(time * 1e3), "tokens_per_s": round(tokens as f64 / time),
        "flop_per_s": round(flops / time), "fraction_of_matmul_ceiling": round(flops / time / ceiling)}),
    );

    // The attention kernel alone: one layer, decode rows.
    let shape = AttentionShape {
        num_heads: config.num_heads,
        num_kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        block_size: BLOCK,
        scale: (config.head_dim as f32).powf(-0.5),
    };
    for &batch in &args.batches {
        let starts: Vec<u32> = (0..=batch as u32).collect();
        let lens = vec![(args.context + 1) as u32; batch];
        let tables: Vec<u32> = (0..batch * blocks_per_seq).map(|b| b as u32).collect();
        let (qs, cl, bt) = (g.upload_index(&starts)?, g.upload_index(&lens)?, g.upload_index(&tables)?);
        let paged = PagedBatch {
            num_seqs: batch,
            query_start: &qs,
            context_lens: &cl,
            block_tables: &bt,
            max_blocks_per_seq: blocks_per_seq,
        };
        let q: CudaBuffer = g.random_buffer(batch * shape.q_width(), 7, 1.0)?;
        let (k_cache, v_cache) = &kv.layers[0];
        let time = median(args.reps, || {
            g.paged_attention(&q, k_cache, v_cache, &paged, &shape)?;
            Ok(g.synchronize()?)
        })?;
        let bytes = batch as f64 * ((args.context + 1) * 2 * shape.kv_width() * 2 + 2 * 2 * shape.q_width()) as f64;
        let floor = bytes / bandwidth;
        line(json!({"case": "paged_attention", "batch": batch, "context": args.context + 1,
            "time_us": round(time * 1e6), "floor_us": round(floor * 1e6), "floor_over_time": round(floor / time)}));
    }

    // Picking tokens from a decode step's logits: greedy and sampled on the device,
    // against downloading the logits for the host's sampler (what sampled rows did
    // before). The floor is one read of the logits.
    for &batch in &args.batches {
        let logits = g.random_buffer(batch * config.vocab_size, 13, 4.0)?;
        let greedy = vec![PickRow::default(); batch];
        let draw = Draw { temperature: 0.8, top_k: 50, top_p: 0.95, min_p: 0.0, uniform: 0.37 };
        let sampled = vec![PickRow { draw: Some(draw), ..PickRow::default() }; batch];
        let nucleus = vec![PickRow { draw: Some(Draw { top_k: 0, ..draw }), ..PickRow::default() }; batch];
        let floor = (batch * config.vocab_size * 4) as f64 / (bandwidth / 2.0);
        for (kind, rows) in
            [("greedy", Some(&greedy)), ("top_k_top_p", Some(&sampled)), ("top_p", Some(&nucleus)), ("download", None)]
        {
            let time = median(args.reps, || {
                match rows {
                    Some(rows) => drop(g.device_pick(&logits, config.vocab_size, rows)?),
                    None => drop(g.download(&logits)?),
                }
                Ok(g.synchronize()?)
            })?;
            line(json!({"case": "pick", "kind": kind, "batch": batch, "vocab": config.vocab_size,
                "time_us": round(time * 1e6), "floor_us": round(floor * 1e6)}));
        }
    }

    kv_tier_copies(&model, &mut kv, args.reps, &line)
}

/// A second KV tier's copies: blocks saved from the cache to host memory (what an
/// eviction to the host tier or a handoff's export does) and loaded back (an onload),
/// each a batch of blocks through `Model::save_kv_blocks` / `load_kv_blocks`, against
/// the bus's own bandwidth between page-locked memory and the device, measured here.
fn kv_tier_copies(
    model: &Model<CudaBackend>,
    kv: &mut KvCache<CudaBackend>,
    reps: usize,
    line: &dyn Fn(Value),
) -> Result<()> {
    let g = model.backend();
    let bus = g.host_copy_bandwidth(1 << 30, reps)?;
    line(json!({"case": "host_copy_bandwidth", "to_device_bytes_per_s": round(bus.to_device),
        "to_host_bytes_per_s": round(bus.to_host)}));
    for blocks in [16, 128].map(|b: usize| b.min(kv.num_blocks)) {
        let ids: Vec<u32> = (0..blocks as u32).collect();
        let mut saved = Vec::new();
        let save = median(reps, || {
            saved = model.save_kv_blocks(kv, &ids)?;
            Ok(())
        })?;
        let bytes = saved.iter().map(Vec::len).sum::<usize>() as f64;
        let parts: Vec<&[u8]> = saved.iter().map(Vec::as_slice).collect();
        let load = median(reps, || {
            model.load_kv_blocks(kv, &ids, &parts)?;
            Ok(g.synchronize()?)
        })?;
        for (direction, time, bus) in [("save", save, bus.to_host), ("load", load, bus.to_device)] {
            line(json!({"case": "kv_tier_copy", "direction": direction, "blocks": blocks,
                "block_bytes": bytes as usize / blocks.max(1), "time_ms": round(time * 1e3),
                "bytes_per_s": round(bytes / time), "fraction_of_bus": round(bytes / time / bus)}));
        }
    }
    Ok(())
}

/// Products with bf16 weights (cuBLAS) and with weights kept in their checkpoints'
/// formats on the device (ggml blocks, FP8 with per-row and 128 × 128 scales, 4-bit in
/// groups of 128; FP8 on FP8 tensor cores for 512 tokens where the GPU has them), at the Llama-3-8B
/// MLP's up-projection shape (14336 × 4096): decode (1 and 8 tokens) against the
/// memory floor of the format's own bytes, prefill (512 tokens) against the bf16 matrix
/// ceiling.
fn packed_products(g: &mut CudaBackend, bandwidth: f64, ceiling: f64, reps: usize, line: &dyn Fn(Value)) -> Result<()> {
    let (rows, cols) = (14_336, 4_096);
    let blocks = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K].map(Packing::Blocks);
    let packings = blocks.into_iter().chain([Packing::Fp8([1, cols]), Packing::Fp8([128, 128]), Packing::Int4]);
    // bf16 first, through cuBLAS and through gemv_bf16 (decode only): the unpacked
    // product the packed ones are read beside.
    let formats = [None, Some(None)].into_iter().chain(packings.map(|p| Some(Some(p))));
    for packing in formats {
        g.set_bf16_gemv(packing.is_none());
        let (format, w) = match packing {
            None => ("bf16_gemv".to_string(), g.random_weight(rows, cols, 21, 0.02)?),
            Some(None) => ("bf16".to_string(), g.random_weight(rows, cols, 21, 0.02)?),
            Some(Some(p)) => (p.name(), g.upload_weight(HostWeight { rows, cols, data: p.random(rows, cols, 21) })?),
        };
        let counts: &[usize] = if packing.is_none() { &[1, 8] } else { &[1, 8, 512] };
        for &tokens in counts {
            let x = g.random_buffer(tokens * cols, 22, 1.0)?;
            let time = median(reps, || {
                g.linear(&x, tokens, &w, None)?;
                Ok(g.synchronize()?)
            })?;
            if tokens <= 8 {
                // Read once: the weight's bytes, the activations; written: the outputs.
                let bytes = (w.device_bytes() + 2 * tokens * (rows + cols)) as f64;
                // `bandwidth` counts a copy's reads and writes.
                let floor = bytes / bandwidth;
                line(json!({"case": "packed_linear", "format": format, "tokens": tokens, "rows": rows, "cols": cols,
                    "time_us": round(time * 1e6), "floor_us": round(floor * 1e6), "floor_over_time": round(floor / time)}));
            } else {
                let flops = 2.0 * (rows * cols * tokens) as f64;
                line(json!({"case": "packed_linear", "format": format, "tokens": tokens, "rows": rows, "cols": cols,
                    "time_us": round(time * 1e6), "flop_per_s": round(flops / time),
                    "fraction_of_matmul_ceiling": round(flops / time / ceiling)}));
            }
        }
    }
    Ok(())
}

/// The bf16 ceiling: an 8192³ product through the backend's `linear` (cuBLAS or
/// cuBLASLt, as the backend is set).
fn matmul_ceiling(g: &CudaBackend, reps: usize) -> Result<f64> {
    let n = 8192;
    let w = g.random_weight(n, n, 11, 0.02)?;
    let x = g.random_buffer(n * n, 12, 1.0)?;
    let t = median(reps, || {
        g.linear(&x, n, &w, None)?;
        Ok(g.synchronize()?)
    })?;
    Ok(2.0 * (n as f64).powi(3) / t)
}

fn llama3_8b_config(layers: usize) -> Result<ModelConfig> {
    let dir = std::env::temp_dir().join(format!("tessera-bench-gpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("config.json");
    let config = json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false});
    std::fs::write(&path, config.to_string())?;
    let parsed = ModelConfig::from_hf_config(&path)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(parsed)
}

/// Parameters every token multiplies through: the layers' matrices and the LM head.
fn matmul_params(c: &ModelConfig) -> usize {
    let d = c.hidden_size;
    let layer = d * (c.q_width() + 2 * c.kv_width()) + c.q_width() * d + 3 * c.intermediate_size * d;
    c.num_layers * layer + c.vocab_size * d
}

/// A model of shape `c` with random weights made on the device (bf16) or on the host in
/// `packing`'s format; and the bytes a decode step reads of its matrices (the layers'
/// and the LM head, not the embedding table, of which a step reads a few rows).
fn random_model(g: CudaBackend, c: ModelConfig, packing: Option<Packing>) -> Result<(Model<CudaBackend>, f64)> {
    let d = c.hidden_size;
    let mut seed = 0u64;
    let mut streamed = 0usize;
    let mut make = |rows: usize, cols: usize, counted: bool| -> Result<CudaWeight> {
        seed += 1;
        let w = match packing {
            // Uniform with variance 1/cols: activations keep their scale through a product.
            None => g.random_weight(rows, cols, seed, (3.0 / cols as f32).sqrt())?,
            Some(p) => g.upload_weight(HostWeight { rows, cols, data: p.random(rows, cols, seed) })?,
        };
        if counted {
            streamed += w.device_bytes();
        }
        Ok(w)
    };
    let mut w = |rows: usize, cols: usize| make(rows, cols, true);
    let ones = vec![1.0f32; d];
    let mut layers = Vec::with_capacity(c.num_layers);
    for _ in 0..c.num_layers {
        layers.push(LayerWeights {
            attn_norm: g.upload(&ones)?,
            qkv: w(c.q_width() + 2 * c.kv_width(), d)?,
            qkv_bias: None,
            o: w(d, c.q_width())?,
            ffn_norm: g.upload(&ones)?,
            gate_up: w(2 * c.intermediate_size, d)?,
            down: w(d, c.intermediate_size)?,
        });
    }
    let lm_head = Some(w(c.vocab_size, d)?);
    let embed = make(c.vocab_size, d, false)?;
    let weights =
        Weights { embed, lm_head, final_norm: g.upload(&ones)?, layers, inv_freq: g.upload(&c.inv_freq(None))? };
    Ok((Model::from_weights(g, c, weights), streamed as f64))
}

/// Median seconds of `reps` runs after two warm-ups.
fn median(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn round(v: f64) -> f64 {
    if v.abs() >= 1000.0 { v.round() } else { (v * 1000.0).round() / 1000.0 }
}
