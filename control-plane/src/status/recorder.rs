//! Measuring generations as they run, and handing the counts to the database.

use super::MINUTE_US;
use super::minutes::{Counts, Minutes};
use crate::billing::Clock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Counts not yet in the database, by (minute, model). Clones share them.
#[derive(Clone)]
pub struct Recorder {
    pending: Arc<Mutex<HashMap<(i64, String), Counts>>>,
    clock: Clock,
}

impl Recorder {
    pub fn new(clock: Clock) -> Self {
        Self { pending: Default::default(), clock }
    }

    /// A probe for one generation of `model` at `endpoint`, for a request that arrived
    /// at `received`.
    pub fn probe(&self, model: &str, endpoint: &'static str, received: Instant) -> Probe {
        Probe {
            recorder: self.clone(),
            model: model.to_string(),
            endpoint,
            received,
            first: None,
            last: received,
            prompt_tokens: 0,
            first_tokens: 0,
            decode_tokens: 0,
            failed: false,
            itl: None,
        }
    }

    /// Adds `counts` to `model`'s current minute.
    pub fn add(&self, model: &str, counts: &Counts) {
        let minute = (self.clock)().div_euclid(MINUTE_US);
        self.lock().entry((minute, model.to_string())).or_default().add(counts);
    }

    /// Adds what was measured since the last flush to the database, and a row for the
    /// current minute of every model in `served` (the rows say the aggregator runs).
    /// Counts that could not be written stay for the next flush; none is written twice.
    pub async fn flush(&self, minutes: &Minutes, served: &[String]) -> Result<(), sqlx::Error> {
        let now = (self.clock)();
        let mut taken = std::mem::take(&mut *self.lock());
        for model in served {
            taken.entry((now.div_euclid(MINUTE_US), model.clone())).or_default();
        }
        let mut rows: Vec<_> = taken.into_iter().collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        let mut rows = rows.into_iter();
        while let Some(((minute, model), counts)) = rows.next() {
            if let Err(e) = minutes.add(minute, &model, &counts, now).await {
                let mut pending = self.lock();
                for (key, c) in std::iter::once(((minute, model), counts)).chain(rows) {
                    pending.entry(key).or_default().add(&c);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(i64, String), Counts>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One generation's measurements, counted when it is dropped: a generation that ran
/// (to its end, or until its client left) or failed on our side counts; one refused
/// before it ran, or cancelled before its first token, does not. The endpoint's
/// latency histograms (`crate::metrics`) are recorded as it goes.
pub struct Probe {
    recorder: Recorder,
    model: String,
    endpoint: &'static str,
    received: Instant,
    first: Option<Instant>,
    last: Instant,
    prompt_tokens: u64,
    /// Tokens of the first delta.
    first_tokens: u64,
    /// Tokens after those of the first delta.
    decode_tokens: u64,
    failed: bool,
    /// The inter-token histogram, resolved once at the first token: deltas only record.
    itl: Option<metrics::Histogram>,
}

impl Probe {
    /// The prompt's length, in tokens.
    pub fn prompt(&mut self, tokens: usize) {
        self.prompt_tokens = tokens as u64;
    }

    /// The first delta arrived, with `tokens` tokens.
    pub fn first_token(&mut self, tokens: usize) {
        let now = Instant::now();
        self.first = Some(now);
        self.last = now;
        self.first_tokens = tokens as u64;
        let labels = self.labels();
        metrics::histogram!(crate::metrics::TIME_TO_FIRST_TOKEN, &labels).record(now - self.received);
        self.itl = Some(metrics::histogram!(crate::metrics::INTER_TOKEN_LATENCY, &labels));
    }

    /// A later delta, of `tokens` tokens.
    pub fn delta(&mut self, tokens: usize) {
        if tokens > 0 {
            let now = Instant::now();
            if let Some(itl) = &self.itl {
                itl.record_many((now - self.last).as_secs_f64() / tokens as f64, tokens);
            }
            self.decode_tokens += tokens as u64;
            self.last = now;
        }
    }

    /// The endpoint's histograms' labels.
    fn labels(&self) -> [(&'static str, String); 2] {
        [("model", self.model.clone()), ("endpoint", self.endpoint.to_string())]
    }

    /// The endpoint's histograms of a generation that produced tokens.
    fn record_totals(&self) {
        if self.first.is_none() {
            return;
        }
        let labels = self.labels();
        metrics::histogram!(crate::metrics::REQUEST_DURATION, &labels).record(self.last - self.received);
        metrics::histogram!(crate::metrics::REQUEST_PROMPT_TOKENS, &labels).record(self.prompt_tokens as f64);
        let output = self.first_tokens + self.decode_tokens;
        metrics::histogram!(crate::metrics::REQUEST_OUTPUT_TOKENS, &labels).record(output as f64);
    }

    /// The generation failed on our side.
    pub fn failed(&mut self) {
        self.failed = true;
    }

    fn counts(&self) -> Counts {
        let mut c = Counts::default();
        let Some(first) = self.first else {
            c.requests = self.failed as i64;
            c.failures = self.failed as i64;
            return c;
        };
        c.requests = 1;
        c.failures = self.failed as i64;
        c.ttfb_samples = 1;
        c.ttfb_us = first.duration_since(self.received).as_micros() as i64;
        let decode_us = self.last.duration_since(first).as_micros() as i64;
        if self.decode_tokens > 0 && decode_us > 0 {
            c.tps_samples = 1;
            c.decode_tokens = self.decode_tokens as i64;
            c.decode_us = decode_us;
        }
        c
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.record_totals();
        let counts = self.counts();
        if counts.requests > 0 {
            self.recorder.add(&self.model, &counts);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn recorder() -> Recorder {
        Recorder::new(Arc::new(|| 5 * MINUTE_US + 1))
    }

    fn pending(r: &Recorder) -> HashMap<(i64, String), Counts> {
        r.lock().clone()
    }

    #[test]
    fn a_probe_counts_what_its_generation_did() {
        let r = recorder();
        let received = Instant::now() - Duration::from_millis(50);
        let mut ran = r.probe("m", "chat.completions", received);
        ran.first_token(1);
        std::thread::sleep(Duration::from_millis(2));
        ran.delta(4);
        drop(ran);
        let mut failed = r.probe("m", "chat.completions", received);
        failed.failed();
        drop(failed);
        // Refused or cancelled before it ran: not counted.
        drop(r.probe("m", "chat.completions", received));

        let c = pending(&r)[&(5, "m".to_string())];
        assert_eq!((c.requests, c.failures, c.ttfb_samples, c.tps_samples, c.decode_tokens), (2, 1, 1, 1, 4));
        assert!(c.ttfb_us >= 50_000, "from the request's arrival: {}", c.ttfb_us);
        assert!(c.decode_us >= 2_000);
    }

    #[tokio::test]
    async fn a_failed_flush_keeps_its_counts_for_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::db::Db::open(&format!("sqlite://{}", dir.path().join("t.db").display())).await.unwrap();
        let minutes = store.status_minutes();
        let r = recorder();
        r.add("m", &Counts { requests: 2, ..Default::default() });
        store.close().await;
        assert!(r.flush(&minutes, &["m".into()]).await.is_err());
        assert_eq!(pending(&r)[&(5, "m".to_string())].requests, 2, "kept");

        let store = crate::db::Db::open(&format!("sqlite://{}", dir.path().join("t.db").display())).await.unwrap();
        let minutes = store.status_minutes();
        r.flush(&minutes, &["m".into(), "idle".into()]).await.unwrap();
        r.flush(&minutes, &["m".into()]).await.unwrap();
        let sums = minutes.sums_since(0).await.unwrap();
        assert_eq!(sums["m"].requests, 2, "written once");
        assert_eq!(sums["idle"], Counts::default(), "a row for a served model without traffic");
        assert_eq!(minutes.newest().await.unwrap(), Some(5 * MINUTE_US + 1));
    }
}
