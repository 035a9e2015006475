//! Fair sharing of a replica among tenants (the organizations requests are for): who
//! may run how many rows in the next step while more than one wants the replica.
//!
//! Without it, whoever sends more gets more of every step: a flood of 48 streams from
//! one organization makes every step 48 rows long, and another organization's short
//! request waits for one such step and then runs inside the next. On a CPU a step's
//! time grows with its rows, so that request's first token came 10 times later than
//! alone. Fairness here is a budget of rows per step, `batch`, in force while tenants
//! contend and split among them by weight:
//!
//! - Contention: two or more tenants have sequences on the replica, or had within the
//!   last `grace`: a tenant sending one request after another is idle between them for
//!   a moment, and a flooder whose steps grew back to full length in that moment would
//!   make the next request wait for one (the anticipation of I/O schedulers).
//! - Allotment: `batch` rows are split by weighted max-min fairness among the tenants'
//!   demands (a decode is one row, a prompt chunk one per token): a tenant asking for
//!   less than its share gets what it asks, the rest is shared among the others by
//!   weight. An idle tenant in its grace asks for nothing, so the flooder keeps every
//!   row nobody else wants, only in shorter steps.
//! - Virtual time: each tenant's tokens run divided by its weight. The tenant furthest
//!   behind goes first in a step and its first piece of work runs whole (a short prompt
//!   is not cut to its share of rows: its first token is what the tenant waits for);
//!   over time this evens out, so shares follow weights. A tenant that arrives takes
//!   the virtual time of the least served active tenant less `lag`: no credit is saved
//!   up while away beyond one step's worth.
//!
//! Within a tenant, lower `priority` first (vLLM's convention), then the sequence that
//! ran least recently: rows rotate among the tenant's streams, so all of them advance.
//! On a GPU a step's time barely grows with its rows, and `batch` defaults to the
//! batch limit: fairness then decides only whose sequences are admitted and preempted
//! first when the batch or the KV cache is full.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a tenant with nothing on the replica still counts as contending.
pub const GRACE: Duration = Duration::from_millis(500);
/// Tenants with nothing on the replica for this long are forgotten (their virtual
/// time: they come back as newcomers).
const FORGET_AFTER: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
struct TenantState {
    weight: u32,
    /// Tokens run divided by weight.
    vtime: f64,
    /// Its sequences on the replica, running or waiting.
    seqs: usize,
    /// When its last sequence left; None while it has some.
    idle_since: Option<Instant>,
    /// Its share of the rows of recent steps (a moving average).
    share: f64,
}

/// Weight of the newest step in the moving average of each tenant's share of rows.
const SHARE_ALPHA: f64 = 0.05;

#[derive(Debug, Clone)]
pub struct Fairness {
    tenants: HashMap<Arc<str>, TenantState>,
    /// Rows a step runs while tenants contend.
    batch: usize,
    grace: Duration,
}

impl Fairness {
    pub fn new(batch: usize, grace: Duration) -> Self {
        Self { tenants: HashMap::new(), batch: batch.max(1), grace }
    }

    /// A sequence of `tenant` arrived (or returned from preemption: it never left).
    pub fn join(&mut self, tenant: &Arc<str>, weight: u32) {
        let floor = self.tenants.values().filter(|t| t.seqs > 0).map(|t| t.vtime).reduce(f64::min);
        let lag = self.batch as f64;
        let t = self.tenants.entry(tenant.clone()).or_insert(TenantState {
            weight: 1,
            vtime: 0.0,
            seqs: 0,
            idle_since: None,
            share: 0.0,
        });
        t.weight = weight.max(1);
        if t.seqs == 0
            && let Some(floor) = floor
        {
            t.vtime = t.vtime.max(floor - lag / f64::from(t.weight));
        }
        t.seqs += 1;
        t.idle_since = None;
    }

    /// A sequence of `tenant` left the replica (finished, aborted, refused).
    pub fn leave(&mut self, tenant: &str, now: Instant) {
        if let Some(t) = self.tenants.get_mut(tenant).filter(|t| t.seqs > 0) {
            t.seqs -= 1;
            if t.seqs == 0 {
                t.idle_since = Some(now);
            }
        }
        self.tenants.retain(|_, t| t.idle_since.is_none_or(|at| now.saturating_duration_since(at) < FORGET_AFTER));
    }

    /// Whether more than one tenant has sequences here or had within the grace.
    pub fn contended(&self, now: Instant) -> bool {
        self.tenants.values().filter(|t| self.active(t, now)).take(2).count() == 2
    }

    fn active(&self, t: &TenantState, now: Instant) -> bool {
        t.idle_since.is_none_or(|at| now.saturating_duration_since(at) < self.grace)
    }

    /// `tenant`'s tokens run: its virtual time moves on by them over its weight.
    pub fn charge(&mut self, tenant: &str, tokens: usize) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.vtime += tokens as f64 / f64::from(t.weight);
        }
    }

    /// A step ran `rows` rows of each tenant's: each tenant's share of recent steps moves
    /// towards its share of this one.
    pub fn record_step(&mut self, rows: &HashMap<Arc<str>, usize>) {
        let total = rows.values().sum::<usize>().max(1) as f64;
        for (name, t) in &mut self.tenants {
            let now = rows.get(name).copied().unwrap_or(0) as f64 / total;
            t.share += SHARE_ALPHA * (now - t.share);
        }
    }

    /// Each known tenant: its name, weight and share of recent steps' rows.
    pub fn shares(&self) -> impl Iterator<Item = (&Arc<str>, u32, f64)> {
        self.tenants.iter().map(|(n, t)| (n, t.weight, t.share))
    }

    /// A tenant's virtual time (tokens run over weight); 0 for one not known.
    pub fn vtime(&self, tenant: &str) -> f64 {
        self.tenants.get(tenant).map_or(0.0, |t| t.vtime)
    }

    /// Splits the contended step's `batch` rows among `demands` (rows each tenant could
    /// run now) by weighted max-min fairness: none gets more than it asks, and what one
    /// leaves goes to the others by weight. Rows that do not divide evenly go to the
    /// tenants furthest behind in virtual time, one each.
    pub fn allot(&self, demands: &HashMap<Arc<str>, usize>) -> HashMap<Arc<str>, usize> {
        let weight = |name: &str| f64::from(self.tenants.get(name).map_or(1, |t| t.weight));
        let mut open: Vec<(&Arc<str>, usize)> = demands.iter().filter(|(_, d)| **d > 0).map(|(n, d)| (n, *d)).collect();
        let mut given: HashMap<Arc<str>, usize> = demands.keys().map(|n| (n.clone(), 0)).collect();
        let mut left = self.batch;
        // Water-filling: whoever asks for no more than its share of what is left gets it
        // all; once none does, the rest is cut by weight.
        loop {
            let total: f64 = open.iter().map(|(n, _)| weight(n)).sum();
            let share = |n: &str| left as f64 * weight(n) / total;
            let (small, large): (Vec<_>, Vec<_>) = open.into_iter().partition(|(n, d)| *d as f64 <= share(n));
            if small.is_empty() {
                let mut cut: Vec<(&Arc<str>, usize)> = Vec::new();
                for &(n, d) in &large {
                    let rows = (share(n).floor() as usize).min(d);
                    given.insert(n.clone(), rows);
                    cut.push((n, d - rows));
                }
                left -= cut.iter().map(|(n, wants)| demands[*n] - wants).sum::<usize>();
                // The remainder, a row each, furthest behind first.
                cut.sort_by(|a, b| self.vtime(a.0).total_cmp(&self.vtime(b.0)).then_with(|| a.0.cmp(b.0)));
                for (n, wants) in cut {
                    if left == 0 {
                        break;
                    }
                    if wants > 0 {
                        *given.get_mut(n).expect("given above") += 1;
                        left -= 1;
                    }
                }
                break;
            }
            for &(n, d) in &small {
                given.insert(n.clone(), d);
                left -= d;
            }
            open = large;
            if open.is_empty() {
                break;
            }
        }
        given
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Arc<str> {
        s.into()
    }

    fn demands(d: &[(&str, usize)]) -> HashMap<Arc<str>, usize> {
        d.iter().map(|(n, r)| (name(n), *r)).collect()
    }

    #[test]
    fn rows_are_split_by_weighted_max_min() {
        let mut f = Fairness::new(8, GRACE);
        for t in ["a", "b", "c"] {
            f.join(&name(t), 1);
        }
        // A flooder beside one asking for a single row: it keeps everything else.
        let got = f.allot(&demands(&[("a", 48), ("b", 1)]));
        assert_eq!((got["a"], got["b"]), (7, 1));
        // Two flooders: half each.
        let got = f.allot(&demands(&[("a", 48), ("b", 30)]));
        assert_eq!((got["a"], got["b"]), (4, 4));
        // Nobody asks for more than there is: all get what they ask.
        let got = f.allot(&demands(&[("a", 3), ("b", 2), ("c", 0)]));
        assert_eq!((got["a"], got["b"], got["c"]), (3, 2, 0));
        // Weights 3 : 1.
        f.join(&name("a"), 3);
        let got = f.allot(&demands(&[("a", 48), ("b", 48)]));
        assert_eq!((got["a"], got["b"]), (6, 2));
        // Three ways, 8 rows, weights 3:1:1 — 4.8, 1.6, 1.6: the remainder goes to those
        // furthest behind.
        f.charge("b", 10);
        let got = f.allot(&demands(&[("a", 48), ("b", 48), ("c", 48)]));
        assert_eq!(got.values().sum::<usize>(), 8);
        assert_eq!((got["a"], got["b"], got["c"]), (5, 1, 2), "{got:?}");
    }

    #[test]
    fn contention_lasts_through_the_grace_and_arrivals_bring_no_saved_credit() {
        let t0 = Instant::now();
        let mut f = Fairness::new(8, Duration::from_millis(500));
        let (a, b) = (name("a"), name("b"));
        f.join(&a, 1);
        assert!(!f.contended(t0), "one tenant");
        f.charge("a", 1000);
        f.join(&b, 1);
        assert!(f.contended(t0));
        assert_eq!(f.vtime("b"), 1000.0 - 8.0, "the least served active tenant's time, less one step");
        f.leave("b", t0);
        assert!(f.contended(t0 + Duration::from_millis(499)), "within the grace");
        assert!(!f.contended(t0 + Duration::from_millis(500)));
        // Away while the other ran on: back at most one step behind.
        f.charge("a", 5000);
        f.join(&b, 1);
        assert_eq!(f.vtime("b"), 6000.0 - 8.0);
        // A heavier tenant's lag is as many rows, over its weight.
        f.leave("b", t0);
        f.join(&b, 2);
        assert_eq!(f.vtime("b"), 6000.0 - 4.0);
        // Long gone: forgotten.
        f.leave("b", t0);
        f.leave("a", t0 + FORGET_AFTER);
        assert_eq!(f.vtime("b"), 0.0);
    }
}
