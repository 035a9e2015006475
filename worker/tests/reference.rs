//! SmolLM2-135M-Instruct against llama.cpp, an independent implementation, on the same
//! GGUF weights (fixtures from scripts/fixtures/reference.py).
//!
//! Two llama.cpp runs are the references:
//! - `f32`: llama.cpp on an F32 copy of the file that llama.cpp's quantize tool decoded
//!   from it, with an f32 KV cache: the same weight values in f32 arithmetic, as ours.
//!   Only the order of floating-point sums differs: logits agree within
//!   F32_LOGIT_BOUND (1.2e-4 measured) and the first 32 greedy tokens of every prompt
//!   agree exactly.
//! - `q4_1`: llama.cpp on the Q4_1 file itself. It does not dequantise the weights to
//!   f32: it rounds each activation row to 8 bits (Q8_1 blocks of 32) and takes integer
//!   dot products against the 4-bit weights (and keeps K/V in f16). That rounding,
//!   repeated in every matrix product of 30 layers, moves logits by up to about 1.5
//!   (we checked the cause by emulating it in NumPy: it accounts for the shift).
//!
//! Our exact path (`CpuBackend::exact`) is held to the first; the served path, which
//! rounds activations the same way llama.cpp does (`int8`), to the second. Two
//! roundings that differ in their details (ties, f16 keys and values) part at near-ties
//! (a top-2 margin of 0.1 on prompt 1), so against `q4_1` the greedy tokens agree on
//! most prompts, not all.

mod common;

use common::{data_dir, smollm2, smollm2_exact};
use serde_json::Value;
use tessera_kernels::cpu::CpuBackend;
use tessera_proto::chat_template::{ChatTemplate, Message};
use tessera_worker::generate::{argmax, greedy};
use tessera_worker::load::LoadedModel;

/// Largest |ours − llama.cpp F32| over the vocabulary after each prompt.
const F32_LOGIT_BOUND: f32 = 1e-3;
/// Largest |ours (served) − llama.cpp Q4_1| over the vocabulary after each prompt.
/// Both round activations to bytes, and each is up to ~1.7 from F32 on its own (see
/// below), in directions of their own: 1.17 measured with keys scored in 8-lane
/// chains, 1.57 with one chain a key (the same accuracy against F32: a summation
/// order moves which activations round up, and this 135M model carries that on).
const Q4_1_LOGIT_BOUND: f32 = 2.0;
/// How much further from llama.cpp F32 the served path may be than llama.cpp Q4_1 is,
/// worst prompt against worst prompt (1.635 against 1.443 measured, then 1.672) —
/// the accuracy check.
const ROUNDING_RATIO_BOUND: f32 = 1.25;
/// Prompts (of 8) whose first token, and whose 32 greedy tokens, are llama.cpp Q4_1's
/// (7 and 3 measured with f32 K/V; 6 and 2 with half-float K/V and two accumulator
/// chains a product; at least 6, and 4, with keys scored in one chain each). Near-ties of this
/// 135M model move with any change of rounding order: the accuracy checks are the
/// logit bounds above.
const MIN_SAME_FIRST: usize = 6;
const MIN_SAME_GREEDY: usize = 2;

fn logits(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(data_dir().join(name)).unwrap();
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Each prompt's ids, after checking the template and tokenizer reproduce them.
fn prompt_ids(loaded: &LoadedModel<CpuBackend>, p: &Value, i: usize) -> Vec<u32> {
    let template = ChatTemplate::new(loaded.tokenizer.chat_template.as_deref().unwrap(), "", "<|im_end|>").unwrap();
    let text = p["text"].as_str().unwrap();
    if p["kind"] == "chat" {
        let messages: Vec<Message> = p["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        assert_eq!(template.render(&messages, true).unwrap(), text, "prompt {i}: chat template");
    }
    let ids: Vec<u32> = serde_json::from_value(p["prompt_token_ids"].clone()).unwrap();
    assert_eq!(loaded.tokenizer.encode(text).unwrap(), ids, "prompt {i}: token ids");
    ids
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data_dir().join("reference.json")).unwrap()).unwrap()
}

/// The exact path is llama.cpp F32's arithmetic up to the order of sums.
#[test]
fn the_exact_path_matches_llama_cpp_f32_logits_and_greedy_tokens() {
    let loaded = smollm2_exact();
    let fixture = fixture();
    let vocab = fixture["vocab"].as_u64().unwrap() as usize;
    assert_eq!(vocab, loaded.model.config.vocab_size);
    let f32_logits = logits("reference_logits_f32.bin");
    let prompts = fixture["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 8);
    let mut worst = 0.0f32;
    for (i, p) in prompts.iter().enumerate() {
        let ids = prompt_ids(loaded, p, i);
        let want_tokens: Vec<u32> = serde_json::from_value(p["f32"]["greedy_token_ids"].clone()).unwrap();
        assert_eq!(want_tokens.len(), 32);
        let run = greedy(&loaded.model, &ids, want_tokens.len(), &[]).unwrap();
        let row = i * vocab..(i + 1) * vocab;
        let d = max_abs_diff(&run.first_logits, &f32_logits[row.clone()]);
        eprintln!("prompt {i}: max |Δlogit| {d:.5} against F32");
        worst = worst.max(d);
        assert!(d <= F32_LOGIT_BOUND, "prompt {i}: logits differ from llama.cpp F32 by {d}");
        assert_eq!(argmax(&run.first_logits), argmax(&f32_logits[row]), "prompt {i}: first token");
        assert_eq!(run.output, want_tokens, "prompt {i}: greedy tokens");
    }
    eprintln!("worst max |Δlogit|: {worst:.5} against F32");
}

/// The served path rounds activations to 8 bits as llama.cpp does on the Q4_1 file
/// (blocks of 32, a scale each): its logits are within Q4_1_LOGIT_BOUND of llama.cpp
/// Q4_1's, and its greedy tokens follow llama.cpp Q4_1's on most prompts (paths part
/// at near-ties: llama.cpp keeps K/V in f16 and rounds halves away from zero).
#[test]
fn the_served_path_matches_llama_cpp_q4_1_within_its_rounding() {
    let (loaded, exact) = (smollm2(), smollm2_exact());
    let fixture = fixture();
    let vocab = fixture["vocab"].as_u64().unwrap() as usize;
    let (f32_logits, q4_logits) = (logits("reference_logits_f32.bin"), logits("reference_logits_q4_1.bin"));
    let prompts = fixture["prompts"].as_array().unwrap();
    let (mut worst, mut same_tokens, mut same_first) = (0.0f32, 0, 0);
    let (mut ours_from_f32, mut theirs_from_f32) = (0.0f32, 0.0f32);
    for (i, p) in prompts.iter().enumerate() {
        let ids = prompt_ids(loaded, p, i);
        let want_tokens: Vec<u32> = serde_json::from_value(p["q4_1"]["greedy_token_ids"].clone()).unwrap();
        let run = greedy(&loaded.model, &ids, want_tokens.len(), &[]).unwrap();
        let row = i * vocab..(i + 1) * vocab;
        let d = max_abs_diff(&run.first_logits, &q4_logits[row.clone()]);
        let (d_f32, d_exact) = (
            max_abs_diff(&run.first_logits, &f32_logits[row.clone()]),
            max_abs_diff(&run.first_logits, &greedy(&exact.model, &ids, 1, &[]).unwrap().first_logits),
        );
        let agree = run.output.iter().zip(&want_tokens).take_while(|(a, b)| a == b).count();
        let theirs = max_abs_diff(&q4_logits[row.clone()], &f32_logits[row.clone()]);
        eprintln!(
            "prompt {i}: max |Δlogit| {d:.3} against Q4_1 ({d_f32:.3} against F32, {d_exact:.3} against our exact path; \
             Q4_1 is {theirs:.3} from F32); {agree} of {} greedy tokens as Q4_1's",
            want_tokens.len()
        );
        worst = worst.max(d);
        (ours_from_f32, theirs_from_f32) = (ours_from_f32.max(d_f32), theirs_from_f32.max(theirs));
        same_tokens += (agree == want_tokens.len()) as usize;
        same_first += (argmax(&run.first_logits) == argmax(&q4_logits[row])) as usize;
        assert!(d <= Q4_1_LOGIT_BOUND, "prompt {i}: logits differ from llama.cpp Q4_1 by {d}");
    }
    eprintln!("worst max |Δlogit|: {worst:.3} against Q4_1; {same_tokens} of {} prompts' greedy tokens", prompts.len());
    assert!(
        ours_from_f32 <= ROUNDING_RATIO_BOUND * theirs_from_f32,
        "{ours_from_f32} from F32 where llama.cpp Q4_1 is {theirs_from_f32}"
    );
    assert!(same_first >= MIN_SAME_FIRST, "{same_first} first tokens as llama.cpp Q4_1's");
    assert!(same_tokens >= MIN_SAME_GREEDY, "{same_tokens} prompts' greedy tokens as llama.cpp Q4_1's");
}
