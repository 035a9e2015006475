//! POST /v1/chat/completions.

use super::auth::Authed;
use super::error::ApiError;
use super::fields::Fields;
use super::format::{self, Shape};
use super::generate::{self, Generation, Output};
use super::sse::{self, Gone, Sender};
use super::{App, logprobs, new_id, params, read_request, unix_now, usage_json};
use crate::chat;
use crate::router::ServedModel;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// A validated chat request.
struct ChatRequest {
    generation: Generation,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

pub async fn handle(
    State(app): State<App>,
    _key: Authed,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, model) = read_request(&app, body, None)?;
    let request = parse(&body, &model)?;
    let out = generate::start(&model.replica, request.generation.clone()).await?;
    let meta = Meta { id: new_id("chatcmpl-"), created: unix_now(), model: model.clone() };
    if request.stream {
        return Ok(sse::respond(move |tx| async move {
            // Gone: the client left, and dropping `out` aborts the generation.
            let _: Result<(), Gone> = stream(tx, out, meta, &request).await;
        }));
    }
    let (choices, usage) = generate::gather(out, request.generation.n).await?;
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text, "refusal": null, "annotations": [], "tool_calls": []},
                "logprobs": if request.logprobs { logprobs::chat(&model.replica, &c.tokens) } else { Value::Null },
                "finish_reason": c.finish_reason,
            })
        })
        .collect();
    Ok(Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": model.entry.id,
        "choices": choices,
        "usage": usage_json(&usage),
        "system_fingerprint": null,
        "service_tier": "default",
    }))
    .into_response())
}

fn parse(body: &Value, model: &ServedModel) -> Result<ChatRequest, ApiError> {
    let mut f = Fields::new(body)?;
    f.raw("model");
    let messages = chat::messages::for_template(f.required("messages")?, &model.entry.capabilities, &model.entry.id)?;
    let mut sampling = params::sampling(&mut f, model.replica.vocab_size())?;
    let (stream, include_usage) = params::stream(&mut f)?;
    let n = params::n(&mut f)?;
    let stop = params::stop(&mut f)?;
    sampling.logprobs = params::chat_logprobs(&mut f)?;
    let logprobs = sampling.logprobs.is_some();
    let max_tokens = f.integer("max_tokens", Some(1), None)?;
    let max_completion_tokens = f.integer("max_completion_tokens", Some(1), None)?;
    if max_tokens.is_some() && max_completion_tokens.is_some() {
        return Err(ApiError::Combination {
            param: "max_tokens".into(),
            message: "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported.".into(),
        });
    }
    let kwargs = match f.raw("chat_template_kwargs") {
        None => None,
        Some(Value::Object(o)) => Some(o),
        Some(_) => {
            return Err(ApiError::InvalidType {
                param: "chat_template_kwargs".into(),
                expected: "an object",
                got: "another type",
            });
        }
    };
    let mut kwargs = chat::template_kwargs(model, kwargs);
    if let Some(effort) = f.string("reasoning_effort")? {
        const EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "max"];
        if !EFFORTS.contains(&effort) {
            return Err(ApiError::invalid_value(
                "reasoning_effort",
                format!(
                    "Invalid value: '{effort}'. Supported values are: 'none', 'minimal', 'low', 'medium', 'high' and 'max'."
                ),
            ));
        }
        kwargs.insert("reasoning_effort".into(), json!(effort));
    }
    unsupported_until_tools(&mut f)?;
    let caps = &model.entry.capabilities;
    let grammar = format::grammar(f.raw("response_format"), Shape::Chat, caps.structured_output, &model.entry.id)?
        .map(|g| (g, Shape::Chat.param()));
    f.ignore(&["user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"]);
    f.finish()?;

    let (_, prompt) = chat::prompt_tokens(model, &messages, &kwargs)?;
    let max_tokens = params::max_tokens(model, prompt.len(), max_tokens.or(max_completion_tokens), "messages")?;
    Ok(ChatRequest {
        generation: Generation { prompt, sampling, max_tokens, stop, n, grammar },
        stream,
        include_usage,
        logprobs,
    })
}

/// Tools are parsed from the output and forced through grammars, which lands with the
/// rest of the structured-output issue; until then they are refused, not ignored.
fn unsupported_until_tools<'a>(f: &mut Fields<'a>) -> Result<(), ApiError> {
    let unsupported = |param: &str| ApiError::Unsupported {
        param: param.into(),
        message: format!("'{param}' is not supported by this deployment yet."),
    };
    for param in ["tools", "functions"] {
        if f.raw(param).is_some_and(|v| !v.as_array().is_some_and(Vec::is_empty)) {
            return Err(unsupported(param));
        }
    }
    if f.raw("function_call").is_some() {
        return Err(unsupported("function_call"));
    }
    if f.raw("tool_choice").is_some_and(|v| v != "none" && v != "auto") {
        return Err(unsupported("tool_choice"));
    }
    if f.raw("parallel_tool_calls").is_some() && !f.present("tools") {
        return Err(ApiError::invalid_value(
            "parallel_tool_calls",
            "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when 'tools' are specified.",
        ));
    }
    Ok(())
}

/// What every chunk of one response repeats.
struct Meta {
    id: String,
    created: u64,
    model: Arc<ServedModel>,
}

impl Meta {
    fn chunk(&self, choices: Value, include_usage: bool) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model.entry.id,
            "system_fingerprint": null,
            "service_tier": "default",
            "choices": choices,
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

async fn stream(tx: Sender, mut out: Output, meta: Meta, request: &ChatRequest) -> Result<(), Gone> {
    let usage_key = request.include_usage;
    let role_logprobs = if request.logprobs { json!({"content": [], "refusal": null}) } else { Value::Null };
    for index in 0..request.generation.n {
        let delta = json!({"role": "assistant", "content": "", "refusal": null});
        let choice = json!([{"index": index, "delta": delta, "logprobs": role_logprobs, "finish_reason": null}]);
        tx.data(&meta.chunk(choice, usage_key)).await?;
    }
    let mut usage = generate::Usage::default();
    loop {
        let r = match tx.unless_gone(out.next()).await? {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                // After the stream has started an error travels in it, then [DONE].
                tx.data(&e.body()).await?;
                return tx.done().await;
            }
        };
        usage.record(&r);
        if !r.text.is_empty() || (request.logprobs && !r.tokens.is_empty()) {
            let lp = if request.logprobs { logprobs::chat(&meta.model.replica, &r.tokens) } else { Value::Null };
            let choice =
                json!([{"index": r.index, "delta": {"content": r.text}, "logprobs": lp, "finish_reason": null}]);
            tx.data(&meta.chunk(choice, usage_key)).await?;
        }
        if let Some(reason) = generate::finish_reason(r.finish_reason) {
            let choice = json!([{"index": r.index, "delta": {}, "logprobs": null, "finish_reason": reason}]);
            tx.data(&meta.chunk(choice, usage_key)).await?;
        }
    }
    if request.include_usage {
        let mut last = meta.chunk(json!([]), true);
        last["usage"] = usage_json(&usage);
        tx.data(&last).await?;
    }
    tx.done().await
}
