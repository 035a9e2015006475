//! POST /v1/responses: the Responses object and its named stream events.

use super::auth::Authed;
use super::error::ApiError;
use super::fields::Fields;
use super::format::{self, Shape};
use super::generate::{self, Generation, Output, Usage};
use super::sse::{self, Gone, Sender};
use super::{App, new_id, params, read_request, unix_now};
use crate::chat;
use crate::router::ServedModel;
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

struct ResponsesRequest {
    generation: Generation,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    stream: bool,
}

pub async fn handle(
    State(app): State<App>,
    _key: Authed,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, model) = read_request(&app, body, Some("model"))?;
    let request = parse(&body, &model)?;
    let out = generate::start(&model.replica, request.generation.clone()).await?;
    let meta = Meta { id: new_id("resp_"), message_id: new_id("msg_"), created_at: unix_now(), model, request };
    if meta.request.stream {
        return Ok(sse::respond(move |tx| async move {
            let _: Result<(), Gone> = stream(tx, out, meta).await;
        }));
    }
    let (choices, usage) = generate::gather(out, 1).await?;
    let c = choices.into_iter().next().unwrap_or_default();
    let item = meta.message(&c.text, if c.finish_reason == "length" { "incomplete" } else { "completed" });
    Ok(Json(meta.object(vec![item], Some(&usage), Some(c.finish_reason))).into_response())
}

fn parse(body: &Value, model: &ServedModel) -> Result<ResponsesRequest, ApiError> {
    let mut f = Fields::new(body)?;
    f.raw("model");
    let instructions = f.string("instructions")?.map(String::from);
    let mut messages = Vec::new();
    match f.required("input")? {
        Value::String(s) => messages.push(json!({"role": "user", "content": s})),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                match item.get("type").and_then(Value::as_str) {
                    None | Some("message") => {
                        let mut m = item.clone();
                        if let Some(o) = m.as_object_mut() {
                            o.remove("type");
                            o.remove("id");
                            o.remove("status");
                        }
                        messages.push(m);
                    }
                    Some(other) => {
                        return Err(ApiError::Unsupported {
                            param: format!("input[{i}]"),
                            message: format!("Input items of type '{other}' are not supported by this deployment yet."),
                        });
                    }
                }
            }
        }
        _ => {
            return Err(ApiError::InvalidType {
                param: "input".into(),
                expected: "a string or array",
                got: "another type",
            });
        }
    }
    // Checked on their own, so that errors name the client's own input items.
    let mut messages =
        chat::messages::for_template(&Value::Array(messages), &model.entry.capabilities, &model.entry.id)
            .map_err(|e| rename_param(e, "messages", "input"))?;
    if let Some(i) = &instructions {
        messages.insert(0, json!({"role": "system", "content": i}));
    }
    let sampling = params::sampling(&mut f, model.replica.vocab_size())?;
    let stream = f.bool("stream", false)?;
    let max_output_tokens = f.integer("max_output_tokens", Some(1), None)?;
    if f.raw("tools").is_some_and(|v| !v.as_array().is_some_and(Vec::is_empty)) {
        return Err(ApiError::Unsupported {
            param: "tools".into(),
            message: "'tools' is not supported by this deployment yet.".into(),
        });
    }
    let format = match f.raw("text") {
        None => None,
        Some(Value::Object(text)) => text.get("format"),
        Some(_) => {
            return Err(ApiError::InvalidType { param: "text".into(), expected: "an object", got: "another type" });
        }
    };
    let caps = &model.entry.capabilities;
    let grammar = format::grammar(format, Shape::Responses, caps.structured_output, &model.entry.id)?
        .map(|g| (g, Shape::Responses.param()));
    for param in ["previous_response_id", "conversation"] {
        if f.raw(param).is_some() {
            return Err(ApiError::Unsupported {
                param: param.into(),
                message: format!("'{param}' is not supported: responses are not stored."),
            });
        }
    }
    if f.bool("background", false)? {
        return Err(ApiError::Unsupported {
            param: "background".into(),
            message: "Background responses are not supported.".into(),
        });
    }
    f.ignore(&[
        "store",
        "metadata",
        "user",
        "reasoning",
        "include",
        "parallel_tool_calls",
        "tool_choice",
        "truncation",
        "top_logprobs",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "stream_options",
        "max_tool_calls",
    ]);
    f.finish()?;
    let kwargs = chat::template_kwargs(model, None);
    let (_, prompt) = chat::prompt_tokens(model, &messages, &kwargs)?;
    let max_tokens = params::max_tokens(model, prompt.len(), max_output_tokens, "input")?;
    Ok(ResponsesRequest {
        generation: Generation { prompt, sampling, max_tokens, stop: Vec::new(), n: 1, grammar },
        instructions,
        max_output_tokens,
        stream,
    })
}

/// Message checks name chat's `messages`; here the client sent `input`.
fn rename_param(e: ApiError, from: &str, to: &str) -> ApiError {
    let fix = |p: String| p.replacen(from, to, 1);
    match e {
        ApiError::InvalidValue { param, message } => ApiError::InvalidValue { param: fix(param), message },
        ApiError::MissingParam(p) => ApiError::MissingParam(fix(p)),
        ApiError::Unsupported { param, message } => ApiError::Unsupported { param: fix(param), message },
        ApiError::InvalidType { param, expected, got } => ApiError::InvalidType { param: fix(param), expected, got },
        ApiError::OutOfRange { param, code, message } => {
            ApiError::OutOfRange { param: fix(param), code, message: message.replacen(from, to, 1) }
        }
        other => other,
    }
}

struct Meta {
    id: String,
    message_id: String,
    created_at: u64,
    model: Arc<ServedModel>,
    request: ResponsesRequest,
}

impl Meta {
    fn message(&self, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" { json!([]) } else { json!([output_text(text)]) };
        json!({"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content})
    }

    /// The Response object; `finish` is None while in progress.
    fn object(&self, output: Vec<Value>, usage: Option<&Usage>, finish: Option<&str>) -> Value {
        let (status, incomplete) = match finish {
            None => ("in_progress", Value::Null),
            Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
            Some(_) => ("completed", Value::Null),
        };
        let s = &self.request.generation.sampling;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": false,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": self.request.instructions,
            "max_output_tokens": self.request.max_output_tokens,
            "max_tool_calls": null,
            "model": self.model.entry.id,
            "output": output,
            "parallel_tool_calls": true,
            "previous_response_id": null,
            "prompt_cache_key": null,
            "reasoning": {"effort": null, "summary": null},
            "safety_identifier": null,
            "service_tier": "default",
            "store": false,
            "temperature": s.temperature,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": "auto",
            "tools": [],
            "top_logprobs": 0,
            "top_p": s.top_p,
            "truncation": "disabled",
            "usage": usage.map(|u| json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            })),
            "user": null,
            "metadata": {},
            "completed_at": finish.map(|_| unix_now()),
            "frequency_penalty": s.frequency_penalty,
            "presence_penalty": s.presence_penalty,
        })
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// Named events, each with its sequence number, in the order the SDK's stream helper
/// requires; no `[DONE]`.
async fn stream(tx: Sender, mut out: Output, meta: Meta) -> Result<(), Gone> {
    let mut seq = 0u64;
    let mut send = async |name: &str, mut payload: Value| {
        payload["type"] = json!(name);
        payload["sequence_number"] = json!(seq);
        seq += 1;
        tx.named(name, &payload).await
    };
    send("response.created", json!({"response": meta.object(vec![], None, None)})).await?;
    send("response.in_progress", json!({"response": meta.object(vec![], None, None)})).await?;
    send("response.output_item.added", json!({"output_index": 0, "item": meta.message("", "in_progress")})).await?;
    let part = |text: &str| json!({"item_id": meta.message_id, "output_index": 0, "content_index": 0, "part": output_text(text)});
    send("response.content_part.added", part("")).await?;
    let mut text = String::new();
    let mut usage = Usage::default();
    let mut finish = "stop";
    loop {
        let r = match tx.unless_gone(out.next()).await? {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                let mut failed = meta.object(vec![], None, Some("stop"));
                failed["status"] = json!("failed");
                failed["completed_at"] = Value::Null;
                failed["error"] = json!({"code": "server_error", "message": e.object()["message"]});
                return send("response.failed", json!({"response": failed})).await;
            }
        };
        usage.record(&r);
        if let Some(f) = generate::finish_reason(r.finish_reason) {
            finish = f;
        }
        if !r.text.is_empty() {
            text.push_str(&r.text);
            let delta = json!({"item_id": meta.message_id, "output_index": 0, "content_index": 0, "delta": r.text, "logprobs": []});
            send("response.output_text.delta", delta).await?;
        }
    }
    let done = json!({"item_id": meta.message_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []});
    send("response.output_text.done", done).await?;
    send("response.content_part.done", part(&text)).await?;
    let status = if finish == "length" { "incomplete" } else { "completed" };
    let item = meta.message(&text, status);
    send("response.output_item.done", json!({"output_index": 0, "item": item.clone()})).await?;
    let terminal = if finish == "length" { "response.incomplete" } else { "response.completed" };
    send(terminal, json!({"response": meta.object(vec![item], Some(&usage), Some(finish))})).await
}
