//! The control plane's Prometheus metrics: every name in one place, described once, and
//! the recorder that renders them for `GET /metrics`. Gauges of state the process holds
//! anyway (etcd connection, leadership, ready replicas) are set when scraped, not kept
//! up to date on every change.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// HTTP requests answered, by `route` (the matched path), `status` and `model`.
pub const HTTP_REQUESTS: &str = "tessera_http_requests_total";
/// Time to the response's head (a stream's first byte), by `route`.
pub const HTTP_DURATION: &str = "tessera_http_request_duration_seconds";
/// 1 while the replica table's etcd connection is up (cluster mode).
pub const ETCD_CONNECTED: &str = "tessera_etcd_connected";
/// The etcd revision the replica table has applied.
pub const ETCD_REVISION: &str = "tessera_etcd_revision";
/// 1 while this process leads placement.
pub const PLACEMENT_LEADER: &str = "tessera_placement_leader";
/// Replicas ready to serve, by `model` (cluster mode: from the replica table).
pub const READY_REPLICAS: &str = "tessera_ready_replicas";

/// Requests refused at admission or dispatch, by `outcome`: rate_limited,
/// window_exhausted (a subscription's usage window), insufficient_quota, overloaded.
pub const REFUSALS: &str = "tessera_admission_refusals_total";
/// Routing choices, by `model` (the weights) and `outcome`: cached (the replica chosen
/// held part of the prompt), uncached, none (every replica saturated or gone).
pub const ROUTING_DECISIONS: &str = "tessera_routing_decisions_total";
/// Prompt blocks routed, and those the chosen replica held (their ratio is the
/// router's prefix hit rate), by `model`.
pub const ROUTED_BLOCKS: &str = "tessera_routing_prompt_blocks_total";
pub const ROUTED_CACHED_BLOCKS: &str = "tessera_routing_cached_blocks_total";
/// Streams ended by an error after their 200 had gone out, by the error's `code` (or
/// type): the failures a status count cannot show.
/// Disaggregated requests handed from a prefill replica to a decode replica, by model
/// and outcome: `transferred` (the KV blocks arrived), `transfer_failed` (the decode
/// side computed the prompt again), `prefill_lost` (the prefill replica failed after
/// its first token).
pub const HANDOFFS: &str = "tessera_handoffs_total";
pub const STREAM_ERRORS: &str = "tessera_stream_errors_total";
/// From a request's end to its bill in the ledger.
pub const SETTLEMENT: &str = "tessera_billing_settlement_seconds";
/// Settlements that failed every retry (their holds are released later).
pub const SETTLEMENT_FAILURES: &str = "tessera_billing_settlement_failures_total";
/// Budget leases taken or renewed (credit moved from an organization's account into a
/// control plane's lease).
pub const LEASE_RENEWALS: &str = "tessera_budget_lease_renewals_total";
/// Budget leases returned to their organization, by `reason`: idle, shutdown, expired
/// (another control plane returned a dead one's).
pub const LEASE_RETURNS: &str = "tessera_budget_lease_returns_total";
/// Rate-limit tokens taken from the database in batches (one per batch).
pub const RATE_TOKEN_LEASES: &str = "tessera_rate_limit_token_leases_total";
/// Each model's supply state: 0 low, 1 medium, 2 high, 3 surplus.
pub const SUPPLY_STATE: &str = "tessera_supply_state";
/// The replicas' load behind that state, 0 to 1.
pub const SUPPLY_LOAD: &str = "tessera_supply_load_ratio";

/// The endpoint's latency, by `model` and `endpoint` (chat.completions, completions,
/// responses), as a client streaming the reply sees it (the names follow vLLM's
/// `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
/// `vllm:e2e_request_latency_seconds` and NVIDIA Dynamo's frontend metrics): from the
/// request's arrival to its first token,
pub const TIME_TO_FIRST_TOKEN: &str = "tessera_time_to_first_token_seconds";
/// between two tokens (each delta's gap over its tokens),
pub const INTER_TOKEN_LATENCY: &str = "tessera_inter_token_latency_seconds";
/// from arrival to the end of the reply,
pub const REQUEST_DURATION: &str = "tessera_request_duration_seconds";
/// and the tokens of each request's prompt and output.
pub const REQUEST_PROMPT_TOKENS: &str = "tessera_request_prompt_tokens";
pub const REQUEST_OUTPUT_TOKENS: &str = "tessera_request_output_tokens";

/// Latency buckets, seconds: 5 ms to 2 minutes.
const SECONDS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Inter-token buckets, seconds: 1 ms to 2.5 s (vLLM's, from 1 ms).
const ITL_SECONDS: [f64; 16] =
    [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5];
/// Token-count buckets: 1 to 128 Ki, doubling.
const TOKENS: [f64; 18] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
    65536.0, 131072.0,
];

/// The process's recorder, installed on first use. In a process that already has
/// another global recorder (tests running several servers) the handle still renders
/// this one's (then empty) registry.
pub fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)
            .and_then(|b| b.set_buckets_for_metric(Matcher::Full(INTER_TOKEN_LATENCY.into()), &ITL_SECONDS))
            .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_tokens".into()), &TOKENS))
            .expect("non-empty buckets")
            .build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_ok() {
            describe();
            start_at_zero();
        }
        handle
    })
}

/// Counters of events that may not have happened yet exist from the start (at zero), so
/// that rates and alerts over them read 0, not "no data".
fn start_at_zero() {
    for outcome in ["rate_limited", "window_exhausted", "insufficient_quota", "overloaded"] {
        metrics::counter!(REFUSALS, "outcome" => outcome).absolute(0);
    }
    metrics::counter!(SETTLEMENT_FAILURES).absolute(0);
    metrics::counter!(LEASE_RENEWALS).absolute(0);
    for reason in ["idle", "shutdown", "expired"] {
        metrics::counter!(LEASE_RETURNS, "reason" => reason).absolute(0);
    }
    metrics::counter!(RATE_TOKEN_LEASES).absolute(0);
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(HTTP_REQUESTS, "HTTP requests answered, by route, status and model.");
    describe_histogram!(HTTP_DURATION, Unit::Seconds, "Time to the response head (a stream's first byte), by route.");
    describe_counter!(LEASE_RENEWALS, "Budget leases taken or renewed from organizations' credit.");
    describe_counter!(LEASE_RETURNS, "Budget leases returned to their organizations, by reason.");
    describe_counter!(RATE_TOKEN_LEASES, "Rate-limit tokens taken from the database in batches.");
    describe_gauge!(ETCD_CONNECTED, "1 while the control plane's etcd connection is up.");
    describe_gauge!(ETCD_REVISION, "The etcd revision of the replica table.");
    describe_gauge!(PLACEMENT_LEADER, "1 while this control plane leads placement.");
    describe_gauge!(READY_REPLICAS, "Replicas ready to serve, by model.");
    describe_counter!(REFUSALS, "Requests refused at admission or dispatch, by outcome.");
    describe_counter!(STREAM_ERRORS, "Streams ended by an error after their 200, by the error's code.");
    describe_counter!(ROUTING_DECISIONS, "Routing choices, by model and outcome (cached, uncached, none).");
    describe_counter!(HANDOFFS, "Requests handed from a prefill to a decode replica, by model and outcome.");
    describe_counter!(ROUTED_BLOCKS, "Prompt blocks routed, by model.");
    describe_counter!(ROUTED_CACHED_BLOCKS, "Routed prompt blocks the chosen replica held, by model.");
    describe_histogram!(SETTLEMENT, Unit::Seconds, "From a request's end to its bill in the ledger.");
    describe_counter!(SETTLEMENT_FAILURES, "Settlements that failed every retry.");
    describe_gauge!(SUPPLY_STATE, "Supply state by model: 0 low, 1 medium, 2 high, 3 surplus.");
    describe_gauge!(SUPPLY_LOAD, "The replicas' load behind the supply state, 0 to 1.");
    describe_histogram!(
        TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "From a request's arrival to its first token, by model and endpoint."
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY,
        Unit::Seconds,
        "Between two output tokens of a reply, by model and endpoint."
    );
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "From a request's arrival to the end of its reply, by model and endpoint."
    );
    describe_histogram!(REQUEST_PROMPT_TOKENS, Unit::Count, "Prompt tokens of each request, by model and endpoint.");
    describe_histogram!(REQUEST_OUTPUT_TOKENS, Unit::Count, "Output tokens of each request, by model and endpoint.");
}
