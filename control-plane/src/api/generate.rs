//! Sending one generation to a replica and reading its stream back: the shared part of
//! chat, completions and responses. Dropping the stream cancels the gRPC call, which
//! aborts the worker's sequences: a client that goes away frees its KV blocks.

use super::error::ApiError;
use crate::billing::Meter;
use crate::router::{Dispatch, Pool, Stage};
use crate::status::Probe;
use std::sync::Arc;
use tessera_proto::block_hash::BlockHash;
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
    /// Served disaggregated and still on its prefill replica: how it goes on.
    decode: Option<Decode>,
    /// Handed over: the prompt's figures from the prefill replica.
    prompt_as_computed: Option<(u32, u32)>,
}

/// A disaggregated request's second half: the decode replica chosen for it with the
/// prefill, and what it needs to go on there.
struct Decode {
    pool: Arc<Pool>,
    /// The request as sent to the prefill replica, its handoff taken out.
    request: pb::GenerateRequest,
    blocks: Vec<BlockHash>,
    /// The decode replica the prefill replica sends the blocks to (counted in its load
    /// until it answers).
    chosen: Option<Dispatch>,
    /// Tokens the prefill replica generated (its first).
    generated: Vec<u32>,
    /// The prompt's figures as the prefill replica computed it: the bill's, whatever
    /// the decode replica found in its cache (the blocks it was sent).
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
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
    pool: &Arc<Pool>,
    g: Generation,
    meter: &Meter,
    slot: usize,
    mut probe: Probe,
) -> Result<Output, ApiError> {
    probe.prompt(g.prompt.len());
    match first_delta(pool, g, meter, slot).await {
        Ok(Started { stream, first, decode }) => {
            probe.first_token(first.as_ref().map_or(0, |f| f.tokens.len()));
            Ok(Output { stream, first, meter: meter.clone(), slot, probe, decode, prompt_as_computed: None })
        }
        Err(e) => {
            if e.status().is_server_error() {
                probe.failed();
            }
            Err(e)
        }
    }
}

struct Started {
    stream: Streaming<pb::GenerateResponse>,
    first: Option<pb::GenerateResponse>,
    decode: Option<Decode>,
}

/// Sends the generation to replicas until one returns its first delta: disaggregated
/// when the pool has prefill and decode replicas and the request allows it (one
/// completion, no prompt scores) and the decode replica lacks enough of the prompt to
/// make a handoff pay (`Pool::worth_handing_over`); whole on a prefill replica when it
/// asks for at most one token; else (or if no prefill replica can start it) whole.
async fn first_delta(pool: &Arc<Pool>, g: Generation, meter: &Meter, slot: usize) -> Result<Started, ApiError> {
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
    let mut attempts = Attempts {
        pool,
        blocks: &blocks,
        meter,
        slot,
        request_id: meter.request_id(),
        params: (grammar_param, g.prompt_param),
        tried: Vec::new(),
    };
    let pooled = pool.disaggregated();
    // A prompt and at most one token is a prefill replica's work, whole.
    if pooled
        && request.max_tokens <= 1
        && let Some((stream, first)) = attempts.run(Stage::Prefill, &request, false).await?
    {
        return Ok(Started { stream, first, decode: None });
    }
    let disaggregable = request.n <= 1 && request.prompt_logprobs.is_none() && request.max_tokens > 1;
    if disaggregable
        && pooled
        && let Some(chosen) = pool.choose_stage(Stage::Decode, &blocks, &[])
        && let held = pool.held_by(chosen.id(), &blocks)
        && pool.worth_handing_over(request.prompt_token_ids.len(), held)
    {
        let handoff = pb::KvHandoff { decode_addr: chosen.replica().addr.clone(), skip_blocks: held as u32 };
        let prefill = pb::GenerateRequest { handoff: Some(handoff), ..request.clone() };
        match attempts.run(Stage::Prefill, &prefill, false).await? {
            Some((stream, first)) => {
                let decode = Decode {
                    pool: pool.clone(),
                    request,
                    blocks: blocks.clone(),
                    chosen: Some(chosen),
                    generated: Vec::new(),
                    prompt_tokens: 0,
                    cached_prompt_tokens: 0,
                };
                return Ok(Started { stream, first, decode: Some(decode) });
            }
            None => {
                tracing::warn!(request_id = %attempts.request_id, "no prefill replica could start the request; serving it whole")
            }
        }
    }
    match attempts.run(Stage::Whole, &request, false).await? {
        Some((stream, first)) => Ok(Started { stream, first, decode: None }),
        None => Err(ApiError::Overloaded),
    }
}

struct Attempts<'a> {
    pool: &'a Pool,
    blocks: &'a [BlockHash],
    meter: &'a Meter,
    slot: usize,
    request_id: String,
    /// The parameters a worker's refusal names (`worker_error`).
    params: (&'a str, &'static str),
    tried: Vec<String>,
}

type FirstDelta = (Streaming<pb::GenerateResponse>, Option<pb::GenerateResponse>);

impl Attempts<'_> {
    /// Sends `request` to replicas of `stage` not tried yet (`ATTEMPTS` at most) until
    /// one returns its first delta; None when none could. `resumed`: the request goes on
    /// after tokens generated elsewhere (its attempts are named for it).
    async fn run(
        &mut self,
        stage: Stage,
        request: &pb::GenerateRequest,
        resumed: bool,
    ) -> Result<Option<FirstDelta>, ApiError> {
        let (grammar_param, prompt_param) = self.params;
        let first_attempt = self.tried.len();
        while self.tried.len() - first_attempt < ATTEMPTS {
            let Some(dispatch) = self.pool.choose_stage(stage, self.blocks, &self.tried) else { break };
            let id = dispatch.id().to_string();
            let attempt_id = attempt_id(&self.request_id, self.slot, self.tried.len() + 1, resumed);
            let mut attempt =
                tonic::Request::new(pb::GenerateRequest { request_id: attempt_id.clone(), ..request.clone() });
            // The worker's span for it joins this request's trace.
            tessera_worker::telemetry::inject(&tracing::Span::current(), attempt.metadata_mut());
            match start_on(&dispatch, attempt).await {
                Ok(started) => {
                    self.meter.started(self.slot);
                    return Ok(Some(started));
                }
                Err(s) if retry_elsewhere(s.code()) => {
                    tracing::warn!(attempt = %attempt_id, "replica {id} failed before the first token ({s}); trying another");
                    if s.code() != Code::ResourceExhausted {
                        self.pool.broken(&id);
                    }
                    self.tried.push(id);
                }
                Err(s) => {
                    self.tried.push(id);
                    return Err(worker_error(s, grammar_param, prompt_param));
                }
            }
        }
        Ok(None)
    }
}

/// The id a worker knows one attempt of a request's generation by: the request's own
/// (its ids are random, so control planes sharing a worker never collide), with the
/// prompt's place when a request has several (`-p1`), its decode half's mark when it
/// was handed over (`-d`) and the attempt's number from the second (`-a2`), so that
/// every worker line of a request is found by its id.
fn attempt_id(request_id: &str, slot: usize, attempt: usize, resumed: bool) -> String {
    let mut id = request_id.to_string();
    if slot > 0 {
        id.push_str(&format!("-p{slot}"));
    }
    if resumed {
        id.push_str("-d");
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
    /// it as `stream::Events`.) A disaggregated request's handoff is followed here: its
    /// stream goes on from the decode replica, the way one replica's would.
    pub(super) async fn next(&mut self) -> Result<Option<pb::GenerateResponse>, ApiError> {
        loop {
            // (The first delta was measured when it came.)
            let (r, measured) = match self.first.take() {
                Some(first) => (Ok(Some(first)), true),
                None => (self.stream.message().await, false),
            };
            let r = match (r, &self.decode) {
                // The prefill replica failed, or its stream ended, after its first token
                // and before its handoff: the decode side computes what it lacks.
                (Err(_) | Ok(None), Some(d)) if !d.generated.is_empty() => {
                    tracing::warn!("the prefill replica was lost before its handoff; decoding goes on without its KV");
                    self.hand_over("prefill_lost").await?;
                    continue;
                }
                (r, _) => r.map_err(|s| worker_error(s, "", "")).inspect_err(|_| self.probe.failed())?,
            };
            let Some(mut r) = r else { return Ok(None) };
            if r.finish_reason == pb::FinishReason::Handoff as i32 && self.decode.is_some() {
                let outcome = match r.transfer.as_ref().filter(|t| !t.error.is_empty()) {
                    Some(t) => {
                        tracing::warn!("a handoff's KV transfer failed ({}); the decode replica computes it", t.error);
                        "transfer_failed"
                    }
                    None => "transferred",
                };
                self.hand_over(outcome).await?;
                continue;
            }
            match &mut self.decode {
                Some(_) => self.prefilled(&r),
                // After a handoff, the prompt is billed as the prefill replica computed it.
                None => {
                    if let Some((prompt, cached)) = self.prompt_as_computed {
                        r.prompt_tokens = prompt;
                        r.cached_prompt_tokens = cached;
                    }
                }
            }
            if !measured {
                self.probe.delta(r.tokens.len());
            }
            self.meter.record(self.slot, r.cached_prompt_tokens, r.tokens.len());
            if r.finish_reason == pb::FinishReason::Abort as i32 {
                self.probe.failed();
                return Err(ApiError::Overloaded);
            }
            return Ok(Some(r));
        }
    }

    /// Notes what the prefill replica sent: its tokens, and its prompt's figures.
    fn prefilled(&mut self, r: &pb::GenerateResponse) {
        if let Some(d) = &mut self.decode {
            d.generated.extend(r.tokens.iter().map(|t| t.token_id));
            d.prompt_tokens = r.prompt_tokens;
            d.cached_prompt_tokens = r.cached_prompt_tokens;
            if r.finish_reason != pb::FinishReason::Unspecified as i32 {
                // It finished there (an end token first): nothing to hand over.
                self.decode = None;
            }
        }
    }

    /// Goes on with a handed-over request on its decode replica: the one chosen with
    /// the prefill (which holds its blocks), else another decode replica, else any
    /// replica (each computes what it lacks). Once one answers, its stream is this
    /// output's; if none can, the request ends with what it generated.
    async fn hand_over(&mut self, outcome: &'static str) -> Result<(), ApiError> {
        let Some(mut d) = self.decode.take() else { return Ok(()) };
        let model = d.pool.model().to_string();
        metrics::counter!(crate::metrics::HANDOFFS, "model" => model, "outcome" => outcome).increment(1);
        self.prompt_as_computed = Some((d.prompt_tokens, d.cached_prompt_tokens));
        let request = pb::GenerateRequest { resume_token_ids: d.generated.clone(), handoff: None, ..d.request.clone() };
        let request_id = self.meter.request_id();
        let mut tried = Vec::new();
        // Whatever a replica answers, the request goes on elsewhere if it can: its first
        // token has been sent.
        if let Some(chosen) = d.chosen.take() {
            let attempt_id = attempt_id(&request_id, self.slot, 1, true);
            let mut attempt = tonic::Request::new(pb::GenerateRequest { request_id: attempt_id, ..request.clone() });
            tessera_worker::telemetry::inject(&tracing::Span::current(), attempt.metadata_mut());
            match start_on(&chosen, attempt).await {
                Ok(started) => {
                    self.continue_with(started);
                    return Ok(());
                }
                Err(s) => {
                    tracing::warn!(
                        "decode replica {} failed before its first token ({s}); trying another",
                        chosen.id()
                    );
                    if retry_elsewhere(s.code()) && s.code() != Code::ResourceExhausted {
                        d.pool.broken(chosen.id());
                    }
                    tried.push(chosen.id().to_string());
                }
            }
        }
        let mut attempts = Attempts {
            pool: &d.pool,
            blocks: &d.blocks,
            meter: &self.meter,
            slot: self.slot,
            request_id,
            params: ("", ""),
            tried,
        };
        let mut refused = None;
        for stage in [Stage::Decode, Stage::Whole] {
            match attempts.run(stage, &request, true).await {
                Ok(Some(started)) => {
                    self.continue_with(started);
                    return Ok(());
                }
                Ok(None) => {}
                Err(e) => refused = Some(e),
            }
        }
        self.probe.failed();
        Err(refused.unwrap_or(ApiError::Overloaded))
    }

    fn continue_with(&mut self, (stream, first): (Streaming<pb::GenerateResponse>, Option<pb::GenerateResponse>)) {
        if let Some(f) = &first {
            self.probe.delta(f.tokens.len());
        }
        self.stream = stream;
        self.first = first;
    }
}

/// Starts a generation on a chosen replica and reads its first delta.
async fn start_on(
    dispatch: &Dispatch,
    attempt: tonic::Request<pb::GenerateRequest>,
) -> Result<(Streaming<pb::GenerateResponse>, Option<pb::GenerateResponse>), Status> {
    let mut stream = dispatch.replica().client.clone().generate(attempt).await?.into_inner();
    match stream.message().await? {
        Some(first) if aborted_before_output(&first) => {
            Err(Status::aborted("the worker aborted the request before its first token"))
        }
        first => Ok((stream, first)),
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
        assert_eq!(attempt_id("req_1", 0, 1, false), "req_1");
        assert_eq!(attempt_id("req_1", 0, 2, false), "req_1-a2");
        assert_eq!(attempt_id("req_1", 2, 1, false), "req_1-p2");
        assert_eq!(attempt_id("req_1", 1, 3, false), "req_1-p1-a3");
        assert_eq!(attempt_id("req_1", 0, 2, true), "req_1-d-a2");
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
