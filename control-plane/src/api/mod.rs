//! The OpenAI-compatible HTTP API: routes, authentication, the JSON body, and the
//! pieces the endpoints share (ids, usage, SSE).

pub mod auth;
pub mod chat;
pub mod completions;
pub mod error;
pub mod fields;
pub mod format;
pub mod generate;
pub mod logprobs;
pub mod messages;
pub mod models;
pub mod params;
pub mod responses;
pub mod sse;
pub mod status;
pub mod stream;
pub mod tools;
pub mod trace;

use crate::accounts::Store;
use crate::metrics as m;
use crate::router::{Models, ServedModel};
use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use error::ApiError;
use rand::Rng;
use serde_json::{Value, json};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use stream::Usage;
use tracing::Instrument;

/// Enough for the longest context in the catalog (about 4 bytes a token) with room
/// for JSON; larger bodies get a 413 in the API's error shape.
const MAX_BODY_BYTES: usize = 64 << 20;

pub struct AppState {
    /// The database every service below keeps its state in.
    pub db: crate::db::Db,
    pub store: Store,
    pub models: Arc<Models>,
    pub billing: crate::billing::Billing,
    pub limits: crate::limits::RateLimiter,
    /// Organizations' shares of a replica's batch, sent with each generation.
    pub weights: crate::weights::Weights,
    /// Cluster mode: the replica table, whose etcd connection /health reports, and
    /// whether this process leads placement.
    pub cluster: Option<crate::cluster::ClusterView>,
    /// Whether metrics are recorded (and served at GET /metrics).
    pub metrics: bool,
    /// GET /status's figures, and what measures them.
    pub status: crate::status::Status,
    /// Fetches and reads request images.
    pub images: crate::images::Images,
}

pub type App = Arc<AppState>;

pub fn router(app: App) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/responses", post(responses::handle))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{*id}", get(models::retrieve))
        .route("/status", get(status::handle))
        .route("/status-page", get(status::page))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/metrics/targets", get(scrape_targets))
        .fallback(unknown)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
        .layer(middleware::from_fn(auth::rate_limit_headers))
        .layer(middleware::from_fn(observe))
        .layer(middleware::from_fn(crate::keep_alive::settle_unread))
}

/// Whether this control plane serves, for load balancers and operators: 200 while it
/// does. In cluster mode it says whether etcd is reachable; without etcd it routes on
/// the last replica table it had, and says `degraded`.
async fn health(State(app): State<App>) -> Json<Value> {
    let models: Vec<String> = app.models.all().iter().map(|m| m.entry.id.clone()).collect();
    let Some(cluster) = &app.cluster else { return Json(json!({"status": "ok", "models": models})) };
    let table = cluster.table.borrow().clone();
    let ready = table.replicas.values().filter(|r| r.state == tessera_proto::cluster::ReplicaState::Ready).count();
    Json(json!({
        "status": if table.connected { "ok" } else { "degraded" },
        "etcd": {"connected": table.connected, "revision": table.revision},
        "placement": {"leader": *cluster.leading.borrow()},
        "ready_replicas": ready,
        "models": models,
    }))
}

/// 404 for every path the API does not have, naming the APIs it deliberately lacks.
async fn unknown(method: Method, uri: Uri) -> ApiError {
    let path = uri.path();
    let unsupported = [
        ("/v1/embeddings", "embeddings"),
        ("/v1/audio", "audio"),
        ("/v1/fine_tuning", "fine-tuning"),
        ("/v1/fine-tunes", "fine-tuning"),
        ("/v1/assistants", "assistants"),
        ("/v1/threads", "assistants"),
        ("/v1/batches", "batch"),
        ("/v1/files", "files"),
        ("/v1/uploads", "files"),
    ];
    match unsupported.iter().find(|(prefix, _)| path == *prefix || path.starts_with(&format!("{prefix}/"))) {
        Some((_, what)) => ApiError::UnsupportedEndpoint { what },
        None => ApiError::UnknownUrl { method: method.to_string(), path: path.to_string() },
    }
}

/// A request's id: in its `x-request-id` response header (which the SDKs surface on
/// errors), every log line about it in this process and the worker's (each attempt
/// there is `{id}`, then `{id}-a2`, …), and its usage record, so that a bill or a
/// failure can be traced to a call. Also when it arrived, and the model its body named,
/// once read, for its metrics.
#[derive(Debug, Clone)]
pub struct RequestId {
    pub id: String,
    /// The client's own id for it (`X-Client-Request-Id`, OpenAI's header, or vLLM's
    /// `X-Request-Id`), checked, logged and recorded beside ours and echoed back. Never
    /// instead of ours: billing keys on ours, and a client's need not be unique.
    pub client: Option<String>,
    pub received: Instant,
    model: Arc<OnceLock<String>>,
}

impl RequestId {
    /// A new request's id, received now.
    pub fn new() -> Self {
        let id = format!("req_{}", crate::accounts::keys::hex(&rand::rng().random::<[u8; 16]>()));
        Self { id, client: None, received: Instant::now(), model: Arc::new(OnceLock::new()) }
    }

    /// The model its body named, once read.
    pub fn model(&self) -> Option<&str> {
        self.model.get().map(String::as_str)
    }
}

impl Default for RequestId {
    fn default() -> Self {
        Self::new()
    }
}

/// The headers a client may name its request with, OpenAI's first.
const CLIENT_ID_HEADERS: [&str; 2] = ["x-client-request-id", "x-request-id"];

/// The client's own id for its request, if it gave one: 1 to 128 visible ASCII
/// characters (what goes into logs and a response header must not break either).
fn client_request_id(headers: &axum::http::HeaderMap) -> Result<Option<String>, ApiError> {
    let Some((name, value)) = CLIENT_ID_HEADERS.iter().find_map(|n| headers.get(*n).map(|v| (*n, v))) else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(v) if (1..=128).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_graphic()) => Ok(Some(v.to_string())),
        _ => Err(ApiError::invalid_value(
            name,
            format!("Invalid '{name}' header: an id of 1 to 128 visible ASCII characters, without spaces."),
        )),
    }
}

/// Every response carries an `x-request-id`, which the SDKs surface on errors (and the
/// client's own id back, when it gave one); every request is counted by route, status
/// and model, and timed to its response's head.
async fn observe(mut request: Request, next: Next) -> Response {
    let mut request_id = RequestId::new();
    let client = client_request_id(request.headers());
    request_id.client = client.as_ref().ok().cloned().flatten();
    let (id, model, start) = (request_id.id.clone(), request_id.model.clone(), request_id.received);
    let echo = request_id.client.clone();
    request.extensions_mut().insert(request_id);
    let route = request.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    // Every line logged while serving it (streams' tasks included) names the request,
    // and its trace continues the client's when it sent one.
    let span = trace::request_span(&id, request.method().as_str(), &route);
    tessera_worker::telemetry::adopt(&span, request.headers());
    if let Some(client) = &echo {
        span.record("client_request_id", client.as_str());
    }
    let mut response = match client {
        Ok(_) => error::answering(id.clone(), next.run(request)).instrument(span.clone()).await,
        Err(refused) => refused.into_response(),
    };
    let status = response.status().as_u16();
    span.record("http.response.status_code", status);
    let model = model.get().cloned().unwrap_or_default();
    let took = start.elapsed();
    span.in_scope(|| tracing::info!(%route, status, %model, ms = took.as_millis() as u64, "answered"));
    metrics::histogram!(m::HTTP_DURATION, "route" => route.clone()).record(took.as_secs_f64());
    let status = status.to_string();
    metrics::counter!(m::HTTP_REQUESTS, "route" => route, "status" => status, "model" => model).increment(1);
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", v);
    }
    if let Some(v) = echo.and_then(|c| HeaderValue::from_str(&c).ok()) {
        response.headers_mut().insert(CLIENT_ID_HEADERS[0], v);
    }
    response
}

use tessera_proto::cluster::ReplicaState;

/// Prometheus's HTTP service discovery: every worker replica to scrape (each serves
/// GET /metrics on its gRPC port), so that one scrape configuration follows replicas as
/// they come and go. In cluster mode from the replica table, with each replica's node
/// as a label; in `tessera serve`, its local workers.
async fn scrape_targets(State(app): State<App>) -> Json<Value> {
    let groups: Vec<Value> = match &app.cluster {
        Some(cluster) => {
            let table = cluster.table.borrow().clone();
            table
                .replicas
                .values()
                .filter(|r| matches!(r.state, ReplicaState::Ready | ReplicaState::Draining))
                .map(|r| json!({"targets": [r.addr], "labels": {"node": r.node}}))
                .collect()
        }
        None => {
            let mut addrs: Vec<String> = app.models.all().iter().flat_map(|m| m.pool.addrs()).collect();
            addrs.sort();
            addrs.dedup();
            addrs.into_iter().map(|a| json!({"targets": [a], "labels": {}})).collect()
        }
    };
    Json(Value::Array(groups))
}

/// Prometheus's text format: this process's metrics, the cluster's gauges read now.
async fn metrics_text(State(app): State<App>, uri: Uri) -> Response {
    if !app.metrics {
        return ApiError::UnknownUrl { method: "GET".into(), path: uri.path().to_string() }.into_response();
    }
    if let Some(cluster) = &app.cluster {
        let table = cluster.table.borrow().clone();
        metrics::gauge!(m::ETCD_CONNECTED).set(if table.connected { 1.0 } else { 0.0 });
        metrics::gauge!(m::ETCD_REVISION).set(table.revision as f64);
        metrics::gauge!(m::PLACEMENT_LEADER).set(if *cluster.leading.borrow() { 1.0 } else { 0.0 });
        let mut ready: std::collections::BTreeMap<String, f64> =
            app.models.all().iter().map(|m| (m.entry.id.clone(), 0.0)).collect();
        for r in table.replicas.values().filter(|r| r.state == tessera_proto::cluster::ReplicaState::Ready) {
            *ready.entry(r.model.clone()).or_default() += 1.0;
        }
        for (model, n) in ready {
            metrics::gauge!(m::READY_REPLICAS, "model" => model).set(n);
        }
    } else {
        // `tessera serve`: its local workers, those answering.
        for model in app.models.all() {
            metrics::gauge!(m::READY_REPLICAS, "model" => model.entry.id.clone()).set(model.pool.loads().len() as f64);
        }
    }
    // Every served model is low until a state is recorded for it.
    let supply = app.billing.supply();
    for model in app.models.all() {
        let state = supply.state(&model.entry.id) as u8 as f64;
        metrics::gauge!(m::SUPPLY_STATE, "model" => model.entry.id.clone()).set(state);
    }
    for point in supply.current() {
        metrics::gauge!(m::SUPPLY_LOAD, "model" => point.model).set(point.load_bp as f64 / 10_000.0);
    }
    let handle = crate::metrics::handle();
    handle.run_upkeep();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response()
}

/// A generation request's JSON body and the model it names (`param` is what a
/// `model_not_found` error names: null for chat and completions, `model` for responses).
/// The model is noted on `request` for its metrics.
pub fn read_request(
    app: &AppState,
    request: &RequestId,
    body: Result<Bytes, BytesRejection>,
    param: Option<&'static str>,
) -> Result<(Value, Arc<ServedModel>), ApiError> {
    let body = json_body(body)?;
    let model = model_of(app, &body, param)?;
    let _ = request.model.set(model.entry.id.clone());
    Ok((body, model))
}

/// The images of the request's list `name` (`messages`, `input`) as the model will be
/// shown them. A model whose weights read no images refuses them (after loading them,
/// so that a bad one is named first); one whose catalog entry takes none leaves them to
/// the message checks, which refuse them by part.
pub async fn visuals(
    app: &AppState,
    model: &ServedModel,
    list: &Value,
    name: &str,
) -> Result<Vec<crate::images::Visual>, ApiError> {
    let parts = messages::image_parts(list, name);
    if parts.is_empty() || !model.entry.capabilities.image_input {
        return Ok(Vec::new());
    }
    match model.vision() {
        None => Ok(app.images.refuse_unseen(&parts, &model.entry).await.map(|()| Vec::new())?),
        Some(v) => Ok(app.images.visuals(&parts, v.takes_video(&model.entry.capabilities)).await?),
    }
}

/// The response header that says how many of a request's video frames its prompt kept.
pub const FRAMES_HEADER: &str = "x-video-frames";

/// `response` with the frames header where the request sent video: `kept/sent`.
pub fn with_frames(mut response: Response, frames: Option<(usize, usize)>) -> Response {
    if let Some((kept, sent)) = frames
        && let Ok(v) = HeaderValue::from_str(&format!("{kept}/{sent}"))
    {
        response.headers_mut().insert(FRAMES_HEADER, v);
    }
    response
}

/// The body as JSON, or the OpenAI error for an unreadable body or malformed JSON.
fn json_body(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let body = body.map_err(|e| ApiError::BadBody { status: e.status(), detail: e.body_text() })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::MalformedJson(e.to_string()))
}

/// The model a body names, checked before anything else in it, as OpenAI does.
fn model_of(app: &AppState, body: &Value, param: Option<&'static str>) -> Result<Arc<ServedModel>, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::invalid_type("body", "an object"));
    };
    match obj.get("model") {
        None | Some(Value::Null) => Err(ApiError::MissingParam("model".into())),
        Some(Value::String(id)) => app.models.get(id).ok_or_else(|| match app.models.is_expected(id) {
            true => ApiError::Overloaded,
            false => ApiError::ModelNotFound { model: id.clone(), param, meant: app.models.meant(id) },
        }),
        Some(_) => Err(ApiError::invalid_type("model", "a string")),
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `prefix` + 24 random alphanumerics: `chatcmpl-…`, `cmpl-…`, `resp_…`.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", crate::accounts::keys::base62(24))
}

/// Chat and legacy completions usage, with the detail objects OpenAI sends.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": u.reasoning_tokens, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_prefix() {
        let id = new_id("chatcmpl-");
        assert!(id.starts_with("chatcmpl-") && id.len() == 9 + 24);
        assert_ne!(new_id("cmpl-"), new_id("cmpl-"));
    }

    #[test]
    fn usage_counts_prompt_and_completion() {
        let u = usage_json(&Usage { prompt_tokens: 10, cached_tokens: 4, completion_tokens: 3, reasoning_tokens: 2 });
        assert_eq!(u["total_tokens"], 13);
        assert_eq!(u["completion_tokens_details"]["reasoning_tokens"], 2);
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 4);
    }
}
