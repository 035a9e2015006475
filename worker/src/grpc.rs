//! The worker's gRPC service over the engine: requests and outputs converted between
//! proto and engine types, engine errors mapped once to gRPC status codes.

use crate::engine::core::{EngineError, FinishReason, Handoff, KvBlocks, Output, Request as EngineRequest};
use crate::engine::grammar::{Constraint, GrammarError, GrammarSource, GrammarSpec};
use crate::engine::runner::{EngineHandle, OutputEvent, Transfer};
use crate::engine::sampler::SamplingParams;
use crate::engine::scheduler::Place;
use crate::engine::sequence::SeqId;
use crate::engine::thinking::ThinkingBudget;
use crate::vision::Use;
use crate::vision::placement::PlacedImages;
use crate::vision::service::{ImageError, ImageInput, PlaceImages};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tessera_proto::errors;
use tessera_proto::worker as pb;
use tessera_proto::worker::ErrorKind;
use tessera_proto::worker::worker_client::WorkerClient;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::Stream;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

pub use pb::worker_server::WorkerServer;

impl From<EngineError> for Status {
    fn from(e: EngineError) -> Self {
        Self::from(&e)
    }
}

impl From<&EngineError> for Status {
    fn from(e: &EngineError) -> Self {
        let (code, kind) = match e {
            EngineError::InvalidRequest(_) => (Code::InvalidArgument, ErrorKind::InvalidRequest),
            EngineError::ContextLength(_) => (Code::OutOfRange, ErrorKind::ContextLength),
            EngineError::DuplicateId(_) => (Code::AlreadyExists, ErrorKind::DuplicateId),
            EngineError::Stopped => (Code::Unavailable, ErrorKind::Stopping),
            EngineError::Model(_) | EngineError::Detokenize(_) | EngineError::Config(_) => {
                (Code::Internal, ErrorKind::Internal)
            }
        };
        errors::status(code, kind, e.to_string())
    }
}

/// A fault of the worker's own.
fn internal(message: String) -> Status {
    errors::status(Code::Internal, ErrorKind::Internal, message)
}

/// Client request ids of live requests → engine ids.
type LiveIds = Arc<Mutex<HashMap<String, SeqId>>>;

/// The version of the KV transfer format this worker speaks (`KvTransferHeader`).
pub const KV_TRANSFER_VERSION: u32 = 1;
/// Blocks of a handoff per PushKv message: a few MB, well under the message limit.
const TRANSFER_CHUNK_BYTES: usize = 4 << 20;

/// The decode replicas this prefill replica hands requests to: one connection each,
/// kept (a connection per handoff would cost a handshake each time).
#[derive(Clone)]
struct Peers {
    clients: Arc<Mutex<HashMap<String, WorkerClient<Channel>>>>,
    /// This replica's `ModelCard::kv_identity`, sent in each transfer's header.
    kv_identity: String,
    engine: EngineHandle,
}

impl Peers {
    fn client(&self, addr: &str) -> Result<WorkerClient<Channel>, String> {
        let mut clients = self.clients.lock().expect("peers lock");
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}")).map_err(|e| e.to_string())?;
        let channel = endpoint
            .connect_timeout(std::time::Duration::from_secs(2))
            .http2_keep_alive_interval(std::time::Duration::from_secs(1))
            .keep_alive_timeout(std::time::Duration::from_secs(3))
            .connect_lazy();
        let client = WorkerClient::new(channel).max_encoding_message_size(tessera_proto::MAX_MESSAGE_BYTES);
        clients.insert(addr.to_string(), client.clone());
        Ok(client)
    }

    /// Sends a handoff's blocks to the decode replica at `addr`, a few MB per message
    /// (made as the stream is read, so a slow receiver holds back the copies too), and
    /// says how it went. A failure is reported, not returned: the decode replica then
    /// computes what it lacks.
    fn send(
        &self,
        addr: String,
        request_id: String,
        blocks: Arc<KvBlocks>,
    ) -> impl std::future::Future<Output = pb::KvTransfer> + Send + 'static {
        let peers = self.clone();
        async move {
            let started = std::time::Instant::now();
            let block_bytes = blocks.first().map_or(0, |(_, d)| d.len());
            let per_message = (TRANSFER_CHUNK_BYTES / block_bytes.max(1)).max(1);
            let mut transfer = pb::KvTransfer {
                blocks_sent: blocks.len() as u32,
                bytes_sent: blocks.iter().map(|(_, d)| d.len() as u64).sum(),
                ..Default::default()
            };
            let header = pb::KvTransferHeader {
                version: KV_TRANSFER_VERSION,
                kv_identity: peers.kv_identity.clone(),
                block_bytes: block_bytes as u64,
                request_id,
            };
            let chunks = (0..blocks.len().div_ceil(per_message)).map(move |c| {
                let part = &blocks[c * per_message..((c + 1) * per_message).min(blocks.len())];
                pb::KvChunk {
                    header: None,
                    blocks: part.iter().map(|(hash, data)| pb::KvBlock { hash: *hash, data: data.clone() }).collect(),
                }
            });
            let first = pb::KvChunk { header: Some(header), blocks: Vec::new() };
            let outgoing = tokio_stream::iter(std::iter::once(first).chain(chunks));
            let sent = match peers.client(&addr) {
                Ok(mut client) => client.push_kv(outgoing).await.map_err(|s| s.message().to_string()),
                Err(e) => Err(e),
            };
            match sent {
                Ok(reply) => transfer.blocks_stored = reply.into_inner().blocks_stored,
                Err(e) => {
                    tracing::warn!("KV blocks for a handoff could not be sent to {addr}: {e}");
                    transfer.error = format!("sending KV blocks to {addr}: {e}");
                }
            }
            transfer.seconds = started.elapsed().as_secs_f64();
            peers.engine.record_transfer(Transfer::Sent {
                bytes: transfer.bytes_sent,
                blocks: transfer.blocks_sent as u64,
                seconds: transfer.seconds,
                ok: transfer.error.is_empty(),
            });
            transfer
        }
    }
}

pub struct WorkerService {
    engine: EngineHandle,
    card: pb::ModelCard,
    grammars: Arc<GrammarSource>,
    live: LiveIds,
    next_id: AtomicU64,
    /// True once the server is shutting down: load streams end (they would otherwise
    /// hold a graceful shutdown open forever), generations run to their end.
    closing: tokio::sync::watch::Receiver<bool>,
    /// The replica's metrics registry, served at GET /metrics.
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// The vision encoder, for a model that reads images.
    images: Option<Arc<dyn PlaceImages>>,
    peers: Peers,
    /// Bytes of one saved KV block here (every rank's share): a transfer's blocks must
    /// be the same (0: not checked).
    kv_block_bytes: u64,
}

impl WorkerService {
    pub fn new(engine: EngineHandle, card: pb::ModelCard) -> Self {
        let grammars = Arc::new(GrammarSource::new(
            card.tokenizer_json.clone(),
            card.eos_token_ids.clone(),
            card.vocab_size as usize,
        ));
        let (_, closing) = tokio::sync::watch::channel(false);
        let next_id = AtomicU64::new(1);
        let peers = Peers { clients: Arc::default(), kv_identity: card.kv_identity.clone(), engine: engine.clone() };
        Self {
            engine,
            card,
            grammars,
            live: LiveIds::default(),
            next_id,
            closing,
            metrics: None,
            images: None,
            peers,
            kv_block_bytes: 0,
        }
    }

    /// The same, reading requests' images with `encoder`.
    pub fn with_images(self, encoder: Arc<dyn PlaceImages>) -> Self {
        Self { images: Some(encoder), ..self }
    }

    /// The request's images encoded and placed over its prompt, off the async threads.
    async fn images(&self, prompt: &[u32], images: Vec<pb::ImageInput>) -> Result<Option<Arc<PlacedImages>>, Status> {
        if images.is_empty() {
            return Ok(None);
        }
        let Some(encoder) = self.images.clone() else {
            let why = format!("{} reads no images: its weights have no vision encoder", self.card.model);
            return Err(errors::status(Code::InvalidArgument, ErrorKind::ImageRefused, why));
        };
        let inputs = images
            .into_iter()
            .enumerate()
            .map(|(i, image)| {
                let sha256 = <[u8; 32]>::try_from(image.sha256.as_slice()).map_err(|_| {
                    let why = format!("images[{i}]: sha256 is not 32 bytes");
                    errors::status(Code::InvalidArgument, ErrorKind::InvalidRequest, why)
                })?;
                let usage = if image.frame { Use::Frame } else { Use::Image { split: image.split } };
                Ok(ImageInput { data: image.data, sha256, usage })
            })
            .collect::<Result<Vec<_>, Status>>()?;
        let prompt = prompt.to_vec();
        tokio::task::spawn_blocking(move || encoder.place(&prompt, &inputs))
            .await
            .map_err(|e| internal(format!("image encoding: {e}")))?
            .map(|placed| Some(Arc::new(placed)))
            .map_err(|e| match e {
                // The encoder's own failure, not the request's.
                ImageError::Encoder { .. } => errors::status(Code::Internal, ErrorKind::Internal, e.to_string()),
                _ => errors::status(Code::InvalidArgument, ErrorKind::ImageRefused, e.to_string()),
            })
    }

    /// The same, taking transferred KV blocks of `bytes` each only.
    pub fn with_kv_block_bytes(self, bytes: u64) -> Self {
        Self { kv_block_bytes: bytes, ..self }
    }

    /// The same, serving `metrics` at GET /metrics.
    pub fn with_metrics(self, metrics: metrics_exporter_prometheus::PrometheusHandle) -> Self {
        Self { metrics: Some(metrics), ..self }
    }

    /// The engine this service feeds.
    pub fn engine(&self) -> EngineHandle {
        self.engine.clone()
    }

    /// The same, ending its load streams when `closing` turns true.
    pub fn closing_on(self, closing: tokio::sync::watch::Receiver<bool>) -> Self {
        Self { closing, ..self }
    }

    /// The request's grammar compiled, off the async threads (a new schema takes
    /// milliseconds to compile).
    async fn constraint(&self, grammar: Option<pb::Grammar>) -> Result<Option<Constraint>, Status> {
        use pb::grammar::Kind;
        let spec = match grammar.and_then(|g| g.kind) {
            None => return Ok(None),
            Some(Kind::JsonObject(_)) => GrammarSpec::JsonObject,
            Some(Kind::JsonSchema(s)) => GrammarSpec::JsonSchema(s),
            Some(Kind::Lark(s)) => GrammarSpec::Lark(s),
        };
        let grammars = self.grammars.clone();
        tokio::task::spawn_blocking(move || grammars.matcher(&spec))
            .await
            .map_err(|e| internal(format!("grammar compilation: {e}")))?
            .map(Some)
            .map_err(|e| match e {
                GrammarError::Refused(_) => {
                    errors::status(Code::InvalidArgument, ErrorKind::GrammarRefused, e.to_string())
                }
                GrammarError::Tokenizer(_) => internal(e.to_string()),
            })
    }
}

fn to_engine(
    id: SeqId,
    r: pb::GenerateRequest,
    grammar: Option<Constraint>,
    images: Option<Arc<PlacedImages>>,
) -> Result<EngineRequest, Status> {
    let s = r.sampling.unwrap_or_default();
    let params = SamplingParams {
        temperature: s.temperature,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        top_k: s.top_k,
        min_p: s.min_p,
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        repetition_penalty: if s.repetition_penalty == 0.0 { 1.0 } else { s.repetition_penalty },
        logit_bias: s.logit_bias.into_iter().collect(),
        seed: s.seed,
        logprobs: s.logprobs,
    };
    Ok(EngineRequest {
        id,
        prompt: r.prompt_token_ids,
        params,
        max_tokens: r.max_tokens as usize,
        stop_token_ids: r.stop_token_ids,
        stop: r.stop,
        ignore_eos: r.ignore_eos,
        min_tokens: r.min_tokens as usize,
        include_stop_str_in_output: r.include_stop_str_in_output,
        skip_special_tokens: !r.keep_special_tokens,
        n: r.n.max(1) as usize,
        grammar,
        thinking: r.thinking.map(|t| ThinkingBudget {
            inside: t.inside,
            open: t.open,
            close: t.close,
            close_tokens: t.close_tokens,
            budget: t.budget as usize,
        }),
        prompt_logprobs: r.prompt_logprobs,
        images,
        tenant: r.tenant,
        weight: r.weight.max(1),
        priority: r.priority,
        resume: r.resume_token_ids,
        handoff: r.handoff.map(|h| Handoff { skip_blocks: h.skip_blocks as usize }),
    })
}

/// A token's most likely alternatives, as the wire has them.
fn alternatives(top: Vec<(u32, f32)>) -> Vec<pb::TokenLogprob> {
    top.into_iter().map(|(token_id, logprob)| pb::TokenLogprob { token_id, logprob }).collect()
}

fn to_proto(o: Output) -> pb::GenerateResponse {
    let tokens = o
        .token
        .into_iter()
        .map(|t| pb::GeneratedToken {
            token_id: t.token,
            logprob: t.logprob,
            top_logprobs: alternatives(t.top_logprobs),
        })
        .collect();
    let finish = match o.finish {
        None => pb::FinishReason::Unspecified,
        Some(FinishReason::Stop) => pb::FinishReason::Stop,
        Some(FinishReason::Length) => pb::FinishReason::Length,
        Some(FinishReason::Abort) => pb::FinishReason::Abort,
        Some(FinishReason::Handoff) => pb::FinishReason::Handoff,
    };
    let prompt_logprobs = o
        .prompt_logprobs
        .into_iter()
        .map(|p| pb::PromptToken {
            token_id: p.token,
            logprob: p.logprob,
            rank: p.rank,
            top_logprobs: alternatives(p.top),
        })
        .collect();
    pb::GenerateResponse {
        index: o.index as u32,
        tokens,
        text: o.text,
        finish_reason: finish as i32,
        prompt_tokens: o.prompt_tokens as u32,
        cached_prompt_tokens: o.cached_prompt_tokens as u32,
        prompt_logprobs,
        transfer: None,
    }
}

/// A request's response stream. Dropping it (the client went away) closes the output
/// channel, which makes the engine abort the request; the client id is freed here, and
/// the request's one log line written: how it ended, what it used, how long it took.
pub struct OutputStream {
    rx: UnboundedReceiver<OutputEvent>,
    live: LiveIds,
    client_id: String,
    log: RequestLog,
    /// A prefill-only request's handoff: where its blocks go, then the blocks going.
    handoff: Option<HandoffState>,
    peers: Peers,
}

enum HandoffState {
    /// The decode replica's address, until the first token comes with the blocks.
    To(String),
    /// The blocks on their way; the stream's last response says how it went.
    Sending(Pin<Box<dyn std::future::Future<Output = pb::KvTransfer> + Send>>),
    Sent,
}

/// What a request's log line says, gathered as its stream is read.
struct RequestLog {
    started: std::time::Instant,
    prompt_tokens: usize,
    output_tokens: usize,
    /// Completions finished, of how many asked.
    finished: usize,
    n: usize,
    failed: Option<String>,
    /// The request's span (`llm_request`), closed with the stream.
    span: tracing::Span,
    /// When it reached each stage, from its last output.
    timeline: Option<Box<crate::metrics::Timeline>>,
}

impl RequestLog {
    fn saw(&mut self, ev: &OutputEvent) {
        match ev {
            Ok(o) => {
                self.output_tokens += usize::from(o.token.is_some());
                self.finished += usize::from(o.finish.is_some());
                if o.timeline.is_some() {
                    self.timeline = o.timeline.clone();
                }
            }
            Err(e) => self.failed = Some(e.to_string()),
        }
    }

    fn write(&self, request_id: &str) {
        let ms = self.started.elapsed().as_millis() as u64;
        let (prompt_tokens, output_tokens) = (self.prompt_tokens, self.output_tokens);
        let _in = self.span.enter();
        self.span.record("gen_ai.usage.output_tokens", output_tokens);
        if let Some(t) = &self.timeline {
            let queued = t.prefill.first().map_or(t.ended, |step| step.0).duration_since(t.arrived);
            self.span.record("gen_ai.latency.time_in_queue", queued.as_secs_f64());
            if let Some(first) = t.first_token {
                self.span.record("gen_ai.latency.time_to_first_token", first.duration_since(t.arrived).as_secs_f64());
            }
            self.span.record("tessera.preemptions", t.preemptions);
            crate::telemetry::stages(&self.span, t);
        }
        match &self.failed {
            Some(e) => {
                self.span.record("tessera.outcome", "failed");
                tracing::error!(request_id, prompt_tokens, output_tokens, ms, "request failed: {e}")
            }
            None if self.finished < self.n => {
                self.span.record("tessera.outcome", "cancelled");
                tracing::info!(request_id, prompt_tokens, output_tokens, ms, "request cancelled by its client")
            }
            None => {
                self.span.record("tessera.outcome", "finished");
                tracing::info!(request_id, prompt_tokens, output_tokens, ms, "request finished")
            }
        }
    }
}

impl Stream for OutputStream {
    type Item = Result<pb::GenerateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(HandoffState::Sending(sending)) = &mut self.handoff {
            let transfer = std::task::ready!(sending.as_mut().poll(cx));
            self.handoff = Some(HandoffState::Sent);
            let done = pb::GenerateResponse {
                finish_reason: pb::FinishReason::Handoff as i32,
                transfer: Some(transfer),
                ..Default::default()
            };
            return Poll::Ready(Some(Ok(done)));
        }
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(ev)) = &polled {
            self.log.saw(ev);
        }
        let Poll::Ready(Some(Ok(mut out))) = polled else {
            return polled.map(|ev| ev.map(|ev| ev.map(to_proto).map_err(|e| Status::from(&*e))));
        };
        // The first token goes to the control plane at once; the handoff's end, once
        // the blocks are across.
        if let (Some(blocks), Some(HandoffState::To(addr))) = (out.handoff.take(), &self.handoff) {
            let send = self.peers.send(addr.clone(), self.client_id.clone(), blocks);
            self.handoff = Some(HandoffState::Sending(Box::pin(send)));
            out.finish = None;
        }
        Poll::Ready(Some(Ok(to_proto(out))))
    }
}

impl Drop for OutputStream {
    fn drop(&mut self) {
        self.live.lock().expect("live ids lock").remove(&self.client_id);
        self.log.write(&self.client_id);
    }
}

impl WorkerService {
    /// Starts request `r` on the engine; its stream answers it, in `span`.
    async fn start(&self, mut r: pb::GenerateRequest, span: tracing::Span) -> Result<Response<OutputStream>, Status> {
        if r.request_id.is_empty() {
            return Err(errors::status(Code::InvalidArgument, ErrorKind::InvalidRequest, "request_id is empty"));
        }
        let grammar = self.constraint(r.grammar.take()).await?;
        let images = self.images(&r.prompt_token_ids, std::mem::take(&mut r.images)).await?;
        let client_id = r.request_id.clone();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut live = self.live.lock().expect("live ids lock");
            if live.contains_key(&client_id) {
                let why = format!("request {client_id} is already running");
                return Err(errors::status(Code::AlreadyExists, ErrorKind::DuplicateId, why));
            }
            live.insert(client_id.clone(), id);
        }
        let log = RequestLog {
            started: std::time::Instant::now(),
            prompt_tokens: r.prompt_token_ids.len(),
            output_tokens: 0,
            finished: 0,
            n: r.n.max(1) as usize,
            failed: None,
            span,
            timeline: None,
        };
        let handoff = r.handoff.as_ref().map(|h| HandoffState::To(h.decode_addr.clone()));
        let stream = |rx| OutputStream {
            rx,
            live: self.live.clone(),
            client_id: client_id.clone(),
            log,
            handoff,
            peers: self.peers.clone(),
        };
        let request = match to_engine(id, r, grammar, images) {
            Ok(request) => request,
            Err(e) => {
                self.live.lock().expect("live ids lock").remove(&client_id);
                return Err(e);
            }
        };
        match self.engine.generate(request).await {
            Ok(rx) => Ok(Response::new(stream(rx))),
            Err(e) => {
                self.live.lock().expect("live ids lock").remove(&client_id);
                Err(e.into())
            }
        }
    }
}

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type GenerateStream = OutputStream;
    type WatchLoadStream = Pin<Box<dyn Stream<Item = Result<pb::LoadReport, Status>> + Send>>;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<OutputStream>, Status> {
        let r = req.get_ref();
        // The request's span, a child of the control plane's when it sent its context:
        // open while the stream is, its figures recorded when it ends.
        let span = tracing::info_span!(
            "llm_request",
            otel.kind = "server",
            request_id = %r.request_id,
            gen_ai.request.max_tokens = r.max_tokens,
            gen_ai.usage.input_tokens = r.prompt_token_ids.len(),
            gen_ai.usage.output_tokens = tracing::field::Empty,
            tessera.completions = r.n.max(1),
            tessera.outcome = tracing::field::Empty,
            tessera.preemptions = tracing::field::Empty,
            gen_ai.latency.time_in_queue = tracing::field::Empty,
            gen_ai.latency.time_to_first_token = tracing::field::Empty,
        );
        crate::telemetry::adopt_call(&span, req.metadata());
        let refused = |s: Status| {
            tracing::warn!(code = ?s.code(), "request refused: {}", s.message());
            span.record("tessera.outcome", "refused");
            s
        };
        let started = self.start(req.into_inner(), span.clone()).instrument(span.clone()).await;
        started.map_err(|s| span.in_scope(|| refused(s)))
    }

    async fn abort(&self, req: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let id = self.live.lock().expect("live ids lock").get(&req.get_ref().request_id).copied();
        let found = match id {
            Some(id) => self.engine.abort(id).await?,
            None => false,
        };
        Ok(Response::new(pb::AbortResponse { found }))
    }

    async fn get_model_card(&self, _: Request<pb::ModelCardRequest>) -> Result<Response<pb::ModelCard>, Status> {
        Ok(Response::new(self.card.clone()))
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse { ready: true }))
    }

    async fn push_kv(&self, req: Request<Streaming<pb::KvChunk>>) -> Result<Response<pb::KvPushReply>, Status> {
        let refuse = |why: String| errors::status(Code::FailedPrecondition, ErrorKind::InvalidRequest, why);
        let mut chunks = req.into_inner();
        let first = chunks.message().await?.ok_or_else(|| refuse("a KV transfer without a header".into()))?;
        let header = first.header.ok_or_else(|| refuse("a KV transfer's first message has no header".into()))?;
        if header.version != KV_TRANSFER_VERSION {
            return Err(refuse(format!(
                "KV transfer format {} is not spoken here (version {KV_TRANSFER_VERSION})",
                header.version
            )));
        }
        if header.kv_identity != self.card.kv_identity {
            return Err(refuse(format!(
                "KV blocks of {} cannot be used by this replica of {}: other weights or layout",
                header.kv_identity, self.card.model
            )));
        }
        if self.kv_block_bytes != 0 && header.block_bytes != self.kv_block_bytes {
            return Err(refuse(format!(
                "KV blocks of {} bytes cannot be used by this replica, whose blocks are {} bytes",
                header.block_bytes, self.kv_block_bytes
            )));
        }
        let mut reply = pb::KvPushReply::default();
        let mut blocks = first.blocks;
        loop {
            if let Some(b) = blocks.iter().find(|b| b.data.len() as u64 != header.block_bytes) {
                let why =
                    format!("a KV block of {} bytes in a transfer of {}-byte blocks", b.data.len(), header.block_bytes);
                return Err(errors::status(Code::InvalidArgument, ErrorKind::InvalidRequest, why));
            }
            if !blocks.is_empty() {
                let bytes = blocks.iter().map(|b| b.data.len() as u64).sum();
                let count = blocks.len() as u64;
                // Stored before the next message is read: the sender waits on us.
                let (stored, held) =
                    self.engine.import_kv(blocks.into_iter().map(|b| (b.hash, b.data)).collect()).await.map_err(
                        |e| match e {
                            EngineError::Config(why) => refuse(why),
                            e => Status::from(e),
                        },
                    )?;
                self.engine.record_transfer(Transfer::Received { bytes, blocks: count });
                reply.blocks_stored += stored as u32;
                reply.blocks_held += held as u32;
            }
            match chunks.message().await? {
                Some(next) => blocks = next.blocks,
                None => break,
            }
        }
        Ok(Response::new(reply))
    }

    async fn watch_load(&self, _: Request<pb::WatchLoadRequest>) -> Result<Response<Self::WatchLoadStream>, Status> {
        // Subscribed first, then the snapshot: the reports after it may repeat changes
        // the snapshot holds, never miss one.
        let mut rx = self.engine.watch_load();
        let cached = self.engine.cached_blocks().await.map_err(|e| Status::unavailable(e.to_string()))?;
        let mut closing = self.closing.clone();
        let stream = async_stream(move |tx| async move {
            let first = pb::LoadReport { snapshot: true, ..with_places(cached) };
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            loop {
                let next = tokio::select! {
                    r = rx.recv() => r,
                    _ = closing.wait_for(|c| *c) => return,
                };
                match next {
                    Ok(r) => {
                        let report = pb::LoadReport {
                            running: r.running as u32,
                            waiting: r.waiting as u32,
                            kv_blocks_used: r.kv_blocks_used as u32,
                            kv_blocks_total: r.kv_blocks_total as u32,
                            tokens_per_s: r.tokens_per_s,
                            prefix_queried_blocks: r.prefix_queried_blocks,
                            prefix_hit_blocks: r.prefix_hit_blocks,
                            snapshot: false,
                            preemptions: r.preemptions,
                            ..with_places(r.kv_changes)
                        };
                        if tx.send(Ok(report)).await.is_err() {
                            return;
                        }
                    }
                    // A slow watcher missed reports: tell it, so it resynchronises.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx.send(Err(Status::data_loss(format!("missed {n} load reports")))).await;
                        return;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(stream))
    }
}

/// A report's block lists: each block in the list of where it is now.
fn with_places(blocks: impl IntoIterator<Item = (u64, Place)>) -> pb::LoadReport {
    let mut r = pb::LoadReport::default();
    for (hash, place) in blocks {
        match place {
            Place::Device => r.stored_block_hashes.push(hash),
            Place::Host => r.host_block_hashes.push(hash),
            Place::Disk => r.disk_block_hashes.push(hash),
            Place::Gone => r.removed_block_hashes.push(hash),
        }
    }
    r
}

/// A stream fed by a task through a small channel.
fn async_stream<T, F, Fut>(f: F) -> Pin<Box<dyn Stream<Item = T> + Send>>
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
