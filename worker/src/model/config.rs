//! The decoder's hyper-parameters, read from GGUF metadata or a Hugging Face
//! config.json, and the one place that knows how each format names its tensors.

use crate::loader::LoadError;
use crate::loader::gguf::GgufFile;
use serde::Deserialize;
use std::path::Path;
use tessera_kernels::RopeStyle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
}

impl Architecture {
    fn parse(file: &Path, name: &str) -> Result<Self, LoadError> {
        match name.to_ascii_lowercase().as_str() {
            "llama" | "llamaforcausallm" => Ok(Self::Llama),
            "mistral" | "mistralforcausallm" => Ok(Self::Mistral),
            "qwen2" | "qwen2forcausallm" => Ok(Self::Qwen2),
            _ => Err(LoadError::UnsupportedArchitecture { file: file.into(), arch: name.into() }),
        }
    }
}

/// Llama 3's frequency-dependent RoPE scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position: f64,
}

/// Which file format's tensor names to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorNaming {
    Gguf,
    HuggingFace,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_style: RopeStyle,
    pub llama3_scaling: Option<Llama3Scaling>,
    pub context_length: usize,
    /// Q, K and V projections carry biases (Qwen2).
    pub attention_bias: bool,
    /// Hugging Face's `tie_word_embeddings`; GGUF says it by leaving out `output.weight`.
    pub tie_word_embeddings: Option<bool>,
    pub naming: TensorNaming,
}

impl ModelConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, LoadError> {
        let arch_name = f.get_str("general.architecture")?.to_string();
        let architecture = Architecture::parse(f.path(), &arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let usize_of = |k: &str| f.get_u64(&key(k)).map(|v| v as usize);
        let hidden_size = usize_of("embedding_length")?;
        let num_heads = usize_of("attention.head_count")?;
        let num_kv_heads = usize_of("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = usize_of("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match f.get_u64(&key("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => f.get("tokenizer.ggml.tokens").and_then(|t| t.as_array()).map(|t| t.len()).ok_or_else(|| {
                LoadError::metadata(f.path(), &key("vocab_size"), "missing, and no tokenizer.ggml.tokens either")
            })?,
        };
        let config = Self {
            architecture,
            hidden_size,
            intermediate_size: usize_of("feed_forward_length")?,
            num_layers: usize_of("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: f.get(&key("attention.layer_norm_rms_epsilon")).and_then(|v| v.as_f64()).unwrap_or(1e-5)
                as f32,
            rope_theta: f.get(&key("rope.freq_base")).and_then(|v| v.as_f64()).unwrap_or(10_000.0),
            // llama.cpp permutes Q/K rows of llama-arch models for interleaved RoPE;
            // qwen2 keeps the Hugging Face layout.
            rope_style: match architecture {
                Architecture::Qwen2 => RopeStyle::Neox,
                _ => RopeStyle::Interleaved,
            },
            // GGUF carries Llama 3 scaling as the `rope_freqs.weight` tensor instead.
            llama3_scaling: None,
            context_length: usize_of("context_length")?,
            attention_bias: architecture == Architecture::Qwen2,
            tie_word_embeddings: None,
            naming: TensorNaming::Gguf,
        };
        config.validate(f.path())
    }

    /// A Hugging Face `config.json`: a decoder's, or a vision-language model's, whose
    /// decoder is its `text_config`.
    pub fn from_hf_config(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| LoadError::format(path, e.to_string()))?;
        let (hf, arch_name) = match json.get("text_config") {
            // Nested configs name their type (a vision model's text config may carry
            // an architecture name of its own, "VLlama3ForCausalLM") and leave out
            // what equals the type's defaults, as llava-1.5's does.
            Some(nested) => {
                let kind = nested.get("model_type").and_then(|v| v.as_str()).unwrap_or("llama").to_string();
                let hf: HfConfig = serde_json::from_value(with_defaults(nested, &kind))
                    .map_err(|e| LoadError::format(path, format!("text_config: {e}")))?;
                (hf, kind)
            }
            None => {
                let hf: HfConfig =
                    serde_json::from_value(json.clone()).map_err(|e| LoadError::format(path, e.to_string()))?;
                let name = hf.architectures.first().cloned().or(hf.model_type.clone()).unwrap_or_default();
                (hf, name)
            }
        };
        let architecture = Architecture::parse(path, &arch_name)?;
        // transformers 5 writes `rope_parameters` (theta and scaling together) where
        // earlier files have `rope_theta` and `rope_scaling`.
        let rope_theta = hf.rope_theta.or(hf.rope_parameters.as_ref().and_then(|p| p.rope_theta));
        let llama3_scaling = match hf.rope_scaling.as_ref().or(hf.rope_parameters.as_ref()) {
            Some(s) if s.rope_type.as_deref().or(s.kind.as_deref()) == Some("llama3") => Some(Llama3Scaling {
                factor: s.factor.unwrap_or(8.0),
                low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                original_max_position: s.original_max_position_embeddings.unwrap_or(8192.0),
            }),
            Some(s) => {
                let kind = s.rope_type.clone().or(s.kind.clone()).unwrap_or_else(|| "default".into());
                if kind != "default" {
                    return Err(LoadError::metadata(
                        path,
                        "rope_scaling",
                        format!("rope type {kind:?} is not supported"),
                    ));
                }
                None
            }
            None => None,
        };
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
        let config = Self {
            architecture,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads,
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            vocab_size: hf.vocab_size,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta.unwrap_or(10_000.0),
            rope_style: RopeStyle::Neox,
            llama3_scaling,
            context_length: hf.max_position_embeddings.unwrap_or(2048),
            attention_bias: architecture == Architecture::Qwen2 || hf.attention_bias.unwrap_or(false),
            tie_word_embeddings: hf.tie_word_embeddings,
            naming: TensorNaming::HuggingFace,
        };
        config.validate(path)
    }

    fn validate(self, file: &Path) -> Result<Self, LoadError> {
        let bad = |key: &str, detail: String| Err(LoadError::metadata(file, key, detail));
        if self.num_heads == 0 || self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(
                "head_count_kv",
                format!("{} heads cannot share {} KV heads", self.num_heads, self.num_kv_heads),
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad("head_dim", format!("{} is not a positive even number", self.head_dim));
        }
        if self.hidden_size == 0 || self.num_layers == 0 || self.vocab_size == 0 || self.intermediate_size == 0 {
            return bad("dimensions", "a model dimension is zero".into());
        }
        Ok(self)
    }

    pub fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// RoPE inverse frequencies, with Llama 3 scaling and GGUF's per-frequency divisors
    /// (`rope_freqs.weight`) applied.
    pub fn inv_freq(&self, freq_divisors: Option<&[f32]>) -> Vec<f32> {
        let half = self.head_dim / 2;
        (0..half)
            .map(|i| {
                let mut f = self.rope_theta.powf(-2.0 * i as f64 / self.head_dim as f64);
                if let Some(s) = &self.llama3_scaling {
                    f = llama3_scale(f, s);
                }
                if let Some(d) = freq_divisors {
                    f /= d[i] as f64;
                }
                f as f32
            })
            .collect()
    }

    /// A tensor's name in this model's file format.
    pub fn tensor_name(&self, t: Tensor) -> String {
        use Tensor::*;
        match self.naming {
            TensorNaming::Gguf => match t {
                Embed => "token_embd.weight".into(),
                FinalNorm => "output_norm.weight".into(),
                LmHead => "output.weight".into(),
                RopeFreqs => "rope_freqs.weight".into(),
                Layer(l, p) => format!(
                    "blk.{l}.{}",
                    match p {
                        LayerTensor::AttnNorm => "attn_norm.weight",
                        LayerTensor::Q => "attn_q.weight",
                        LayerTensor::K => "attn_k.weight",
                        LayerTensor::V => "attn_v.weight",
                        LayerTensor::QBias => "attn_q.bias",
                        LayerTensor::KBias => "attn_k.bias",
                        LayerTensor::VBias => "attn_v.bias",
                        LayerTensor::O => "attn_output.weight",
                        LayerTensor::FfnNorm => "ffn_norm.weight",
                        LayerTensor::Gate => "ffn_gate.weight",
                        LayerTensor::Up => "ffn_up.weight",
                        LayerTensor::Down => "ffn_down.weight",
                    }
                ),
            },
            TensorNaming::HuggingFace => match t {
                Embed => "model.embed_tokens.weight".into(),
                FinalNorm => "model.norm.weight".into(),
                LmHead => "lm_head.weight".into(),
                RopeFreqs => "rope_freqs.weight".into(),
                Layer(l, p) => format!(
                    "model.layers.{l}.{}",
                    match p {
                        LayerTensor::AttnNorm => "input_layernorm.weight",
                        LayerTensor::Q => "self_attn.q_proj.weight",
                        LayerTensor::K => "self_attn.k_proj.weight",
                        LayerTensor::V => "self_attn.v_proj.weight",
                        LayerTensor::QBias => "self_attn.q_proj.bias",
                        LayerTensor::KBias => "self_attn.k_proj.bias",
                        LayerTensor::VBias => "self_attn.v_proj.bias",
                        LayerTensor::O => "self_attn.o_proj.weight",
                        LayerTensor::FfnNorm => "post_attention_layernorm.weight",
                        LayerTensor::Gate => "mlp.gate_proj.weight",
                        LayerTensor::Up => "mlp.up_proj.weight",
                        LayerTensor::Down => "mlp.down_proj.weight",
                    }
                ),
            },
        }
    }

    /// The shape a tensor must have, row-major.
    pub fn tensor_shape(&self, t: Tensor) -> Vec<usize> {
        use LayerTensor::*;
        let (d, q, kv, ffn) = (self.hidden_size, self.q_width(), self.kv_width(), self.intermediate_size);
        match t {
            Tensor::Embed | Tensor::LmHead => vec![self.vocab_size, d],
            Tensor::FinalNorm => vec![d],
            Tensor::RopeFreqs => vec![self.head_dim / 2],
            Tensor::Layer(_, p) => match p {
                AttnNorm | FfnNorm => vec![d],
                Q => vec![q, d],
                K | V => vec![kv, d],
                QBias => vec![q],
                KBias | VBias => vec![kv],
                O => vec![d, q],
                Gate | Up => vec![ffn, d],
                Down => vec![d, ffn],
            },
        }
    }
}

fn llama3_scale(freq: f64, s: &Llama3Scaling) -> f64 {
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    let low_wavelen = s.original_max_position / s.low_freq_factor;
    let high_wavelen = s.original_max_position / s.high_freq_factor;
    if wavelen < high_wavelen {
        freq
    } else if wavelen > low_wavelen {
        freq / s.factor
    } else {
        let smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * freq / s.factor + smooth * freq
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tensor {
    Embed,
    FinalNorm,
    LmHead,
    RopeFreqs,
    Layer(usize, LayerTensor),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerTensor {
    AttnNorm,
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    O,
    FfnNorm,
    Gate,
    Up,
    Down,
}

#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<HfRopeScaling>,
    rope_parameters: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
}

/// `config` with the fields its type's configuration class defaults filled in, where
/// the file leaves them out (transformers writes only what differs from them in nested
/// configs). Only llama-family decoders are known; others come back as they are.
fn with_defaults(config: &serde_json::Value, model_type: &str) -> serde_json::Value {
    let defaults = match model_type {
        // LlamaConfig's defaults (transformers' configuration_llama.py).
        "llama" => serde_json::json!({
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 2048, "rope_theta": 10000.0
        }),
        _ => serde_json::json!({}),
    };
    let mut out = config.clone();
    if let (Some(o), Some(d)) = (out.as_object_mut(), defaults.as_object()) {
        for (k, v) in d {
            // `rope_theta` is not a default when `rope_parameters` carries it.
            if k == "rope_theta" && o.contains_key("rope_parameters") {
                continue;
            }
            o.entry(k.clone()).or_insert(v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, json: &str) -> std::path::PathBuf {
        let p = dir.join("config.json");
        std::fs::write(&p, json).unwrap();
        p
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let s =
            Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192.0 };
        // Wavelength 2π < 2048: unchanged.
        assert_eq!(llama3_scale(1.0, &s), 1.0);
        // Wavelength 2π·10⁴ > 8192: divided by the factor.
        assert!((llama3_scale(1e-4, &s) - 1e-4 / 8.0).abs() < 1e-15);
        // In between, a blend strictly between the two.
        let f = 2.0 * std::f64::consts::PI / 4096.0;
        let v = llama3_scale(f, &s);
        assert!(v > f / 8.0 && v < f, "{v}");
    }

    #[test]
    fn hf_config_reads_qwen2_and_llama3() {
        let dir = std::env::temp_dir().join(format!("tessera-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let qwen = write(
            &dir,
            r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"rope_theta":1000000.0}"#,
        );
        let c = ModelConfig::from_hf_config(&qwen).unwrap();
        assert_eq!(
            (c.architecture, c.attention_bias, c.head_dim, c.rope_style),
            (Architecture::Qwen2, true, 16, RopeStyle::Neox)
        );
        let llama = write(
            &dir,
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100,
            "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        );
        let c = ModelConfig::from_hf_config(&llama).unwrap();
        assert_eq!(c.llama3_scaling.unwrap().factor, 32.0);
        assert_eq!(c.num_kv_heads, 4);
        let gpt2 = write(
            &dir,
            r#"{"architectures":["GPT2LMHeadModel"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100}"#,
        );
        let err = ModelConfig::from_hf_config(&gpt2).unwrap_err();
        assert!(matches!(err, LoadError::UnsupportedArchitecture { .. }), "{err}");
        assert!(err.to_string().contains("config.json") && err.to_string().contains("GPT2LMHeadModel"));
        // A vision model's decoder: the nested text config, its type's defaults filled in
        // (llava-1.5 leaves out the sizes), rope theta from transformers 5's rope_parameters.
        let llava = write(
            &dir,
            r#"{"architectures":["LlavaForConditionalGeneration"],"model_type":"llava",
            "text_config":{"architectures":["VLlama3ForCausalLM"],"model_type":"llama","vocab_size":32064,
            "rope_parameters":{"rope_type":"default","rope_theta":100000.0}},
            "vision_config":{"model_type":"clip_vision_model"}}"#,
        );
        let c = ModelConfig::from_hf_config(&llava).unwrap();
        assert_eq!((c.hidden_size, c.num_layers, c.num_heads, c.vocab_size), (4096, 32, 32, 32064));
        assert_eq!((c.architecture, c.rope_theta), (Architecture::Llama, 100000.0));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
