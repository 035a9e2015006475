//! The model's tokenizer as a `tokenizers::Tokenizer`, built from GGUF metadata (byte-level
//! BPE: vocabulary, merges, the pre-tokenizer its `tokenizer.ggml.pre` names, special
//! tokens) or read from a Hugging Face tokenizer.json, with the chat template and the
//! BOS/EOS tokens beside it.

use crate::loader::LoadError;
use crate::loader::gguf::{GgufFile, MetaValue};
use serde_json::{Value, json};
use std::path::Path;
use tokenizers::Tokenizer;

pub struct ModelTokenizer {
    inner: Tokenizer,
    /// tokenizer.json of `inner`, for processes that tokenize without the model files.
    pub json: String,
    pub bos: Option<TokenInfo>,
    /// Tokens that end generation: the model's EOS first.
    pub eos: Vec<TokenInfo>,
    /// Whether a BOS token is prepended to prompts.
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    pub text: String,
}

impl ModelTokenizer {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, LoadError> {
        let path = f.path();
        let model = f.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(LoadError::metadata(
                path,
                "tokenizer.ggml.model",
                format!("{model:?} tokenizers are not supported; use the model's Hugging Face directory"),
            ));
        }
        let tokens = string_array(f, "tokenizer.ggml.tokens")?;
        let merges = string_array(f, "tokenizer.ggml.merges")?;
        let types: Vec<u64> = match f.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let pre = f.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
        let spec = bpe_tokenizer_json(
            &tokens,
            &merges,
            &types,
            pre_tokenizer(pre).ok_or_else(|| {
                LoadError::metadata(path, "tokenizer.ggml.pre", format!("pre-tokenizer {pre:?} is not supported"))
            })?,
        );
        let json = spec.to_string();
        let inner =
            Tokenizer::from_bytes(json.as_bytes()).map_err(|e| LoadError::format(path, format!("tokenizer: {e}")))?;
        let token = |key: &str| -> Option<TokenInfo> {
            let id = f.get(key)?.as_u64()? as u32;
            Some(TokenInfo { id, text: tokens.get(id as usize)?.clone() })
        };
        Ok(Self {
            inner,
            json,
            bos: token("tokenizer.ggml.bos_token_id"),
            eos: token("tokenizer.ggml.eos_token_id").into_iter().collect(),
            add_bos: f.get("tokenizer.ggml.add_bos_token").and_then(MetaValue::as_bool).unwrap_or(false),
            chat_template: f.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string),
        })
    }

    /// Reads `tokenizer.json` and `tokenizer_config.json` (chat template, BOS/EOS).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("tokenizer.json");
        let json = std::fs::read_to_string(&path).map_err(|e| LoadError::io(&path, e))?;
        let inner = Tokenizer::from_bytes(json.as_bytes()).map_err(|e| LoadError::format(&path, e.to_string()))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| LoadError::format(&config_path, e.to_string()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => json!({}),
            Err(e) => return Err(LoadError::io(&config_path, e)),
        };
        // Special tokens are strings, or objects with a "content" field.
        let token = |key: &str| -> Option<TokenInfo> {
            let v = config.get(key)?;
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?.to_string();
            Some(TokenInfo { id: inner.token_to_id(&text)?, text })
        };
        let chat_template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            // A list of named templates: the default one.
            Some(Value::Array(list)) => {
                list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string)
            }
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        Ok(Self {
            bos: token("bos_token"),
            eos: token("eos_token").into_iter().collect(),
            add_bos: config.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false),
            chat_template,
            json,
            inner,
        })
    }

    /// Token ids of `text`; special tokens written in the text are recognised, and BOS is
    /// prepended when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, tokenizers::Error> {
        let mut ids = self.inner.encode_fast(text, false)?.get_ids().to_vec();
        if let (true, Some(bos)) = (self.add_bos, &self.bos)
            && ids.first() != Some(&bos.id)
        {
            ids.insert(0, bos.id);
        }
        Ok(ids)
    }

    /// Text of `ids`, without special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String, tokenizers::Error> {
        self.inner.decode(ids, true)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}

fn string_array(f: &GgufFile, key: &str) -> Result<Vec<String>, LoadError> {
    let items = f
        .get(key)
        .and_then(|v| v.as_array())
        .ok_or_else(|| LoadError::metadata(f.path(), key, "missing or not an array"))?;
    items
        .iter()
        .map(|v| v.as_str().map(str::to_string).ok_or_else(|| LoadError::metadata(f.path(), key, "holds a non-string")))
        .collect()
}

// The split patterns of the pre-tokenizers llama.cpp names, as Hugging Face writes them.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The Hugging Face pre-tokenizer equivalent to llama.cpp's pre-tokenizer type `pre`.
fn pre_tokenizer(pre: &str) -> Option<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    Some(match pre {
        "default" | "gpt2" => byte_level(true),
        // Starcoder-family vocabularies: every digit alone, then GPT-2's split.
        "smollm" | "starcoder" | "refact" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama3" | "llama-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]})
        }
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [split(QWEN2_PATTERN), byte_level(false)]}),
        _ => return None,
    })
}

/// tokenizer.json for a byte-level BPE vocabulary. Control and user-defined tokens
/// (GGUF token types 3 and 4) become added tokens so the text can name them.
fn bpe_tokenizer_json(tokens: &[String], merges: &[String], types: &[u64], pre_tokenizer: Value) -> Value {
    let vocab: serde_json::Map<String, Value> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let added: Vec<Value> = tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(ty, 3 | 4))
        .map(|(id, (content, ty))| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": *ty == 3})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    })
}
