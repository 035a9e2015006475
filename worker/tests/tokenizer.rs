//! Our tokenizer, built from the GGUF's vocabulary, against llama.cpp's on the same
//! vocabulary (fixture from scripts/fixtures/reference.py): emoji, CJK, accents, code,
//! runs of whitespace, digits, inline special tokens.

mod common;

use common::{data_dir, smollm2_path};
use serde_json::Value;
use tessera_worker::loader::gguf::GgufFile;
use tessera_worker::tokenizer::ModelTokenizer;

fn cases() -> Vec<(String, Vec<u32>)> {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(data_dir().join("tokenizer_cases.json")).unwrap()).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|c| (c["text"].as_str().unwrap().to_string(), serde_json::from_value(c["ids"].clone()).unwrap()))
        .collect()
}

fn gguf_tokenizer() -> ModelTokenizer {
    ModelTokenizer::from_gguf(&GgufFile::open(&smollm2_path()).unwrap()).unwrap()
}

#[test]
fn gguf_tokenizer_matches_llama_cpp_and_round_trips() {
    let tok = gguf_tokenizer();
    let cases = cases();
    assert!(cases.len() >= 8);
    for (text, want) in &cases {
        assert_eq!(&tok.encode(text).unwrap(), want, "{text:?}");
        // Decoding with special tokens kept gives the text back byte for byte.
        assert_eq!(&tok.inner().decode(want, false).unwrap(), text);
    }
}

#[test]
fn special_tokens_and_template_come_from_metadata() {
    let tok = gguf_tokenizer();
    assert_eq!(tok.bos.as_ref().map(|t| (t.id, t.text.as_str())), Some((1, "<|im_start|>")));
    assert_eq!(tok.eos.iter().map(|t| (t.id, t.text.as_str())).collect::<Vec<_>>(), vec![(2, "<|im_end|>")]);
    assert!(!tok.add_bos);
    assert!(tok.chat_template.as_deref().unwrap().contains("<|im_start|>"));
    assert_eq!(tok.vocab_size(), 49152);
    // Decoding for users drops special tokens.
    assert_eq!(tok.decode(&[1, 9690, 2]).unwrap(), "system");
}

#[test]
fn tokenizer_json_directory_gives_the_same_ids() {
    let tok = gguf_tokenizer();
    let dir = std::env::temp_dir().join(format!("tessera-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), &tok.json).unwrap();
    let config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": tok.chat_template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let hf = ModelTokenizer::from_hf_dir(&dir).unwrap();
    for (text, want) in cases() {
        assert_eq!(hf.encode(&text).unwrap(), want, "{text:?}");
    }
    assert_eq!(hf.bos, tok.bos);
    assert_eq!(hf.eos, tok.eos);
    assert_eq!(hf.chat_template, tok.chat_template);
    std::fs::remove_dir_all(&dir).unwrap();
}
