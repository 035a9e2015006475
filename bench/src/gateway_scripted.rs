//! The control plane's own cost, with nothing else in the way: a scripted worker (a
//! real tonic `Worker` on the loopback that answers every Generate at once with one
//! token — no engine, so that the two cores are not spent on inference) behind the real
//! API (`api::router` over HTTP on the loopback, its SQLite database, key check, rate
//! limit, billing hold and settlement, routing and gRPC client), all in this process.
//! Time to first token through the API against calling the worker directly, at
//! concurrency 1 (the two interleaved) and open loop at `rate` requests per second (each
//! path alone for `seconds`): p50, p99 and what the API adds.

use crate::gateway::{Timing, grpc, http, report, run_level};
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
        // The worker.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let worker = listener.local_addr()?.to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(WorkerServer::new(ScriptedWorker(AtOnce)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
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
        tokio::spawn(async move { axum::serve(http_listener, tessera_control_plane::api::router(app)).await });

        let client = WorkerClient::connect(format!("http://{worker}")).await?;
        let prompt = vec![1u32, 2, 3];
        // Warm both paths.
        for _ in 0..20 {
            grpc(client.clone(), prompt.clone(), 1).await?;
            http(port, &key, MODEL, &prompt, 1).await?;
        }
        // Concurrency 1, the two paths interleaved.
        let jobs: Vec<bool> = (0..args.requests.max(2)).map(|i| i % 2 == 0).collect();
        let (c, k, p) = (client.clone(), key.clone(), prompt.clone());
        let timings = run_level(1, jobs, move |direct| {
            let (c, k, p) = (c.clone(), k.clone(), p.clone());
            async move {
                let t = if direct { grpc(c, p, 1).await? } else { http(port, &k, MODEL, &p, 1).await? };
                anyhow::Ok((direct, t))
            }
        })
        .await?;
        let pick = |want: bool| timings.iter().filter(|(d, _)| *d == want).map(|(_, t)| *t).collect::<Vec<_>>();
        let closed = report(1, &pick(true), &pick(false));
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
