//! The decoder driven by its config — Llama 2 (MHA), Llama 3 (RoPE scaling), Mistral
//! (GQA), Qwen2 (Q/K/V biases), tied and untied heads — on tiny random models in
//! Hugging Face layout, against a dense f64 forward written here from the papers'
//! equations, with no paging, no caching and no fused weights.
//!
//! Each model also runs its prompt as a prefill followed by single-token decodes, so
//! the paged KV cache is checked against recomputation at every step. On the CPU's
//! exact path (f32 keys and values), which the f64 forward bounds tightly.

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::Value;
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::loader::safetensors_dir::SafetensorsDir;
use tessera_worker::model::{Model, ModelConfig, SeqInput};

mod tiny_models;

use tiny_models::{Weights, random_weights, variants, write_dir};

const PROMPT: [u32; 11] = [3, 17, 42, 5, 9, 63, 0, 28, 28, 11, 50];

/// `x · Wᵀ (+ b)` in f64 for one row.
fn matvec(w: &(Vec<usize>, Vec<f32>), x: &[f64], bias: Option<&(Vec<usize>, Vec<f32>)>) -> Vec<f64> {
    let (rows, cols) = (w.0[0], w.0[1]);
    (0..rows)
        .map(|r| (0..cols).map(|c| w.1[r * cols + c] as f64 * x[c]).sum::<f64>() + bias.map_or(0.0, |b| b.1[r] as f64))
        .collect()
}

fn rms_norm(x: &[f64], w: &(Vec<usize>, Vec<f32>), eps: f64) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter().zip(&w.1).map(|(v, g)| v * inv * *g as f64).collect()
}

/// RoPE frequencies, Llama 3 scaling per Meta's reference code.
fn inv_freq(c: &Value, hd: usize) -> Vec<f64> {
    let theta = c["rope_theta"].as_f64().unwrap();
    (0..hd / 2)
        .map(|i| {
            let f = theta.powf(-((2 * i) as f64) / hd as f64);
            let Some(s) = c.get("rope_scaling") else { return f };
            let (factor, lo, hi, orig) = (
                s["factor"].as_f64().unwrap(),
                s["low_freq_factor"].as_f64().unwrap(),
                s["high_freq_factor"].as_f64().unwrap(),
                s["original_max_position_embeddings"].as_f64().unwrap(),
            );
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < orig / hi {
                f
            } else if wavelen > orig / lo {
                f / factor
            } else {
                let smooth = (orig / wavelen - lo) / (hi - lo);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// Rotate-half RoPE of one head at position `pos`.
fn rope(x: &mut [f64], pos: usize, freqs: &[f64]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (s, c) = (pos as f64 * freqs[i]).sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

/// Logits at every position of `tokens`, dense causal attention in f64.
fn reference_forward(c: &Value, w: &Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    let (d, heads) = (u("hidden_size"), u("num_attention_heads"));
    let kv_heads = c.get("num_key_value_heads").and_then(Value::as_u64).map_or(heads, |v| v as usize);
    let hd = d / heads;
    let eps = c["rms_norm_eps"].as_f64().unwrap();
    let freqs = inv_freq(c, hd);
    let embed = &w["model.embed_tokens.weight"];
    let mut h: Vec<Vec<f64>> =
        tokens.iter().map(|&t| embed.1[t as usize * d..][..d].iter().map(|v| *v as f64).collect()).collect();
    for l in 0..u("num_hidden_layers") {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
        for (pos, x) in h.iter().enumerate() {
            let x = rms_norm(x, &w[&p("input_layernorm.weight")], eps);
            let mut q = matvec(&w[&p("self_attn.q_proj.weight")], &x, w.get(&p("self_attn.q_proj.bias")));
            let mut k = matvec(&w[&p("self_attn.k_proj.weight")], &x, w.get(&p("self_attn.k_proj.bias")));
            q.chunks_mut(hd).for_each(|head| rope(head, pos, &freqs));
            k.chunks_mut(hd).for_each(|head| rope(head, pos, &freqs));
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&w[&p("self_attn.v_proj.weight")], &x, w.get(&p("self_attn.v_proj.bias"))));
        }
        for pos in 0..h.len() {
            let mut attn = vec![0.0; heads * hd];
            for head in 0..heads {
                let kvh = head / (heads / kv_heads);
                let q = &qs[pos][head * hd..][..hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        q.iter().zip(&ks[j][kvh * hd..][..hd]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    for e in 0..hd {
                        attn[head * hd + e] += (s - max).exp() / z * vs[j][kvh * hd + e];
                    }
                }
            }
            let o = matvec(&w[&p("self_attn.o_proj.weight")], &attn, None);
            h[pos].iter_mut().zip(o).for_each(|(a, b)| *a += b);
            let x = rms_norm(&h[pos], &w[&p("post_attention_layernorm.weight")], eps);
            let gate = matvec(&w[&p("mlp.gate_proj.weight")], &x, None);
            let up = matvec(&w[&p("mlp.up_proj.weight")], &x, None);
            let act: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = matvec(&w[&p("mlp.down_proj.weight")], &act, None);
            h[pos].iter_mut().zip(down).for_each(|(a, b)| *a += b);
        }
    }
    let head = w.get("lm_head.weight").unwrap_or(embed);
    h.iter().map(|x| matvec(head, &rms_norm(x, &w["model.norm.weight"], eps), None)).collect()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}

#[test]
fn every_variant_matches_the_dense_f64_forward_in_prefill_and_decode() {
    let mut rng = tiny_models::seeded_rng();
    let root = tiny_models::temp_root("variants");
    for v in variants() {
        let weights = random_weights(&v.config, &mut rng);
        let dir = root.join(v.name);
        write_dir(&dir, &v.config, &weights);
        let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
        let model = Model::load(CpuBackend::exact(), config, &SafetensorsDir::open(&dir).unwrap()).unwrap();
        let want = reference_forward(&v.config, &weights, &PROMPT);

        // Whole prompt in one forward; blocks of 4 tokens handed out back to front.
        let mut kv = model.new_kv_cache(8, 4).unwrap();
        let table = [7, 6, 5, 4, 3, 2, 1, 0];
        let got = model
            .forward(
                &[SeqInput { tokens: &PROMPT, cached: 0, block_table: &table, logits: true, embeds: &[] }],
                &mut kv,
            )
            .unwrap();
        let err = max_diff(&got, want.last().unwrap());
        assert!(err < 1e-4, "{}: prefill logits differ by {err}", v.name);

        // Prefill 8, then decode the rest one token at a time from the cache.
        let mut kv = model.new_kv_cache(8, 4).unwrap();
        model
            .forward(
                &[SeqInput { tokens: &PROMPT[..8], cached: 0, block_table: &table, logits: false, embeds: &[] }],
                &mut kv,
            )
            .unwrap();
        for pos in 8..PROMPT.len() {
            let got = model
                .forward(
                    &[SeqInput {
                        tokens: &PROMPT[pos..=pos],
                        cached: pos,
                        block_table: &table,
                        logits: true,
                        embeds: &[],
                    }],
                    &mut kv,
                )
                .unwrap();
            let err = max_diff(&got, &want[pos]);
            assert!(err < 1e-4, "{}: decode at {pos} differs by {err}", v.name);
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_batch_of_sequences_computes_what_each_computes_alone() {
    let mut rng = StdRng::seed_from_u64(7);
    let v = &variants()[3];
    let weights = random_weights(&v.config, &mut rng);
    let dir = std::env::temp_dir().join(format!("tessera-batch-{}", std::process::id()));
    write_dir(&dir, &v.config, &weights);
    let config = ModelConfig::from_hf_config(&dir.join("config.json")).unwrap();
    let model = Model::load(CpuBackend::exact(), config, &SafetensorsDir::open(&dir).unwrap()).unwrap();
    let mut kv = model.new_kv_cache(16, 4).unwrap();
    let (a, b, c) = (&PROMPT[..], &PROMPT[2..5], &PROMPT[..1]);
    let seqs = [
        SeqInput { tokens: a, cached: 0, block_table: &[0, 1, 2], logits: true, embeds: &[] },
        SeqInput { tokens: b, cached: 0, block_table: &[5], logits: true, embeds: &[] },
        SeqInput { tokens: c, cached: 0, block_table: &[9], logits: true, embeds: &[] },
    ];
    let batched = model.forward(&seqs, &mut kv).unwrap();
    for (i, tokens) in [a, b, c].iter().enumerate() {
        let want = reference_forward(&v.config, &weights, tokens);
        let err = max_diff(&batched[i * 64..(i + 1) * 64], want.last().unwrap());
        assert!(err < 1e-4, "sequence {i} differs by {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
