//! Log probabilities in the two shapes the API has: chat's list of token objects and
//! legacy completions' four parallel arrays.

use crate::router::Replica;
use serde_json::{Map, Value, json};
use tessera_proto::worker::{GeneratedToken, PromptToken, TokenLogprob};

/// Chat: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}`.
pub fn chat(replica: &Replica, tokens: &[GeneratedToken]) -> Value {
    let entry = |id: u32, logprob: f32| json!({"token": replica.token_text(id), "logprob": logprob, "bytes": replica.token_bytes(id)});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.token_id, t.logprob.unwrap_or(0.0));
            e["top_logprobs"] = t.top_logprobs.iter().map(|a| entry(a.token_id, a.logprob)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Legacy completions: `{tokens, token_logprobs, top_logprobs, text_offset}` for the
/// generated tokens, offsets counted from `offset` (the characters before them).
pub fn legacy(replica: &Replica, tokens: &[GeneratedToken], offset: &mut usize) -> Value {
    let mut out = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for t in tokens {
        let text = replica.token_text(t.token_id);
        let logprob = t.logprob.unwrap_or(0.0);
        push(&mut out, "tokens", json!(text));
        push(&mut out, "token_logprobs", json!(logprob));
        push(&mut out, "top_logprobs", top_by_text(replica, &t.top_logprobs, &text, logprob));
        push(&mut out, "text_offset", json!(*offset));
        *offset += text.chars().count();
    }
    out
}

/// Legacy completions' four arrays for an echoed prompt (`echo` with `logprobs`): its
/// tokens from offset 0, the first with a null log-probability and no alternatives,
/// as OpenAI's API shows them. `scores` are the worker's, for every token after the
/// first; `offset` ends past the prompt.
pub fn legacy_prompt(replica: &Replica, prompt: &[u32], scores: &[PromptToken], offset: &mut usize) -> Value {
    let mut out = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for (i, &id) in prompt.iter().enumerate() {
        let text = replica.token_text(id);
        let score = i.checked_sub(1).and_then(|j| scores.get(j));
        let (logprob, top) = match score {
            Some(s) => (json!(s.logprob), top_by_text(replica, &s.top_logprobs, &text, s.logprob)),
            None => (Value::Null, Value::Null),
        };
        push(&mut out, "tokens", json!(text));
        push(&mut out, "token_logprobs", logprob);
        push(&mut out, "top_logprobs", top);
        push(&mut out, "text_offset", json!(*offset));
        *offset += text.chars().count();
    }
    out
}

/// The generated tokens' arrays appended to the prompt's.
pub fn join_legacy(mut prompt: Value, generated: Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(a), Some(b)) = (prompt[key].as_array_mut(), generated[key].as_array()) {
            a.extend(b.iter().cloned());
        }
    }
    prompt
}

/// vLLM's `prompt_logprobs`: null for the first token, then for each token an object
/// keyed by token id holding it and its top alternatives, each with its log-probability,
/// its rank (1: the most likely) and its text.
pub fn vllm_prompt(replica: &Replica, scores: &[PromptToken]) -> Value {
    let entry = |logprob: f32, rank: u32, id: u32| json!({"logprob": logprob, "rank": rank, "decoded_token": replica.token_text(id)});
    let mut list = vec![Value::Null];
    for s in scores {
        let mut at = Map::new();
        for (r, a) in s.top_logprobs.iter().enumerate() {
            at.insert(a.token_id.to_string(), entry(a.logprob, r as u32 + 1, a.token_id));
        }
        at.insert(s.token_id.to_string(), entry(s.logprob, s.rank, s.token_id));
        list.push(Value::Object(at));
    }
    Value::Array(list)
}

/// Legacy `top_logprobs` entry: the alternatives by text, the token itself listed even
/// when it is not among them.
fn top_by_text(replica: &Replica, top: &[TokenLogprob], text: &str, logprob: f32) -> Value {
    let mut by_text = Map::new();
    for a in top {
        by_text.insert(replica.token_text(a.token_id), json!(a.logprob));
    }
    by_text.entry(text.to_string()).or_insert(json!(logprob));
    Value::Object(by_text)
}

fn push(obj: &mut Value, key: &str, v: Value) {
    if let Some(a) = obj[key].as_array_mut() {
        a.push(v);
    }
}
