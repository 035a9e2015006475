//! A rate per second, estimated over windows of 250 ms (the window in progress counted
//! as if whole, so that a burst from quiet shows at once): an organization's spend at a
//! control plane (budget leases) or its arrivals (rate-limit token leases). Times are
//! µs since the epoch, so that tests and simulations drive it on their own clocks.

/// How long a window runs before it is folded in, µs.
const WINDOW_US: i64 = 250_000;

#[derive(Debug, Clone)]
pub struct Rate {
    since: i64,
    sum: i64,
    per_sec: f64,
}

impl Rate {
    pub fn new(now_us: i64) -> Self {
        Self { since: now_us, sum: 0, per_sec: 0.0 }
    }

    pub fn add(&mut self, now_us: i64, amount: i64) {
        let dt = now_us - self.since;
        if dt >= WINDOW_US {
            let recent = self.sum as f64 * 1e6 / dt as f64;
            // A window after a long quiet spell is the rate; otherwise half old, half new.
            self.per_sec = if dt > 8 * WINDOW_US { recent } else { (self.per_sec + recent) / 2.0 };
            (self.since, self.sum) = (now_us, 0);
        }
        self.sum += amount;
    }

    pub fn per_sec(&self) -> f64 {
        self.per_sec.max(self.sum as f64 * 1e6 / WINDOW_US as f64)
    }

    /// When the window in progress began: nothing was added for at least this long
    /// before the last addition's window.
    pub fn since(&self) -> i64 {
        self.since
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_shows_at_once_and_a_steady_rate_settles() {
        let mut r = Rate::new(0);
        for i in 0..10 {
            r.add(i * 1_000, 1);
        }
        assert_eq!(r.per_sec(), 40.0, "10 in the first window read as 10 per 250 ms");
        // 1,000 a second for two seconds.
        for i in 0..2_000 {
            r.add(10_000 + i * 1_000, 1);
        }
        assert!((r.per_sec() - 1_000.0).abs() < 50.0, "{}", r.per_sec());
    }
}
