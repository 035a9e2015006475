//! A client that leaves frees its sequence whatever state it is in: running, waiting
//! for a slot, preempted back into the queue, or half way through its prompt. Each test
//! puts a request in that state, sees it there in the worker's own load reports, drops
//! its stream, and sees it gone in the reports — with the request that kept it there
//! still running, so that it cannot have left by finishing.

mod common;

use common::{request, serve_config, serve_in_process};
use std::collections::HashSet;
use std::time::Duration;
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};
use tessera_worker::serve::ServeConfig;
use tonic::Streaming;
use tonic::transport::Channel;

/// Bytes of KV cache per token of SmolLM2-135M (30 layers × K and V × 3 heads × 64 ×
/// 2 bytes: the served path's half floats).
const KV_BYTES_PER_TOKEN: u64 = 30 * 2 * 192 * 2;

/// Distinct prompt tokens from `from` on.
fn tokens(from: u32, len: u32) -> Vec<u32> {
    (from..from + len).collect()
}

/// A worker's load reports, followed from the start.
struct Reports {
    stream: Streaming<pb::LoadReport>,
    /// Every block hash the prefix cache ever reported storing.
    stored: HashSet<u64>,
}

impl Reports {
    async fn watch(client: &mut WorkerClient<Channel>) -> Self {
        let stream = client.watch_load(pb::WatchLoadRequest::default()).await.unwrap().into_inner();
        Self { stream, stored: HashSet::new() }
    }

    /// Reads reports until one (not the opening snapshot) satisfies `pred`.
    async fn until(&mut self, what: &str, pred: impl Fn(&pb::LoadReport) -> bool) -> pb::LoadReport {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let next = tokio::time::timeout_at(deadline, self.stream.message()).await;
            let r = next.unwrap_or_else(|_| panic!("never: {what}")).unwrap().unwrap();
            self.stored.extend(&r.stored_block_hashes);
            if !r.snapshot && pred(&r) {
                return r;
            }
        }
    }

    async fn idle(&mut self) {
        self.until("idle", |r| r.running == 0 && r.waiting == 0 && r.kv_blocks_used == 0).await;
    }
}

/// Aborts `id` by name; true if it was still running.
async fn abort(client: &mut WorkerClient<Channel>, id: &str) -> bool {
    client.abort(pb::AbortRequest { request_id: id.into() }).await.unwrap().into_inner().found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_sequence_is_freed_when_its_client_leaves() {
    let mut client = serve_in_process(serve_config(64 << 20)).await;
    let mut reports = Reports::watch(&mut client).await;
    let mut stream = client.generate(request("gone", tokens(1000, 5), 1400)).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some(), "it decodes");
    reports.until("running", |r| r.running == 1).await;
    drop(stream);
    reports.idle().await;
    // 1,400 tokens would have filled 87 blocks.
    assert!(reports.stored.len() < 20, "{} blocks stored: it ran on", reports.stored.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_sequence_is_freed_when_its_client_leaves() {
    // One sequence at a time: the second waits for the first, which runs long.
    let mut client = serve_in_process(ServeConfig { max_num_seqs: 1, ..serve_config(64 << 20) }).await;
    let mut reports = Reports::watch(&mut client).await;
    let mut first = client.generate(request("first", tokens(1000, 5), 1400)).await.unwrap().into_inner();
    assert!(first.message().await.unwrap().is_some());
    let second = client.generate(request("second", tokens(2000, 5), 4)).await.unwrap().into_inner();
    reports.until("the second waiting", |r| r.running == 1 && r.waiting == 1).await;
    drop(second);
    reports.until("the second gone", |r| r.running == 1 && r.waiting == 0).await;
    assert!(abort(&mut client, "first").await, "the first still ran: the second never did");
    reports.idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_sequence_is_freed_when_its_client_leaves() {
    // 22 blocks (352 tokens): two sequences that may each reach 345 tokens run side by
    // side until the cache is full, then the second goes back to the queue until the
    // first is done.
    let config = serve_config(22 * 16 * KV_BYTES_PER_TOKEN);
    let mut client = serve_in_process(config).await;
    let mut reports = Reports::watch(&mut client).await;
    let mut first = client.generate(request("first", tokens(1000, 5), 340)).await.unwrap().into_inner();
    assert!(first.message().await.unwrap().is_some());
    let mut second = client.generate(request("second", tokens(2000, 5), 340)).await.unwrap().into_inner();
    assert!(second.message().await.unwrap().is_some(), "both run");
    let r = reports.until("the second preempted", |r| r.preemptions > 0 && r.waiting == 1).await;
    assert_eq!(r.running, 1, "{r:?}");
    drop(second);
    reports.until("the second gone", |r| r.running == 1 && r.waiting == 0).await;
    assert!(abort(&mut client, "first").await, "the first still ran: the second could not come back");
    reports.idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_half_way_through_its_prompt_is_freed_when_its_client_leaves() {
    // 8 prompt tokens a step: a 1,200-token prompt takes 150 steps to prefill.
    let config = ServeConfig { max_num_batched_tokens: 8, ..serve_config(64 << 20) };
    let mut client = serve_in_process(config).await;
    let mut reports = Reports::watch(&mut client).await;
    let stream = client.generate(request("long", tokens(1000, 1200), 4)).await.unwrap().into_inner();
    reports.until("prefilling", |r| r.running == 1 && r.kv_blocks_used > 0).await;
    drop(stream);
    reports.idle().await;
    // Each full block of prompt joins the prefix cache as it is computed: the prefill
    // stopped short of its 75.
    assert!(reports.stored.len() < 60, "{} of 75 prompt blocks computed", reports.stored.len());
}
