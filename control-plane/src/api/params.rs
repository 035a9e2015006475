//! Parameters the generation endpoints share, with OpenAI's defaults and ranges.

use super::error::ApiError;
use super::fields::{Fields, check_range};
use crate::router::ServedModel;
use serde_json::{Map, Value};
use tessera_proto::worker::{self as pb};

/// Sampling controls common to chat, completions and responses.
pub fn sampling<'a>(f: &mut Fields<'a>, vocab: u32) -> Result<pb::SamplingParams, ApiError> {
    let temperature = f.decimal("temperature", Some(0.0), Some(2.0))?.unwrap_or(1.0);
    let top_p = f.decimal("top_p", Some(0.0), Some(1.0))?.unwrap_or(1.0);
    if top_p as f32 == 0.0 {
        return Err(ApiError::OutOfRange {
            param: "top_p".into(),
            code: "decimal_below_min_value",
            message: "Invalid 'top_p': decimal below minimum value. Expected a value > 0, but got 0 instead.".into(),
        });
    }
    let top_k = f.integer("top_k", Some(-1), Some(i32::MAX as i64))?.unwrap_or(-1);
    let min_p = f.decimal("min_p", Some(0.0), Some(1.0))?.unwrap_or(0.0);
    let frequency_penalty = f.decimal("frequency_penalty", Some(-2.0), Some(2.0))?.unwrap_or(0.0);
    let presence_penalty = f.decimal("presence_penalty", Some(-2.0), Some(2.0))?.unwrap_or(0.0);
    let repetition_penalty = f.decimal("repetition_penalty", None, Some(2.0))?.unwrap_or(1.0);
    if repetition_penalty as f32 <= 0.0 {
        return Err(ApiError::OutOfRange {
            param: "repetition_penalty".into(),
            code: "decimal_below_min_value",
            message: format!(
                "Invalid 'repetition_penalty': decimal below minimum value. Expected a value > 0, but got {repetition_penalty} instead."
            ),
        });
    }
    let seed = f.integer("seed", Some(i64::MIN), Some(i64::MAX))?.map(|s| s as u64);
    Ok(pb::SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k: if top_k == 0 { -1 } else { top_k as i32 },
        min_p: min_p as f32,
        frequency_penalty: frequency_penalty as f32,
        presence_penalty: presence_penalty as f32,
        repetition_penalty: repetition_penalty as f32,
        logit_bias: logit_bias(f, vocab)?,
        seed,
        logprobs: None,
    })
}

/// `logit_bias`: token id (as a string key) → bias in [-100, 100], ids in the vocabulary.
fn logit_bias<'a>(f: &mut Fields<'a>, vocab: u32) -> Result<std::collections::HashMap<u32, f32>, ApiError> {
    let Some(v) = f.raw("logit_bias") else { return Ok(Default::default()) };
    let Value::Object(map) = v else {
        return Err(ApiError::invalid_type("logit_bias", "an object"));
    };
    let mut out = std::collections::HashMap::new();
    for (key, bias) in map {
        let param = format!("logit_bias.{key}");
        let id: u32 = key.parse().map_err(|_| {
            ApiError::invalid_value("logit_bias", format!("Invalid key in 'logit_bias': {key:?} is not a token id."))
        })?;
        if id >= vocab {
            return Err(ApiError::invalid_value(
                "logit_bias",
                format!("Invalid key in 'logit_bias': token id {id} is outside the vocabulary of {vocab} tokens."),
            ));
        }
        let b = bias.as_f64().ok_or(ApiError::invalid_type(param.clone(), "a number"))?;
        check_range(&param, b, Some(-100.0), Some(100.0), false)?;
        out.insert(id, b as f32);
    }
    Ok(out)
}

/// `stop`: a string or up to 4 strings.
pub fn stop<'a>(f: &mut Fields<'a>) -> Result<Vec<String>, ApiError> {
    let stops = match f.raw("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str().map(String::from).ok_or_else(|| ApiError::invalid_type(format!("stop[{i}]"), "a string"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid_type("stop", "a string or array"));
        }
    };
    if stops.len() > 4 {
        return Err(ApiError::OutOfRange {
            param: "stop".into(),
            code: "array_above_max_length",
            message: format!(
                "Invalid 'stop': array too long. Expected an array with maximum length 4, but got an array with length {} instead.",
                stops.len()
            ),
        });
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid_value("stop", "Invalid 'stop': stop sequences must not be empty."));
    }
    Ok(stops)
}

/// vLLM's sampling extensions, which its benchmark clients (and NVIDIA's) send.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Extensions {
    /// Keep generating past the end-of-sequence token (fixed output lengths).
    pub ignore_eos: bool,
    /// End tokens and stop strings take effect only after this many tokens.
    pub min_tokens: u32,
    /// More tokens that end the output, like end-of-sequence.
    pub stop_token_ids: Vec<u32>,
    /// A matched stop string stays at the end of the text.
    pub include_stop_str_in_output: bool,
    /// Special tokens' text is left out of the output (the default).
    pub skip_special_tokens: bool,
    /// Lower runs sooner among the organization's own requests (`priority`).
    pub priority: i32,
}

/// `ignore_eos`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`,
/// `skip_special_tokens` and `spaces_between_special_tokens`, typed and bounded as
/// strictly as OpenAI's own parameters. `spaces_between_special_tokens` is read and
/// has no effect: it changes only what vLLM's slow (Python) tokenizers join, and every
/// tokenizer here is a fast one.
pub fn extensions<'a>(f: &mut Fields<'a>, vocab: u32) -> Result<Extensions, ApiError> {
    let ignore_eos = f.bool("ignore_eos", false)?;
    let min_tokens = f.integer("min_tokens", Some(0), Some(u32::MAX as i64))?.unwrap_or(0) as u32;
    let stop_token_ids = match f.raw("stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let param = format!("stop_token_ids[{i}]");
                let id = v
                    .as_i64()
                    .filter(|_| v.is_i64() || v.is_u64())
                    .ok_or_else(|| ApiError::invalid_type(param.clone(), "an integer"))?;
                if !(0..vocab as i64).contains(&id) {
                    return Err(ApiError::invalid_value(
                        param,
                        format!("Invalid 'stop_token_ids': token id {id} is outside the vocabulary of {vocab} tokens."),
                    ));
                }
                Ok(id as u32)
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid_type("stop_token_ids", "an array")),
    };
    let include_stop_str_in_output = f.bool("include_stop_str_in_output", false)?;
    let skip_special_tokens = f.bool("skip_special_tokens", true)?;
    f.bool("spaces_between_special_tokens", true)?;
    let priority = priority(f)?;
    Ok(Extensions { ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens, priority })
}

/// vLLM's `priority`: lower is sooner, default 0, a 32-bit integer. It orders a
/// replica's queue among the requests of the caller's own organization only; between
/// organizations their weights decide (fair sharing), so no one jumps ahead of another
/// organization by asking.
pub fn priority<'a>(f: &mut Fields<'a>) -> Result<i32, ApiError> {
    Ok(f.integer("priority", Some(i32::MIN as i64), Some(i32::MAX as i64))?.unwrap_or(0) as i32)
}

/// `min_tokens` no larger than the completion's budget, as vLLM requires.
pub fn check_min_tokens(ext: &Extensions, max_tokens: u32, max_param: &str) -> Result<(), ApiError> {
    if ext.min_tokens > max_tokens {
        return Err(ApiError::invalid_value(
            "min_tokens",
            format!(
                "Invalid 'min_tokens': {} is more than '{max_param}' ({max_tokens}); it must be less than or equal to it.",
                ext.min_tokens
            ),
        ));
    }
    Ok(())
}

/// `stream` and `stream_options.include_usage`.
pub fn stream<'a>(f: &mut Fields<'a>) -> Result<(bool, bool), ApiError> {
    let stream = f.bool("stream", false)?;
    let include_usage = match f.raw("stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid_value(
                "stream_options",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            ));
        }
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::invalid_type("stream_options.include_usage", "a boolean"));
            }
        },
        Some(_) => {
            return Err(ApiError::invalid_type("stream_options", "an object"));
        }
    };
    Ok((stream, include_usage))
}

/// Chat's `logprobs` and `top_logprobs` (0–20, only with `logprobs`): the number of
/// alternatives to return per token, None when log probabilities are off.
pub fn chat_logprobs<'a>(f: &mut Fields<'a>) -> Result<Option<u32>, ApiError> {
    let on = f.bool("logprobs", false)?;
    let top = f.integer("top_logprobs", Some(0), Some(20))?;
    if top.is_some() && !on {
        return Err(ApiError::invalid_value(
            "top_logprobs",
            "The 'top_logprobs' parameter is only allowed when 'logprobs' is enabled.",
        ));
    }
    Ok(on.then(|| top.unwrap_or(0) as u32))
}

/// Legacy completions' `logprobs`: up to 5 alternatives per token.
pub fn legacy_logprobs<'a>(f: &mut Fields<'a>) -> Result<Option<u32>, ApiError> {
    Ok(f.integer("logprobs", Some(0), Some(5))?.map(|k| k as u32))
}

/// vLLM's `prompt_logprobs`: score the prompt's tokens, with this many alternatives.
pub fn prompt_logprobs<'a>(f: &mut Fields<'a>) -> Result<Option<u32>, ApiError> {
    Ok(f.integer("prompt_logprobs", Some(0), Some(20))?.map(|k| k as u32))
}

/// `n`: completions per prompt.
pub fn n<'a>(f: &mut Fields<'a>) -> Result<u32, ApiError> {
    Ok(f.integer("n", Some(1), Some(128))?.unwrap_or(1) as u32)
}

/// The completion budget: what was asked for, or the rest of the context; refused
/// when prompt and completion do not fit.
pub fn max_tokens(
    model: &ServedModel,
    prompt_tokens: usize,
    asked: Option<i64>,
    param: &'static str,
) -> Result<u32, ApiError> {
    let context = model.context_length() as usize;
    let asked = asked.map(|a| a.max(0) as usize);
    let needed = prompt_tokens + asked.unwrap_or(1);
    if needed > context {
        let message = match asked {
            Some(a) => format!(
                "This model's maximum context length is {context} tokens. However, you requested {needed} tokens \
                 ({prompt_tokens} in the messages, {a} in the completion). Please reduce the length of the messages \
                 or completion."
            ),
            None => format!(
                "This model's maximum context length is {context} tokens. However, your messages resulted in \
                 {prompt_tokens} tokens. Please reduce the length of the messages."
            ),
        };
        return Err(ApiError::ContextLength { param, message });
    }
    Ok(asked.unwrap_or(context - prompt_tokens) as u32)
}

/// The budget a request names; None when it names none or `-1` (the model's default).
pub fn thinking_budget<'a>(f: &mut Fields<'a>, kwargs: Option<&Map<String, Value>>) -> Result<Option<u32>, ApiError> {
    let mut named: Option<(String, i64)> = None;
    let top = [
        ("thinking_token_budget", f.integer("thinking_token_budget", Some(-1), None)?),
        ("thinking_budget", f.integer("thinking_budget", Some(-1), None)?),
    ];
    let in_kwargs = match kwargs.and_then(|k| k.get("thinking_budget")) {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(b) if b >= -1 => Some(b),
            _ => {
                return Err(ApiError::invalid_value(
                    "chat_template_kwargs.thinking_budget",
                    format!(
                        "Invalid value: {v}. The thinking budget is a number of tokens, or -1 for the model's default."
                    ),
                ));
            }
        },
    };
    for (param, value) in top.into_iter().chain([("chat_template_kwargs.thinking_budget", in_kwargs)]) {
        let Some(value) = value else { continue };
        match &named {
            Some((first, v)) if *v != value => {
                return Err(ApiError::Combination {
                    param: param.into(),
                    message: format!("'{param}' ({value}) and '{first}' ({v}) name different thinking budgets."),
                });
            }
            _ => named = Some((param.into(), value)),
        }
    }
    Ok(named.and_then(|(_, v)| u32::try_from(v).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> Result<pb::SamplingParams, ApiError> {
        let mut f = Fields::new(&body).unwrap();
        sampling(&mut f, 1000)
    }

    fn code(e: ApiError) -> String {
        e.body()["error"]["code"].as_str().unwrap_or("null").to_string()
    }

    #[test]
    fn defaults_follow_the_spec() {
        let s = parse(json!({})).unwrap();
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (1.0, 1.0, -1, 0.0));
        assert_eq!((s.frequency_penalty, s.presence_penalty, s.repetition_penalty), (0.0, 0.0, 1.0));
        assert!(s.logit_bias.is_empty() && s.seed.is_none());
    }

    #[test]
    fn every_range_of_the_spec_is_enforced_at_both_ends() {
        let cases = [
            (json!({"temperature": -0.1}), "decimal_below_min_value"),
            (json!({"temperature": 2.01}), "decimal_above_max_value"),
            (json!({"top_p": 1.5}), "decimal_above_max_value"),
            (json!({"top_p": 0}), "decimal_below_min_value"),
            (json!({"top_k": -2}), "integer_below_min_value"),
            (json!({"min_p": 1.1}), "decimal_above_max_value"),
            (json!({"frequency_penalty": -2.5}), "decimal_below_min_value"),
            (json!({"frequency_penalty": 2.5}), "decimal_above_max_value"),
            (json!({"presence_penalty": -2.5}), "decimal_below_min_value"),
            (json!({"presence_penalty": 2.5}), "decimal_above_max_value"),
            (json!({"repetition_penalty": 0}), "decimal_below_min_value"),
            (json!({"logit_bias": {"5": 101}}), "decimal_above_max_value"),
            (json!({"logit_bias": {"5": -101}}), "decimal_below_min_value"),
            (json!({"logit_bias": {"1000": 1}}), "invalid_value"),
            (json!({"logit_bias": {"x": 1}}), "invalid_value"),
            (json!({"temperature": "hot"}), "invalid_type"),
        ];
        for (body, want) in cases {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!(code(e), want, "{body}");
        }
        // The bounds themselves are accepted.
        let s = parse(json!({"temperature": 2, "top_p": 1, "frequency_penalty": -2, "presence_penalty": 2,
            "logit_bias": {"999": -100, "0": 100}, "top_k": -1, "min_p": 1}))
        .unwrap();
        assert_eq!(s.logit_bias[&999], -100.0);
        assert_eq!(parse(json!({"top_k": 0})).unwrap().top_k, -1, "0 also disables top_k");
    }

    #[test]
    fn vllm_extensions_are_read_typed_and_bounded() {
        let read = |body: Value| {
            let mut f = Fields::new(&body).unwrap();
            let ext = extensions(&mut f, 1000);
            ext.and_then(|e| f.finish().map(|_| e))
        };
        let all = read(json!({"ignore_eos": true, "min_tokens": 4, "stop_token_ids": [2, 999],
            "include_stop_str_in_output": true, "skip_special_tokens": false, "spaces_between_special_tokens": false,
            "priority": -5}))
        .unwrap();
        assert_eq!(
            all,
            Extensions {
                ignore_eos: true,
                min_tokens: 4,
                stop_token_ids: vec![2, 999],
                include_stop_str_in_output: true,
                skip_special_tokens: false,
                priority: -5,
            }
        );
        assert_eq!(read(json!({})).unwrap(), Extensions { skip_special_tokens: true, ..Extensions::default() });
        let refused = |body: Value| read(body).unwrap_err().body()["error"]["param"].as_str().unwrap_or("").to_string();
        assert_eq!(refused(json!({"ignore_eos": "yes"})), "ignore_eos");
        assert_eq!(refused(json!({"min_tokens": -1})), "min_tokens");
        assert_eq!(refused(json!({"min_tokens": 1.5})), "min_tokens");
        assert_eq!(refused(json!({"stop_token_ids": 5})), "stop_token_ids");
        assert_eq!(refused(json!({"stop_token_ids": [1, 1000]})), "stop_token_ids[1]");
        assert_eq!(refused(json!({"stop_token_ids": [-1]})), "stop_token_ids[0]");
        assert_eq!(refused(json!({"stop_token_ids": ["7"]})), "stop_token_ids[0]");
        assert_eq!(refused(json!({"skip_special_tokens": 0})), "skip_special_tokens");
        assert_eq!(refused(json!({"spaces_between_special_tokens": "no"})), "spaces_between_special_tokens");
        assert_eq!(refused(json!({"priority": 1.5})), "priority");
        assert_eq!(refused(json!({"priority": "high"})), "priority");
        assert_eq!(refused(json!({"priority": 2_147_483_648u64})), "priority");
        assert_eq!(refused(json!({"priority": -2_147_483_649i64})), "priority");
        assert_eq!(read(json!({"priority": i32::MIN})).unwrap().priority, i32::MIN);
        let four = Extensions { min_tokens: 4, ..Extensions::default() };
        assert!(check_min_tokens(&four, 4, "max_tokens").is_ok());
        let e = check_min_tokens(&four, 3, "max_completion_tokens").unwrap_err();
        assert_eq!(e.body()["error"]["param"], "min_tokens");
        assert!(e.body()["error"]["message"].as_str().unwrap().contains("max_completion_tokens"));
    }

    #[test]
    fn stop_takes_a_string_or_up_to_four() {
        let one = |b: Value| stop(&mut Fields::new(&b).unwrap());
        assert_eq!(one(json!({"stop": "x"})).unwrap(), ["x"]);
        assert_eq!(one(json!({"stop": ["a", "b", "c", "d"]})).unwrap().len(), 4);
        assert_eq!(code(one(json!({"stop": ["a", "b", "c", "d", "e"]})).unwrap_err()), "array_above_max_length");
        assert_eq!(code(one(json!({"stop": [1]})).unwrap_err()), "invalid_type");
        assert_eq!(code(one(json!({"stop": [""]})).unwrap_err()), "invalid_value");
    }

    #[test]
    fn logprobs_ranges_of_both_shapes() {
        let chat = |b: Value| chat_logprobs(&mut Fields::new(&b).unwrap());
        assert_eq!(chat(json!({})).unwrap(), None);
        assert_eq!(chat(json!({"logprobs": true})).unwrap(), Some(0));
        assert_eq!(chat(json!({"logprobs": true, "top_logprobs": 20})).unwrap(), Some(20));
        assert_eq!(code(chat(json!({"logprobs": true, "top_logprobs": 21})).unwrap_err()), "integer_above_max_value");
        assert_eq!(code(chat(json!({"logprobs": true, "top_logprobs": -1})).unwrap_err()), "integer_below_min_value");
        let e = chat(json!({"top_logprobs": 2})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "top_logprobs");
        let legacy = |b: Value| legacy_logprobs(&mut Fields::new(&b).unwrap());
        assert_eq!(legacy(json!({"logprobs": 5})).unwrap(), Some(5));
        assert_eq!(legacy(json!({"logprobs": 0})).unwrap(), Some(0));
        assert_eq!(code(legacy(json!({"logprobs": 6})).unwrap_err()), "integer_above_max_value");
    }

    #[test]
    fn stream_options_need_stream_and_n_has_bounds() {
        let s = |b: Value| stream(&mut Fields::new(&b).unwrap());
        assert_eq!(s(json!({"stream": true, "stream_options": {"include_usage": true}})).unwrap(), (true, true));
        let e = s(json!({"stream_options": {"include_usage": true}})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "stream_options");
        let count = |b: Value| n(&mut Fields::new(&b).unwrap());
        assert_eq!(count(json!({})).unwrap(), 1);
        assert_eq!(code(count(json!({"n": 0})).unwrap_err()), "integer_below_min_value");
        assert_eq!(code(count(json!({"n": 129})).unwrap_err()), "integer_above_max_value");
    }

    fn budget(body: Value) -> Result<Option<u32>, ApiError> {
        let mut f = Fields::new(&body).unwrap();
        let kwargs = body.get("chat_template_kwargs").and_then(Value::as_object).cloned();
        f.raw("chat_template_kwargs");
        let r = thinking_budget(&mut f, kwargs.as_ref());
        f.finish()?;
        r
    }

    #[test]
    fn each_name_of_the_budget_is_read_and_minus_one_is_the_default() {
        assert_eq!(budget(json!({})).unwrap(), None);
        assert_eq!(budget(json!({"thinking_token_budget": 64})).unwrap(), Some(64));
        assert_eq!(budget(json!({"thinking_budget": 0})).unwrap(), Some(0));
        assert_eq!(budget(json!({"chat_template_kwargs": {"thinking_budget": 12}})).unwrap(), Some(12));
        assert_eq!(budget(json!({"thinking_budget": -1})).unwrap(), None);
        assert_eq!(budget(json!({"thinking_budget": 5, "thinking_token_budget": 5})).unwrap(), Some(5));
        let e = budget(json!({"thinking_budget": 5, "thinking_token_budget": 6})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "thinking_budget", "{:?}", e.body());
        let e = budget(json!({"thinking_budget": -2})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "thinking_budget");
        let e = budget(json!({"chat_template_kwargs": {"thinking_budget": "lots"}})).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "chat_template_kwargs.thinking_budget");
    }
}
