//! The control plane's own cost, with nothing else in the way: a scripted worker (a
//! real tonic `Worker` on the loopback that answers every Generate at once with one
//! token — no engine, so that the two cores are not spent on inference) behind the real
//! API (`api::router` over HTTP on the loopback, its SQLite database, key check, rate
//! limit, billing hold and settlement, routing and gRPC client), all in this process.
//! Time to first token through the API against calling the worker directly, at
//! concurrency 1 (interleaved: the API on a kept-alive connection, as the SDKs send, and
//! on a fresh connection each) and open loop (fresh connections) at `rate` requests per second (each
//! path alone for `seconds`): p50, p99 and what the API adds.

use crate::gateway::{Timing, grpc, http, http_on, report, run_level};
use anyhow::{Context, Result};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_control_plane::catalog::Catalog;
use tessera_control_plane::config::ApiArgs;
use tessera_control_plane::db::Db;
use tessera_control_plane::router::choice::Routing;
use tessera_control_plane::router::{Models, Pool, Replica};
use tessera_proto::scripted::{self, GenerateStream, Script, ScriptedWorker};
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::worker_server::WorkerServer;
use tessera_proto::worker::{self as pb};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

pub struct ScriptedArgs {
    pub requests: usize,
    pub rate: f64,
    pub seconds: f64,
}

const MODEL: &str = "bench/scripted";

/// How a concurrency-1 request is sent.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    /// To the worker's gRPC directly.
    Grpc,
    /// Through the API on the one kept-alive connection.
    Kept,
    /// Through the API on a connection of its own.
    Fresh,
}

/// Answers every generation at once: one token, then the end.
struct AtOnce;

impl Script for AtOnce {
    fn generate(&self, r: pb::GenerateRequest) -> Result<GenerateStream, Status> {
        let (tx, rx) = mpsc::channel(1);
        let answer = pb::GenerateResponse {
            prompt_tokens: r.prompt_token_ids.len() as u32,
            ..scripted::delta(0, "hello", pb::FinishReason::Length)
        };
        tx.try_send(Ok(answer)).map_err(|_| Status::internal("closed"))?;
        Ok(ReceiverStream::new(rx))
    }
}

const CATALOG: &str = r#"
[[models]]
id = "bench/scripted"
name = "Scripted"
context_length = 4096
quantization = "none"
weights = "scripted"
prices = { input = 1_000, output = 2_000 }
capabilities = { image_input = false, video_input = false, tool_calling = false, structured_output = false }
reasoning = { default = "off", control = "none" }
"#;

pub fn run(args: ScriptedArgs) -> Result<()> {
    let data = tempfile::tempdir()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let line = runtime.block_on(async {
        // The worker, its connections without Nagle's delay as `tessera-worker` serves them.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let worker = listener.local_addr()?.to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(WorkerServer::new(ScriptedWorker(AtOnce)))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))),
        );
        // The control plane: its database, an organization with credit and a key, the
        // model's pool of one replica, the API over HTTP.
        let db = Db::open(&format!("sqlite://{}", data.path().join("tessera.db").display())).await?;
        let (_, key) = crate::billing::funded_org(&db, "bench", 1_000_000_000_000).await?;
        let replica = Arc::new(Replica::connect(&worker).await?);
        let pool = Arc::new(Pool::new(&replica.card.model, Routing::CacheAware));
        pool.add(&worker, replica.clone())?;
        let catalog = Catalog::parse(CATALOG, "bench")?;
        let models = Arc::new(Models::new(&catalog, &BTreeMap::from([("scripted".to_string(), (replica, pool))]))?);
        let config = ApiArgs { rate_limit_rpm: 100_000_000, rate_limit_burst: 1_000_000, ..ApiArgs::defaults() };
        let app = tessera_control_plane::serve::app_state(db, models, None, &config).await?;
        let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = http_listener.local_addr()?.port();
        let listener = tessera_control_plane::serve::no_delay(http_listener);
        tokio::spawn(async move { axum::serve(listener, tessera_control_plane::api::router(app)).await });

        let client = WorkerClient::connect(format!("http://{worker}")).await?;
        let prompt = vec![1u32, 2, 3];
        // Warm both paths.
        for _ in 0..20 {
            grpc(client.clone(), prompt.clone(), 1).await?;
            http(port, &key, MODEL, &prompt, 1).await?;
        }
        // Concurrency 1, the paths interleaved: gRPC on its channel, the API on one
        // kept-alive connection (as the SDKs' pooled clients send) and on a fresh one each.
        let kept = Arc::new(tokio::sync::Mutex::new(crate::api::Conn::open(port).await?));
        let jobs: Vec<Path> = (0..args.requests.max(3)).map(|i| [Path::Grpc, Path::Kept, Path::Fresh][i % 3]).collect();
        let (c, k, p) = (client.clone(), key.clone(), prompt.clone());
        let timings = run_level(1, jobs, move |path| {
            let (c, k, p, kept) = (c.clone(), k.clone(), p.clone(), kept.clone());
            async move {
                let t = match path {
                    Path::Grpc => grpc(c, p, 1).await?,
                    Path::Kept => http_on(&mut *kept.lock().await, &k, MODEL, &p, 1).await?,
                    Path::Fresh => http(port, &k, MODEL, &p, 1).await?,
                };
                anyhow::Ok((path, t))
            }
        })
        .await?;
        let pick = |want: Path| timings.iter().filter(|(p, _)| *p == want).map(|(_, t)| *t).collect::<Vec<_>>();
        let closed = report(1, &pick(Path::Grpc), &pick(Path::Kept));
        let fresh = report(1, &pick(Path::Grpc), &pick(Path::Fresh));
        // Open loop: requests start on the clock whatever the answers do.
        let direct = open_loop(args.rate, args.seconds, {
            let (c, p) = (client.clone(), prompt.clone());
            move || {
                let (c, p) = (c.clone(), p.clone());
                async move { grpc(c, p, 1).await }
            }
        })
        .await?;
        let through = open_loop(args.rate, args.seconds, {
            let (k, p) = (key.clone(), prompt.clone());
            move || {
                let (k, p) = (k.clone(), p.clone());
                async move { http(port, &k, MODEL, &p, 1).await }
            }
        })
        .await?;
        let mut open = report(0, &direct, &through);
        open["rate_per_s"] = json!(args.rate);
        open["requests"] = json!(through.len());
        anyhow::Ok(json!({
            "bench": "gateway_scripted",
            "worker": "scripted, answers at once with one token",
            "concurrency_1": closed,
            "concurrency_1_fresh_connections": fresh,
            "open_loop": open,
            "load_average_before": crate::peer::load_average(),
        }))
    })?;
    println!("{line}");
    Ok(())
}

/// Starts `send` `rate` times a second for `seconds`, each on its own task; every
/// answer's timing.
async fn open_loop<F, Fut>(rate: f64, seconds: f64, send: F) -> Result<Vec<Timing>>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Timing>> + Send + 'static,
{
    let n = (rate * seconds) as usize;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at.into()).await;
        tasks.push(tokio::spawn(send()));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.context("a request's task")??);
    }
    Ok(out)
}
