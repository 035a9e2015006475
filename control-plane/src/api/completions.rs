//! POST /v1/completions (legacy): one or more prompts, `n` completions each.

use super::auth::Authed;
use super::error::ApiError;
use super::fields::Fields;
use super::generate::{self, Generation};
use super::sse::{self, Gone, Sender};
use super::stream::{self, Event, Events, FinishReason, Usage};
use super::{App, RequestId, logprobs, new_id, params, read_request, unix_now, usage_json};
use crate::billing::{Ask, Meter};
use crate::chat;
use crate::chat::output::Reading;
use crate::router::ServedModel;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use tessera_proto::worker as pb;

/// Completions one request may ask for (prompts × n), as chat's `n` allows.
const MAX_SEQUENCES: usize = 128;

struct Prompt {
    text: String,
    tokens: Vec<u32>,
}

struct CompletionRequest {
    prompts: Vec<Prompt>,
    template: Generation,
    echo: bool,
    logprobs: Option<u32>,
    /// vLLM's `prompt_logprobs`: the prompt's scores in its own shape.
    prompt_logprobs: Option<u32>,
    stream: bool,
    include_usage: bool,
}

pub async fn handle(
    State(app): State<App>,
    Authed(key): Authed,
    Extension(request_id): Extension<RequestId>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, model) = read_request(&app, &request_id, body, None)?;
    let mut request = parse(&body, &model)?;
    request.template.weight = app.weights.of(&key.org_id).await;
    let request = Arc::new(request);
    let id = new_id("cmpl-");
    let created = unix_now();
    let n = request.template.n;
    let lengths: Vec<usize> = request.prompts.iter().map(|p| p.tokens.len()).collect();
    let t = &request.template;
    let ask = Ask {
        request_id: &request_id.id,
        client_request_id: request_id.client.as_deref(),
        endpoint: "completions",
        prompts: &lengths,
        max_completion_each: t.max_tokens as u64 * n as u64,
    };
    let meter = app.billing.admit(&key, &model, ask).await?;
    super::trace::admitted("completions", &model.entry.id, &meter.org_id(), t);
    super::trace::responding(&id);
    // One generation per prompt, all at once; choice index = prompt × n + completion.
    let mut outputs = Vec::new();
    for (slot, p) in request.prompts.iter().enumerate() {
        let g = Generation { prompt: p.tokens.clone(), ..request.template.clone() };
        // Nothing to generate, and no prompt to score: nothing to ask a worker.
        if g.max_tokens == 0 && g.prompt_logprobs.is_none() {
            outputs.push(None);
            continue;
        }
        let probe = app.status.probe(&model.entry.id, "completions", request_id.received);
        let out = generate::start(&model.pool, g, &meter, slot, probe).await?;
        outputs.push(Some(Events::new(out, n, &Reading::PLAIN)));
    }
    let base = json!({"id": id, "object": "text_completion", "created": created, "model": model.entry.id, "system_fingerprint": null});
    if request.stream {
        return Ok(sse::respond(move |tx| async move {
            let _: Result<(), Gone> = stream(tx, outputs, base, model, request, meter).await;
        }));
    }
    let mut choices = Vec::new();
    let mut usage = Usage::default();
    for (p, (prompt, out)) in request.prompts.iter().zip(outputs).enumerate() {
        usage.prompt_tokens += prompt.tokens.len() as u32;
        let gathered = match out {
            Some(events) => {
                let (g, u) = stream::gather(events).await?;
                usage.cached_tokens += u.cached_tokens;
                usage.completion_tokens += u.completion_tokens;
                g
            }
            None => vec![stream::Gathered { finish_reason: FinishReason::Length, ..Default::default() }; n as usize],
        };
        for (i, c) in gathered.into_iter().enumerate() {
            let prefix = if request.echo { prompt.text.as_str() } else { "" };
            let mut offset = 0;
            let echoed = match (request.echo, request.logprobs) {
                (true, Some(_)) => {
                    Some(logprobs::legacy_prompt(&model.replica, &prompt.tokens, &c.prompt_scores, &mut offset))
                }
                _ => {
                    offset = prefix.chars().count();
                    None
                }
            };
            let lp = match request.logprobs {
                Some(_) => {
                    let generated = logprobs::legacy(&model.replica, &c.tokens, &mut offset);
                    echoed.map_or(generated.clone(), |e| logprobs::join_legacy(e, generated))
                }
                None => Value::Null,
            };
            let mut choice = json!({
                "index": p * n as usize + i,
                "text": format!("{prefix}{}", c.text),
                "logprobs": lp,
                "finish_reason": c.finish_reason.as_str(),
            });
            if request.prompt_logprobs.is_some() {
                choice["prompt_logprobs"] = logprobs::vllm_prompt(&model.replica, &c.prompt_scores);
            }
            choices.push(choice);
        }
    }
    let mut reply = base;
    reply["choices"] = json!(choices);
    reply["usage"] = usage_json(&usage);
    let finish = choices.first().and_then(|c| c["finish_reason"].as_str()).unwrap_or("stop");
    meter.finish(finish, 0);
    super::trace::finished(finish, &usage);
    meter.settle().await;
    Ok(Json(reply).into_response())
}

fn parse(body: &Value, model: &ServedModel) -> Result<CompletionRequest, ApiError> {
    let mut f = Fields::new(body)?;
    f.raw("model");
    let prompts = prompts(f.required("prompt")?, model)?;
    let mut sampling = params::sampling(&mut f, model.replica.vocab_size())?;
    let (stream, include_usage) = params::stream(&mut f)?;
    let n = params::n(&mut f)?;
    let stop = params::stop(&mut f)?;
    let extensions = params::extensions(&mut f, model.replica.vocab_size())?;
    let echo = f.bool("echo", false)?;
    let logprobs = params::legacy_logprobs(&mut f)?;
    let prompt_logprobs = params::prompt_logprobs(&mut f)?;
    sampling.logprobs = logprobs;
    // Echoed with log-probabilities, the prompt is scored by the worker too.
    let scored = [logprobs.filter(|_| echo), prompt_logprobs].into_iter().flatten().max();
    let max_tokens = f.integer("max_tokens", Some(0), None)?.unwrap_or(16);
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::Unsupported {
            param: "suffix".into(),
            message: "'suffix' is not supported by this model.".into(),
        });
    }
    // Best-of-n reranking is not offered; 1 is what it means without it.
    f.integer("best_of", Some(1), Some(1))?;
    f.ignore(&["user"]);
    f.finish()?;
    if prompts.len() * n as usize > MAX_SEQUENCES {
        return Err(ApiError::invalid_value(
            "n",
            format!(
                "{} prompts × n = {n} asks for more than {MAX_SEQUENCES} completions in one request.",
                prompts.len()
            ),
        ));
    }
    let longest = prompts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    let max_tokens = params::max_tokens(model, longest, Some(max_tokens), "prompt")?;
    params::check_min_tokens(&extensions, max_tokens, "max_tokens")?;
    Ok(CompletionRequest {
        prompts,
        template: Generation {
            prompt: Vec::new(),
            sampling,
            max_tokens,
            stop,
            n,
            grammar: None,
            prompt_param: "prompt",
            thinking: None,
            prompt_logprobs: scored,
            extensions,
            images: Vec::new(),
            image_spans: Vec::new(),
            weight: crate::weights::DEFAULT_WEIGHT,
        },
        echo,
        logprobs,
        prompt_logprobs,
        stream,
        include_usage,
    })
}

/// A string, a list of strings, a list of token ids, or a list of lists of them.
fn prompts(v: &Value, model: &ServedModel) -> Result<Vec<Prompt>, ApiError> {
    let vocab = model.replica.vocab_size();
    let from_ids = |at: String, ids: &[Value]| -> Result<Prompt, ApiError> {
        let tokens = ids
            .iter()
            .map(|t| t.as_u64().filter(|&t| t < vocab as u64).map(|t| t as u32))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| ApiError::invalid_value(at, format!("Token ids must be integers below {vocab}.")))?;
        let text = model.replica.tokenizer.decode(&tokens, false).map_err(|e| ApiError::Internal(e.to_string()))?;
        Ok(Prompt { text, tokens })
    };
    let from_text = |text: &str| -> Result<Prompt, ApiError> {
        Ok(Prompt { text: text.to_string(), tokens: chat::tokenize(model, text)? })
    };
    let prompts = match v {
        Value::String(s) => vec![from_text(s)?],
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
            vec![from_ids("prompt".into(), items)?]
        }
        Value::Array(items) if !items.is_empty() => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => from_text(s),
                Value::Array(ids) => from_ids(format!("prompt[{i}]"), ids),
                _ => Err(ApiError::invalid_type(format!("prompt[{i}]"), "a string")),
            })
            .collect::<Result<_, _>>()?,
        Value::Array(_) => return Err(ApiError::invalid_value("prompt", "Invalid 'prompt': empty array.")),
        _ => {
            return Err(ApiError::invalid_type("prompt", "a string or array"));
        }
    };
    if let Some(i) = prompts.iter().position(|p| p.tokens.is_empty()) {
        return Err(ApiError::invalid_value("prompt", format!("Prompt {i} is empty.")));
    }
    Ok(prompts)
}

/// One prompt's stream, merged with the others'.
enum Item {
    /// An event, and for a delta the end of its choice when the same message ended it.
    Event(Event, Option<FinishReason>),
    /// Its end, with what it used.
    Ended(Usage),
    Failed(ApiError),
}

async fn stream(
    tx: Sender,
    outputs: Vec<Option<Events>>,
    base: Value,
    model: Arc<ServedModel>,
    request: Arc<CompletionRequest>,
    meter: Meter,
) -> Result<(), Gone> {
    let n = request.template.n as usize;
    let chunk = |index: usize, text: &str, logprobs: Value, finish: Option<&str>| {
        let mut c = base.clone();
        c["choices"] = json!([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]);
        if request.include_usage {
            c["usage"] = Value::Null;
        }
        c
    };
    // Each choice's place in its text, in characters, for logprobs' text offsets.
    let mut offsets = vec![0usize; request.prompts.len() * n];
    // An echo with log-probabilities waits for the prompt's scores, which come before
    // its completions' first output; a plain echo goes out at once.
    let echo_scored = request.echo && request.logprobs.is_some();
    let mut echoed = vec![!echo_scored; request.prompts.len() * n];
    if request.echo && !echo_scored {
        for (p, prompt) in request.prompts.iter().enumerate() {
            for i in 0..n {
                offsets[p * n + i] = prompt.text.chars().count();
                tx.data(&chunk(p * n + i, &prompt.text, Value::Null, None)).await?;
            }
        }
    }
    let mut scores: Vec<Vec<pb::PromptToken>> = vec![Vec::new(); request.prompts.len()];
    let mut streams = Vec::new();
    for (p, out) in outputs.into_iter().enumerate() {
        match out {
            Some(events) => streams.push(
                futures_util::stream::unfold(Some(events), |events| async move {
                    let mut events = events?;
                    match events.next().await {
                        Ok(Some(e)) => {
                            // The last text and the end of a choice go in one chunk.
                            let finish = match &e {
                                Event::Delta { index, .. } => events.finished_with(*index),
                                _ => None,
                            };
                            Some((Item::Event(e, finish), Some(events)))
                        }
                        Ok(None) => Some((Item::Ended(events.usage()), None)),
                        Err(e) => Some((Item::Failed(e), None)),
                    }
                })
                .map(move |r| (p, r))
                .boxed(),
            ),
            None => {
                for i in 0..n {
                    tx.data(&chunk(p * n + i, "", Value::Null, Some("length"))).await?;
                }
            }
        }
    }
    let mut merged = futures_util::stream::select_all(streams);
    let mut usage =
        Usage { prompt_tokens: request.prompts.iter().map(|p| p.tokens.len() as u32).sum(), ..Default::default() };
    let mut last_finish = FinishReason::Stop;
    while let Some((p, item)) = tx.unless_gone(merged.next()).await? {
        let (event, finish) = match item {
            Item::Event(e, finish) => (e, finish),
            Item::Ended(used) => {
                usage.cached_tokens += used.cached_tokens;
                usage.completion_tokens += used.completion_tokens;
                continue;
            }
            Item::Failed(e) => return tx.fail(&e).await,
        };
        let index = match &event {
            Event::PromptScores(s) => {
                // Every choice of the prompt shows them.
                scores[p] = s.clone();
                // An echo with log-probabilities carries them; otherwise a chunk of their own.
                if echo_scored || request.prompt_logprobs.is_none() {
                    continue;
                }
                let mut c = chunk(p * n, "", Value::Null, None);
                c["choices"][0]["prompt_logprobs"] = logprobs::vllm_prompt(&model.replica, &scores[p]);
                tx.data(&c).await?;
                continue;
            }
            Event::Delta { index, .. } | Event::Finished { index, .. } => p * n + index,
        };
        let offset = &mut offsets[index];
        if !echoed[index] {
            echoed[index] = true;
            let prompt = &request.prompts[p];
            let lp = logprobs::legacy_prompt(&model.replica, &prompt.tokens, &scores[p], offset);
            let mut c = chunk(index, &prompt.text, lp, None);
            if request.prompt_logprobs.is_some() {
                c["choices"][0]["prompt_logprobs"] = logprobs::vllm_prompt(&model.replica, &scores[p]);
            }
            tx.data(&c).await?;
        }
        let lp = |tokens: &[pb::GeneratedToken], offset: &mut usize| match request.logprobs {
            Some(_) => logprobs::legacy(&model.replica, tokens, offset),
            None => Value::Null,
        };
        match event {
            Event::Delta { text, tokens, .. } => {
                if let Some(reason) = finish {
                    last_finish = reason;
                }
                if !text.is_empty() || finish.is_some() || (request.logprobs.is_some() && !tokens.is_empty()) {
                    tx.data(&chunk(index, &text, lp(&tokens, offset), finish.map(FinishReason::as_str))).await?;
                }
            }
            Event::Finished { reason, .. } => {
                last_finish = reason;
                tx.data(&chunk(index, "", lp(&[], offset), Some(reason.as_str()))).await?;
            }
            Event::PromptScores(_) => {}
        }
    }
    meter.finish(last_finish.as_str(), 0);
    super::trace::finished(last_finish.as_str(), &usage);
    meter.settle().await;
    if request.include_usage {
        let mut last = base.clone();
        last["choices"] = json!([]);
        last["usage"] = usage_json(&usage);
        tx.data(&last).await?;
    }
    tx.done().await
}
