//! The public `GET /status`: each model's decoding speed, time to first token and
//! success rate over a window, with its live subscription supply.
//!
//! Every generation is measured as it runs (`recorder`), added to per-minute rows per
//! model in the database every few seconds (`minutes`), and summed over each window
//! into snapshots kept in memory (`board`), which is what requests read: the figures
//! cost nothing under load, cover the whole service when several control planes share
//! the database, and a 30-day window survives restarts.
//!
//! The figures, over the minutes of the window (the current one included):
//! - `tps`: tokens generated after each generation's first, per second of the time
//!   they took (decoding speed, weighted by tokens);
//! - `ttfb_seconds`: the mean time from a request's arrival to its first token;
//! - `uptime_pct`: the share of generations that did not fail on our side (the
//!   replicas failing or overloaded); a client's mistake or a refusal by its limits
//!   is not counted, and a client that leaves mid-stream counts as served.
//!
//! Each is null until the window holds [`MIN_SAMPLES`] measurements of it. The
//! snapshot is `stale` when the newest aggregate is older than [`STALE_AFTER_US`] or
//! this process's aggregator stopped: no flush, or no refresh, within that time.
//! Without `?window=`, the window is [`Window::DEFAULT`] (1 hour).

pub mod board;
pub mod minutes;
pub mod recorder;

pub use board::{Listed, Snapshot, Status};
pub use minutes::{Counts, Minutes};
pub use recorder::{Probe, Recorder};

use std::str::FromStr;

/// Fewer measurements than this in a window give a null figure.
pub const MIN_SAMPLES: i64 = 3;
/// Aggregates older than this (µs) make a snapshot stale.
pub const STALE_AFTER_US: i64 = 120_000_000;
pub const MINUTE_US: i64 = 60_000_000;

/// The windows a snapshot covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Window {
    FiveMinutes,
    Hour,
    Day,
    Month,
}

impl Window {
    pub const ALL: [Window; 4] = [Self::FiveMinutes, Self::Hour, Self::Day, Self::Month];
    pub const DEFAULT: Window = Self::Hour;

    pub fn as_str(self) -> &'static str {
        match self {
            Self::FiveMinutes => "5m",
            Self::Hour => "1h",
            Self::Day => "24h",
            Self::Month => "30d",
        }
    }

    pub fn secs(self) -> i64 {
        match self {
            Self::FiveMinutes => 300,
            Self::Hour => 3_600,
            Self::Day => 86_400,
            Self::Month => 30 * 86_400,
        }
    }

    /// The first minute (since the epoch) the window holds at `now_us`.
    pub fn first_minute(self, now_us: i64) -> i64 {
        now_us.div_euclid(MINUTE_US) - self.secs() / 60 + 1
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|w| *w == self).unwrap_or(0)
    }
}

impl FromStr for Window {
    type Err = tessera_proto::UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|w| w.as_str() == s)
            .ok_or_else(|| tessera_proto::UnknownName::new("window", s, Self::ALL.map(Self::as_str)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_and_name_the_allowed_ones_otherwise() {
        assert_eq!("30d".parse::<Window>(), Ok(Window::Month));
        assert_eq!(Window::ALL.map(|w| w.secs()), [300, 3_600, 86_400, 2_592_000]);
        let e = "2h".parse::<Window>().unwrap_err();
        assert_eq!((e.value.as_str(), e.known), ("2h", vec!["5m", "1h", "24h", "30d"]));
        // Five minutes: the current one and the four before it.
        assert_eq!(Window::FiveMinutes.first_minute(10 * MINUTE_US + 5), 6);
    }
}
