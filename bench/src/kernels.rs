//! The CPU backend's two hot kernels on SmolLM2-135M's shapes, in isolation: each
//! matrix product of a decode step of `--tokens` sequences (GFLOP/s; Q4_1-style
//! quantised rows as the model file has them — Q8_0 for `lm_head` — with inputs
//! rounded to 8 bits as served and kept exact, and f32), and paged attention for the
//! same batch over four shared system prompts plus each sequence's own blocks. Each
//! figure is the best of `--reps` runs: on a shared machine the best is the figure
//! least disturbed by the neighbours.

use crate::round;
use anyhow::Result;
use serde_json::json;
use std::time::Instant;
use tessera_kernels::cpu::{Activations, CpuBackend};
use tessera_kernels::quant::GgmlType;
use tessera_kernels::{AttentionShape, Backend, HostWeight, PagedBatch, WeightData};

#[derive(clap::Args)]
pub struct Args {
    /// Sequences in the batch (one token each for the products); several run one after
    /// the other, attention at the last.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4, 16, 256])]
    tokens: Vec<usize>,
    /// Keys each sequence attends to.
    #[arg(long, default_value_t = 414)]
    context: usize,
    #[arg(long, default_value_t = 15)]
    reps: usize,
}

/// (name, output rows, input columns) of SmolLM2-135M's products.
const PRODUCTS: [(&str, usize, usize); 5] =
    [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)];

pub fn run(args: Args) -> Result<()> {
    for &tokens in &args.tokens {
        for (name, n, k) in PRODUCTS {
            let x: Vec<f32> = (0..tokens * k).map(|i| ((i % 11) as f32 - 5.0) * 0.1).collect();
            let quantized = if name == "lm_head" { "q8_0" } else { "q4_1" };
            for (format, activations) in
                [(quantized, Activations::Int8), (quantized, Activations::F32), ("f32", Activations::F32)]
            {
                let b = CpuBackend { activations };
                let w = b.upload_weight(weight(format, n, k))?;
                let s = best(args.reps, || b.linear(&x, tokens, &w, None).map(drop))?;
                println!(
                    "{}",
                    json!({"bench": "kernels", "kernel": "linear", "product": name, "weights": format,
                           "activations": format!("{activations:?}").to_lowercase(), "rows": n, "cols": k,
                           "tokens": tokens, "ms": round(s * 1e3),
                           "gflop_per_s": round(2.0 * (n * k * tokens) as f64 / s / 1e9)})
                );
            }
        }
    }
    let tokens = args.tokens.last().copied().unwrap_or(256);
    let shape = AttentionShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16, scale: 0.125 };
    let (seqs, bs) = (tokens, shape.block_size);
    let per_seq = args.context.div_ceil(bs);
    // Four shared prompts of 19 blocks (304 tokens), then each sequence's own blocks.
    let shared = 19.min(per_seq);
    let own = per_seq - shared;
    let num_blocks = 4 * shared + seqs * own;
    let keys: Vec<f32> = (0..num_blocks * shape.block_floats()).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect();
    let slots: Vec<u32> = (0..(num_blocks * bs) as u32).collect();
    let tables: Vec<u32> = (0..seqs)
        .flat_map(|s| {
            (0..per_seq).map(move |b| if b < shared { (s % 4) * shared + b } else { 4 * shared + s * own + b - shared })
        })
        .map(|b| b as u32)
        .collect();
    let starts: Vec<u32> = (0..=seqs as u32).collect();
    let ctx = vec![args.context as u32; seqs];
    let q: Vec<f32> = (0..seqs * shape.q_width()).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let batch = PagedBatch {
        num_seqs: seqs,
        query_start: &starts,
        context_lens: &ctx,
        block_tables: &tables,
        max_blocks_per_seq: per_seq,
    };
    // The served path's half-float K/V and the exact path's f32, written as a forward
    // writes them.
    for (kv, b) in [("f16", CpuBackend::default()), ("f32", CpuBackend::exact())] {
        let (mut k_cache, mut v_cache) = (b.kv_zeros(keys.len())?, b.kv_zeros(keys.len())?);
        b.write_kv(&keys, &keys, &slots, &shape, &mut k_cache, &mut v_cache)?;
        let s = best(args.reps, || b.paged_attention(&q, &k_cache, &v_cache, &batch, &shape).map(drop))?;
        let flops = 4.0 * (seqs * shape.num_heads * args.context * shape.head_dim) as f64;
        println!(
            "{}",
            json!({"bench": "kernels", "kernel": "paged_attention", "kv": kv, "sequences": seqs,
                   "context": args.context, "heads": shape.num_heads, "kv_heads": shape.num_kv_heads,
                   "head_dim": shape.head_dim, "ms": round(s * 1e3), "gflop_per_s": round(flops / s / 1e9)})
        );
    }
    Ok(())
}

/// A `[n, k]` weight: Q4_1 blocks (an f16 scale and offset, then 16 bytes of nibbles),
/// Q8_0 blocks (an f16 scale, then 32 signed bytes) or f32, with values that vary along
/// both axes.
fn weight(format: &str, n: usize, k: usize) -> HostWeight {
    let pattern = |blk: usize, len: usize| (0..len).map(move |j| ((blk * 31 + j * 7) % 256) as u8);
    let data = match format {
        "q4_1" => {
            let mut bytes = Vec::with_capacity(n * k / 32 * 20);
            for blk in 0..n * k / 32 {
                bytes.extend_from_slice(&0x2000u16.to_le_bytes()); // f16 1/128
                bytes.extend_from_slice(&0xA000u16.to_le_bytes()); // f16 −1/128
                bytes.extend(pattern(blk, 16));
            }
            WeightData::Blocks { ty: GgmlType::Q4_1, bytes }
        }
        "q8_0" => {
            let mut bytes = Vec::with_capacity(n * k / 32 * 34);
            for blk in 0..n * k / 32 {
                bytes.extend_from_slice(&0x1800u16.to_le_bytes()); // f16 1/512
                bytes.extend(pattern(blk, 32));
            }
            WeightData::Blocks { ty: GgmlType::Q8_0, bytes }
        }
        _ => WeightData::F32((0..n * k).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect()),
    };
    HostWeight { rows: n, cols: k, data }
}

fn best(reps: usize, mut f: impl FnMut() -> tessera_kernels::Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}
