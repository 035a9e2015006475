//! Tiny random llama-family models in Hugging Face layout, shared by the decoder tests
//! and the GPU tests: the four config variants, their random weights, the directory
//! writer, and a byte-level tokenizer so that the engine can run on them.

#![allow(dead_code)] // each test binary uses its own subset

pub mod quantised;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use tessera_kernels::Backend;
use tessera_worker::model::{Model, SeqInput};

pub type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

pub struct Variant {
    pub name: &'static str,
    pub config: Value,
}

/// A wider model than the decoder variants: head_dim 64, grouped-query attention, a
/// byte-level vocabulary the engine's tokenizer covers.
pub fn wide() -> Variant {
    Variant {
        name: "wide",
        config: json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "intermediate_size": 1024,
            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 320,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096,
            "tie_word_embeddings": false}),
    }
}

pub fn variants() -> Vec<Variant> {
    let base = json!({"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 128});
    let with = |extra: Value| {
        let mut c = base.clone();
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        c
    };
    vec![
        Variant {
            name: "llama2",
            config: with(
                json!({"architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0, "tie_word_embeddings": false}),
            ),
        },
        Variant {
            name: "llama3",
            config: with(
                json!({"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2, "rope_theta": 500000.0,
            "tie_word_embeddings": true,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
            ),
        },
        Variant {
            name: "mistral",
            config: with(
                json!({"architectures": ["MistralForCausalLM"], "num_key_value_heads": 1, "rope_theta": 1e6, "tie_word_embeddings": false}),
            ),
        },
        Variant {
            name: "qwen2",
            config: with(
                json!({"architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 2, "rope_theta": 1e6, "tie_word_embeddings": true}),
            ),
        },
    ]
}

pub fn random_weights(c: &Value, rng: &mut StdRng) -> Weights {
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    let (d, ffn, heads, vocab) = (u("hidden_size"), u("intermediate_size"), u("num_attention_heads"), u("vocab_size"));
    let kv_heads = c.get("num_key_value_heads").and_then(Value::as_u64).map_or(heads, |v| v as usize);
    let hd = d / heads;
    let qwen = c["architectures"][0] == "Qwen2ForCausalLM";
    let mut w = Weights::new();
    let mut put = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        w.insert(name, (shape, (0..n).map(|_| offset + rng.random_range(-scale..scale)).collect()));
    };
    put("model.embed_tokens.weight".into(), vec![vocab, d], 1.0, 0.0);
    put("model.norm.weight".into(), vec![d], 0.2, 1.0);
    if c["tie_word_embeddings"] == false {
        put("lm_head.weight".into(), vec![vocab, d], 0.3, 0.0);
    }
    for l in 0..u("num_hidden_layers") {
        let p = format!("model.layers.{l}.");
        put(format!("{p}input_layernorm.weight"), vec![d], 0.2, 1.0);
        put(format!("{p}post_attention_layernorm.weight"), vec![d], 0.2, 1.0);
        put(format!("{p}self_attn.q_proj.weight"), vec![heads * hd, d], 0.4, 0.0);
        put(format!("{p}self_attn.k_proj.weight"), vec![kv_heads * hd, d], 0.4, 0.0);
        put(format!("{p}self_attn.v_proj.weight"), vec![kv_heads * hd, d], 0.4, 0.0);
        put(format!("{p}self_attn.o_proj.weight"), vec![d, heads * hd], 0.3, 0.0);
        put(format!("{p}mlp.gate_proj.weight"), vec![ffn, d], 0.3, 0.0);
        put(format!("{p}mlp.up_proj.weight"), vec![ffn, d], 0.3, 0.0);
        put(format!("{p}mlp.down_proj.weight"), vec![d, ffn], 0.3, 0.0);
        if qwen {
            put(format!("{p}self_attn.q_proj.bias"), vec![heads * hd], 0.5, 0.0);
            put(format!("{p}self_attn.k_proj.bias"), vec![kv_heads * hd], 0.5, 0.0);
            put(format!("{p}self_attn.v_proj.bias"), vec![kv_heads * hd], 0.5, 0.0);
        }
    }
    w
}

pub fn write_dir(dir: &Path, config: &Value, w: &Weights) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        w.iter().map(|(n, (s, d))| (n.clone(), s.clone(), d.iter().flat_map(|v| v.to_le_bytes()).collect())).collect();
    let views = bytes.iter().map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// GPT-2's map from bytes to the printable characters byte-level BPE spells them with.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return b as char;
    }
    let shift = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shift).expect("a valid code point")
}

/// A byte-level tokenizer (one token per byte, ids 0–255) with `<|im_start|>` (256) as
/// BOS and `<|im_end|>` (257) as EOS, and a ChatML template: enough for the engine.
pub fn write_byte_tokenizer(dir: &Path) {
    let vocab: serde_json::Map<String, Value> = (0..=255u8).map(|b| (byte_char(b).to_string(), json!(b))).collect();
    let added: Vec<Value> = ["<|im_start|>", "<|im_end|>"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// Logits of a prefill of `prompt[..split]`, then of one decode per remaining token,
/// over a cache of 64 blocks of `block_size` handed out back to front.
pub fn prefill_then_decode<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    split: usize,
    block_size: usize,
) -> Vec<Vec<f32>> {
    let mut kv = model.new_kv_cache(64, block_size).unwrap();
    let table: Vec<u32> = (0..64).rev().collect();
    let first = SeqInput { tokens: &prompt[..split], cached: 0, block_table: &table, logits: true, embeds: &[] };
    let mut out = vec![model.forward(&[first], &mut kv).unwrap()];
    for pos in split..prompt.len() {
        let step =
            [SeqInput { tokens: &prompt[pos..=pos], cached: pos, block_table: &table, logits: true, embeds: &[] }];
        out.push(model.forward(&step, &mut kv).unwrap());
    }
    out
}

/// A generator from a fresh seed, printed so that a failure can be replayed.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn seeded_rng() -> StdRng {
    let seed: u64 = StdRng::from_os_rng().random();
    eprintln!("random seed {seed}");
    StdRng::seed_from_u64(seed)
}

/// A scratch folder of this test process, `tessera-{tag}-{pid}` under the temp dir.
#[allow(dead_code)] // each test binary uses its own subset of these helpers
pub fn temp_root(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("tessera-{tag}-{}", std::process::id()))
}
