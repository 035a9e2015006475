//! Log probabilities in the two shapes the API has: chat's list of token objects and
//! legacy completions' four parallel arrays.

use crate::router::Replica;
use serde_json::{Map, Value, json};
use tessera_proto::worker::GeneratedToken;

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
        let mut top = Map::new();
        for a in &t.top_logprobs {
            top.insert(replica.token_text(a.token_id), json!(a.logprob));
        }
        // The sampled token is listed even when it is not among the top alternatives.
        top.entry(text.clone()).or_insert(json!(t.logprob.unwrap_or(0.0)));
        push(&mut out, "tokens", json!(text));
        push(&mut out, "token_logprobs", json!(t.logprob.unwrap_or(0.0)));
        push(&mut out, "top_logprobs", Value::Object(top));
        push(&mut out, "text_offset", json!(*offset));
        *offset += text.chars().count();
    }
    out
}

fn push(obj: &mut Value, key: &str, v: Value) {
    if let Some(a) = obj[key].as_array_mut() {
        a.push(v);
    }
}
