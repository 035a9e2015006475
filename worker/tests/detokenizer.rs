//! Incremental detokenization with the real SmolLM2 tokenizer: multi-byte characters
//! split across byte-level tokens, stop strings spanning token boundaries.

mod common;

use common::smollm2_path;
use tessera_worker::engine::detokenizer::{Delta, Detokenizer};
use tessera_worker::loader::gguf::GgufFile;
use tessera_worker::tokenizer::ModelTokenizer;

fn tokenizer() -> ModelTokenizer {
    ModelTokenizer::from_gguf(&GgufFile::open(&smollm2_path()).unwrap()).unwrap()
}

fn run(tok: &ModelTokenizer, prompt: &str, text: &str, stops: &[&str]) -> (Vec<Delta>, String) {
    let prompt_ids = tok.encode(prompt).unwrap();
    let mut d = Detokenizer::new(&prompt_ids, stops.iter().map(|s| s.to_string()).collect());
    let mut deltas = Vec::new();
    for id in tok.encode(text).unwrap() {
        let delta = d.push(tok.inner(), id).unwrap();
        let stopped = delta.stopped_on.is_some();
        deltas.push(delta);
        if stopped {
            break;
        }
    }
    let tail = d.finish();
    (deltas, tail)
}

#[test]
fn multi_byte_characters_split_across_tokens_never_break() {
    let tok = tokenizer();
    let text = " Crabs 🦀🦀 and café, 日本語のテキスト, 👩‍👩‍👧 family.";
    let ids = tok.encode(text).unwrap();
    // The test means something only if some character spans several tokens.
    let pieces: Vec<String> = ids.iter().map(|&i| tok.inner().decode(&[i], false).unwrap()).collect();
    assert!(pieces.iter().any(|p| p.contains('\u{FFFD}')), "no token splits a character: {pieces:?}");
    let (deltas, tail) = run(&tok, "Say something:", text, &[]);
    for d in &deltas {
        assert!(!d.text.contains('\u{FFFD}'), "broken character in {:?}", d.text);
    }
    let whole: String = deltas.iter().map(|d| d.text.as_str()).collect::<String>() + &tail;
    assert_eq!(whole, text);
}

#[test]
fn a_stop_string_spanning_tokens_ends_the_text_before_it() {
    let tok = tokenizer();
    let text = " The answer is forty-two, and then more text.";
    let (deltas, _) = run(&tok, "Q:", text, &["two, and", "never"]);
    let last = deltas.last().unwrap();
    assert_eq!(last.stopped_on.as_deref(), Some("two, and"));
    let emitted: String = deltas.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(emitted, " The answer is forty-");
}

#[test]
fn text_that_might_start_a_stop_string_is_held_then_released() {
    let tok = tokenizer();
    // "an" could begin "and then": held until the text goes elsewhere.
    let (deltas, tail) = run(&tok, "Q:", " a banana split", &["and then"]);
    assert!(deltas.iter().all(|d| d.stopped_on.is_none()));
    let emitted: String = deltas.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(emitted + &tail, " a banana split");
    // With the text ending right after a possible start, finish() sends it.
    let (deltas, tail) = run(&tok, "Q:", " bread an", &["and then"]);
    let emitted: String = deltas.iter().map(|d| d.text.as_str()).collect();
    assert!(!emitted.ends_with("an"), "{emitted:?} should hold back \"an\"");
    assert_eq!(emitted + &tail, " bread an");
}

#[test]
fn the_earliest_of_several_stop_strings_wins() {
    let tok = tokenizer();
    let (deltas, _) = run(&tok, "Q:", " one two three four", &["four", "two", "three"]);
    assert_eq!(deltas.last().unwrap().stopped_on.as_deref(), Some("two"));
    let emitted: String = deltas.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(emitted, " one ");
}
