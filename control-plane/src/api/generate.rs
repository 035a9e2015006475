//! Sending one generation to a replica and reading its stream back: the shared part of
//! chat, completions and responses. Dropping the stream cancels the gRPC call, which
//! aborts the worker's sequences: a client that goes away frees its KV blocks.

use super::error::ApiError;
use crate::billing::Meter;
use crate::router::Pool;
use crate::status::Probe;
use tessera_proto::errors;
use tessera_proto::worker::ErrorKind;
use tessera_proto::worker::{self as pb};
use tonic::{Code, Status, Streaming};

/// What every endpoint turns its request into.
#[derive(Debug, Clone, Default)]
pub struct Generation {
    pub prompt: Vec<u32>,
    pub sampling: pb::SamplingParams,
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub n: u32,
    /// Structured output, and the parameter that asked for it (named in its errors).
    pub grammar: Option<(pb::Grammar, &'static str)>,
    /// The parameter holding the prompt, named when prompt and completion do not fit.
    pub prompt_param: &'static str,
    /// When the worker ends the output's reasoning.
    pub thinking: Option<pb::ThinkingBudget>,
    /// Score the prompt's tokens, with this many alternatives each.
    pub prompt_logprobs: Option<u32>,
    /// vLLM's sampling extensions.
    pub extensions: super::params::Extensions,
    /// The images the prompt's placeholders stand for, and where they sit.
    pub images: Vec<pb::ImageInput>,
    pub image_spans: Vec<tessera_proto::block_hash::ImageSpan>,
    /// The organization's scheduling weight (`weights`), set once the caller is known.
    pub weight: u32,
}

pub struct Output {
    stream: Streaming<pb::GenerateResponse>,
    /// The first delta, read before the request was committed to its replica.
    first: Option<pb::GenerateResponse>,
    /// The request's bill, and which of its prompts this is.
    meter: Meter,
    slot: usize,
    /// Its measurements for GET /status.
    probe: Probe,
}

/// Most replicas one request tries before it answers 503.
const ATTEMPTS: usize = 3;

/// Starts prompt `slot` of a metered request on the replica the pool chooses. Until the
/// first delta arrives nothing has been generated or billed, so a replica that cannot be
/// reached, fails, or is full by then is left for the next choice (one that failed is
/// taken out of routing until its load stream answers again). After the first delta a
/// failure ends the request with what it generated (`Output::next`). `probe` measures
/// the generation, and counts its failure if it fails on our side.
pub async fn start(
    pool: &Pool,
    g: Generation,
    meter: &Meter,
    slot: usize,
    mut probe: Probe,
) -> Result<Output, ApiError> {
    probe.prompt(g.prompt.len());
    match first_delta(pool, g, meter, slot).await {
        Ok((stream, first)) => {
            probe.first_token(first.as_ref().map_or(0, |f| f.tokens.len()));
            Ok(Output { stream, first, meter: meter.clone(), slot, probe })
        }
        Err(e) => {
            if e.status().is_server_error() {
                probe.failed();
            }
            Err(e)
        }
    }
}

type Started = (Streaming<pb::GenerateResponse>, Option<pb::GenerateResponse>);

/// Sends the generation to replicas until one returns its first delta.
async fn first_delta(pool: &Pool, g: Generation, meter: &Meter, slot: usize) -> Result<Started, ApiError> {
    let (grammar, grammar_param) = g.grammar.map_or((None, ""), |(g, p)| (Some(g), p));
    let request = pb::GenerateRequest {
        prompt_token_ids: g.prompt,
        sampling: Some(g.sampling),
        max_tokens: g.max_tokens,
        stop_token_ids: g.extensions.stop_token_ids,
        stop: g.stop,
        ignore_eos: g.extensions.ignore_eos,
        n: g.n,
        grammar,
        thinking: g.thinking,
        prompt_logprobs: g.prompt_logprobs,
        min_tokens: g.extensions.min_tokens,
        include_stop_str_in_output: g.extensions.include_stop_str_in_output,
        keep_special_tokens: !g.extensions.skip_special_tokens,
        images: g.images,
        tenant: meter.org_id(),
        priority: g.extensions.priority,
        weight: g.weight,
        ..Default::default()
    };
    let blocks = pool.blocks(&request.prompt_token_ids, &g.image_spans);
    let request_id = meter.request_id();
    let mut tried = Vec::new();
    while tried.len() < ATTEMPTS {
        let Some(dispatch) = pool.choose(&blocks, &tried) else { break };
        let id = dispatch.id().to_string();
        let attempt_id = attempt_id(&request_id, slot, tried.len() + 1);
        let mut attempt =
            tonic::Request::new(pb::GenerateRequest { request_id: attempt_id.clone(), ..request.clone() });
        // The worker's span for it joins this request's trace.
        tessera_worker::telemetry::inject(&tracing::Span::current(), attempt.metadata_mut());
        let first = match dispatch.replica().client.clone().generate(attempt).await {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                match stream.message().await {
                    Ok(first) if !first.as_ref().is_some_and(aborted_before_output) => Ok((stream, first)),
                    Ok(_) => Err(Status::aborted("the worker aborted the request before its first token")),
                    Err(s) => Err(s),
                }
            }
            Err(s) => Err(s),
        };
        match first {
            Ok(started) => {
                meter.started(slot);
                return Ok(started);
            }
            Err(s) if retry_elsewhere(s.code()) => {
                tracing::warn!(attempt = %attempt_id, "replica {id} failed before the first token ({s}); trying another");
                if s.code() != Code::ResourceExhausted {
                    pool.broken(&id);
                }
                tried.push(id);
            }
            Err(s) => return Err(worker_error(s, grammar_param, g.prompt_param)),
        }
    }
    Err(ApiError::Overloaded)
}

/// The id a worker knows one attempt of a request's generation by: the request's own
/// (its ids are random, so control planes sharing a worker never collide), with the
/// prompt's place when a request has several (`-p1`) and the attempt's number from the
/// second (`-a2`), so that every worker line of a request is found by its id.
fn attempt_id(request_id: &str, slot: usize, attempt: usize) -> String {
    let mut id = request_id.to_string();
    if slot > 0 {
        id.push_str(&format!("-p{slot}"));
    }
    if attempt > 1 {
        id.push_str(&format!("-a{attempt}"));
    }
    id
}

/// Failures that say nothing about the request itself: the worker is gone, stopping, or
/// full.
fn retry_elsewhere(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted | Code::ResourceExhausted)
}

fn aborted_before_output(r: &pb::GenerateResponse) -> bool {
    r.finish_reason == pb::FinishReason::Abort as i32 && r.tokens.is_empty()
}

impl Output {
    /// Counts the generation as failed on our side (a worker that broke the protocol).
    pub(super) fn failed(&mut self) {
        self.probe.failed();
    }

    /// The next message of the worker's stream, or None at its end. (Endpoints read
    /// it as `stream::Events`.)
    pub(super) async fn next(&mut self) -> Result<Option<pb::GenerateResponse>, ApiError> {
        let r = match self.first.take() {
            Some(first) => Some(first),
            None => {
                let r = self.stream.message().await.map_err(|s| worker_error(s, "", ""));
                if let Ok(Some(r)) = &r {
                    self.probe.delta(r.tokens.len());
                }
                r.inspect_err(|_| self.probe.failed())?
            }
        };
        if let Some(r) = &r {
            self.meter.record(self.slot, r.cached_prompt_tokens, r.tokens.len());
        }
        if let Some(r) = &r
            && r.finish_reason == pb::FinishReason::Abort as i32
        {
            self.probe.failed();
            return Err(ApiError::Overloaded);
        }
        Ok(r)
    }
}

/// A worker's refusal of what we validated is our bug; a worker that is gone or full
/// is overload.
/// `grammar_param`: the parameter a grammar the worker cannot compile came from;
/// `prompt_param`: the one holding a prompt too long for the replica that took it (its
/// KV cache smaller than the model's context, and than the others' when it joined).
fn worker_error(s: Status, grammar_param: &str, prompt_param: &'static str) -> ApiError {
    match (errors::kind(&s), s.code()) {
        // (Unspecified: a worker from before kinds, during a rolling upgrade.)
        (ErrorKind::ContextLength | ErrorKind::Unspecified, Code::OutOfRange) if !prompt_param.is_empty() => {
            ApiError::ContextLength {
                param: prompt_param,
                message: format!(
                    "This request does not fit the model's context on the server that took it: {}. Please reduce the \
                 length of the {prompt_param} or completion.",
                    s.message()
                ),
            }
        }
        (ErrorKind::GrammarRefused, _) if !grammar_param.is_empty() => {
            ApiError::invalid_value(grammar_param, format!("Invalid schema: {}", s.message()))
        }
        (_, Code::Unavailable | Code::ResourceExhausted | Code::Cancelled) => ApiError::Overloaded,
        _ => ApiError::Internal(format!("worker: {s}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_attempt_is_known_by_the_request_id() {
        assert_eq!(attempt_id("req_1", 0, 1), "req_1");
        assert_eq!(attempt_id("req_1", 0, 2), "req_1-a2");
        assert_eq!(attempt_id("req_1", 2, 1), "req_1-p2");
        assert_eq!(attempt_id("req_1", 1, 3), "req_1-p1-a3");
    }

    #[test]
    fn worker_errors_are_answered_by_their_kind() {
        assert!(matches!(worker_error(Status::unavailable("gone"), "", "messages"), ApiError::Overloaded));
        assert!(matches!(
            worker_error(Status::invalid_argument("x"), "response_format", "messages"),
            ApiError::Internal(_)
        ));
        // By the kind in the details, whatever the message says.
        let refused = errors::status(Code::InvalidArgument, ErrorKind::GrammarRefused, "unknown type 'frob'");
        let e = worker_error(refused, "response_format", "messages");
        assert_eq!(e, ApiError::invalid_value("response_format", "Invalid schema: unknown type 'frob'"));
        let posing = Status::invalid_argument("the grammar does not compile: unknown type 'frob'");
        assert!(matches!(worker_error(posing, "response_format", "messages"), ApiError::Internal(_)));
        let long = errors::status(
            Code::OutOfRange,
            ErrorKind::ContextLength,
            "the prompt has 2000 tokens; the context is 1456",
        );
        let e = worker_error(long, "", "prompt");
        assert_eq!(e.body()["error"]["code"], "context_length_exceeded");
        assert_eq!(e.body()["error"]["param"], "prompt");
        assert!(e.body()["error"]["message"].as_str().unwrap().contains("the context is 1456"), "{:?}", e.body());
    }
}
