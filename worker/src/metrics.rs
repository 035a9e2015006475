//! A worker's Prometheus metrics, named and meant as vLLM's (so that dashboards and
//! alerts written for vLLM read Tessera's workers too), labelled by `model_name` and
//! `replica`. Each replica has a registry of its own, recorded into from its engine
//! thread alone and served at `GET /metrics` on its own port: a node running several
//! replicas in one process never reports one replica's figures at another's address.

use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use std::collections::HashMap;
use std::time::Instant;

pub const RUNNING: &str = "vllm:num_requests_running";
pub const WAITING: &str = "vllm:num_requests_waiting";
/// Share of the KV cache's blocks in use, 0 to 1.
pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// Prompt tokens looked up in the prefix cache, and found there.
pub const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
pub const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
pub const PREEMPTIONS: &str = "vllm:num_preemptions_total";
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
/// Finished requests, by `finished_reason` (stop, length, abort).
pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";
pub const TTFT: &str = "vllm:time_to_first_token_seconds";
pub const ITL: &str = "vllm:inter_token_latency_seconds";
pub const E2E: &str = "vllm:e2e_request_latency_seconds";
pub const QUEUE: &str = "vllm:request_queue_time_seconds";
pub const PREFILL: &str = "vllm:request_prefill_time_seconds";
pub const DECODE: &str = "vllm:request_decode_time_seconds";
/// Tokens computed per engine step.
pub const ITERATION_TOKENS: &str = "vllm:iteration_tokens_total";
/// Speculative decoding: sequences verified with proposals, the tokens proposed, those
/// accepted, and those accepted by their position in the proposal (`position`, from 0).
pub const SPEC_DRAFTS: &str = "vllm:spec_decode_num_drafts_total";
pub const SPEC_DRAFT_TOKENS: &str = "vllm:spec_decode_num_draft_tokens_total";
pub const SPEC_ACCEPTED_TOKENS: &str = "vllm:spec_decode_num_accepted_tokens_total";
pub const SPEC_ACCEPTED_PER_POS: &str = "vllm:spec_decode_num_accepted_tokens_per_pos_total";

/// Fair sharing (`engine::fair`), by `tenant` (the organization's id): sequences running
/// and waiting, and share of recent steps' rows (0 to 1). Only the `TOP_TENANTS` with
/// the most sequences are named; the rest are summed as `tenant="other"`. A tenant out
/// of the top for `TENANT_SERIES_EXPIRE` loses its series.
pub const TENANT_RUNNING: &str = "tessera:tenant_requests_running";
pub const TENANT_WAITING: &str = "tessera:tenant_requests_waiting";
pub const TENANT_SHARE: &str = "tessera:tenant_batch_share";
/// Preemptions that made room for another tenant's sequence (of `PREEMPTIONS`).
pub const FAIR_PREEMPTIONS: &str = "tessera:fair_preemptions_total";
pub const TOP_TENANTS: usize = 8;
/// The second KV tier (`engine::kv_tier`), by `tier` (host, disk): what it holds, the
/// blocks copied back from it (prefix hits there), and the bytes moved each way.
/// Recorded when the tier is on.
pub const TIER_BYTES: &str = "tessera:kv_tier_bytes";
pub const TIER_BLOCKS: &str = "tessera:kv_tier_blocks";
pub const TIER_HITS: &str = "tessera:kv_tier_hits_total";
pub const TIER_OFFLOADED_BYTES: &str = "tessera:kv_tier_offloaded_bytes_total";
pub const TIER_ONLOADED_BYTES: &str = "tessera:kv_tier_onloaded_bytes_total";
/// Blocks dropped from the lowest tier for room, and disk reads or writes that failed.
pub const TIER_DROPPED: &str = "tessera:kv_tier_dropped_blocks_total";
pub const TIER_DISK_ERRORS: &str = "tessera:kv_tier_disk_errors_total";
/// Disaggregated serving: KV bytes and blocks sent to decode replicas and received
/// from prefill replicas (`direction`), handoffs by outcome (sent, failed), and how
/// long each took from its first block to the receiver's reply.
pub const TRANSFER_BYTES: &str = "tessera:kv_transfer_bytes_total";
pub const TRANSFER_BLOCKS: &str = "tessera:kv_transfer_blocks_total";
pub const TRANSFERS: &str = "tessera:kv_transfers_total";
pub const TRANSFER_SECONDS: &str = "tessera:kv_transfer_seconds";
/// Gauges not set for this long leave the exposition; the engine's own are set every
/// report interval, so only tenants' series fall out of the top go.
const TENANT_SERIES_EXPIRE: std::time::Duration = std::time::Duration::from_secs(60);

/// Latency buckets, seconds: 1 ms to 2 minutes.
const SECONDS: [f64; 16] =
    [0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Tokens per step: 1 to 8192.
const TOKENS: [f64; 14] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0];

/// A replica's registry: the recorder its engine thread installs, and the handle that
/// renders it.
pub fn registry(model: &str, replica: &str) -> (PrometheusRecorder, PrometheusHandle) {
    let recorder = PrometheusBuilder::new()
        .add_global_label("model_name", model)
        .add_global_label("replica", replica)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(ITERATION_TOKENS.into()), &TOKENS))
        .expect("non-empty buckets")
        .idle_timeout(metrics_util::MetricKindMask::GAUGE, Some(TENANT_SERIES_EXPIRE))
        .build_recorder();
    let handle = recorder.handle();
    (recorder, handle)
}

/// Describes every metric (on the recorder installed where it is called).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(RUNNING, "Requests in the running batch.");
    describe_gauge!(WAITING, "Requests waiting to be scheduled.");
    describe_gauge!(KV_USAGE, "Share of KV-cache blocks in use (0 to 1).");
    describe_counter!(PREFIX_QUERIES, Unit::Count, "Prompt tokens looked up in the prefix cache.");
    describe_counter!(PREFIX_HITS, Unit::Count, "Prompt tokens found in the prefix cache.");
    describe_counter!(PREEMPTIONS, "Sequences preempted (their blocks freed, recomputed later).");
    describe_counter!(PROMPT_TOKENS, "Prompt tokens of finished requests.");
    describe_counter!(GENERATION_TOKENS, "Tokens generated.");
    describe_counter!(REQUEST_SUCCESS, "Finished requests, by finished_reason.");
    describe_gauge!(TENANT_RUNNING, "An organization's sequences running (the top 8; the rest as tenant=other).");
    describe_gauge!(TENANT_WAITING, "An organization's sequences waiting (the top 8; the rest as tenant=other).");
    describe_gauge!(TENANT_SHARE, "An organization's share of recent engine steps' rows, 0 to 1.");
    describe_counter!(FAIR_PREEMPTIONS, "Sequences preempted to make room for another organization's.");
    describe_gauge!(TIER_BYTES, Unit::Bytes, "KV blocks held in the second tier, by tier (host, disk).");
    describe_gauge!(TIER_BLOCKS, "KV blocks held in the second tier, by tier.");
    describe_counter!(TIER_HITS, "KV blocks copied back from the second tier instead of computed, by tier.");
    describe_counter!(TIER_OFFLOADED_BYTES, Unit::Bytes, "Bytes of evicted KV blocks copied to the second tier.");
    describe_counter!(TIER_ONLOADED_BYTES, Unit::Bytes, "Bytes of KV blocks copied back from the second tier.");
    describe_counter!(TIER_DROPPED, "KV blocks dropped from the lowest tier for room.");
    describe_counter!(TIER_DISK_ERRORS, "Disk-tier reads and writes that failed (the block is computed again).");
    describe_counter!(TRANSFER_BYTES, Unit::Bytes, "KV bytes moved between replicas, by direction (sent, received).");
    describe_counter!(TRANSFER_BLOCKS, "KV blocks moved between replicas, by direction.");
    describe_counter!(TRANSFERS, "Handoffs to decode replicas, by outcome (sent, failed).");
    describe_histogram!(TRANSFER_SECONDS, Unit::Seconds, "A handoff's KV transfer, from its first block to the reply.");
    describe_histogram!(TTFT, Unit::Seconds, "From arrival to the first generated token.");
    describe_histogram!(ITL, Unit::Seconds, "Between consecutive tokens of a request.");
    describe_histogram!(E2E, Unit::Seconds, "From arrival to the last token.");
    describe_histogram!(QUEUE, Unit::Seconds, "From arrival to the first step that computed it.");
    describe_histogram!(PREFILL, Unit::Seconds, "From the first step that computed it to its first token.");
    describe_histogram!(DECODE, Unit::Seconds, "From the first token to the last.");
    describe_histogram!(ITERATION_TOKENS, "Tokens computed per engine step.");
    describe_counter!(SPEC_DRAFTS, "Sequences verified with proposed tokens (speculative decoding).");
    describe_counter!(SPEC_DRAFT_TOKENS, Unit::Count, "Tokens proposed and verified.");
    describe_counter!(SPEC_ACCEPTED_TOKENS, Unit::Count, "Proposed tokens the model accepted.");
    describe_counter!(SPEC_ACCEPTED_PER_POS, Unit::Count, "Proposed tokens accepted, by position in the proposal.");
}

/// The tenants' series: the `TOP_TENANTS` with the most sequences by name (ties: the
/// larger share), the rest summed as "other" (absent when there is no rest); tenants
/// with nothing here and no share left out.
pub fn tenant_series(mut loads: Vec<crate::engine::scheduler::TenantLoad>) -> Vec<(String, usize, usize, f64)> {
    loads.retain(|l| l.running + l.waiting > 0 || l.share > 0.001);
    loads.sort_by(|a, b| {
        (b.running + b.waiting)
            .cmp(&(a.running + a.waiting))
            .then(b.share.total_cmp(&a.share))
            .then(a.tenant.cmp(&b.tenant))
    });
    let rest = loads.split_off(loads.len().min(TOP_TENANTS));
    let mut series: Vec<(String, usize, usize, f64)> =
        loads.into_iter().map(|l| (name(&l.tenant), l.running, l.waiting, l.share)).collect();
    if !rest.is_empty() {
        let sum = |f: fn(&crate::engine::scheduler::TenantLoad) -> f64| rest.iter().map(f).sum::<f64>();
        series.push((
            "other".into(),
            sum(|l| l.running as f64) as usize,
            sum(|l| l.waiting as f64) as usize,
            sum(|l| l.share),
        ));
    }
    series
}

/// A tenant's label: requests sent with none are "anonymous" (an empty label would
/// read as no label at all).
fn name(tenant: &str) -> String {
    if tenant.is_empty() { "anonymous".into() } else { tenant.into() }
}

/// When each request reached the milestones its histograms measure. The handles are
/// looked up once (on the engine thread, whose recorder they belong to): recording
/// through one is an atomic add, not a registry lookup, on every token.
pub struct RequestTimes {
    by_request: HashMap<u64, Times>,
    generated: Counter,
    prompt: Counter,
    queue: Histogram,
    ttft: Histogram,
    prefill: Histogram,
    itl: Histogram,
    e2e: Histogram,
    decode: Histogram,
}

impl Default for RequestTimes {
    fn default() -> Self {
        Self {
            by_request: HashMap::new(),
            generated: metrics::counter!(GENERATION_TOKENS),
            prompt: metrics::counter!(PROMPT_TOKENS),
            queue: metrics::histogram!(QUEUE),
            ttft: metrics::histogram!(TTFT),
            prefill: metrics::histogram!(PREFILL),
            itl: metrics::histogram!(ITL),
            e2e: metrics::histogram!(E2E),
            decode: metrics::histogram!(DECODE),
        }
    }
}

struct Times {
    arrived: Instant,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// The steps that computed its prompt, each's start and end.
    prefill: Vec<(Instant, Instant)>,
    preemptions: u32,
}

/// When a request reached each stage, for its trace: handed to the gRPC layer with its
/// last output.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    pub arrived: Instant,
    /// Each step that computed part of its prompt (the last one samples its first
    /// token): start and end.
    pub prefill: Vec<(Instant, Instant)>,
    pub first_token: Option<Instant>,
    pub ended: Instant,
    /// Times it was sent back to the queue to make room.
    pub preemptions: u32,
}

impl RequestTimes {
    pub fn arrived(&mut self, request: u64, at: Instant) {
        let times = Times {
            arrived: at,
            scheduled: None,
            first_token: None,
            last_token: None,
            prefill: Vec::new(),
            preemptions: 0,
        };
        self.by_request.insert(request, times);
    }

    /// A step from `began` to `ended` computed part of `request`: part of its prompt,
    /// when it has no token yet.
    pub fn stepped(&mut self, request: u64, began: Instant, ended: Instant) {
        if let Some(t) = self.by_request.get_mut(&request)
            && t.first_token.is_none()
        {
            t.prefill.push((began, ended));
        }
    }

    /// `request` went back to the queue to make room.
    pub fn preempted(&mut self, request: u64) {
        if let Some(t) = self.by_request.get_mut(&request) {
            t.preemptions += 1;
        }
    }

    /// A step that began at `at` computed part of `request`.
    pub fn scheduled(&mut self, request: u64, at: Instant) {
        if let Some(t) = self.by_request.get_mut(&request)
            && t.scheduled.is_none()
        {
            t.scheduled = Some(at);
            self.queue.record(at.duration_since(t.arrived).as_secs_f64());
        }
    }

    /// `request` produced a token at `at`.
    pub fn token(&mut self, request: u64, at: Instant) {
        self.generated.increment(1);
        let Some(t) = self.by_request.get_mut(&request) else { return };
        match t.last_token {
            None => {
                self.ttft.record(at.duration_since(t.arrived).as_secs_f64());
                let scheduled = t.scheduled.unwrap_or(t.arrived);
                self.prefill.record(at.duration_since(scheduled).as_secs_f64());
                t.first_token = Some(at);
            }
            Some(last) => self.itl.record(at.duration_since(last).as_secs_f64()),
        }
        t.last_token = Some(at);
    }

    /// `request` ended at `at` for `reason`, with a prompt of `prompt_tokens`: its
    /// timeline.
    pub fn finished(
        &mut self,
        request: u64,
        at: Instant,
        reason: &'static str,
        prompt_tokens: usize,
    ) -> Option<Timeline> {
        metrics::counter!(REQUEST_SUCCESS, "finished_reason" => reason).increment(1);
        self.prompt.increment(prompt_tokens as u64);
        let t = self.by_request.remove(&request)?;
        self.e2e.record(at.duration_since(t.arrived).as_secs_f64());
        if let (Some(first), Some(last)) = (t.first_token, t.last_token) {
            self.decode.record(last.duration_since(first).as_secs_f64());
        }
        Some(Timeline {
            arrived: t.arrived,
            prefill: t.prefill,
            first_token: t.first_token,
            ended: at,
            preemptions: t.preemptions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::scheduler::TenantLoad;

    #[test]
    fn tenant_series_name_the_busiest_and_sum_the_rest() {
        let load = |t: &str, running: usize, waiting: usize, share: f64| TenantLoad {
            tenant: t.into(),
            running,
            waiting,
            share,
        };
        let mut loads: Vec<TenantLoad> = (0..10).map(|i| load(&format!("org_{i}"), i, 1, 0.01 * i as f64)).collect();
        loads.push(load("", 20, 0, 0.5));
        loads.push(load("org_gone", 0, 0, 0.0));
        let series = tenant_series(loads);
        assert_eq!(series.len(), TOP_TENANTS + 1);
        assert_eq!(series[0], ("anonymous".into(), 20, 0, 0.5));
        assert_eq!(series[1].0, "org_9");
        // org_0, org_1 and org_2 are the rest; org_gone, idle with no share, is left out.
        let other = series.last().unwrap();
        assert_eq!((other.0.as_str(), other.1, other.2), ("other", 3, 3));
        assert!((other.3 - 0.03).abs() < 1e-9);
        assert!(!series.iter().any(|s| s.0 == "org_gone"));
        assert!(tenant_series(vec![load("a", 1, 0, 0.0)]).iter().all(|s| s.0 != "other"), "no rest, no other");
    }
}
