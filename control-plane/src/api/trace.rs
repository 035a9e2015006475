//! What a request's span says, in OpenTelemetry's GenAI conventions: the operation and
//! model (also the span's name, `chat vendor-a/model-a`), the sampling asked for, the
//! response's id, and at its end the finish reason and tokens; with the organization
//! billed. Never a key, a prompt or an output: spans leave the process.
//!
//! The span is the request's own (`observe` opens it, a client's `traceparent` its
//! parent); these record into it from wherever the request is being served.

use super::generate::Generation;
use super::stream::Usage;
use tracing::Span;

/// A request's span, with the fields the functions below fill declared empty.
pub fn request_span(id: &str, method: &str, route: &str) -> Span {
    use tracing::field::Empty;
    tracing::info_span!(
        "request",
        request_id = %id,
        client_request_id = Empty,
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = Empty,
        gen_ai.operation.name = Empty,
        gen_ai.provider.name = Empty,
        gen_ai.request.model = Empty,
        gen_ai.request.max_tokens = Empty,
        gen_ai.request.temperature = Empty,
        gen_ai.request.top_p = Empty,
        gen_ai.response.id = Empty,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        tessera.organization.id = Empty,
    )
}

/// The GenAI operation an endpoint performs.
fn operation(endpoint: &str) -> &'static str {
    match endpoint {
        "completions" => "text_completion",
        _ => "chat",
    }
}

/// A generation admitted: what it is, on which model, with what sampling, billed to
/// whom. (The span is renamed for it: `otel.name` is read only when a span starts.)
pub fn admitted(endpoint: &str, model: &str, org_id: &str, g: &Generation) {
    let span = Span::current();
    let op = operation(endpoint);
    tessera_worker::telemetry::rename(&span, format!("{op} {model}"));
    span.record("gen_ai.operation.name", op);
    span.record("gen_ai.provider.name", "tessera");
    span.record("gen_ai.request.model", model);
    span.record("tessera.organization.id", org_id);
    span.record("gen_ai.request.max_tokens", g.max_tokens);
    span.record("gen_ai.request.temperature", g.sampling.temperature as f64);
    span.record("gen_ai.request.top_p", g.sampling.top_p as f64);
}

/// The id its response carries.
pub fn responding(response_id: &str) {
    Span::current().record("gen_ai.response.id", response_id);
}

/// How it ended.
pub fn finished(finish_reason: &str, usage: &Usage) {
    let span = Span::current();
    span.record("gen_ai.response.finish_reasons", finish_reason);
    span.record("gen_ai.usage.input_tokens", usage.prompt_tokens);
    span.record("gen_ai.usage.output_tokens", usage.completion_tokens);
}
