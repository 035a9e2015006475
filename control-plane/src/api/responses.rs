//! POST /v1/responses: the Responses object and its named stream events.

use super::auth::Authed;
use super::error::ApiError;
use super::fields::Fields;
use super::format::{self, Shape};
use super::generate::{self, Generation};
use super::sse::{self, Gone, Sender};
use super::stream::{self, Event, Events, FinishReason, Usage};
use super::{App, RequestId, new_id, params, read_request, unix_now};
use crate::billing::{Ask, Meter};
use crate::chat;
use crate::chat::output::{Piece, Reading};
use crate::chat::tools::{ToolChoice, Tools};
use crate::images::Visual;
use crate::router::ServedModel;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

struct ResponsesRequest {
    generation: Generation,
    reading: Reading,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    tools: Option<Tools>,
    stream: bool,
    /// Video frames kept of those sent, where there was video.
    frames: Option<(usize, usize)>,
}

pub async fn handle(
    State(app): State<App>,
    Authed(key): Authed,
    Extension(request_id): Extension<RequestId>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, model) = read_request(&app, &request_id, body, Some("model"))?;
    let visuals = super::visuals(&app, &model, &body["input"], "input").await?;
    let mut request = parse(&body, &model, &visuals)?;
    request.generation.weight = app.weights.of(&key.org_id).await;
    let frames = request.frames;
    let g = &request.generation;
    let ask = Ask {
        request_id: &request_id.id,
        client_request_id: request_id.client.as_deref(),
        endpoint: "responses",
        prompts: &[g.prompt.len()],
        max_completion_each: g.max_tokens as u64,
    };
    let meter = app.billing.admit(&key, &model, ask).await?;
    super::trace::admitted("responses", &model.entry.id, &meter.org_id(), g);
    let probe = app.status.probe(&model.entry.id, "responses", request_id.received);
    let out = generate::start(&model.pool, g.clone(), &meter, 0, probe).await?;
    let events = Events::new(out, 1, &request.reading);
    let meta = Meta { id: new_id("resp_"), created_at: unix_now(), model, request };
    super::trace::responding(&meta.id);
    if meta.request.stream {
        let response = sse::respond(move |tx| async move {
            let _: Result<(), Gone> = stream(tx, events, meta, meter).await;
        });
        return Ok(super::with_frames(response, frames));
    }
    let (choices, usage) = stream::gather(events).await?;
    let c = choices.into_iter().next().unwrap_or_default();
    meter.finish(c.finish_reason.as_str(), usage.reasoning_tokens);
    super::trace::finished(c.finish_reason.as_str(), &usage);
    meter.settle().await;
    let status = status(c.finish_reason);
    let split = &c.split;
    let mut output = Vec::new();
    if !split.reasoning.is_empty() {
        output.push(reasoning_item(&new_id("rs_"), &split.reasoning, status));
    }
    if !split.content.trim().is_empty() || (split.calls.is_empty() && split.reasoning.is_empty()) {
        output.push(message_item(&new_id("msg_"), &split.content, status));
    }
    for (name, arguments) in &split.calls {
        output.push(function_call_item(&new_id("fc_"), &new_id("call_"), name, arguments, status));
    }
    Ok(super::with_frames(Json(meta.object(output, Some(&usage), Some(c.finish_reason))).into_response(), frames))
}

/// An item's and the response's status once the output has ended.
fn status(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Length => "incomplete",
        FinishReason::Stop => "completed",
    }
}

fn parse(body: &Value, model: &ServedModel, visuals: &[Visual]) -> Result<ResponsesRequest, ApiError> {
    let mut f = Fields::new(body)?;
    f.raw("model");
    let instructions = f.string("instructions")?.map(String::from);
    let mut messages = match f.required("input")? {
        Value::String(s) => vec![json!({"role": "user", "content": s})],
        Value::Array(items) => input_items(items)?,
        _ => {
            return Err(ApiError::invalid_type("input", "a string or array"));
        }
    };
    // Checked on their own, so that errors name the client's own input items.
    messages =
        super::messages::for_model(model, &Value::Array(messages)).map_err(|e| rename_param(e, "messages", "input"))?;
    if let Some(i) = &instructions {
        // A vision model's template reads parts everywhere.
        let content = if model.vision().is_some() { json!([{"type": "text", "text": i}]) } else { json!(i) };
        messages.insert(0, json!({"role": "system", "content": content}));
    }
    let sampling = params::sampling(&mut f, model.replica.vocab_size())?;
    let stream = f.bool("stream", false)?;
    let budget = params::thinking_budget(&mut f, None)?;
    let max_output_tokens = f.integer("max_output_tokens", Some(1), None)?;
    let caps = &model.entry.capabilities;
    let tools = super::tools::parse(&mut f, Shape::Responses, caps.tool_calling, &model.entry.id)?;
    let format = match f.raw("text") {
        None => None,
        Some(Value::Object(text)) => text.get("format"),
        Some(_) => {
            return Err(ApiError::invalid_type("text", "an object"));
        }
    };
    let format = format::grammar(format, Shape::Responses, caps.structured_output, &model.entry.id)?
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
    let priority = params::priority(&mut f)?;
    f.ignore(&[
        "store",
        "metadata",
        "user",
        "reasoning",
        "include",
        "truncation",
        "top_logprobs",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "stream_options",
        "max_tool_calls",
    ]);
    f.finish()?;
    // Reasoning cannot be turned off here (docs/api.md, Reasoning): the catalog's defaults apply.
    let kwargs = chat::template_kwargs(model, None);
    let shown = chat::Shown { visuals, room: max_output_tokens.map_or(1, |m| m.max(1) as usize), param: "input" };
    let prepared = chat::prepare(model, &messages, tools.as_ref(), &kwargs, format, shown)?;
    let max_tokens = params::max_tokens(model, prepared.prompt.len(), max_output_tokens, "input")?;
    let thinking = chat::budget::for_worker(model, &prepared, budget, max_tokens, "max_output_tokens")?;
    Ok(ResponsesRequest {
        generation: Generation {
            prompt: prepared.prompt,
            sampling,
            max_tokens,
            stop: Vec::new(),
            n: 1,
            grammar: prepared.grammar,
            prompt_param: "input",
            thinking,
            prompt_logprobs: None,
            // Of vLLM's extensions the Responses API has only `priority`.
            extensions: params::Extensions { priority, ..Default::default() },
            images: prepared.images,
            image_spans: prepared.image_spans,
            weight: crate::weights::DEFAULT_WEIGHT,
        },
        frames: prepared.frames,
        reading: prepared.reading,
        instructions,
        max_output_tokens,
        tools,
        stream,
    })
}

/// Input items as chat messages: messages as they are; a `function_call` echoed back
/// joins the assistant turn before it (or starts one); a `function_call_output` is a
/// tool message; reasoning items passed back are dropped, as templates clear earlier
/// thinking.
fn input_items(items: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut messages: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let field = |name: &str| match item.get(name) {
            Some(Value::String(s)) => Ok(s.clone()),
            None | Some(Value::Null) => Err(ApiError::MissingParam(format!("{at}.{name}"))),
            Some(_) => Err(ApiError::invalid_type(format!("{at}.{name}"), "a string")),
        };
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
            Some("function_call") => {
                let call_id = call_id(&at, field("call_id")?)?;
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": field("name")?, "arguments": field("arguments")?}});
                match messages
                    .last_mut()
                    .and_then(Value::as_object_mut)
                    .filter(|m| m.get("role") == Some(&json!("assistant")))
                {
                    Some(last) => match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => {
                            last.insert("tool_calls".into(), json!([call]));
                        }
                    },
                    None => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            Some("function_call_output") => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => json!(s),
                    Some(parts @ Value::Array(_)) => parts.clone(),
                    None | Some(Value::Null) => return Err(ApiError::MissingParam(format!("{at}.output"))),
                    Some(_) => {
                        return Err(ApiError::invalid_type(format!("{at}.output"), "a string or array"));
                    }
                };
                let call_id = call_id(&at, field("call_id")?)?;
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            Some("reasoning") | Some("item_reference") => {}
            Some(other) => {
                return Err(ApiError::invalid_value(
                    format!("{at}.type"),
                    format!(
                        "Invalid value: '{other}'. Supported values are: 'message', 'function_call', \
                         'function_call_output' and 'reasoning'."
                    ),
                ));
            }
        }
    }
    Ok(messages)
}

/// OpenAI's limit on a call id's length.
fn call_id(at: &str, id: String) -> Result<String, ApiError> {
    if id.len() > 64 {
        return Err(ApiError::OutOfRange {
            param: format!("{at}.call_id"),
            code: "string_above_max_length",
            message: format!(
                "Invalid '{at}.call_id': string too long. Expected a string with maximum length 64, but got a string with length {} instead.",
                id.len()
            ),
        });
    }
    Ok(id)
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
    created_at: u64,
    model: Arc<ServedModel>,
    request: ResponsesRequest,
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([output_text(text)]) };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

/// Raw chain-of-thought as open-weight servers give it: `reasoning_text` content.
fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([reasoning_text(text)]) };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "encrypted_content": null, "status": status})
}

fn function_call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn reasoning_text(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

impl Meta {
    /// The Response object; `finish` is None while in progress.
    fn object(&self, output: Vec<Value>, usage: Option<&Usage>, finish: Option<FinishReason>) -> Value {
        let (status, incomplete) = match finish {
            None => ("in_progress", Value::Null),
            Some(FinishReason::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
            Some(FinishReason::Stop) => ("completed", Value::Null),
        };
        let s = &self.request.generation.sampling;
        let tools = &self.request.tools;
        let tool_choice = match tools.as_ref().map(|t| &t.choice) {
            None | Some(ToolChoice::Auto) => json!("auto"),
            Some(ToolChoice::None) => json!("none"),
            Some(ToolChoice::Required) => json!("required"),
            Some(ToolChoice::Named(n)) => json!({"type": "function", "name": n}),
        };
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
            "parallel_tool_calls": tools.as_ref().is_none_or(|t| t.parallel),
            "previous_response_id": null,
            "prompt_cache_key": null,
            "reasoning": {"effort": null, "summary": null},
            "safety_identifier": null,
            "service_tier": "default",
            "store": false,
            "temperature": s.temperature,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": tool_choice,
            "tools": tools.as_ref().map_or(json!([]), Tools::flat),
            "top_logprobs": 0,
            "top_p": s.top_p,
            "truncation": "disabled",
            "usage": usage.map(|u| json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
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

/// The output item being streamed into.
enum Open {
    Nothing,
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
}

/// Named events with their sequence numbers, and the output items as they complete.
struct Wire {
    tx: Sender,
    seq: u64,
    output: Vec<Value>,
    open: Open,
}

impl Wire {
    async fn send(&mut self, name: &str, mut payload: Value) -> Result<(), Gone> {
        payload["type"] = json!(name);
        payload["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.tx.named(name, &payload).await
    }

    /// Text into the open item of its kind, opening one (and closing another) first.
    async fn text(&mut self, reasoning: bool, delta: String) -> Result<(), Gone> {
        let fits = matches!((&self.open, reasoning), (Open::Reasoning { .. }, true) | (Open::Message { .. }, false));
        if !fits {
            self.close("completed").await?;
            let index = self.output.len();
            let (item, part, open) = if reasoning {
                let id = new_id("rs_");
                (
                    reasoning_item(&id, "", "in_progress"),
                    reasoning_text(""),
                    Open::Reasoning { id, text: String::new() },
                )
            } else {
                let id = new_id("msg_");
                (message_item(&id, "", "in_progress"), output_text(""), Open::Message { id, text: String::new() })
            };
            self.send("response.output_item.added", json!({"output_index": index, "item": item})).await?;
            let id = item_id(&open);
            self.send(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            )
            .await?;
            self.open = open;
        }
        let index = self.output.len();
        let (event, id, text) = match &mut self.open {
            Open::Reasoning { id, text } => ("response.reasoning_text.delta", id.clone(), text),
            Open::Message { id, text } => ("response.output_text.delta", id.clone(), text),
            Open::Nothing => return Ok(()),
        };
        text.push_str(&delta);
        let mut payload = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta});
        if event == "response.output_text.delta" {
            payload["logprobs"] = json!([]);
        }
        self.send(event, payload).await
    }

    /// Ends the open item, if any.
    async fn close(&mut self, status: &str) -> Result<(), Gone> {
        let index = self.output.len();
        let (item, done, text_event, part) = match std::mem::replace(&mut self.open, Open::Nothing) {
            Open::Nothing => return Ok(()),
            Open::Reasoning { id, text } => (
                reasoning_item(&id, &text, status),
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                "response.reasoning_text.done",
                reasoning_text(&text),
            ),
            Open::Message { id, text } => (
                message_item(&id, &text, status),
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                "response.output_text.done",
                output_text(&text),
            ),
        };
        self.send(text_event, done.clone()).await?;
        let mut part_done = done;
        part_done["part"] = part;
        if let Some(o) = part_done.as_object_mut() {
            o.remove("text");
            o.remove("logprobs");
        }
        self.send("response.content_part.done", part_done).await?;
        self.send("response.output_item.done", json!({"output_index": index, "item": item.clone()})).await?;
        self.output.push(item);
        Ok(())
    }

    /// A whole call: added with empty arguments, the arguments, done.
    async fn call(&mut self, name: &str, arguments: &str) -> Result<(), Gone> {
        self.close("completed").await?;
        let index = self.output.len();
        let (id, call_id) = (new_id("fc_"), new_id("call_"));
        let added = function_call_item(&id, &call_id, name, "", "in_progress");
        self.send("response.output_item.added", json!({"output_index": index, "item": added})).await?;
        self.send(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": arguments}),
        )
        .await?;
        self.send(
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments}),
        )
        .await?;
        let item = function_call_item(&id, &call_id, name, arguments, "completed");
        self.send("response.output_item.done", json!({"output_index": index, "item": item.clone()})).await?;
        self.output.push(item);
        Ok(())
    }
}

fn item_id(open: &Open) -> &str {
    match open {
        Open::Reasoning { id, .. } | Open::Message { id, .. } => id,
        Open::Nothing => "",
    }
}

/// Named events, each with its sequence number, in the order the SDK's stream helper
/// requires; no `[DONE]`. Items open as the output's kind changes: reasoning, message
/// text, calls.
async fn stream(tx: Sender, mut events: Events, meta: Meta, meter: Meter) -> Result<(), Gone> {
    let mut ev = Wire { tx, seq: 0, output: Vec::new(), open: Open::Nothing };
    ev.send("response.created", json!({"response": meta.object(vec![], None, None)})).await?;
    ev.send("response.in_progress", json!({"response": meta.object(vec![], None, None)})).await?;
    let mut finish = FinishReason::Stop;
    loop {
        let event = match ev.tx.unless_gone(events.next()).await? {
            Ok(Some(e)) => e,
            Ok(None) => break,
            Err(e) => {
                e.mid_stream();
                let mut failed = meta.object(std::mem::take(&mut ev.output), None, Some(FinishReason::Stop));
                failed["status"] = json!("failed");
                failed["completed_at"] = Value::Null;
                failed["error"] = json!({"code": "server_error", "message": e.object()["message"]});
                return ev.send("response.failed", json!({"response": failed})).await;
            }
        };
        match event {
            Event::PromptScores(_) => {}
            Event::Delta { pieces, .. } => {
                for piece in pieces {
                    match piece {
                        Piece::Reasoning(t) => ev.text(true, t).await?,
                        // Whitespace between calls is not a message.
                        Piece::Content(t) if t.trim().is_empty() && !matches!(ev.open, Open::Message { .. }) => {}
                        Piece::Content(t) => ev.text(false, t).await?,
                        Piece::ToolCall { name, arguments } => ev.call(&name, &arguments).await?,
                    }
                }
            }
            Event::Finished { reason, .. } => finish = reason,
        }
    }
    let usage = events.usage();
    meter.finish(finish.as_str(), usage.reasoning_tokens);
    super::trace::finished(finish.as_str(), &usage);
    meter.settle().await;
    if ev.output.is_empty() && matches!(ev.open, Open::Nothing) {
        // An answer with nothing else has a message, even an empty one.
        ev.text(false, String::new()).await?;
    }
    ev.close(status(finish)).await?;
    let output = std::mem::take(&mut ev.output);
    let terminal = if finish == FinishReason::Length { "response.incomplete" } else { "response.completed" };
    ev.send(terminal, json!({"response": meta.object(output, Some(&usage), Some(finish))})).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_become_the_chat_history() {
        let items = json!([
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
            {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
        ]);
        let m = input_items(items.as_array().unwrap()).unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["user", "assistant", "tool", "tool"]);
        assert_eq!(m[1]["tool_calls"][1]["function"]["name"], "get_time", "calls join the assistant turn");
        assert_eq!(m[2], json!({"role": "tool", "tool_call_id": "call_1", "content": "22C"}));
        let alone =
            input_items(&[json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"})]).unwrap();
        assert_eq!(alone[0]["role"], "assistant");
        let long = json!({"type": "function_call_output", "call_id": "c".repeat(65), "output": "x"});
        let e = input_items(&[long]).unwrap_err().object();
        assert_eq!(
            (e["param"].as_str(), e["code"].as_str()),
            (Some("input[0].call_id"), Some("string_above_max_length"))
        );
        let e = input_items(&[json!({"type": "web_search_call"})]).unwrap_err().object();
        assert_eq!(e["param"], "input[0].type");
        let e = input_items(&[json!({"type": "function_call", "call_id": "c", "name": "f"})]).unwrap_err().object();
        assert_eq!(e["param"], "input[0].arguments");
    }
}
