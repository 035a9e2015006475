//! The worker over gRPC, in-process on a loopback port with the real model: the
//! model card, concurrent streams equal to solo ones, aborts and dropped streams
//! returning every block, bad requests refused with INVALID_ARGUMENT (OUT_OF_RANGE past
//! the context, which the KV cache may cap).

mod common;

use common::{request, serve_config, serve_in_process, serve_in_process_at};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};
use tonic::transport::Channel;

/// A worker on a loopback port; the server stops when the runtime ends.
async fn start(kv_cache_bytes: u64) -> WorkerClient<Channel> {
    serve_in_process(serve_config(kv_cache_bytes)).await
}

/// Runs a request to its end; returns its tokens, text and finish reason.
async fn collect(mut client: WorkerClient<Channel>, req: pb::GenerateRequest) -> (Vec<u32>, String, i32) {
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let (mut tokens, mut text, mut finish) = (Vec::new(), String::new(), 0);
    while let Some(r) = stream.message().await.unwrap() {
        tokens.extend(r.tokens.iter().map(|t| t.token_id));
        text.push_str(&r.text);
        finish = r.finish_reason;
    }
    (tokens, text, finish)
}

/// Waits (on load reports, no sleeping) until nothing runs and no block is held.
async fn wait_until_idle(client: &mut WorkerClient<Channel>) -> pb::LoadReport {
    let mut reports = client.watch_load(pb::WatchLoadRequest::default()).await.unwrap().into_inner();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let r =
            tokio::time::timeout_at(deadline, reports.message()).await.expect("idle within a minute").unwrap().unwrap();
        if !r.snapshot && r.running == 0 && r.waiting == 0 && r.kv_blocks_used == 0 {
            return r;
        }
    }
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    // Token ids of short distinct texts, straight from the vocabulary.
    (0..n).map(|i| vec![504, 3575 + i as u32 % 50, 282, 4649 + i as u32, 314]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_stream_opens_with_the_prefix_cache_then_its_changes() {
    let mut client = start(64 << 20).await;
    let mut first = client.watch_load(pb::WatchLoadRequest::default()).await.unwrap().into_inner();
    let empty = first.message().await.unwrap().unwrap();
    assert!(empty.snapshot && empty.stored_block_hashes.is_empty(), "a fresh cache: {empty:?}");
    // 40 prompt tokens: two full blocks, cached once computed.
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + i).collect();
    collect(client.clone(), request("snap", prompt, 1)).await;
    let mut second = client.watch_load(pb::WatchLoadRequest::default()).await.unwrap().into_inner();
    let snapshot = second.message().await.unwrap().unwrap();
    assert!(snapshot.snapshot);
    assert!(snapshot.stored_block_hashes.len() >= 2, "{snapshot:?}");
    // The first watcher learnt the same blocks as changes.
    let mut learnt = std::collections::BTreeSet::new();
    while learnt.len() < snapshot.stored_block_hashes.len() {
        let r = first.message().await.unwrap().unwrap();
        assert!(!r.snapshot, "only the first report is a snapshot");
        learnt.extend(r.stored_block_hashes);
        r.removed_block_hashes.iter().for_each(|h| {
            learnt.remove(h);
        });
    }
    let snap: std::collections::BTreeSet<u64> = snapshot.stored_block_hashes.into_iter().collect();
    assert_eq!(learnt, snap);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_evicted_to_the_second_tier_are_reported_where_they_went() {
    // A cache of 24 blocks and a host tier of 64: a second 300-token prompt evicts the
    // first's blocks, which move to host memory.
    let block = 2 * 30 * 16 * 192 * 2;
    let kv_tier = tessera_worker::serve::KvTierArgs { kv_offload_bytes: 64 * block, ..Default::default() };
    let config = tessera_worker::serve::ServeConfig { kv_tier, ..serve_config(24 * block) };
    let mut client = serve_in_process(config).await;
    let mut watch = client.watch_load(pb::WatchLoadRequest::default()).await.unwrap().into_inner();
    assert!(watch.message().await.unwrap().unwrap().snapshot);
    let a: Vec<u32> = (0..300).map(|i| 1000 + i).collect();
    let b: Vec<u32> = (0..300).map(|i| 5000 + i).collect();
    collect(client.clone(), request("a", a, 1)).await;
    collect(client.clone(), request("b", b, 1)).await;
    // Each report says where each changed block is now.
    let mut places: HashMap<u64, &str> = HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while places.values().filter(|p| **p == "host").count() < 10 {
        let r = tokio::time::timeout_at(deadline, watch.message()).await.expect("reported").unwrap().unwrap();
        let lists =
            [(&r.stored_block_hashes, "device"), (&r.host_block_hashes, "host"), (&r.disk_block_hashes, "disk")];
        for (hashes, place) in lists {
            places.extend(hashes.iter().map(|&h| (h, place)));
        }
        for h in &r.removed_block_hashes {
            places.remove(h);
        }
    }
    // A new watcher starts from the same picture.
    let mut second = client.watch_load(pb::WatchLoadRequest::default()).await.unwrap().into_inner();
    let snapshot = second.message().await.unwrap().unwrap();
    let host: BTreeSet<u64> = places.iter().filter(|(_, p)| **p == "host").map(|(h, _)| *h).collect();
    assert_eq!(snapshot.host_block_hashes.iter().copied().collect::<BTreeSet<_>>(), host);
    assert!(snapshot.stored_block_hashes.iter().all(|h| places.get(h) == Some(&"device")));
}

/// Reads a prefill replica's stream: its first token (and text), then the handoff's
/// report.
async fn prefill(mut client: WorkerClient<Channel>, req: pb::GenerateRequest) -> (Vec<u32>, String, pb::KvTransfer) {
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.finish_reason, pb::FinishReason::Unspecified as i32, "the first token comes at once: {first:?}");
    let done = stream.message().await.unwrap().unwrap();
    assert_eq!(done.finish_reason, pb::FinishReason::Handoff as i32);
    assert!(done.tokens.is_empty() && done.text.is_empty());
    assert!(stream.message().await.unwrap().is_none(), "the handoff ends the stream");
    (first.tokens.iter().map(|t| t.token_id).collect(), first.text, done.transfer.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_replica_hands_its_blocks_to_a_decode_replica_which_goes_on_as_one_replica_would() {
    use tessera_proto::cluster::Role;
    let block = 2 * 30 * 16 * 192 * 2;
    let role =
        |disaggregation_mode| tessera_worker::serve::ServeConfig { disaggregation_mode, ..serve_config(64 * block) };
    let (p, _) = serve_in_process_at(role(Role::Prefill)).await;
    let (d, d_addr) = serve_in_process_at(role(Role::Decode)).await;
    let card = p.clone().get_model_card(pb::ModelCardRequest {}).await.unwrap().into_inner();
    assert_eq!(card.role(), pb::ServingRole::Prefill);
    assert_eq!(card.kv_identity.len(), 64);
    assert_eq!(
        d.clone().get_model_card(pb::ModelCardRequest {}).await.unwrap().into_inner().kv_identity,
        card.kv_identity
    );

    // 100 tokens: 6 full blocks go across; sampled with a seed, held to a stop string.
    let prompt: Vec<u32> = (0..100).map(|i| 2000 + i * 7).collect();
    let sampling = pb::SamplingParams { temperature: 0.9, seed: Some(7), ..Default::default() };
    let whole = pb::GenerateRequest {
        sampling: Some(sampling),
        stop: vec!["zzzz".into()],
        ..request("whole", prompt.clone(), 12)
    };
    let handoff = pb::KvHandoff { decode_addr: d_addr.clone(), skip_blocks: 0 };
    let first_half = pb::GenerateRequest { request_id: "p".into(), handoff: Some(handoff), ..whole.clone() };
    let (first, first_text, transfer) = prefill(p.clone(), first_half.clone()).await;
    assert_eq!(first.len(), 1);
    assert_eq!((transfer.blocks_sent, transfer.blocks_stored, transfer.error.as_str()), (6, 6, ""));
    assert_eq!(transfer.bytes_sent, 6 * block);

    // The decode replica goes on from the first token, the prompt's blocks found here.
    let second_half = pb::GenerateRequest { request_id: "d".into(), resume_token_ids: first.clone(), ..whole.clone() };
    let mut stream = d.clone().generate(second_half).await.unwrap().into_inner();
    let mut rest = Vec::new();
    let mut text = first_text;
    let mut cached = None;
    while let Some(r) = stream.message().await.unwrap() {
        cached.get_or_insert(r.cached_prompt_tokens);
        rest.extend(r.tokens.iter().map(|t| t.token_id));
        text.push_str(&r.text);
    }
    assert_eq!(cached, Some(96), "six blocks came from the prefill replica");
    assert_eq!(rest.len(), 11, "max_tokens counts the resumed token");
    // As one replica serves it whole (the seed's draws line up).
    let (tokens, whole_text, _) = collect(p.clone(), whole).await;
    assert_eq!([first, rest].concat(), tokens);
    assert_eq!(text, whole_text);

    // A second handoff of the same prompt sends only what the decode replica lacks.
    let skip = pb::KvHandoff { decode_addr: d_addr.clone(), skip_blocks: 4 };
    let again = pb::GenerateRequest { request_id: "p2".into(), handoff: Some(skip), ..first_half.clone() };
    let (_, _, transfer) = prefill(p.clone(), again).await;
    assert_eq!((transfer.blocks_sent, transfer.blocks_stored), (2, 0), "{transfer:?}");

    // A decode replica that cannot be reached: the first token still comes, and the
    // report says what failed.
    let gone = pb::KvHandoff { decode_addr: "127.0.0.1:1".into(), skip_blocks: 0 };
    let lost = pb::GenerateRequest { request_id: "p3".into(), handoff: Some(gone), ..first_half.clone() };
    let (tokens, _, transfer) = prefill(p.clone(), lost).await;
    assert_eq!(tokens.len(), 1);
    assert!(transfer.error.contains("127.0.0.1:1"), "{transfer:?}");

    // Blocks of other weights, another format, or for a replica without a tier to keep
    // them in, are refused.
    let chunk = |version, kv_identity: &str, block_bytes: u64| pb::KvChunk {
        header: Some(pb::KvTransferHeader {
            version,
            kv_identity: kv_identity.into(),
            block_bytes,
            request_id: "x".into(),
        }),
        blocks: vec![pb::KvBlock { hash: 1, data: vec![0; block_bytes as usize] }],
    };
    for (to, c) in [
        (d.clone(), chunk(1, "other", block)),
        (d.clone(), chunk(2, &card.kv_identity, block)),
        (d.clone(), chunk(1, &card.kv_identity, 4)),
        (p.clone(), chunk(1, &card.kv_identity, block)),
    ] {
        let refused = to.clone().push_kv(tokio_stream::iter([c])).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    }
    // A resumed request is refused where it cannot be one.
    let bad = pb::GenerateRequest { request_id: "b".into(), resume_token_ids: vec![1; 12], ..request("b", prompt, 12) };
    assert_eq!(d.clone().generate(bad).await.unwrap_err().code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_card_describes_the_model() {
    let mut client = start(32 << 20).await;
    let card = client.get_model_card(pb::ModelCardRequest {}).await.unwrap().into_inner();
    assert_eq!((card.bos_token_id, card.eos_token_ids.as_slice()), (Some(1), &[2][..]));
    assert_eq!((card.bos_token.as_str(), card.eos_token.as_str()), ("<|im_start|>", "<|im_end|>"));
    // 32 MiB hold 1,456 tokens of this model's half-float cache, less than its 8,192:
    // the card says what a request may use.
    assert_eq!((card.context_length, card.kv_block_size, card.vocab_size), (1456, 16, 49152));
    assert!(card.chat_template.contains("<|im_start|>"));
    let tokenizer = tokenizers::Tokenizer::from_bytes(card.tokenizer_json.as_bytes()).unwrap();
    assert_eq!(tokenizer.encode("Hello", false).unwrap().get_ids(), &[19556]);
    assert!(client.health(pb::HealthRequest {}).await.unwrap().into_inner().ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_streams_match_their_solo_runs() {
    let client = start(256 << 20).await;
    let prompts = prompts(64);
    let mut solo = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        solo.push(collect(client.clone(), request(&format!("solo-{i}"), p.clone(), 6)).await);
    }
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| tokio::spawn(collect(client.clone(), request(&format!("batch-{i}"), p.clone(), 6))))
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let got = h.await.unwrap();
        assert_eq!(got, solo[i], "request {i}");
        assert_eq!(got.2, pb::FinishReason::Length as i32);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_and_an_abort_return_every_block() {
    let mut client = start(64 << 20).await;
    // Dropped after its first response: the engine aborts it.
    let mut stream = client.generate(request("dropped", prompts(1)[0].clone(), 1000)).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some());
    drop(stream);
    let report = wait_until_idle(&mut client).await;
    assert!(report.kv_blocks_total > 0);
    // Aborted by id: its stream ends with ABORT.
    let mut stream = client.generate(request("aborted", prompts(2)[1].clone(), 1000)).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some());
    let found = client.abort(pb::AbortRequest { request_id: "aborted".into() }).await.unwrap().into_inner().found;
    assert!(found);
    let mut last = None;
    while let Some(r) = stream.message().await.unwrap() {
        last = Some(r.finish_reason);
    }
    assert_eq!(last, Some(pb::FinishReason::Abort as i32));
    wait_until_idle(&mut client).await;
    let again = client.abort(pb::AbortRequest { request_id: "aborted".into() }).await.unwrap().into_inner().found;
    assert!(!again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_a_reason() {
    let mut client = start(32 << 20).await;
    let cases = [
        (request("empty", vec![], 4), "prompt is empty"),
        (request("long", vec![5; 8192], 4), "context"),
        (request("max", vec![5; 10], 8190), "max_tokens"),
        // Within the model's context, beyond what the cache holds (the case).
        (request("cache", vec![5; 1380], 400), "the context is 1456 tokens, all this replica's KV cache holds"),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams { logit_bias: [(60000, 1.0)].into(), ..Default::default() }),
                ..request("bias", vec![5], 4)
            },
            "logit_bias token id 60000",
        ),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams { logprobs: Some(21), ..Default::default() }),
                ..request("lp", vec![5], 4)
            },
            "top_logprobs",
        ),
        (request("", vec![5], 4), "request_id"),
    ];
    for (req, want) in cases {
        let long = ["long", "max", "cache"].contains(&req.request_id.as_str());
        let Err(status) = client.generate(req).await else { panic!("refused") };
        let code = if long { tonic::Code::OutOfRange } else { tonic::Code::InvalidArgument };
        assert_eq!(status.code(), code, "{status:?}");
        // The kind the control plane answers by travels in the details.
        let kind = if long { pb::ErrorKind::ContextLength } else { pb::ErrorKind::InvalidRequest };
        assert_eq!(tessera_proto::errors::kind(&status), kind, "{status:?}");
        assert!(status.message().contains(want), "{} should mention {want:?}", status.message());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_and_cached_prompt_tokens_are_reported() {
    let client = start(64 << 20).await;
    let prompt: Vec<u32> = (0..40).map(|i| 500 + i).collect();
    let mut req = request("first", prompt.clone(), 2);
    req.sampling = Some(pb::SamplingParams { logprobs: Some(3), ..Default::default() });
    let mut c = client.clone();
    let mut stream = c.generate(req).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    let token = &first.tokens[0];
    assert!(token.logprob.unwrap() <= 0.0);
    assert_eq!(token.top_logprobs.len(), 3);
    assert_eq!(token.top_logprobs[0].token_id, token.token_id, "greedy picks the most likely");
    assert_eq!((first.prompt_tokens, first.cached_prompt_tokens), (40, 0));
    while stream.message().await.unwrap().is_some() {}
    let mut stream = c.generate(request("second", prompt, 1)).await.unwrap().into_inner();
    let second = stream.message().await.unwrap().unwrap();
    assert_eq!(second.cached_prompt_tokens, 32, "two full blocks came from the cache");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_completions_stream_with_their_index_until_all_finish() {
    let mut client = start(64 << 20).await;
    let req = pb::GenerateRequest { n: 2, ..request("two", prompts(1)[0].clone(), 3) };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut tokens = [0, 0];
    let mut finished = [false, false];
    while let Some(r) = stream.message().await.unwrap() {
        let i = r.index as usize;
        tokens[i] += r.tokens.len();
        finished[i] |= r.finish_reason == pb::FinishReason::Length as i32;
    }
    assert_eq!(tokens, [3, 3]);
    assert_eq!(finished, [true, true]);
}
