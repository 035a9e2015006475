//! POST /v1/chat/completions.

use super::auth::Authed;
use super::error::ApiError;
use super::fields::Fields;
use super::format::{self, Shape};
use super::generate::{self, Generation};
use super::sse::{self, Gone, Sender};
use super::stream::{self, Event, Events, FinishReason};
use super::{App, RequestId, logprobs, new_id, params, read_request, unix_now, usage_json};
use crate::billing::{Ask, Meter};
use crate::chat;
use crate::chat::output::{Piece, Reading, Split};
use crate::chat::tools::ToolChoice;
use crate::images::Visual;
use crate::router::ServedModel;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// A validated chat request.
struct ChatRequest {
    generation: Generation,
    reading: Reading,
    /// A named `tool_choice`: its call ends the reply with `stop`, as OpenAI's does.
    named_tool: bool,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    /// Video frames kept of those sent, where there was video.
    frames: Option<(usize, usize)>,
}

impl ChatRequest {
    /// vLLM's `prompt_logprobs` was asked for.
    fn scores_prompt(&self) -> bool {
        self.generation.prompt_logprobs.is_some()
    }
}

pub async fn handle(
    State(app): State<App>,
    Authed(key): Authed,
    Extension(request_id): Extension<RequestId>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, model) = read_request(&app, &request_id, body, None)?;
    let visuals = super::visuals(&app, &model, &body["messages"], "messages").await?;
    let mut request = parse(&body, &model, &visuals)?;
    request.generation.weight = app.weights.of(&key.org_id).await;
    let frames = request.frames;
    let g = &request.generation;
    let ask = Ask {
        request_id: &request_id.id,
        client_request_id: request_id.client.as_deref(),
        endpoint: "chat.completions",
        prompts: &[g.prompt.len()],
        max_completion_each: g.max_tokens as u64 * g.n as u64,
    };
    let meter = app.billing.admit(&key, &model, ask).await?;
    super::trace::admitted("chat.completions", &model.entry.id, &meter.org_id(), g);
    let probe = app.status.probe(&model.entry.id, "chat.completions", request_id.received);
    let out = generate::start(&model.pool, g.clone(), &meter, 0, probe).await?;
    let events = Events::new(out, g.n, &request.reading);
    let meta = Meta { id: new_id("chatcmpl-"), created: unix_now(), model: model.clone() };
    super::trace::responding(&meta.id);
    if request.stream {
        let response = sse::respond(move |tx| async move {
            // Gone: the client left; dropping `out` aborts the generation, and dropping
            // the meter settles what it used.
            let _: Result<(), Gone> = stream(tx, events, meta, &request, meter).await;
        });
        return Ok(super::with_frames(response, frames));
    }
    let (choices, usage) = stream::gather(events).await?;
    let scores = choices.first().map(|c| c.prompt_scores.clone()).unwrap_or_default();
    let first = choices.first().map(|c| finish_reason(c.finish_reason, c.split.calls.len(), request.named_tool));
    meter.finish(first.unwrap_or("stop"), usage.reasoning_tokens);
    super::trace::finished(first.unwrap_or("stop"), &usage);
    meter.settle().await;
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "message": message(&c.split),
                "logprobs": if request.logprobs { logprobs::chat(&model.replica, &c.tokens) } else { Value::Null },
                "finish_reason": finish_reason(c.finish_reason, c.split.calls.len(), request.named_tool),
            })
        })
        .collect();
    let mut reply = json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": model.entry.id,
        "choices": choices,
        "usage": usage_json(&usage),
        "system_fingerprint": null,
        "service_tier": "default",
    });
    if request.scores_prompt() {
        reply["prompt_logprobs"] = logprobs::vllm_prompt(&model.replica, &scores);
    }
    Ok(super::with_frames(Json(reply).into_response(), frames))
}

fn parse(body: &Value, model: &ServedModel, visuals: &[Visual]) -> Result<ChatRequest, ApiError> {
    let mut f = Fields::new(body)?;
    f.raw("model");
    let messages = super::messages::for_model(model, f.required("messages")?)?;
    let mut sampling = params::sampling(&mut f, model.replica.vocab_size())?;
    let (stream, include_usage) = params::stream(&mut f)?;
    let n = params::n(&mut f)?;
    let stop = params::stop(&mut f)?;
    let extensions = params::extensions(&mut f, model.replica.vocab_size())?;
    sampling.logprobs = params::chat_logprobs(&mut f)?;
    let prompt_logprobs = params::prompt_logprobs(&mut f)?;
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
            return Err(ApiError::invalid_type("chat_template_kwargs", "an object"));
        }
    };
    let budget = params::thinking_budget(&mut f, kwargs)?;
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
    let caps = &model.entry.capabilities;
    let tools = super::tools::parse(&mut f, Shape::Chat, caps.tool_calling, &model.entry.id)?;
    // The deprecated single-function API: refused, not ignored.
    for param in ["functions", "function_call"] {
        if f.raw(param).is_some() {
            return Err(ApiError::Unsupported {
                param: param.into(),
                message: format!("'{param}' is deprecated and not supported; use 'tools' and 'tool_choice'."),
            });
        }
    }
    let format = format::grammar(f.raw("response_format"), Shape::Chat, caps.structured_output, &model.entry.id)?
        .map(|g| (g, Shape::Chat.param()));
    // A top-level `thinking` object is ignored (docs/api.md, Reasoning): the
    // switches live in `chat_template_kwargs`.
    f.ignore(&["user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "thinking"]);
    f.finish()?;

    let room = max_tokens.or(max_completion_tokens).map_or(1, |m| m.max(1) as usize);
    let shown = chat::Shown { visuals, room, param: "messages" };
    let prepared = chat::prepare(model, &messages, tools.as_ref(), &kwargs, format, shown)?;
    let max_param = if max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens =
        params::max_tokens(model, prepared.prompt.len(), max_tokens.or(max_completion_tokens), "messages")?;
    params::check_min_tokens(&extensions, max_tokens, max_param)?;
    let thinking = chat::budget::for_worker(model, &prepared, budget, max_tokens, max_param)?;
    Ok(ChatRequest {
        generation: Generation {
            prompt: prepared.prompt,
            sampling,
            max_tokens,
            stop,
            n,
            grammar: prepared.grammar,
            prompt_param: "messages",
            thinking,
            prompt_logprobs,
            extensions,
            images: prepared.images,
            image_spans: prepared.image_spans,
            weight: crate::weights::DEFAULT_WEIGHT,
        },
        frames: prepared.frames,
        reading: prepared.reading,
        named_tool: tools.is_some_and(|t| matches!(t.choice, ToolChoice::Named(_))),
        stream,
        include_usage,
        logprobs,
    })
}

/// A whole reply's message: reasoning only when there was some, content null when
/// the model only called tools.
fn message(split: &Split) -> Value {
    let calls: Vec<Value> = split
        .calls
        .iter()
        .map(|(name, arguments)| {
            json!({"id": new_id("call_"), "type": "function", "function": {"name": name, "arguments": arguments}})
        })
        .collect();
    let content = if !calls.is_empty() && split.content.trim().is_empty() { Value::Null } else { json!(split.content) };
    let mut m =
        json!({"role": "assistant", "content": content, "refusal": null, "annotations": [], "tool_calls": calls});
    if !split.reasoning.is_empty() {
        m["reasoning"] = json!(split.reasoning);
    }
    m
}

/// `tool_calls` when the model called tools of its own choice; a forced named call
/// ends with `stop`, as OpenAI's does.
fn finish_reason(reason: FinishReason, calls: usize, named_tool: bool) -> &'static str {
    if reason == FinishReason::Stop && calls > 0 && !named_tool { "tool_calls" } else { reason.as_str() }
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

/// Adds text to a delta's string field.
fn append(delta: &mut serde_json::Map<String, Value>, field: &str, text: &str) {
    match delta.get_mut(field) {
        Some(Value::String(s)) => s.push_str(text),
        _ => {
            delta.insert(field.into(), json!(text));
        }
    }
}

async fn stream(tx: Sender, mut events: Events, meta: Meta, request: &ChatRequest, meter: Meter) -> Result<(), Gone> {
    let usage_key = request.include_usage;
    let role_logprobs = if request.logprobs { json!({"content": [], "refusal": null}) } else { Value::Null };
    for index in 0..request.generation.n {
        let delta = json!({"role": "assistant", "content": "", "refusal": null});
        let choice = json!([{"index": index, "delta": delta, "logprobs": role_logprobs, "finish_reason": null}]);
        tx.data(&meta.chunk(choice, usage_key)).await?;
    }
    // Calls made so far, per choice (`Events` checked the index).
    let mut calls = vec![0usize; events.n()];
    let mut last_reason = "stop";
    loop {
        let event = match tx.unless_gone(events.next()).await? {
            Ok(Some(e)) => e,
            Ok(None) => break,
            // After the stream has started an error travels in it, then [DONE].
            Err(e) => return tx.fail(&e).await,
        };
        match event {
            // The prompt's scores, before its first token: a chunk of their own.
            Event::PromptScores(scores) if request.scores_prompt() => {
                let mut c = meta.chunk(json!([]), usage_key);
                c["prompt_logprobs"] = logprobs::vllm_prompt(&meta.model.replica, &scores);
                tx.data(&c).await?;
            }
            Event::PromptScores(_) => {}
            // Reasoning and content of this delta in one chunk (with its tokens' logprobs),
            // then each call it completed: id, type and name first, arguments after.
            Event::Delta { index, pieces, tokens, .. } => {
                let mut delta = serde_json::Map::new();
                let mut call_deltas = Vec::new();
                for piece in pieces {
                    match piece {
                        Piece::Reasoning(t) => append(&mut delta, "reasoning", &t),
                        Piece::Content(t) => append(&mut delta, "content", &t),
                        Piece::ToolCall { name, arguments } => {
                            let i = calls[index];
                            calls[index] += 1;
                            call_deltas.push(json!([{"index": i, "id": new_id("call_"), "type": "function",
                                                     "function": {"name": name, "arguments": ""}}]));
                            call_deltas.push(json!([{"index": i, "function": {"arguments": arguments}}]));
                        }
                    }
                }
                if !delta.is_empty() || (request.logprobs && !tokens.is_empty()) {
                    let lp = if request.logprobs { logprobs::chat(&meta.model.replica, &tokens) } else { Value::Null };
                    let choice = json!([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": null}]);
                    tx.data(&meta.chunk(choice, usage_key)).await?;
                }
                for tool_calls in call_deltas {
                    let choice = json!([{"index": index, "delta": {"tool_calls": tool_calls}, "logprobs": null,
                                         "finish_reason": null}]);
                    tx.data(&meta.chunk(choice, usage_key)).await?;
                }
            }
            Event::Finished { index, reason } => {
                let reason = finish_reason(reason, calls[index], request.named_tool);
                last_reason = reason;
                let choice = json!([{"index": index, "delta": {}, "logprobs": null, "finish_reason": reason}]);
                tx.data(&meta.chunk(choice, usage_key)).await?;
            }
        }
    }
    let usage = events.usage();
    // The bill is final before the client hears the end.
    meter.finish(last_reason, usage.reasoning_tokens);
    super::trace::finished(last_reason, &usage);
    meter.settle().await;
    if request.include_usage {
        let mut last = meta.chunk(json!([]), true);
        last["usage"] = usage_json(&usage);
        tx.data(&last).await?;
    }
    tx.done().await
}
