//! The engine on its own thread. The async side talks to it through a command
//! channel and gets each request's outputs on a channel of its own; it never blocks the
//! loop, and the loop never waits on it. A request whose output channel is gone (the
//! client hung up) is aborted at its next output, its blocks freed at once.

use super::block_pool::KvEvents;
use super::core::{EngineCore, EngineError, Output, Request};
use super::sequence::SeqId;
use crate::metrics::{self as m, RequestTimes};
use metrics_exporter_prometheus::PrometheusRecorder;
use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};
use tessera_kernels::Backend;
use tokio::sync::{broadcast, mpsc as tmpsc, oneshot};

/// How often the loop publishes a load report.
pub const REPORT_INTERVAL: Duration = Duration::from_millis(250);

/// What a request's stream receives: outputs, or the engine's failure.
pub type OutputEvent = Result<Output, String>;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub tokens_per_s: f64,
    pub kv_events: KvEvents,
    pub prefix_queried_blocks: u64,
    pub prefix_hit_blocks: u64,
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
        hashes: oneshot::Sender<Vec<u64>>,
    },
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
        let publisher = reports.clone();
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                // Everything the engine records, it records on this thread.
                let _installed = recorder.as_ref().map(|r| metrics::set_default_local_recorder(r));
                crate::metrics::describe();
                let times = RequestTimes::default();
                Loop { core, streams: HashMap::new(), reports: publisher, tokens: 0, times }.run(rx)
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

    /// Every block hash in the prefix cache now. Taken after subscribing to
    /// `watch_load`, it and the reports that follow give the cache exactly: changes
    /// already in it that a report repeats are applied again to the same effect.
    pub async fn cached_blocks(&self) -> Result<Vec<u64>, EngineError> {
        let (hashes, answer) = oneshot::channel();
        self.send(Command::CachedBlocks { hashes })?;
        answer.await.map_err(|_| EngineError::Stopped)
    }

    fn send(&self, c: Command) -> Result<(), EngineError> {
        self.commands.send(c).map_err(|_| EngineError::Stopped)
    }
}

struct Loop<B: Backend> {
    core: EngineCore<B>,
    streams: HashMap<SeqId, tmpsc::UnboundedSender<OutputEvent>>,
    reports: broadcast::Sender<LoadReport>,
    /// Output tokens since the last report.
    tokens: u64,
    times: RequestTimes,
}

impl<B: Backend> Loop<B> {
    fn run(mut self, commands: mpsc::Receiver<Command>) {
        let mut last_report = Instant::now();
        loop {
            // Idle: sleep until a command or the next report. Busy: take what is queued.
            if !self.core.has_work() {
                match commands.recv_timeout(REPORT_INTERVAL.saturating_sub(last_report.elapsed())) {
                    Ok(c) => self.handle(c),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(c) = commands.try_recv() {
                self.handle(c);
            }
            if self.core.has_work() {
                self.step();
            }
            if last_report.elapsed() >= REPORT_INTERVAL {
                self.report(last_report.elapsed());
                last_report = Instant::now();
            }
        }
    }

    fn handle(&mut self, c: Command) {
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
                let outputs = self.core.abort(id);
                if let Some(out) = outputs.last() {
                    self.times.finished(id, Instant::now(), "abort", out.prompt_tokens);
                }
                if let Some(stream) = self.streams.remove(&id) {
                    for out in &outputs {
                        let _ = stream.send(Ok(out.clone()));
                    }
                }
                let _ = found.send(!outputs.is_empty());
            }
            Command::CachedBlocks { hashes } => {
                let _ = hashes.send(self.core.scheduler().pool().cached_hashes());
            }
        }
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
        }
        match stepped {
            Ok(outputs) => {
                for out in outputs {
                    self.tokens += out.token.is_some() as u64;
                    if out.token.is_some() {
                        self.times.token(out.id, now);
                    }
                    if out.last {
                        let reason = out.finish.map_or("abort", |f| f.as_str());
                        self.times.finished(out.id, now, reason, out.prompt_tokens);
                    }
                    let (id, last) = (out.id, out.last);
                    let delivered = self.streams.get(&id).is_some_and(|s| s.send(Ok(out)).is_ok());
                    if last {
                        self.streams.remove(&id);
                    } else if !delivered && self.streams.remove(&id).is_some() {
                        // The client is gone: stop computing for it.
                        if let Some(out) = self.core.abort(id).last() {
                            self.times.finished(id, now, "abort", out.prompt_tokens);
                        }
                    }
                }
            }
            Err(e) => {
                // A failed forward leaves no request in a known state: end them all.
                let message = e.to_string();
                for (id, stream) in self.streams.drain() {
                    let _ = stream.send(Err(message.clone()));
                    if let Some(out) = self.core.abort(id).last() {
                        self.times.finished(id, now, "abort", out.prompt_tokens);
                    }
                }
            }
        }
    }

    fn report(&mut self, elapsed: Duration) {
        let s = self.core.scheduler();
        let pool = s.pool();
        let stats = pool.stats();
        let report = LoadReport {
            running: s.num_running(),
            waiting: s.num_waiting(),
            kv_blocks_used: pool.num_used(),
            kv_blocks_total: pool.num_blocks(),
            tokens_per_s: self.tokens as f64 / elapsed.as_secs_f64(),
            kv_events: KvEvents::default(),
            prefix_queried_blocks: stats.queried_blocks,
            prefix_hit_blocks: stats.hit_blocks,
        };
        metrics::gauge!(m::RUNNING).set(report.running as f64);
        metrics::gauge!(m::WAITING).set(report.waiting as f64);
        metrics::gauge!(m::KV_USAGE).set(report.kv_blocks_used as f64 / report.kv_blocks_total.max(1) as f64);
        let block = tessera_proto::block_hash::BLOCK_TOKENS as u64;
        metrics::counter!(m::PREFIX_QUERIES).absolute(stats.queried_blocks * block);
        metrics::counter!(m::PREFIX_HITS).absolute(stats.hit_blocks * block);
        metrics::counter!(m::PREEMPTIONS).absolute(self.core.stats().preemptions);
        let report = LoadReport { kv_events: self.core.take_kv_events(), ..report };
        self.tokens = 0;
        // No subscriber is fine: the events are dropped, as no router is listening.
        let _ = self.reports.send(report);
    }
}
