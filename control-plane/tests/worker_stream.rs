//! The API in-process against a scripted worker: a real tonic `Worker` on port 0 whose
//! every answer the test writes, so that what a real engine rarely does on cue — fail in
//! the middle of a stream, lag, send a choice that was not asked for, refuse a grammar,
//! end a stream early — is checked against what the client sees and what is billed.
//! (The worker is scripted because no engine fails on demand; the control plane, its
//! database, billing and gRPC client are the real ones.)

use axum::body::Body;
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tessera_control_plane::accounts::{BillingMode, NewKey};
use tessera_control_plane::api::{self, App};
use tessera_control_plane::catalog::Catalog;
use tessera_control_plane::config::ApiArgs;
use tessera_control_plane::db::Db;
use tessera_control_plane::router::choice::Routing;
use tessera_control_plane::router::{Models, Pool, Replica};
use tessera_proto::errors;
use tessera_proto::scripted::{GenerateStream, Script, ScriptedWorker, delta};
use tessera_proto::worker::worker_server::WorkerServer;
use tessera_proto::worker::{self as pb, ErrorKind};
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};
use tower::ServiceExt;

/// What the worker does for one Generate call, in order.
enum Step {
    Send(pb::GenerateResponse),
    Fail(Status),
    /// Waits for the test's word.
    Wait(Arc<Notify>),
    /// Keeps the stream open until the client goes away, then says so.
    HoldUntilCancelled(Arc<Notify>),
}

#[derive(Default, Clone)]
struct Scripted {
    scripts: Arc<Mutex<VecDeque<Vec<Step>>>>,
    /// Each Generate call's request, in order.
    seen: Arc<Mutex<Vec<pb::GenerateRequest>>>,
    /// The part its card says it plays in disaggregated serving.
    role: pb::ServingRole,
}

impl Script for Scripted {
    fn card(&self) -> pb::ModelCard {
        pb::ModelCard { role: self.role as i32, ..tessera_proto::scripted::model_card("scripted") }
    }

    fn generate(&self, request: pb::GenerateRequest) -> Result<GenerateStream, Status> {
        self.seen.lock().unwrap().push(request);
        let script = self.scripts.lock().unwrap().pop_front().ok_or_else(|| Status::internal("no script left"))?;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            for step in script {
                match step {
                    Step::Send(r) => {
                        if tx.send(Ok(r)).await.is_err() {
                            return;
                        }
                    }
                    Step::Fail(s) => {
                        let _ = tx.send(Err(s)).await;
                        return;
                    }
                    Step::Wait(go) => go.notified().await,
                    Step::HoldUntilCancelled(told) => {
                        tx.closed().await;
                        told.notify_one();
                        return;
                    }
                }
            }
        });
        Ok(ReceiverStream::new(rx))
    }
}

const CATALOG: &str = r#"
[[models]]
id = "test/scripted"
name = "Scripted"
context_length = 4096
quantization = "none"
weights = "scripted"
prices = { input = 1_000_000, output = 2_000_000 }
capabilities = { image_input = false, video_input = false, tool_calling = true, structured_output = true }
reasoning = { default = "off", control = "none" }
"#;

fn more(index: u32, text: &str) -> Step {
    Step::Send(delta(index, text, pb::FinishReason::Unspecified))
}

fn last(index: u32, text: &str, finish: pb::FinishReason) -> Step {
    Step::Send(delta(index, text, finish))
}

struct Harness {
    app: App,
    worker: Scripted,
    /// Every worker, `worker` first, with its address.
    workers: Vec<(Scripted, String)>,
    key: String,
    org: String,
}

impl Harness {
    async fn start() -> Self {
        Self::with_roles(&[pb::ServingRole::Aggregated]).await
    }

    /// One scripted worker per role, in one pool that hands over every prompt.
    async fn with_roles(roles: &[pb::ServingRole]) -> Self {
        Self::with_roles_from(roles, 0).await
    }

    /// The same, handing over prompts of `min_tokens` on.
    async fn with_roles_from(roles: &[pb::ServingRole], min_tokens: usize) -> Self {
        let mut workers = Vec::new();
        let mut pool = None;
        let mut first_replica = None;
        for &role in roles {
            let worker = Scripted { role, ..Default::default() };
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let serving = WorkerServer::new(ScriptedWorker(worker.clone()));
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(serving)
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
            let replica = Arc::new(Replica::connect(&addr).await.unwrap());
            let pool = pool.get_or_insert_with(|| {
                Arc::new(Pool::new(&replica.card.model, Routing::CacheAware).handing_over_from(min_tokens))
            });
            pool.add(&addr, replica.clone()).unwrap();
            first_replica.get_or_insert(replica);
            workers.push((worker, addr));
        }
        let (pool, replica, worker) = (pool.unwrap(), first_replica.unwrap(), workers[0].0.clone());
        let catalog = Catalog::parse(CATALOG, "test").unwrap();
        let pools = BTreeMap::from([("scripted".to_string(), (replica, pool))]);
        let models = Arc::new(Models::new(&catalog, &pools).unwrap());

        let db = Db::open("sqlite::memory:").await.unwrap();
        let store = db.accounts();
        let org = store.create_org("scripted").await.unwrap();
        db.ledger().grant(&org.id, 10_000_000, "test credit").await.unwrap();
        let new = NewKey {
            org_id: &org.id,
            name: "test",
            billing_mode: BillingMode::Credits,
            fallback_to_credits: false,
            created_by: None,
        };
        let (_, key) = store.create_key(new).await.unwrap();
        let app = tessera_control_plane::serve::app_state(db, models, None, &ApiArgs::defaults()).await.unwrap();
        Self { app, worker, workers, key, org: org.id }
    }

    fn script(&self, steps: Vec<Step>) {
        self.worker.scripts.lock().unwrap().push_back(steps);
    }

    /// Scripts the next Generate call to worker `i`.
    fn script_on(&self, i: usize, steps: Vec<Step>) {
        self.workers[i].0.scripts.lock().unwrap().push_back(steps);
    }

    fn seen_on(&self, i: usize) -> Vec<pb::GenerateRequest> {
        self.workers[i].0.seen.lock().unwrap().clone()
    }

    async fn post(&self, path: &str, body: Value) -> axum::response::Response {
        let request = axum::http::Request::post(path)
            .header("authorization", format!("Bearer {}", self.key))
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        api::router(self.app.clone()).oneshot(request).await.unwrap()
    }

    /// Status, request id and the whole body as JSON.
    async fn json(&self, path: &str, body: Value) -> (u16, String, Value) {
        let response = self.post(path, body).await;
        let status = response.status().as_u16();
        let id = request_id(&response);
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        (status, id, serde_json::from_slice(&bytes).unwrap())
    }

    /// Status, request id and each event's data (JSON, or `[DONE]` as a string).
    async fn events(&self, path: &str, body: Value) -> (u16, String, Vec<Value>) {
        let response = self.post(path, body).await;
        let status = response.status().as_u16();
        let id = request_id(&response);
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        (status, id, data_lines(std::str::from_utf8(&bytes).unwrap()))
    }
}

fn request_id(response: &axum::response::Response) -> String {
    response.headers()["x-request-id"].to_str().unwrap().to_string()
}

fn data_lines(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| json!(d)))
        .collect()
}

fn chat(stream: bool) -> Value {
    json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hello"}],
           "max_tokens": 8, "stream": stream})
}

/// What the chat chunks of one choice say, joined.
fn content_of(chunks: &[Value], index: u64) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"].as_array())
        .flatten()
        .filter(|c| c["index"] == index)
        .filter_map(|c| c["delta"]["content"].as_str())
        .collect()
}

fn finish_of(chunks: &[Value], index: u64) -> Vec<String> {
    chunks
        .iter()
        .filter_map(|c| c["choices"].as_array())
        .flatten()
        .filter(|c| c["index"] == index)
        .filter_map(|c| c["finish_reason"].as_str().map(String::from))
        .collect()
}

/// Settlements run in the background once a request ends: waits (a bounded while) for
/// the record to appear.
async fn settled(h: &Harness, request_id: &str) -> tessera_control_plane::billing::ledger::UsageRecord {
    let wait = async {
        loop {
            if let Some(r) = h.app.db.ledger().usage_record(request_id).await.unwrap() {
                return r;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait).await.expect("the request settles")
}

/// A prefill replica's handoff after its first token: how its transfer went.
fn handoff(error: &str) -> Step {
    let transfer =
        pb::KvTransfer { blocks_sent: 1, bytes_sent: 100, blocks_stored: 1, seconds: 0.001, error: error.into() };
    Step::Send(pb::GenerateResponse {
        finish_reason: pb::FinishReason::Handoff as i32,
        transfer: Some(transfer),
        ..Default::default()
    })
}

/// A prefill replica's first delta: a token of a prompt of 2, 1 of them cached.
fn first_token() -> Step {
    Step::Send(pb::GenerateResponse { cached_prompt_tokens: 1, ..delta(0, "a1 ", pb::FinishReason::Unspecified) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_requests_go_on_whatever_side_fails_and_are_billed_once() {
    use pb::ServingRole::{Decode, Prefill};
    let body = json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8});
    // The decode replica's deltas report the prompt as found in its cache (the blocks
    // it was sent): the bill keeps the prefill replica's figures.
    let decoded = |text, finish| Step::Send(pb::GenerateResponse { cached_prompt_tokens: 2, ..delta(0, text, finish) });

    // As it should go: the first token from the prefill replica, which names the decode
    // replica chosen; the rest from that one, resumed after the first token.
    let h = Harness::with_roles(&[Prefill, Decode]).await;
    h.script_on(0, vec![first_token(), handoff("")]);
    h.script_on(1, vec![decoded("a2 ", pb::FinishReason::Unspecified), decoded("a3", pb::FinishReason::Stop)]);
    let (status, id, reply) = h.json("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["message"]["content"], "a1 a2 a3");
    assert_eq!(reply["usage"]["completion_tokens"], 3);
    assert_eq!(reply["usage"]["prompt_tokens_details"]["cached_tokens"], 1, "{reply}");
    let (prefill, decode) = (h.seen_on(0).remove(0), h.seen_on(1).remove(0));
    assert_eq!(prefill.handoff.as_ref().unwrap().decode_addr, h.workers[1].1);
    assert_eq!((prefill.request_id.as_str(), decode.request_id.clone()), (id.as_str(), format!("{id}-d")));
    assert_eq!((decode.resume_token_ids, decode.handoff), (vec![1], None));
    assert_eq!(decode.prompt_token_ids, prefill.prompt_token_ids);
    let bill = settled(&h, &id).await;
    assert_eq!((bill.prompt_tokens, bill.cached_tokens, bill.completion_tokens), (1, 1, 3));

    // The prefill replica lost mid-transfer, after its first token: the decode replica
    // goes on (computing the prompt it lacks), streamed.
    let h = Harness::with_roles(&[Prefill, Decode]).await;
    h.script_on(0, vec![first_token(), Step::Fail(Status::unavailable("killed"))]);
    h.script_on(1, vec![decoded("a2", pb::FinishReason::Length)]);
    let (status, id, chunks) = h.events("/v1/chat/completions", chat(true)).await;
    assert_eq!(status, 200);
    assert_eq!(content_of(&chunks, 0), "a1 a2");
    assert_eq!(finish_of(&chunks, 0), ["length"]);
    assert_eq!(h.seen_on(1)[0].resume_token_ids, [1]);
    assert_eq!(settled(&h, &id).await.completion_tokens, 2);

    // The decode replica lost mid-transfer: the prefill replica reports the failed
    // transfer, the decode replica refuses, and the request goes on elsewhere (here the
    // prefill replica itself, resumed: any replica can).
    let h = Harness::with_roles(&[Prefill, Decode]).await;
    h.script_on(0, vec![first_token(), handoff("sending KV blocks: connection refused")]);
    h.script_on(1, vec![Step::Fail(Status::unavailable("killed"))]);
    h.script_on(0, vec![decoded("a2", pb::FinishReason::Stop)]);
    let (status, id, reply) = h.json("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["message"]["content"], "a1 a2");
    let resumed = h.seen_on(0).remove(1);
    assert_eq!((resumed.resume_token_ids, resumed.handoff), (vec![1], None));
    assert_eq!(settled(&h, &id).await.completion_tokens, 2);

    // The prefill replica fails before its first token: the request is served whole,
    // by the decode replica, unbilled until it starts.
    let h = Harness::with_roles(&[Prefill, Decode]).await;
    h.script_on(0, vec![Step::Fail(Status::unavailable("killed"))]);
    h.script_on(1, vec![last(0, "b1", pb::FinishReason::Stop)]);
    let (status, id, reply) = h.json("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["message"]["content"], "b1");
    let whole = h.seen_on(1).remove(0);
    assert!(whole.resume_token_ids.is_empty() && whole.handoff.is_none());
    assert_eq!(settled(&h, &id).await.completion_tokens, 1);

    // The decode replica fails after its first delta: the stream ends with an error,
    // and what was generated on both sides is billed, once.
    let h = Harness::with_roles(&[Prefill, Decode]).await;
    h.script_on(0, vec![first_token(), handoff("")]);
    h.script_on(1, vec![decoded("a2 ", pb::FinishReason::Unspecified), Step::Fail(Status::internal("crash"))]);
    let (status, id, chunks) = h.events("/v1/chat/completions", chat(true)).await;
    assert_eq!(status, 200);
    assert_eq!(content_of(&chunks, 0), "a1 a2 ");
    assert!(chunks.iter().any(|c| c.get("error").is_some()), "{chunks:?}");
    let bill = settled(&h, &id).await;
    assert_eq!((bill.prompt_tokens, bill.completion_tokens), (1, 2));

    // A prompt shorter than the threshold is computed where it decodes, whole.
    let h = Harness::with_roles_from(&[Prefill, Decode], 2).await;
    h.script_on(1, vec![last(0, "d", pb::FinishReason::Stop)]);
    let (status, _, reply) = h.json("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{reply}");
    assert!(h.seen_on(0).is_empty() && h.seen_on(1)[0].handoff.is_none());

    // A prompt and one token is a prefill replica's work, whole.
    let h = Harness::with_roles(&[Prefill, Decode]).await;
    h.script_on(0, vec![last(0, "p", pb::FinishReason::Length)]);
    let one = json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1});
    let (status, _, reply) = h.json("/v1/chat/completions", one).await;
    assert_eq!(status, 200, "{reply}");
    assert!(h.seen_on(0)[0].handoff.is_none() && h.seen_on(1).is_empty());

    // Aggregated replicas beside the pools take whole requests (n = 2 here); n = 1 is
    // still handed over.
    let h = Harness::with_roles(&[pb::ServingRole::Aggregated, Prefill, Decode]).await;
    h.script_on(0, vec![last(0, "x", pb::FinishReason::Stop), last(1, "y", pb::FinishReason::Stop)]);
    let two =
        json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "n": 2});
    let (status, _, reply) = h.json("/v1/chat/completions", two).await;
    assert_eq!((status, reply["choices"][1]["message"]["content"].as_str()), (200, Some("y")), "{reply}");
    h.script_on(1, vec![first_token(), handoff("")]);
    h.script_on(2, vec![decoded("a2", pb::FinishReason::Stop)]);
    let (status, _, reply) = h.json("/v1/chat/completions", body.clone()).await;
    assert_eq!((status, reply["choices"][0]["message"]["content"].as_str()), (200, Some("a1 a2")), "{reply}");
    assert_eq!((h.seen_on(0).len(), h.seen_on(1).len(), h.seen_on(2).len()), (1, 1, 1));

    // n > 1 is never disaggregated: served whole by the decode replica.
    let h = Harness::with_roles(&[Prefill, Decode]).await;
    h.script_on(1, vec![last(0, "x", pb::FinishReason::Stop), last(1, "y", pb::FinishReason::Stop)]);
    let two =
        json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "n": 2});
    let (status, _, reply) = h.json("/v1/chat/completions", two).await;
    assert_eq!(status, 200, "{reply}");
    assert!(h.seen_on(0).is_empty() && h.seen_on(1)[0].handoff.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_stream_as_clients_and_the_bill_see_it() {
    let h = Harness::start().await;

    // Two choices, interleaved, each with its own end: each reaches its own index.
    h.script(vec![
        more(1, "b1 "),
        more(0, "a1 "),
        last(1, "b2", pb::FinishReason::Length),
        last(0, "a2", pb::FinishReason::Stop),
    ]);
    let body = json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hello"}],
                      "max_tokens": 8, "n": 2, "stream": true, "stream_options": {"include_usage": true}});
    let (status, id, chunks) = h.events("/v1/chat/completions", body).await;
    assert_eq!(status, 200);
    assert_eq!((content_of(&chunks, 0), content_of(&chunks, 1)), ("a1 a2".into(), "b1 b2".into()));
    assert_eq!((finish_of(&chunks, 0), finish_of(&chunks, 1)), (vec!["stop".into()], vec!["length".into()]));
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let usage = &chunks[chunks.len() - 2]["usage"];
    assert_eq!((usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()), (Some(2), Some(4)));
    let seen = h.worker.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!((seen.request_id.as_str(), seen.n), (id.as_str(), 2), "the worker knows the request by its id");
    let bill = settled(&h, &id).await;
    assert_eq!((bill.completion_tokens, bill.finish_reason.as_str()), (4, "stop"));

    // The same, whole: both choices gathered.
    h.script(vec![
        more(0, "a1 "),
        more(1, "b1"),
        last(0, "a2", pb::FinishReason::Stop),
        last(1, "", pb::FinishReason::Stop),
    ]);
    let body = json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hello"}],
                      "max_tokens": 8, "n": 2});
    let (status, _, reply) = h.json("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["message"]["content"], "a1 a2");
    assert_eq!(reply["choices"][1]["message"]["content"], "b1");
    assert_eq!(reply["usage"]["completion_tokens"], 4);

    // Who the request is for travels to the worker's scheduler: the organization, its
    // weight (the operator's), and the request's priority among the organization's own.
    h.app.weights.set(&h.org, Some(5)).await.unwrap();
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "test/scripted", "messages": [{"role": "user", "content": "hi"}], "priority": -3}),
        ),
        ("/v1/completions", json!({"model": "test/scripted", "prompt": "hi", "priority": -3})),
        ("/v1/responses", json!({"model": "test/scripted", "input": "hi", "priority": -3})),
    ] {
        h.script(vec![last(0, "ok", pb::FinishReason::Stop)]);
        let (status, _, reply) = h.json(path, body).await;
        assert_eq!(status, 200, "{path}: {reply}");
        let seen = h.worker.seen.lock().unwrap().last().cloned().unwrap();
        assert_eq!((seen.tenant.as_str(), seen.weight, seen.priority), (h.org.as_str(), 5, -3), "{path}");
    }
    let (status, _, reply) = h
        .json(
            "/v1/chat/completions",
            json!({"model": "test/scripted",
        "messages": [{"role": "user", "content": "hi"}], "priority": 1e10}),
        )
        .await;
    assert_eq!((status, reply["error"]["param"].as_str()), (400, Some("priority")), "{reply}");

    // Failure in the middle of a stream: what was sent stays, an error object ends the
    // stream (without the worker's words), the tokens generated are billed.
    h.script(vec![more(0, "Hel"), Step::Fail(Status::internal("engine state 0xdeadbeef"))]);
    let (status, id, chunks) = h.events("/v1/chat/completions", chat(true)).await;
    assert_eq!(status, 200);
    assert_eq!(content_of(&chunks, 0), "Hel");
    let error = &chunks[chunks.len() - 2]["error"];
    assert_eq!(error["type"], "server_error", "{chunks:?}");
    assert!(!error.to_string().contains("deadbeef"), "internal detail leaked: {error}");
    assert!(error["message"].as_str().unwrap().contains(&id), "the client is told the id to quote: {error}");
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let bill = settled(&h, &id).await;
    assert_eq!(bill.completion_tokens, 1, "the token generated before the failure is billed");
    assert!(bill.cost_micros > 0);

    // The Responses stream ends in response.failed.
    h.script(vec![more(0, "Hel"), Step::Fail(Status::internal("engine state 0xdeadbeef"))]);
    let body = json!({"model": "test/scripted", "input": "hello", "stream": true});
    let (status, _, events) = h.events("/v1/responses", body).await;
    assert_eq!(status, 200);
    let end = events.last().unwrap();
    assert_eq!((end["type"].as_str(), end["response"]["status"].as_str()), (Some("response.failed"), Some("failed")));
    assert!(events.iter().any(|e| e["type"] == "response.output_text.delta" && e["delta"] == "Hel"));

    // A choice the request did not ask for: an internal error, in a stream and out.
    h.script(vec![more(0, "a"), more(3, "z")]);
    let (status, _, chunks) = h.events("/v1/chat/completions", chat(true)).await;
    assert_eq!(status, 200);
    assert_eq!(chunks[chunks.len() - 2]["error"]["type"], "server_error", "{chunks:?}");
    h.script(vec![more(3, "z")]);
    let (status, id, reply) = h.json("/v1/chat/completions", chat(false)).await;
    assert_eq!((status, reply["error"]["type"].as_str()), (500, Some("server_error")), "{reply}");
    assert!(reply["error"]["message"].as_str().unwrap().contains(&id), "{reply}");

    // Output after a choice finished, and a stream that ends before its choice did.
    h.script(vec![last(0, "a", pb::FinishReason::Stop), more(0, "b")]);
    let (status, _, _) = h.json("/v1/chat/completions", chat(false)).await;
    assert_eq!(status, 500);
    h.script(vec![more(0, "a")]);
    let (status, _, reply) = h.json("/v1/chat/completions", chat(false)).await;
    assert_eq!(status, 500, "{reply}");

    // Legacy completions: the same events in their own wire format.
    h.script(vec![more(0, "one "), last(0, "two", pb::FinishReason::Length)]);
    let body = json!({"model": "test/scripted", "prompt": "hello", "max_tokens": 2, "stream": true});
    let (status, _, chunks) = h.events("/v1/completions", body).await;
    assert_eq!(status, 200);
    let texts: Vec<(&str, Option<&str>)> = chunks
        .iter()
        .filter_map(|c| Some((c["choices"][0]["text"].as_str()?, c["choices"][0]["finish_reason"].as_str())))
        .collect();
    assert_eq!(texts, [("one ", None), ("two", Some("length"))], "the last text carries the end");
    // An echo without log-probabilities goes out at once; the prompt's scores follow.
    let mut scored = delta(0, "x", pb::FinishReason::Stop);
    scored.prompt_logprobs = vec![pb::PromptToken { token_id: 1, logprob: -1.0, rank: 1, top_logprobs: vec![] }];
    h.script(vec![Step::Send(scored)]);
    let body = json!({"model": "test/scripted", "prompt": "hello world", "max_tokens": 2, "stream": true,
                      "echo": true, "prompt_logprobs": 0});
    let (status, _, chunks) = h.events("/v1/completions", body).await;
    assert_eq!(status, 200);
    assert_eq!(chunks[0]["choices"][0]["text"], "hello world", "{chunks:?}");
    let scores: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"][0].get("prompt_logprobs")).collect();
    assert_eq!(scores.len(), 1, "{chunks:?}");
    assert_eq!(scores[0][1]["1"]["logprob"], -1.0, "{chunks:?}");

    // The worker refuses the grammar: a 400 naming the client's parameter, by the kind
    // the status carries; nothing is billed.
    h.script(vec![Step::Fail(errors::status(Code::InvalidArgument, ErrorKind::GrammarRefused, "unknown type 'frob'"))]);
    let mut body = chat(false);
    body["response_format"] =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
    let (status, id, reply) = h.json("/v1/chat/completions", body).await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["param"], "response_format");
    assert!(reply["error"]["message"].as_str().unwrap().contains("unknown type 'frob'"), "{reply}");
    assert!(h.worker.seen.lock().unwrap().last().unwrap().grammar.is_some(), "the grammar reached the worker");
    let bill = settled(&h, &id).await;
    assert_eq!((bill.completion_tokens, bill.cost_micros), (0, 0));

    // A lagging worker: its first token reaches the client before the second exists;
    // a client that leaves meanwhile cancels the worker's call, and pays for what was
    // generated.
    let go = Arc::new(Notify::new());
    let cancelled = Arc::new(Notify::new());
    h.script(vec![more(0, "first"), Step::Wait(go.clone()), Step::HoldUntilCancelled(cancelled.clone())]);
    let response = h.post("/v1/chat/completions", chat(true)).await;
    let id = request_id(&response);
    let mut body = response.into_body().into_data_stream();
    let mut seen = String::new();
    let read = async {
        while !seen.contains("first") {
            seen.push_str(&String::from_utf8_lossy(&body.next().await.unwrap().unwrap()));
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read).await.expect("the first token arrives while the worker lags");
    drop(body);
    go.notify_one();
    tokio::time::timeout(Duration::from_secs(10), cancelled.notified()).await.expect("the worker's call is cancelled");
    let bill = settled(&h, &id).await;
    assert_eq!(bill.completion_tokens, 1, "{bill:?}");
    assert!(bill.cost_micros > 0);

    keep_alive_survives_early_answers(&h).await;

    // The only replica is gone before the first token: 503. (Last: the replica is out
    // of routing until its load stream reports again.)
    h.script(vec![Step::Fail(Status::unavailable("stopping"))]);
    let (status, _, reply) = h.json("/v1/chat/completions", chat(false)).await;
    assert_eq!(status, 503, "{reply}");
}

/// One response on `stream`: its head (lowercased) once its body has been read.
async fn response(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let length: usize =
                head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + length {
                return head;
            }
        }
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the connection closed before a whole response: {}", String::from_utf8_lossy(&buf));
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A request answered before its body is read (a key that does not exist: 401) leaves
/// a keep-alive connection usable, or says it will close: a pooled client never sends
/// its next request down a connection that is about to close.
async fn keep_alive_survives_early_answers(h: &Harness) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, api::router(h.app.clone())).into_future());
    let body = chat(false).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nauthorization: Bearer sk-nobody\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let next = "GET /health HTTP/1.1\r\nhost: t\r\n\r\n";

    // The body follows the head a moment later, as from a client whose body is a
    // separate write: it is read, and the connection serves the next request.
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    stream.write_all(body.as_bytes()).await.unwrap();
    let first = response(&mut stream).await;
    assert!(first.starts_with("http/1.1 401"), "{first}");
    assert!(!first.contains("connection: close"), "{first}");
    stream.write_all(next.as_bytes()).await.unwrap();
    assert!(response(&mut stream).await.starts_with("http/1.1 200"), "the connection still serves");

    // A client that sends its body only once answered: the answer says the
    // connection closes, so that nothing is sent down it again.
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let first = response(&mut stream).await;
    assert!(first.starts_with("http/1.1 401") && first.contains("connection: close"), "{first}");
}
