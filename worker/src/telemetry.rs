//! Logs and traces, set up once per process by both binaries (`tessera` and
//! `tessera-worker`): log lines on standard error, as text or one JSON object a line,
//! and, when an OTLP endpoint is configured, spans exported over OTLP/gRPC, sampled by
//! ratio unless the caller's trace context decides. The W3C trace context crosses the
//! control plane → worker call in gRPC metadata (`inject`, `extract`), and comes in
//! from a client's `traceparent` header (`extract`), so one trace holds a client's
//! span, the control plane's and the worker's.
//!
//! Export runs on the SDK's own thread and never in a request's path: a collector that
//! is slow or gone costs a request nothing (spans beyond the queue are dropped).

use anyhow::{Result, ensure};
use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use std::time::Duration;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue, KeyRef, MetadataMap};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Where traces go, and how many are kept.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct TraceConfig {
    /// Export traces over OTLP/gRPC to this collector (`http://collector:4317`); none
    /// are recorded when unset.
    #[arg(long = "otlp-traces-endpoint", env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", global = true)]
    pub endpoint: Option<String>,
    /// The share of requests traced (0 to 1) when the caller's `traceparent` does not
    /// decide: one it sampled is always traced, one it did not never is.
    #[arg(
        long = "otlp-traces-sample-ratio",
        env = "TESSERA_OTLP_TRACES_SAMPLE_RATIO",
        default_value_t = 1.0,
        global = true
    )]
    pub sample_ratio: f64,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self { endpoint: None, sample_ratio: 1.0 }
    }
}

/// Keeps the exporter running; dropping it sends the spans still queued.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // On a thread of its own: the exporter's channel may need the runtime this
            // drop would otherwise block.
            let _ = std::thread::spawn(move || provider.shutdown_with_timeout(Duration::from_secs(5))).join();
        }
    }
}

/// How long one export may take before it is given up.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Sets up logs (`default_filter` unless RUST_LOG says otherwise; JSON lines when
/// `json`), and traces to `traces.endpoint` under service name `service`. Called inside
/// a Tokio runtime when traces are on: the exporter's channel runs on it. A subscriber
/// already set (a test's) stays.
pub fn init(json: bool, default_filter: &str, traces: &TraceConfig, service: &'static str) -> Result<Telemetry> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into());
    // A log nobody reads any more (its pipe closed) loses lines, never a request: the
    // layer would otherwise report the failed write with a print that panics.
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).log_internal_errors(false);
    let fmt = if json { fmt.json().boxed() } else { fmt.boxed() };
    let (otel, provider) = match &traces.endpoint {
        None => (None, None),
        Some(endpoint) => {
            ensure!(
                (0.0..=1.0).contains(&traces.sample_ratio),
                "--otlp-traces-sample-ratio is a share of requests, 0 to 1 (got {})",
                traces.sample_ratio
            );
            // Plain gRPC only: a collector beside the process, or a sidecar, terminates TLS.
            ensure!(
                endpoint.starts_with("http://"),
                "--otlp-traces-endpoint is an http:// URL, like http://collector:4317 (got {endpoint})"
            );
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build()?;
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(traces.sample_ratio))))
                .with_resource(Resource::builder().with_service_name(service).build())
                .build();
            // Tessera's own spans, whatever RUST_LOG lets the log show.
            let ours = Targets::new()
                .with_target("tessera_control_plane", LevelFilter::INFO)
                .with_target("tessera_worker", LevelFilter::INFO);
            let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer(service)).with_filter(ours);
            // The stages of a worker's requests are made through the API (`stages`).
            opentelemetry::global::set_tracer_provider(provider.clone());
            (Some(layer), Some(provider))
        }
    };
    let _ = tracing_subscriber::registry().with(fmt.with_filter(filter)).with(otel).try_init();
    Ok(Telemetry { provider })
}

/// Whether log lines are JSON: TESSERA_LOG_FORMAT=json, as `tessera` passes it on.
pub fn json_from_env() -> bool {
    std::env::var("TESSERA_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"))
}

/// The stages of a request, as children of its span, from the times the engine kept:
/// `queue` from its arrival to its first step, a `prefill` for each step that computed
/// part of its prompt, `decode` from its first token to its end. The engine's thread
/// runs every request's steps together, so the spans are made once the request ends,
/// with the times they had.
pub fn stages(span: &tracing::Span, t: &crate::metrics::Timeline) {
    use opentelemetry::KeyValue;
    use opentelemetry::trace::{Span as _, TraceContextExt, Tracer};
    let parent = span.context();
    if !parent.span().span_context().is_sampled() {
        return;
    }
    let tracer = opentelemetry::global::tracer("tessera-worker");
    let (now, wall) = (std::time::Instant::now(), std::time::SystemTime::now());
    let at = |i: std::time::Instant| wall - now.saturating_duration_since(i);
    let stage = |name: &'static str, from: std::time::Instant, to: std::time::Instant, attributes: Vec<KeyValue>| {
        let mut s = tracer
            .span_builder(name)
            .with_start_time(at(from))
            .with_attributes(attributes)
            .start_with_context(&tracer, &parent);
        s.end_with_timestamp(at(to));
    };
    stage("queue", t.arrived, t.prefill.first().map_or(t.ended, |step| step.0), Vec::new());
    for (i, &(from, to)) in t.prefill.iter().enumerate() {
        stage("prefill", from, to, vec![KeyValue::new("tessera.prefill.step", i as i64)]);
    }
    if let Some(first) = t.first_token {
        stage("decode", first, t.ended, vec![KeyValue::new("tessera.preemptions", i64::from(t.preemptions))]);
    }
}

struct ReadHeaders<'a>(&'a HeaderMap);

impl Extractor for ReadHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct ReadMetadata<'a>(&'a MetadataMap);

impl Extractor for ReadMetadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        let ascii = |k| match k {
            KeyRef::Ascii(k) => Some(k.as_str()),
            KeyRef::Binary(_) => None,
        };
        self.0.keys().filter_map(ascii).collect()
    }
}

struct WriteMetadata<'a>(&'a mut MetadataMap);

impl Injector for WriteMetadata<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) =
            (AsciiMetadataKey::from_bytes(key.as_bytes()), AsciiMetadataValue::try_from(&value))
        {
            self.0.insert(key, value);
        }
    }
}

/// Names `span` anew in its trace (its `otel.name` is read only when it starts).
pub fn rename(span: &tracing::Span, name: String) {
    use opentelemetry::trace::TraceContextExt;
    span.context().span().update_name(name);
}

/// Makes `span` a child of the trace context a client's HTTP `headers` carry
/// (`traceparent`), if any.
pub fn adopt(span: &tracing::Span, headers: &HeaderMap) {
    join(span, &ReadHeaders(headers));
}

/// Makes `span` a child of the trace context a worker call's `metadata` carries.
pub fn adopt_call(span: &tracing::Span, metadata: &MetadataMap) {
    join(span, &ReadMetadata(metadata));
}

fn join(span: &tracing::Span, carrier: &dyn Extractor) {
    let parent = TraceContextPropagator::new().extract(carrier);
    // Fails only when no trace layer is installed: nothing to join then.
    let _ = span.set_parent(parent);
}

/// `span`'s trace context, as `traceparent` (and `tracestate`), into `metadata`: the
/// worker's span for the call becomes its child.
pub fn inject(span: &tracing::Span, metadata: &mut MetadataMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut WriteMetadata(metadata));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused_before_anything_starts() {
        let ratio = TraceConfig { endpoint: Some("http://127.0.0.1:1".into()), sample_ratio: 1.5 };
        assert!(init(false, "warn", &ratio, "t").err().unwrap().to_string().contains("0 to 1"));
        let scheme = TraceConfig { endpoint: Some("127.0.0.1:4317".into()), sample_ratio: 1.0 };
        assert!(init(false, "warn", &scheme, "t").err().unwrap().to_string().contains("http://"));
    }
}
