//! A scripted worker: a real gRPC `Worker` whose generations a test or a benchmark
//! writes (`Script`), used where the control plane is measured or tested without an
//! engine (a test double for the engine, which cannot fail or answer on cue). Its model
//! card's tokenizer knows four words; the control plane tokenizes prompts with it, and
//! the script may ignore them. It reports an idle replica's load until nobody listens.

use crate::worker as pb;
use crate::worker::worker_server::Worker;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

pub type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;

/// What a scripted worker answers to each Generate call.
pub trait Script: Send + Sync + 'static {
    fn generate(&self, request: pb::GenerateRequest) -> Result<GenerateStream, Status>;

    /// The worker's card (a script may play a prefill or decode replica).
    fn card(&self) -> pb::ModelCard {
        model_card("scripted")
    }
}

/// The worker around a `Script`, serving `model_card("scripted")`.
pub struct ScriptedWorker<S>(pub S);

#[tonic::async_trait]
impl<S: Script> Worker for ScriptedWorker<S> {
    type GenerateStream = GenerateStream;
    type WatchLoadStream = ReceiverStream<Result<pb::LoadReport, Status>>;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        self.0.generate(request.into_inner()).map(Response::new)
    }

    async fn abort(&self, _: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        Ok(Response::new(pb::AbortResponse { found: false }))
    }

    async fn get_model_card(&self, _: Request<pb::ModelCardRequest>) -> Result<Response<pb::ModelCard>, Status> {
        Ok(Response::new(self.0.card()))
    }

    async fn push_kv(&self, _: Request<tonic::Streaming<pb::KvChunk>>) -> Result<Response<pb::KvPushReply>, Status> {
        Err(Status::unimplemented("a scripted worker keeps no KV blocks"))
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse { ready: true }))
    }

    async fn watch_load(&self, _: Request<pb::WatchLoadRequest>) -> Result<Response<Self::WatchLoadStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut report = pb::LoadReport { kv_blocks_total: 1000, snapshot: true, ..Default::default() };
            // Reports keep coming, as a live worker's do, until the pool stops listening.
            while tx.send(Ok(report.clone())).await.is_ok() {
                report.snapshot = false;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A word-level tokenizer of four words (`<unk>` 0, `hello` 1, `world` 2, `again` 3).
pub const WORD_TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"<unk>":0,"hello":1,"world":2,"again":3},"unk_token":"<unk>"}}"#;

/// A delta of choice `index`: `text` as one token (id 1, log-probability −0.5) of a
/// 2-token prompt, ending as `finish` says.
pub fn delta(index: u32, text: &str, finish: pb::FinishReason) -> pb::GenerateResponse {
    pb::GenerateResponse {
        index,
        text: text.into(),
        tokens: vec![pb::GeneratedToken { token_id: 1, logprob: Some(-0.5), top_logprobs: vec![] }],
        finish_reason: finish as i32,
        prompt_tokens: 2,
        cached_prompt_tokens: 0,
        prompt_logprobs: vec![],
        transfer: None,
    }
}

/// The card of a scripted worker serving `model`: the four-word tokenizer, a template
/// that joins the messages' contents, 4,096 tokens of context.
pub fn model_card(model: &str) -> pb::ModelCard {
    pb::ModelCard {
        model: model.into(),
        tokenizer_json: WORD_TOKENIZER.into(),
        chat_template: "{% for m in messages %}{{ m.content }} {% endfor %}".into(),
        eos_token_ids: vec![0],
        eos_token: "<unk>".into(),
        context_length: 4096,
        kv_block_size: 16,
        vocab_size: 4,
        ..Default::default()
    }
}
