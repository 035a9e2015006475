//! The engine on its own thread. The async side talks to it through a command
//! channel and gets each request's outputs on a channel of its own; it never blocks the
//! loop, and the loop never waits on it. Between steps the loop aborts every request
//! whose output channel is gone (the client hung up), whatever its state — running,
//! waiting, preempted or mid-prefill — and its blocks are freed at once.
//!
//! Load reports go out from a thread of their own (`reporter`), from what the loop
//! published after its last step: a step that runs for seconds (a long prefill chunk on
//! a busy CPU) never silences them, so a router never mistakes a busy replica for a
//! gone one.

use super::core::{EngineCore, EngineError, Output, Request};
use super::scheduler::Place;
use super::sequence::SeqId;
use crate::metrics::{self as m, RequestTimes};
use metrics_exporter_prometheus::PrometheusRecorder;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_kernels::Backend;
use tokio::sync::{broadcast, mpsc as tmpsc, oneshot};

/// How often a load report goes out.
pub const REPORT_INTERVAL: Duration = Duration::from_millis(250);

/// What a request's stream receives: outputs, or the engine's failure (one failure
/// ends every request of the step, hence shared).
pub type OutputEvent = Result<Output, Arc<EngineError>>;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub tokens_per_s: f64,
    /// Blocks whose place changed since the last report, and where each is now.
    pub kv_changes: HashMap<u64, Place>,
    pub prefix_queried_blocks: u64,
    pub prefix_hit_blocks: u64,
    /// Sequences sent back to the queue since start.
    pub preemptions: u64,
}

enum Command {
    Add {
        request: Box<Request>,
        outputs: tmpsc::UnboundedSender<OutputEvent>,
        accepted: oneshot::Sender<Result<(), EngineError>>,
    },
    Abort {
        id: SeqId,
        found: oneshot::Sender<bool>,
    },
    CachedBlocks {
        hashes: oneshot::Sender<Vec<(u64, Place)>>,
    },
    /// The worker is stopping: keep what the KV cache holds on disk
    /// (`EngineCore::persist_kv`) and end the loop.
    Stop {
        written: oneshot::Sender<usize>,
    },
    /// A KV transfer between replicas happened: counted in the metrics, which are
    /// recorded on the engine's thread.
    Transferred(Transfer),
    /// Blocks another replica computed, for the second tier (`EngineCore::import_kv`).
    Import {
        blocks: super::core::KvBlocks,
        stored: oneshot::Sender<Result<(usize, usize), EngineError>>,
    },
}

/// A KV transfer of disaggregated serving, as this replica's metrics count it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transfer {
    /// A handoff's blocks sent to a decode replica, and whether it stored them.
    Sent { bytes: u64, blocks: u64, seconds: f64, ok: bool },
    /// Blocks received from a prefill replica.
    Received { bytes: u64, blocks: u64 },
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    reports: broadcast::Sender<LoadReport>,
}

impl EngineHandle {
    /// Starts the engine loop on a new thread; it ends when every handle is dropped.
    pub fn spawn<B: Backend + 'static>(core: EngineCore<B>) -> Self {
        Self::spawn_recording(core, None)
    }

    /// The same, with the engine's metrics recorded into `recorder` (see `metrics`).
    pub fn spawn_recording<B: Backend + 'static>(core: EngineCore<B>, recorder: Option<PrometheusRecorder>) -> Self {
        let (commands, rx) = mpsc::channel();
        let (reports, _) = broadcast::channel(64);
        let published = Arc::new(Mutex::new(Published::default()));
        let reporter = reporter::spawn(published.clone(), reports.clone(), REPORT_INTERVAL);
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                // Everything the engine records, it records on this thread.
                let _installed = recorder.as_ref().map(|r| metrics::set_default_local_recorder(r));
                crate::metrics::describe();
                let times = RequestTimes::default();
                Loop { core, streams: HashMap::new(), published, _reporter: reporter, tokens: 0, times }.run(rx)
            })
            .expect("spawning the engine thread");
        Self { commands, reports }
    }

    /// Queues a request; its outputs arrive on the returned channel, each completion's
    /// last with a finish reason, the request's last marked `last`. Fails at once for an
    /// invalid request.
    pub async fn generate(&self, request: Request) -> Result<tmpsc::UnboundedReceiver<OutputEvent>, EngineError> {
        let (outputs, rx) = tmpsc::unbounded_channel();
        let (accepted, answer) = oneshot::channel();
        self.send(Command::Add { request: Box::new(request), outputs, accepted })?;
        answer.await.map_err(|_| EngineError::Stopped)??;
        Ok(rx)
    }

    /// Aborts a request; false if it is not running (finished, or never was).
    pub async fn abort(&self, id: SeqId) -> Result<bool, EngineError> {
        let (found, answer) = oneshot::channel();
        self.send(Command::Abort { id, found })?;
        answer.await.map_err(|_| EngineError::Stopped)
    }

    /// Load reports, one every `REPORT_INTERVAL`, each with the prefix cache's changes
    /// since the one before.
    pub fn watch_load(&self) -> broadcast::Receiver<LoadReport> {
        self.reports.subscribe()
    }

    /// Every block the prefix cache and its second tier hold now, and where. Taken after
    /// subscribing to `watch_load`, it and the reports that follow give the cache
    /// exactly: a report repeating a change already in it says where the block is now.
    pub async fn cached_blocks(&self) -> Result<Vec<(u64, Place)>, EngineError> {
        let (hashes, answer) = oneshot::channel();
        self.send(Command::CachedBlocks { hashes })?;
        answer.await.map_err(|_| EngineError::Stopped)
    }

    /// Stops the engine once the server has drained: what its KV cache holds is written
    /// to the disk tier first, where there is one; the blocks written.
    pub async fn stop(&self) -> Result<usize, EngineError> {
        let (written, answer) = oneshot::channel();
        self.send(Command::Stop { written })?;
        answer.await.map_err(|_| EngineError::Stopped)
    }

    /// Stores a prefill replica's blocks in the second tier (between steps): how many
    /// were stored, and how many were held here already.
    pub async fn import_kv(&self, blocks: super::core::KvBlocks) -> Result<(usize, usize), EngineError> {
        let (stored, answer) = oneshot::channel();
        self.send(Command::Import { blocks, stored })?;
        answer.await.map_err(|_| EngineError::Stopped)?
    }

    /// Counts a KV transfer in the replica's metrics (a stopped engine counts nothing).
    pub fn record_transfer(&self, t: Transfer) {
        let _ = self.send(Command::Transferred(t));
    }

    fn send(&self, c: Command) -> Result<(), EngineError> {
        self.commands.send(c).map_err(|_| EngineError::Stopped)
    }
}

fn record_transfer(t: Transfer) {
    match t {
        Transfer::Sent { bytes, blocks, seconds, ok } => {
            metrics::counter!(m::TRANSFER_BYTES, "direction" => "sent").increment(bytes);
            metrics::counter!(m::TRANSFER_BLOCKS, "direction" => "sent").increment(blocks);
            metrics::counter!(m::TRANSFERS, "outcome" => if ok { "sent" } else { "failed" }).increment(1);
            metrics::histogram!(m::TRANSFER_SECONDS).record(seconds);
        }
        Transfer::Received { bytes, blocks } => {
            metrics::counter!(m::TRANSFER_BYTES, "direction" => "received").increment(bytes);
            metrics::counter!(m::TRANSFER_BLOCKS, "direction" => "received").increment(blocks);
        }
    }
}

/// The engine's state as of its last step, for the reporter to send on its own clock.
#[derive(Debug, Default)]
pub struct Published {
    /// Counts as of the last step; `kv_changes` gathers changes until a report takes them.
    report: LoadReport,
    /// Output tokens since the last report went out.
    tokens: u64,
}

struct Loop<B: Backend> {
    core: EngineCore<B>,
    streams: HashMap<SeqId, tmpsc::UnboundedSender<OutputEvent>>,
    published: Arc<Mutex<Published>>,
    /// Stops the reporter when the loop ends.
    _reporter: reporter::Stop,
    /// Output tokens since the last publication.
    tokens: u64,
    times: RequestTimes,
}

impl<B: Backend> Loop<B> {
    fn run(mut self, commands: mpsc::Receiver<Command>) {
        let mut last_metrics = Instant::now();
        loop {
            // Idle: sleep until a command or the next metrics update. Busy: take what is
            // queued.
            if !self.core.has_work() {
                match commands.recv_timeout(REPORT_INTERVAL.saturating_sub(last_metrics.elapsed())) {
                    Ok(c) => {
                        if self.handle(c).is_break() {
                            return;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(c) = commands.try_recv() {
                if self.handle(c).is_break() {
                    return;
                }
            }
            self.drop_departed();
            if self.core.has_work() {
                self.step();
            }
            self.publish();
            if last_metrics.elapsed() >= REPORT_INTERVAL {
                self.record_gauges();
                last_metrics = Instant::now();
            }
        }
    }

    /// Carries out a command; Break: the loop ends.
    fn handle(&mut self, c: Command) -> ControlFlow<()> {
        match c {
            Command::Add { request, outputs, accepted } => {
                let id = request.id;
                let result = self.core.add_request(*request);
                if result.is_ok() {
                    self.streams.insert(id, outputs);
                    self.times.arrived(id, Instant::now());
                }
                let _ = accepted.send(result);
            }
            Command::Abort { id, found } => {
                let outputs = self.abort(id, Instant::now());
                if let Some(stream) = self.streams.remove(&id) {
                    for out in &outputs {
                        let _ = stream.send(Ok(out.clone()));
                    }
                }
                let _ = found.send(!outputs.is_empty());
            }
            Command::CachedBlocks { hashes } => {
                let _ = hashes.send(self.core.scheduler().kv_snapshot());
            }
            Command::Stop { written } => {
                let _ = written.send(self.core.persist_kv());
                return ControlFlow::Break(());
            }
            Command::Transferred(t) => record_transfer(t),
            Command::Import { blocks, stored } => {
                let _ = stored.send(self.core.import_kv(blocks));
            }
        }
        ControlFlow::Continue(())
    }

    /// Aborts every request whose client is gone. Only running sequences produce
    /// outputs, so a closed channel is looked for directly: a waiting, preempted or
    /// half-prefilled request would otherwise hold its place (and blocks) until then.
    fn drop_departed(&mut self) {
        let gone: Vec<SeqId> = self.streams.iter().filter(|(_, s)| s.is_closed()).map(|(&id, _)| id).collect();
        let now = Instant::now();
        for id in gone {
            self.streams.remove(&id);
            self.abort(id, now);
        }
    }

    fn abort(&mut self, id: SeqId, now: Instant) -> Vec<Output> {
        let outputs = self.core.abort(id);
        if let Some(out) = outputs.last() {
            self.times.finished(id, now, "abort", out.prompt_tokens);
        }
        outputs
    }

    fn step(&mut self) {
        let began = Instant::now();
        let stepped = self.core.step();
        let now = Instant::now();
        let summary = self.core.last_step();
        if summary.tokens > 0 {
            metrics::histogram!(m::ITERATION_TOKENS).record(summary.tokens as f64);
        }
        for &request in &summary.requests {
            self.times.scheduled(request, began);
            self.times.stepped(request, began, now);
        }
        for &request in &summary.preempted {
            self.times.preempted(request);
        }
        match stepped {
            Ok(outputs) => {
                for mut out in outputs {
                    self.tokens += out.token.is_some() as u64;
                    if out.token.is_some() {
                        self.times.token(out.id, now);
                    }
                    if out.last {
                        let reason = out.finish.map_or("abort", |f| f.as_str());
                        out.timeline = self.times.finished(out.id, now, reason, out.prompt_tokens).map(Box::new);
                    }
                    // A client gone meanwhile is aborted before the next step.
                    let (id, last) = (out.id, out.last);
                    if let Some(stream) = self.streams.get(&id) {
                        let _ = stream.send(Ok(out));
                    }
                    if last {
                        self.streams.remove(&id);
                    }
                }
            }
            Err(e) => {
                // A failed forward leaves no request in a known state: end them all.
                let e = Arc::new(e);
                for (id, stream) in std::mem::take(&mut self.streams) {
                    let _ = stream.send(Err(e.clone()));
                    self.abort(id, now);
                }
            }
        }
    }

    /// Hands the reporter the state after this step: counts, cache changes, tokens.
    fn publish(&mut self) {
        let changes = self.core.take_kv_changes();
        let preemptions = self.core.stats().preemptions;
        let s = self.core.scheduler();
        let pool = s.pool();
        let stats = pool.stats();
        let mut p = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let r = &mut p.report;
        r.running = s.num_running();
        r.waiting = s.num_waiting();
        r.kv_blocks_used = pool.num_used();
        r.kv_blocks_total = pool.num_blocks();
        r.prefix_queried_blocks = stats.queried_blocks;
        r.prefix_hit_blocks = stats.hit_blocks;
        r.preemptions = preemptions;
        r.kv_changes.extend(changes);
        p.tokens += std::mem::take(&mut self.tokens);
    }

    /// The engine's gauges, recorded on this thread (its metrics recorder is local to it).
    fn record_gauges(&self) {
        let s = self.core.scheduler();
        let pool = s.pool();
        let stats = pool.stats();
        metrics::gauge!(m::RUNNING).set(s.num_running() as f64);
        metrics::gauge!(m::WAITING).set(s.num_waiting() as f64);
        metrics::gauge!(m::KV_USAGE).set(pool.num_used() as f64 / pool.num_blocks().max(1) as f64);
        let block = tessera_proto::block_hash::BLOCK_TOKENS as u64;
        metrics::counter!(m::PREFIX_QUERIES).absolute(stats.queried_blocks * block);
        metrics::counter!(m::PREFIX_HITS).absolute(stats.hit_blocks * block);
        metrics::counter!(m::PREEMPTIONS).absolute(self.core.stats().preemptions);
        metrics::counter!(m::FAIR_PREEMPTIONS).absolute(self.core.stats().fair_preemptions);
        for (tenant, running, waiting, share) in m::tenant_series(s.tenants()) {
            metrics::gauge!(m::TENANT_RUNNING, "tenant" => tenant.clone()).set(running as f64);
            metrics::gauge!(m::TENANT_WAITING, "tenant" => tenant.clone()).set(waiting as f64);
            metrics::gauge!(m::TENANT_SHARE, "tenant" => tenant).set(share);
        }
        if let Some(tiers) = s.tiers() {
            let (stats, (host_bytes, disk_bytes), (host_blocks, disk_blocks)) =
                (tiers.stats(), tiers.occupancy(), tiers.blocks());
            for (tier, bytes, blocks, hits) in
                [("host", host_bytes, host_blocks, stats.host_hits), ("disk", disk_bytes, disk_blocks, stats.disk_hits)]
            {
                metrics::gauge!(m::TIER_BYTES, "tier" => tier).set(bytes as f64);
                metrics::gauge!(m::TIER_BLOCKS, "tier" => tier).set(blocks as f64);
                metrics::counter!(m::TIER_HITS, "tier" => tier).absolute(hits);
            }
            metrics::counter!(m::TIER_OFFLOADED_BYTES).absolute(stats.offloaded_bytes);
            metrics::counter!(m::TIER_ONLOADED_BYTES).absolute(stats.onloaded_bytes);
            metrics::counter!(m::TIER_DROPPED).absolute(stats.dropped_blocks);
            metrics::counter!(m::TIER_DISK_ERRORS).absolute(stats.disk_errors);
        }
        // Exported with speculation off too (as zeros), so that dashboards find them.
        let spec = self.core.spec_stats().cloned().unwrap_or_default();
        metrics::counter!(m::SPEC_DRAFTS).absolute(spec.drafts);
        metrics::counter!(m::SPEC_DRAFT_TOKENS).absolute(spec.draft_tokens);
        metrics::counter!(m::SPEC_ACCEPTED_TOKENS).absolute(spec.accepted_tokens);
        let per_position = if spec.accepted_per_position.is_empty() { &[0][..] } else { &spec.accepted_per_position };
        for (position, &n) in per_position.iter().enumerate() {
            metrics::counter!(m::SPEC_ACCEPTED_PER_POS, "position" => position.to_string()).absolute(n);
        }
    }
}

/// The thread that sends a load report every interval, whatever the engine is doing.
mod reporter {
    use super::{LoadReport, Published};
    use std::sync::mpsc::{self, RecvTimeoutError};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};
    use tokio::sync::broadcast;

    /// Dropped, the reporter stops.
    pub struct Stop(#[allow(dead_code)] mpsc::Sender<()>);

    pub fn spawn(published: Arc<Mutex<Published>>, reports: broadcast::Sender<LoadReport>, interval: Duration) -> Stop {
        let (stop, stopped) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("engine-reports".into())
            .spawn(move || {
                let mut last = Instant::now();
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    let elapsed = std::mem::replace(&mut last, Instant::now()).elapsed();
                    let report = {
                        let mut p = published.lock().unwrap_or_else(|e| e.into_inner());
                        let tokens = std::mem::take(&mut p.tokens);
                        LoadReport {
                            tokens_per_s: tokens as f64 / elapsed.as_secs_f64(),
                            kv_changes: std::mem::take(&mut p.report.kv_changes),
                            ..p.report.clone()
                        }
                    };
                    // No subscriber is fine: the events are dropped, as no router listens.
                    let _ = reports.send(report);
                }
            })
            .expect("spawning the engine's reporter");
        Stop(stop)
    }

    #[cfg(test)]
    mod tests {
        use super::super::Place;
        use super::*;
        use std::collections::HashMap;

        #[test]
        fn reports_go_out_on_time_while_the_engine_publishes_nothing() {
            // The engine thread is stuck in one long step: it publishes nothing for a
            // second. Reports keep coming, with the state it published before.
            let published = Arc::new(Mutex::new(Published::default()));
            {
                let mut p = published.lock().unwrap();
                p.report.running = 3;
                p.report.kv_changes = HashMap::from([(7, Place::Device), (8, Place::Host)]);
                p.tokens = 5;
            }
            let (reports, mut rx) = broadcast::channel(64);
            let stop = spawn(published, reports, Duration::from_millis(20));
            let began = Instant::now();
            let mut got = Vec::new();
            while began.elapsed() < Duration::from_secs(1) {
                got.push(rx.blocking_recv().unwrap());
            }
            assert!(got.len() >= 10, "{} reports in a second at 20 ms", got.len());
            assert!(got.iter().all(|r| r.running == 3));
            assert_eq!(got[0].kv_changes.len(), 2, "changes go out once");
            assert!(got[1..].iter().all(|r| r.kv_changes.is_empty()));
            assert!(got[0].tokens_per_s > 0.0 && got[1..].iter().all(|r| r.tokens_per_s == 0.0));
            drop(stop);
            // Stopped: the sender goes with the thread.
            while let Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) = rx.blocking_recv() {}
        }
    }
}
