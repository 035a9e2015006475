//! Broken model files fail with an error that names the file and the tensor or key at
//! fault — never a panic.

mod common;

use common::data_dir;
use std::path::{Path, PathBuf};
use tessera_kernels::cpu::CpuBackend;
use tessera_worker::loader::LoadError;
use tessera_worker::loader::gguf::{GgufFile, MetaValue};
use tessera_worker::loader::gguf_writer::{GgufTensor, write_gguf};
use tessera_worker::model::{Model, ModelConfig, ModelError};

struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tessera-bad-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A two-layer llama GGUF with random-ish F32 weights; `edit` may change the parts.
fn tiny_llama(edit: impl FnOnce(&mut Vec<(&'static str, MetaValue)>, &mut Vec<GgufTensor>)) -> Vec<u8> {
    let (d, ffn, heads, kv_heads, vocab, layers) = (8usize, 16usize, 2u32, 1u32, 32usize, 2usize);
    let hd = d / heads as usize;
    let mut meta = vec![
        ("general.architecture", MetaValue::String("llama".into())),
        ("llama.embedding_length", MetaValue::U32(d as u32)),
        ("llama.feed_forward_length", MetaValue::U32(ffn as u32)),
        ("llama.block_count", MetaValue::U32(layers as u32)),
        ("llama.attention.head_count", MetaValue::U32(heads)),
        ("llama.attention.head_count_kv", MetaValue::U32(kv_heads)),
        ("llama.context_length", MetaValue::U32(64)),
        ("llama.vocab_size", MetaValue::U32(vocab as u32)),
    ];
    let fill = |n: usize| (0..n).map(|i| ((i * 7919 % 13) as f32 - 6.0) / 10.0).collect::<Vec<_>>();
    let mut t = vec![
        GgufTensor::f32("token_embd.weight", &[vocab, d], &fill(vocab * d)),
        GgufTensor::f32("output_norm.weight", &[d], &fill(d)),
    ];
    for l in 0..layers {
        let kv = kv_heads as usize * hd;
        for (name, shape) in [
            ("attn_norm.weight", vec![d]),
            ("attn_q.weight", vec![d, d]),
            ("attn_k.weight", vec![kv, d]),
            ("attn_v.weight", vec![kv, d]),
            ("attn_output.weight", vec![d, d]),
            ("ffn_norm.weight", vec![d]),
            ("ffn_gate.weight", vec![ffn, d]),
            ("ffn_up.weight", vec![ffn, d]),
            ("ffn_down.weight", vec![d, ffn]),
        ] {
            let n = shape.iter().product();
            t.push(GgufTensor::f32(&format!("blk.{l}.{name}"), &shape, &fill(n)));
        }
    }
    edit(&mut meta, &mut t);
    write_gguf(&meta, &t)
}

fn load(path: &Path) -> Result<Model<CpuBackend>, ModelError> {
    let file = GgufFile::open(path)?;
    let config = ModelConfig::from_gguf(&file)?;
    Model::load(CpuBackend::default(), config, &file)
}

fn message(e: impl std::fmt::Display) -> String {
    e.to_string()
}

#[test]
fn the_unbroken_tiny_model_loads_and_runs() {
    let s = Scratch::new("ok");
    let model = load(&s.write("ok.gguf", &tiny_llama(|_, _| {}))).unwrap();
    let mut kv = model.new_kv_cache(4, 16).unwrap();
    let seq =
        tessera_worker::model::SeqInput { tokens: &[1, 2, 3], cached: 0, block_table: &[0], logits: true, embeds: &[] };
    let logits = model.forward(&[seq], &mut kv).unwrap();
    assert_eq!(logits.len(), 32);
    assert!(logits.iter().all(|v| v.is_finite()));
}

#[test]
fn truncation_anywhere_is_an_error_naming_the_file() {
    let bytes = std::fs::read(data_dir().join("dequant.gguf")).unwrap();
    let s = Scratch::new("trunc");
    let whole = GgufFile::open(&data_dir().join("dequant.gguf")).unwrap();
    let data_start = whole.tensors.iter().map(|t| t.start).min().unwrap();
    // Past the last tensor there is only padding, which a file may lack.
    let data_end = whole.tensors.iter().map(|t| t.start + t.len).max().unwrap();
    for len in 0..data_end {
        let path = s.write("cut.gguf", &bytes[..len]);
        let err = GgufFile::open(&path).unwrap_err();
        let text = message(&err);
        assert!(text.contains("cut.gguf"), "{len}: {text}");
        assert!(matches!(err, LoadError::Truncated { .. }) || len < 8, "{len}: {text}");
        if len >= data_start {
            assert!(text.contains("tensor"), "cut in the data at {len} should name a tensor: {text}");
        }
    }
}

#[test]
fn wrong_magic_and_version() {
    let s = Scratch::new("magic");
    let mut bytes = std::fs::read(data_dir().join("dequant.gguf")).unwrap();
    bytes[0..4].copy_from_slice(b"GGML");
    let err = GgufFile::open(&s.write("magic.gguf", &bytes)).unwrap_err();
    assert!(matches!(err, LoadError::BadMagic { .. }), "{err}");
    assert!(message(&err).contains("magic.gguf"));
    bytes[0..4].copy_from_slice(b"GGUF");
    // Version 2 has version 3's layout (3 added big-endian files, which carry a
    // byte-swapped version number and so fail this check).
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(GgufFile::open(&s.write("v2.gguf", &bytes)).unwrap().version, 2);
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let err = GgufFile::open(&s.write("v1.gguf", &bytes)).unwrap_err();
    assert!(matches!(err, LoadError::UnsupportedVersion { version: 1, .. }), "{err}");
}

#[test]
fn unknown_and_unsupported_tensor_types_name_the_tensor() {
    let s = Scratch::new("types");
    for (ty, shown) in [(99u32, "unknown (id 99)"), (7, "Q5_1")] {
        let bytes = tiny_llama(|_, t| {
            t[1].ty = ty;
        });
        let err = GgufFile::open(&s.write("type.gguf", &bytes)).unwrap_err();
        assert!(matches!(err, LoadError::UnsupportedTensorType { .. }), "{err}");
        let text = message(&err);
        assert!(text.contains("type.gguf") && text.contains("output_norm.weight") && text.contains(shown), "{text}");
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let s = Scratch::new("missing");
    let bytes = tiny_llama(|_, t| t.retain(|t| t.name != "blk.1.ffn_up.weight"));
    let err = load(&s.write("missing.gguf", &bytes)).err().unwrap();
    assert!(matches!(err, ModelError::Load(LoadError::MissingTensor { .. })), "{err}");
    let text = message(&err);
    assert!(text.contains("missing.gguf") && text.contains("blk.1.ffn_up.weight"), "{text}");
}

#[test]
fn a_shape_mismatch_names_tensor_and_shapes() {
    let s = Scratch::new("shape");
    let bytes = tiny_llama(|_, t| {
        let v = t.iter_mut().find(|t| t.name == "blk.0.attn_k.weight").unwrap();
        *v = GgufTensor::f32("blk.0.attn_k.weight", &[8, 8], &[0.0; 64]);
    });
    let err = load(&s.write("shape.gguf", &bytes)).err().unwrap();
    let text = message(&err);
    assert!(matches!(err, ModelError::Load(LoadError::ShapeMismatch { .. })), "{text}");
    assert!(
        text.contains("shape.gguf")
            && text.contains("blk.0.attn_k.weight")
            && text.contains("[8, 8]")
            && text.contains("[4, 8]"),
        "{text}"
    );
}

#[test]
fn an_unsupported_architecture_is_named() {
    let s = Scratch::new("arch");
    let bytes = tiny_llama(|m, _| m[0].1 = MetaValue::String("gpt2".into()));
    let err = load(&s.write("arch.gguf", &bytes)).err().unwrap();
    let text = message(&err);
    assert!(matches!(err, ModelError::Load(LoadError::UnsupportedArchitecture { .. })), "{text}");
    assert!(text.contains("arch.gguf") && text.contains("gpt2"), "{text}");
}

#[test]
fn missing_metadata_is_named() {
    let s = Scratch::new("meta");
    let bytes = tiny_llama(|m, _| m.retain(|(k, _)| *k != "llama.block_count"));
    let err = load(&s.write("meta.gguf", &bytes)).err().unwrap();
    let text = message(&err);
    assert!(text.contains("meta.gguf") && text.contains("llama.block_count") && text.contains("missing"), "{text}");
}

#[test]
fn a_missing_file_is_an_io_error_naming_it() {
    let err = GgufFile::open(Path::new("/nonexistent/model.gguf")).unwrap_err();
    assert!(matches!(err, LoadError::Io { .. }) && message(&err).contains("/nonexistent/model.gguf"), "{err}");
}
