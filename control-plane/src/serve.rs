//! `tessera serve`: everything on one machine with no external services — a SQLite
//! database, local workers for the catalog's weights, the API on a loopback port.

use axum::serve::ListenerExt;

use crate::accounts::{BillingMode, NewKey, Store};
use crate::api::{self, AppState};
use crate::billing::Billing;
use crate::billing::lease::LeaseConfig;
use crate::billing::payments::DevProcessor;
use crate::billing::subscriptions::Subscriptions;
use crate::billing::supply::{Refresher, Supply};
use crate::catalog::Catalog;
use crate::config::{ApiArgs, ServeConfig};
use crate::db::Db;
use crate::limits::RateConfig;
use crate::router::{Models, Pool, Replica};
use crate::status::Status;
use crate::workers;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tessera_proto::cluster::Role;

/// `log_format`: this process's, which its workers log in too.
/// `traces`: where this process's traces go, and its workers' too.
pub async fn run(
    config: ServeConfig,
    log_format: crate::config::LogFormat,
    traces: tessera_worker::telemetry::TraceConfig,
) -> Result<()> {
    let data_dir = &config.store.data_dir;
    std::fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let db = Db::open(&config.store.database_url()).await.context("opening the database")?;
    bootstrap(&db, data_dir, config.dev_credit_usd).await?;
    let catalog = Catalog::load(config.api.catalog.as_deref())?.default_thinking_budget(config.api.thinking_budget);

    let worker = workers::WorkerCommand {
        json_logs: log_format == crate::config::LogFormat::Json,
        traces,
        contended_batch: config.contended_batch,
        kv_offload_bytes: config.kv_offload_bytes,
        kv_disk: config.kv_disk_bytes.map(|bytes| (data_dir.join("kv-cache"), bytes)),
        ..workers::worker_command(config.worker_bin.as_deref())?
    };
    let mut local = Vec::new();
    let mut pools = BTreeMap::new();
    let pooled = config.prefill_replicas + config.decode_replicas > 0;
    let roles = [
        (Role::None, config.replicas.unwrap_or(if pooled { 0 } else { 1 })),
        (Role::Prefill, config.prefill_replicas),
        (Role::Decode, config.decode_replicas),
    ];
    anyhow::ensure!(roles.iter().any(|(_, n)| *n > 0), "--replicas 0 needs prefill or decode replicas");
    let workers_of = roles.iter().flat_map(|&(role, n)| (0..n).map(move |_| role));
    for weights in catalog.weights() {
        let mut pool: Option<(Arc<Replica>, Arc<Pool>)> = None;
        for (n, role) in workers_of.clone().enumerate() {
            let part = if role.is_none() { String::new() } else { format!(" ({role})") };
            eprintln!("starting worker {n}{part} for {weights} (the model is fetched on first use)");
            let replica = format!("{weights}-{n}");
            let speculative = config.speculative.apply(catalog.speculative(&weights));
            let metrics = !config.api.no_metrics;
            let settings = workers::Settings { kv_cache_bytes: config.kv_cache_bytes, metrics, speculative, role };
            let worker = workers::start(&worker, &weights, &replica, settings).await?;
            let replica = Arc::new(Replica::connect(&worker.addr).await?);
            let (_, pool) = pool.get_or_insert_with(|| {
                (
                    replica.clone(),
                    Arc::new(
                        Pool::new(&replica.card.model, config.api.routing)
                            .handing_over_from(config.api.disaggregation_min_prompt_tokens),
                    ),
                )
            });
            pool.add(&worker.addr, replica)?;
            local.push(worker);
        }
        pools.insert(weights.clone(), pool.expect("at least one replica"));
    }
    let models = Models::new(&catalog, &pools)?;
    serve_api(db, Arc::new(models), None, &config.api, data_dir).await?;
    drop(local);
    Ok(())
}

/// Serves the API over `models` until SIGINT or SIGTERM, with billing's background
/// work (heartbeat, stale holds, plan renewals, supply states) beside it; requests still
/// open are settled before it returns.
pub async fn serve_api(
    db: Db,
    models: Arc<Models>,
    cluster: Option<crate::cluster::ClusterView>,
    config: &ApiArgs,
    data_dir: &Path,
) -> Result<Arc<AppState>> {
    let app = app_state(db, models, cluster, config).await?;

    let listener =
        tokio::net::TcpListener::bind(&config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let addr = listener.local_addr()?;
    let grace = Duration::from_secs(config.shutdown_grace_secs);
    let stopping = Arc::new(tokio::sync::Notify::new());
    let signal = {
        let stopping = stopping.clone();
        async move {
            shutdown_signal().await;
            eprintln!("shutting down: finishing in-flight requests (up to {}s)", grace.as_secs());
            stopping.notify_one();
        }
    };
    let console = console_state(&app, config, data_dir, addr)?;
    if app.cluster.is_none() {
        owner_link(&app.store, data_dir, &console.config.console_url).await?;
    }
    // Last before serving: tests and scripts take this line to mean ready.
    eprintln!("tessera listening on http://{addr}/v1");
    let routes = api::router(app.clone()).merge(crate::console::router(console));
    let server = axum::serve(no_delay(listener), routes.into_make_service_with_connect_info::<std::net::SocketAddr>())
        .with_graceful_shutdown(signal);
    tokio::select! {
        r = server => r?,
        _ = async { stopping.notified().await; tokio::time::sleep(grace).await } => {
            eprintln!("grace period over: dropping the requests still running");
        }
    }
    // Requests still open are settled with what they used, before the process ends.
    app.billing.shutdown(Duration::from_secs(10)).await;
    // And their /status counts are written.
    app.status.tick(&app.models.listed(), app.billing.supply()).await;
    Ok(app)
}

/// The API's state over `models`, with billing's background work (heartbeat, stale
/// holds, plan renewals, supply states) and GET /status's refresh running beside it
/// for as long as the state lives. `serve_api` serves it; tests drive `api::router`
/// over it in-process.
pub async fn app_state(
    db: Db,
    models: Arc<Models>,
    cluster: Option<crate::cluster::ClusterView>,
    config: &ApiArgs,
) -> Result<Arc<AppState>> {
    // Metrics recorded from here on reach GET /metrics.
    if !config.no_metrics {
        crate::metrics::handle();
    }
    // No real payment processor can run here: plans and credit purchases go through
    // the development processor (see billing::payments).
    let mut billing = db.billing(Arc::new(DevProcessor::default()));
    if config.budget_lease_secs > 0.0 {
        let idle = Duration::try_from_secs_f64(config.budget_lease_idle_secs.max(0.0)).unwrap_or(Duration::MAX);
        billing = billing.with_leases(LeaseConfig { seconds_of_spend: config.budget_lease_secs, idle });
        tokio::spawn(return_idle_leases(billing.clone()));
    }
    billing.heartbeat(DEAD_AFTER.as_micros() as i64).await?;
    tokio::spawn(keep_alive(billing.clone()));
    tokio::spawn(release_stale_holds(db.ledger()));
    tokio::spawn(renew_subscriptions(billing.subscriptions().clone()));
    billing.supply().reload().await?;
    let limits = db.rate_limiter(RateConfig { default_rpm: config.rate_limit_rpm, burst: config.rate_limit_burst });
    let status = Status::new(db.status_minutes(), Arc::new(crate::limits::now_us));
    let images = crate::images::Images::new(config.images.config())?;
    let app = Arc::new(AppState {
        weights: db.weights(),
        store: db.accounts(),
        db,
        models,
        billing,
        limits,
        cluster,
        metrics: !config.no_metrics,
        status,
        images,
    });
    let refresh = Duration::from_secs(config.supply_refresh_secs.max(1));
    tokio::spawn(refresh_supply(app.billing.supply().clone(), refresh, Arc::downgrade(&app)));
    // The first snapshot is ready before the first request.
    app.status.tick(&app.models.listed(), app.billing.supply()).await;
    let refresh = Duration::from_secs(config.status_refresh_secs.max(1));
    tokio::spawn(refresh_status(app.status.clone(), refresh, Arc::downgrade(&app)));
    Ok(app)
}

/// Connections accepted with TCP_NODELAY. Streamed events are small writes: with Nagle's
/// algorithm each waits for the ACK of the one before, which the client's delayed ACK can
/// hold for 40 ms.
pub fn no_delay(
    listener: tokio::net::TcpListener,
) -> axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
        }
    })
}

/// On first start (no organizations yet): a `default` organization with a development
/// credit grant, and a key for it, written to `<data-dir>/bootstrap.key` (mode 0600) and
/// printed this once.
async fn bootstrap(db: &Db, data_dir: &Path, dev_credit_usd: f64) -> Result<()> {
    let store = db.accounts();
    if store.count_orgs().await? > 0 {
        return Ok(());
    }
    let org = store.create_org("default").await?;
    store.set_setting("bootstrap_org", &org.id).await?;
    let micros = crate::billing::cost::usd_to_micros(dev_credit_usd)?;
    if micros > 0 {
        db.ledger().grant(&org.id, micros, "development credit on first start").await?;
    }
    let new = NewKey {
        org_id: &org.id,
        name: "bootstrap",
        billing_mode: BillingMode::Credits,
        fallback_to_credits: false,
        created_by: None,
    };
    let (key, secret) = store.create_key(new).await?;
    let path = data_dir.join("bootstrap.key");
    // A stale file from an earlier database would keep its old mode: start afresh.
    let _ = std::fs::remove_file(&path);
    let mut file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)
    }
    .with_context(|| format!("writing {}", path.display()))?;
    writeln!(file, "{secret}")?;
    println!("Created organization {} and API key {} ({}); saved to {}:", org.id, key.id, key.name, path.display());
    println!("{secret}");
    Ok(())
}

/// The console's state from the command line: its URL (the address listened on unless
/// --console-url says otherwise), mail, lifetimes.
fn console_state(
    app: &Arc<AppState>,
    config: &ApiArgs,
    data_dir: &Path,
    addr: std::net::SocketAddr,
) -> Result<crate::console::State> {
    let c = &config.console;
    let mail = crate::console::mail::Mailer::new(c.smtp_url.as_deref(), &c.smtp_from, data_dir.join("outbox"))?;
    if c.smtp_url.is_none() {
        eprintln!("no --smtp-url: console e-mails are written to {}", data_dir.join("outbox").display());
    }
    let config = crate::console::ConsoleConfig {
        console_url: c.url(&addr.to_string()),
        invite_ttl: i64::from(c.invite_ttl_days) * 86_400,
        lifetimes: crate::accounts::Lifetimes {
            idle: i64::from(c.session_idle_minutes) * 60,
            absolute: i64::from(c.session_max_hours) * 3600,
        },
        throttle: Default::default(),
        trust_forwarded_for: c.trust_forwarded_for,
        capacity_requests_to: c.capacity_requests_to.clone(),
    };
    eprintln!("console at {}/", config.console_url);
    Ok(Arc::new(crate::console::Console {
        store: app.store.clone(),
        billing: app.billing.clone(),
        capacity: app.db.capacity_requests(),
        mail,
        config,
        api: Some(app.clone()),
    }))
}

/// While the bootstrap organization has no owner, each start prints a fresh one-time
/// link (valid 24 hours; earlier ones stop working) that makes its first owner, and
/// writes it to `<data-dir>/owner-link` (mode 0600).
async fn owner_link(store: &Store, data_dir: &Path, console_url: &str) -> Result<()> {
    let Some(org) = store.setting("bootstrap_org").await? else { return Ok(()) };
    let org = store.find_org(&org).await?;
    if store.owner_count(&org.id).await? > 0 {
        return Ok(());
    }
    let purpose = crate::accounts::LinkPurpose::Owner { org_id: org.id.clone() };
    let token = store.create_link(&purpose, 86_400).await?;
    let link = format!("{console_url}/setup?token={token}");
    let path = data_dir.join("owner-link");
    let _ = std::fs::remove_file(&path);
    let mut file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)
    }
    .with_context(|| format!("writing {}", path.display()))?;
    writeln!(file, "{link}")?;
    println!("Open this link once to create the first owner of organization {} (saved to {}):", org.id, path.display());
    println!("{link}");
    Ok(())
}

/// A control plane silent this long is dead: the holds it took are released.
const DEAD_AFTER: Duration = Duration::from_secs(60);

/// Beats this process's heart every 10 s, releasing the holds of processes that died
/// mid-request (their credit back to the organizations, their plan concurrency back to
/// the users).
async fn keep_alive(billing: Billing) {
    let mut every = tokio::time::interval(Duration::from_secs(10));
    loop {
        every.tick().await;
        match billing.heartbeat(DEAD_AFTER.as_micros() as i64).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!("released {n} holds of a control plane that stopped"),
            Err(e) => tracing::error!("heartbeat: {e}"),
        }
    }
}

/// Returns budget leases that have idled, every second, so that an organization's
/// credit leased here and no longer used is back in its account within a few seconds.
async fn return_idle_leases(billing: Billing) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        every.tick().await;
        if let Err(e) = billing.return_idle_leases().await {
            tracing::warn!("returning idle budget leases: {e}");
        }
    }
}

/// Holds that no live process owns and no heartbeat covers (taken before holds had
/// owners): their credit goes back to the organization once no request can still be
/// running on them (the longest generation takes minutes; a day is far past it).
async fn release_stale_holds(ledger: crate::billing::Ledger) {
    const STALE_SECS: i64 = 24 * 3600;
    let mut every = tokio::time::interval(Duration::from_secs(3600));
    loop {
        every.tick().await;
        match ledger.release_stale(STALE_SECS).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!("released {n} holds left by requests that never settled"),
            Err(e) => tracing::error!("releasing stale holds: {e}"),
        }
    }
}

/// Renews plans whose period is over, every minute (a request renews its own plan
/// sooner, at admission).
async fn renew_subscriptions(subscriptions: Subscriptions) {
    let mut every = tokio::time::interval(Duration::from_secs(60));
    loop {
        every.tick().await;
        if let Err(e) = subscriptions.renew_due(crate::limits::now_us()).await {
            tracing::error!("renewing plans: {e}");
        }
    }
}

/// Samples every model's replicas' load every few seconds; the supply state follows
/// once per `slot`. Stops with the app.
async fn refresh_supply(supply: Supply, slot: Duration, app: std::sync::Weak<AppState>) {
    let mut refresher = Refresher::new(supply, slot, crate::limits::now_us());
    let mut every = tokio::time::interval((slot / 60).clamp(Duration::from_millis(100), Duration::from_secs(10)));
    loop {
        every.tick().await;
        let Some(app) = app.upgrade() else { return };
        let loads: Vec<(String, Vec<_>)> =
            app.models.all().iter().map(|m| (m.entry.id.clone(), m.pool.loads())).collect();
        drop(app);
        if let Err(e) = refresher.sample(crate::limits::now_us(), &loads).await {
            tracing::error!("recording supply states: {e}");
        }
    }
}

/// Writes this process's /status counts and refreshes the snapshots every `every`.
/// Stops with the app.
async fn refresh_status(status: Status, every: Duration, app: std::sync::Weak<AppState>) {
    let mut every = tokio::time::interval(every);
    every.tick().await;
    loop {
        every.tick().await;
        let Some(app) = app.upgrade() else { return };
        let (models, supply) = (app.models.listed(), app.billing.supply().clone());
        drop(app);
        status.tick(&models, &supply).await;
    }
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return interrupt.await.unwrap_or(()),
        };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    #[tokio::test]
    async fn accepted_connections_send_small_writes_without_delay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = super::no_delay(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await;
        assert!(accepted.nodelay().unwrap());
    }
}
