//! Traces across processes: `tessera serve --otlp-traces-endpoint` exports its spans and
//! its worker's to a real OTLP receiver (OpenTelemetry's own protocol, served here on
//! port 0). A streamed chat request that carries a client's W3C `traceparent` makes one
//! trace: the control plane's span a child of the client's, the worker's a child of the
//! control plane's, with the GenAI conventions' attributes and the organization, and no
//! key or prompt in any attribute. A request without one starts a trace of its own.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::sync::{Arc, Mutex};
use tessera_e2e::{Serve, python, until};

/// Every span received, with the service that sent it.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<(String, Span)>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = self.0.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            let attributes = resource.resource.map(|r| r.attributes).unwrap_or_default();
            let service = text(&attributes, "service.name").unwrap_or_default();
            for scope in resource.scope_spans {
                received.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An attribute's value, as text.
fn text(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|a| a.key == key)?.value.as_ref()?.value.as_ref()?;
    Some(match value {
        Any::StringValue(s) => s.clone(),
        Any::IntValue(i) => i.to_string(),
        Any::DoubleValue(d) => d.to_string(),
        Any::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_holds_the_client_the_control_plane_and_the_worker() {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let receiving = tokio::spawn(server);
    let data = tempfile::tempdir().unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let serve = tokio::task::block_in_place(|| Serve::start(data.path(), &["--otlp-traces-endpoint", &endpoint], &[]));

    let (trace_id, client_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let script = r#"
import json, os, urllib.request
def post(headers):
    body = {"model": "vendor-a/model-a", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "SECRET-PROMPT-TEXT say hi"}]}
    req = urllib.request.Request(os.environ["BASE"] + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["KEY"], "Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req) as r:
        r.read()
        return r.headers["x-request-id"]
print(post({"traceparent": "00-" + os.environ["TRACE"] + "-" + os.environ["PARENT"] + "-01"}))
print(post({}))
"#;
    let env = [("TRACE", trace_id.to_string()), ("PARENT", client_span.to_string())];
    let out = python(script, &serve.base_url(), &serve.key, &env).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ids: Vec<String> = String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect();

    // The first request's trace: the control plane's span and the worker's, exported
    // on their batches' schedules.
    let spans = tokio::task::block_in_place(|| {
        until(60, "spans of both processes in the client's trace", || {
            let received = receiver.0.lock().unwrap();
            let ours: Vec<(String, Span)> =
                received.iter().filter(|(_, s)| hex(&s.trace_id) == trace_id).cloned().collect();
            let services = |name: &str| {
                ours.iter().any(|(s, span)| {
                    s == name && span.parent_span_id.len() == 8 && { name == "tessera" || span.name == "llm_request" }
                })
            };
            let second = received.iter().any(|(_, s)| text(&s.attributes, "request_id").as_deref() == Some(&ids[1]));
            (services("tessera") && services("tessera-worker") && second).then_some(ours)
        })
    });
    let requests: Vec<&Span> = spans
        .iter()
        .filter(|(svc, s)| svc == "tessera" && text(&s.attributes, "request_id").is_some())
        .map(|(_, s)| s)
        .collect();
    assert_eq!(requests.len(), 1, "one request span in the trace: {spans:?}");
    let request = requests[0];
    assert_eq!(request.name, "chat vendor-a/model-a");
    assert_eq!(hex(&request.parent_span_id), client_span, "a child of the client's span");
    assert_eq!(text(&request.attributes, "request_id").as_deref(), Some(ids[0].as_str()));
    assert_eq!(text(&request.attributes, "gen_ai.operation.name").as_deref(), Some("chat"));
    assert_eq!(text(&request.attributes, "gen_ai.request.model").as_deref(), Some("vendor-a/model-a"));
    assert_eq!(text(&request.attributes, "gen_ai.request.max_tokens").as_deref(), Some("4"));
    let tokens = |span: &Span, key: &str| text(&span.attributes, key).and_then(|t| t.parse::<u64>().ok()).unwrap_or(0);
    assert!(tokens(request, "gen_ai.usage.input_tokens") > 0 && tokens(request, "gen_ai.usage.output_tokens") > 0);
    assert!(text(&request.attributes, "tessera.organization.id").is_some_and(|o| o.starts_with("org_")));
    let worker = spans.iter().find(|(svc, s)| svc == "tessera-worker" && s.name == "llm_request").map(|(_, s)| s);
    let worker = worker.unwrap_or_else(|| panic!("no llm_request span: {spans:?}"));
    assert_eq!(worker.parent_span_id, request.span_id, "the worker's span is the control plane's child");
    assert_eq!(text(&worker.attributes, "request_id").as_deref(), Some(ids[0].as_str()));
    assert_eq!(text(&worker.attributes, "tessera.outcome").as_deref(), Some("finished"));
    assert!(text(&worker.attributes, "gen_ai.latency.time_in_queue").is_some());
    assert!(text(&worker.attributes, "gen_ai.latency.time_to_first_token").is_some());
    assert_eq!(text(&worker.attributes, "tessera.preemptions").as_deref(), Some("0"));
    // The engine's stages, children of the worker's span, in order: queue, each
    // prefill step, decode.
    let stages: Vec<&Span> = spans
        .iter()
        .filter(|(svc, s)| svc == "tessera-worker" && s.parent_span_id == worker.span_id)
        .map(|(_, s)| s)
        .collect();
    let named = |name: &str| stages.iter().filter(|s| s.name == name).copied().collect::<Vec<_>>();
    let (queue, prefill, decode) = (named("queue"), named("prefill"), named("decode"));
    assert!(queue.len() == 1 && !prefill.is_empty() && decode.len() == 1, "{stages:?}");
    assert!(queue[0].end_time_unix_nano <= prefill[0].start_time_unix_nano + 1_000_000);
    assert!(prefill.last().unwrap().start_time_unix_nano <= decode[0].start_time_unix_nano);
    // What one streamed chat request's trace looks like, for whoever reads the log.
    let origin = request.start_time_unix_nano;
    let mut all: Vec<&(String, Span)> = spans.iter().collect();
    all.sort_by_key(|(_, s)| s.start_time_unix_nano);
    for (svc, s) in all {
        let ms = |ns: u64| ns.saturating_sub(origin) as f64 / 1e6;
        let took = (s.end_time_unix_nano - s.start_time_unix_nano) as f64 / 1e6;
        eprintln!("trace: {svc:>14} {:<24} +{:8.2} ms  {took:8.2} ms", s.name, ms(s.start_time_unix_nano));
    }

    // Nothing secret leaves: no key, no prompt, in any attribute of any span.
    let received = receiver.0.lock().unwrap().clone();
    for (_, span) in &received {
        for a in &span.attributes {
            let value = text(std::slice::from_ref(a), &a.key).unwrap_or_default();
            assert!(!value.contains(&serve.key) && !value.contains("SECRET-PROMPT"), "{}: {value}", a.key);
        }
    }
    // The request without a traceparent has a trace of its own.
    let (_, other) =
        received.iter().find(|(_, s)| text(&s.attributes, "request_id").as_deref() == Some(&ids[1])).unwrap();
    assert_ne!(hex(&other.trace_id), trace_id);

    // With the collector gone, exports fail and requests do not.
    receiving.abort();
    let _ = receiving.await;
    let again = python(script, &serve.base_url(), &serve.key, &env).output().unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
}
