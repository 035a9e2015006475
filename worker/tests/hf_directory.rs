//! Hugging Face directories: the GGUF test model exported to safetensors (Q/K rows put
//! back in Hugging Face's rotate-half order, f32 split over two shards with an index,
//! and single-file f16 and bf16) loads and computes what the GGUF computes.

mod common;

use common::{smollm2, smollm2_path};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::generate::SingleSequence;
use tessera_worker::load::load_model;
use tessera_worker::loader::TensorSource;
use tessera_worker::loader::gguf::GgufFile;
use tessera_worker::loader::safetensors_dir::SafetensorsDir;
use tessera_worker::model::ModelConfig;
use tessera_worker::model::config::{LayerTensor, Tensor, TensorNaming};

/// A tensor under its name: shape and f32 values.
type Named<'a> = (&'a String, &'a (Vec<usize>, Vec<f32>));

/// llama.cpp's converter interleaves each head's rotary halves in Q/K rows; undo it:
/// GGUF row `2i + half` of a head is Hugging Face row `half·d/2 + i`.
fn unpermute(rows: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; rows.len()];
    for h in 0..heads {
        for i in 0..head_dim / 2 {
            for half in 0..2 {
                let src = (h * head_dim + 2 * i + half) * cols;
                let dst = (h * head_dim + half * head_dim / 2 + i) * cols;
                out[dst..dst + cols].copy_from_slice(&rows[src..src + cols]);
            }
        }
    }
    out
}

/// Every tensor of the model under its Hugging Face name, in f32.
fn hf_tensors(gguf: &GgufFile, config: &ModelConfig) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let hf = ModelConfig { naming: TensorNaming::HuggingFace, ..config.clone() };
    let mut parts = vec![Tensor::Embed, Tensor::FinalNorm];
    for l in 0..config.num_layers {
        use LayerTensor::*;
        parts.extend([AttnNorm, Q, K, V, O, FfnNorm, Gate, Up, Down].map(|p| Tensor::Layer(l, p)));
    }
    parts
        .into_iter()
        .map(|t| {
            let mut tensor = gguf.load(&config.tensor_name(t)).unwrap();
            let cols = config.hidden_size;
            match t {
                Tensor::Layer(_, LayerTensor::Q) => {
                    tensor.data = unpermute(&tensor.data, config.num_heads, config.head_dim, cols)
                }
                Tensor::Layer(_, LayerTensor::K) => {
                    tensor.data = unpermute(&tensor.data, config.num_kv_heads, config.head_dim, cols)
                }
                _ => {}
            }
            (hf.tensor_name(t), (tensor.shape, tensor.data))
        })
        .collect()
}

fn encode(dtype: Dtype, data: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => data.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::BF16 => data.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        _ => unreachable!(),
    }
}

fn write_shard(path: &Path, tensors: &[Named<'_>], dtype: Dtype) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.iter().map(|(n, (s, d))| (n.to_string(), s.clone(), encode(dtype, d))).collect();
    let views = bytes.iter().map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn write_dir(
    dir: &Path,
    config: &ModelConfig,
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    dtype: Dtype,
    shards: usize,
) {
    std::fs::create_dir_all(dir).unwrap();
    let all: Vec<_> = tensors.iter().collect();
    if shards == 1 {
        write_shard(&dir.join("model.safetensors"), &all, dtype);
    } else {
        let mut weight_map = serde_json::Map::new();
        for (i, chunk) in all.chunks(all.len().div_ceil(shards)).enumerate() {
            let name = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
            write_shard(&dir.join(&name), chunk, dtype);
            for (tensor, _) in chunk {
                weight_map.insert(tensor.to_string(), name.clone().into());
            }
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
    let hf_config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.context_length, "tie_word_embeddings": true,
    });
    std::fs::write(dir.join("config.json"), hf_config.to_string()).unwrap();
    let tok = &smollm2().tokenizer;
    std::fs::write(dir.join("tokenizer.json"), &tok.json).unwrap();
    let tok_config =
        serde_json::json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tok.chat_template});
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).unwrap();
}

fn last_logits(model: &tessera_worker::model::Model<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    SingleSequence::new(model, ids.len()).unwrap().extend(model, ids).unwrap()
}

#[test]
fn exported_directories_load_and_match_the_gguf() {
    let gguf = GgufFile::open(&smollm2_path()).unwrap();
    let config = ModelConfig::from_gguf(&gguf).unwrap();
    let tensors = hf_tensors(&gguf, &config);
    let root: PathBuf = std::env::temp_dir().join(format!("tessera-hf-{}", std::process::id()));

    // f32 over two shards: the same numbers, so the same logits up to summation order.
    let f32_dir = root.join("f32");
    write_dir(&f32_dir, &config, &tensors, Dtype::F32, 2);
    let hf = load_model(CpuBackend::exact(), &f32_dir).unwrap();
    assert_eq!(hf.model.config.rope_style, tessera_kernels::RopeStyle::Neox);
    let ids = smollm2().tokenizer.encode("The capital of France is").unwrap();
    assert_eq!(hf.tokenizer.encode("The capital of France is").unwrap(), ids);
    // The GGUF's quantised weights on the exact path: its inputs unrounded, as f32
    // weights' are.
    let exact = load_model(CpuBackend::exact(), &smollm2_path()).unwrap();
    let (want, got) = (last_logits(&exact.model, &ids), last_logits(&hf.model, &ids));
    let diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(diff < 1e-3, "f32 directory logits differ by {diff}");
    drop(hf);

    // f16 and bf16 single files: each tensor reads back as the rounded original.
    for (dtype, round) in [
        (Dtype::F16, (|v: f32| half::f16::from_f32(v).to_f32()) as fn(f32) -> f32),
        (Dtype::BF16, |v: f32| half::bf16::from_f32(v).to_f32()),
    ] {
        let dir = root.join(format!("{dtype:?}"));
        write_dir(&dir, &config, &tensors, dtype, 1);
        let st = SafetensorsDir::open(&dir).unwrap();
        for name in ["model.layers.3.self_attn.k_proj.weight", "model.norm.weight"] {
            let loaded = st.load(name).unwrap();
            let (shape, original) = &tensors[name];
            assert_eq!(&loaded.shape, shape);
            assert!(loaded.data.iter().zip(original).all(|(a, b)| *a == round(*b)), "{dtype:?} {name}");
        }
        let model = load_model(CpuBackend::default(), &dir).unwrap();
        assert_eq!(model.model.config.num_layers, 30);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_directory_without_weights_or_with_a_broken_index_is_an_error() {
    let dir = std::env::temp_dir().join(format!("tessera-hf-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = SafetensorsDir::open(&dir).err().unwrap();
    assert!(err.to_string().contains("no model.safetensors"), "{err}");
    std::fs::write(dir.join("model.safetensors.index.json"), "{\"weight_map\": 3}").unwrap();
    let err = SafetensorsDir::open(&dir).err().unwrap();
    assert!(err.to_string().contains("weight_map"), "{err}");
    std::fs::write(dir.join("model.safetensors.index.json"), "{\"weight_map\": {\"a\": \"gone.safetensors\"}}")
        .unwrap();
    let err = SafetensorsDir::open(&dir).err().unwrap();
    assert!(err.to_string().contains("gone.safetensors"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
