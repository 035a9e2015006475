//! The personal plans (Basic, Pro, Max) and the calendar their billing periods follow.

use crate::calendar::{civil_from_days, days_from_civil};
use serde::Serialize;
use std::str::FromStr;
use tessera_proto::UnknownName;

/// Basic, Pro and Max: what each costs a month, how much model usage it includes
/// (price × multiplier) and how many of its requests may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Plan {
    Basic,
    Pro,
    Max,
}

pub const HOUR_US: i64 = 3_600_000_000;
pub const WINDOW_5H_US: i64 = 5 * HOUR_US;
pub const WINDOW_7D_US: i64 = 7 * 24 * HOUR_US;

impl Plan {
    pub fn price_micros(self) -> i64 {
        match self {
            Self::Basic => 10_000_000,
            Self::Pro => 30_000_000,
            Self::Max => 100_000_000,
        }
    }

    /// The included-usage multiplier, in basis points (2.5 = 25 000).
    pub fn multiplier_bp(self) -> i64 {
        match self {
            Self::Basic => 20_000,
            Self::Pro => 25_000,
            Self::Max => 30_000,
        }
    }

    /// Subscription requests of one user in flight at once.
    pub fn concurrency(self) -> u32 {
        match self {
            Self::Basic => 2,
            Self::Pro => 3,
            Self::Max => 4,
        }
    }

    /// Model usage included for `paid` micro-dollars of this plan.
    pub fn included_for(self, paid: i64) -> i64 {
        (paid as i128 * self.multiplier_bp() as i128 / 10_000) as i64
    }

    /// A month's included usage at the full price: $20, $75, $300.
    pub fn included_micros(self) -> i64 {
        self.included_for(self.price_micros())
    }

    /// The 5-hour window's cap: 25 % of the month's included usage.
    pub fn cap_5h(self) -> i64 {
        self.included_micros() / 4
    }

    /// The 7-day window's cap: 50 % of the month's included usage.
    pub fn cap_7d(self) -> i64 {
        self.included_micros() / 2
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Basic => "basic",
            Self::Pro => "pro",
            Self::Max => "max",
        }
    }
}

impl FromStr for Plan {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "basic" => Ok(Self::Basic),
            "pro" => Ok(Self::Pro),
            "max" => Ok(Self::Max),
            other => Err(UnknownName::new("plan", other, ["basic", "pro", "max"])),
        }
    }
}

/// The start of month `n` of a subscription begun at `start` (µs since the epoch): the
/// same day of the month and time of day, the day clamped to shorter months (a plan
/// begun on January 31st renews on February 28th, then March 31st).
pub fn add_months(start_us: i64, n: i64) -> i64 {
    const DAY_US: i64 = 24 * HOUR_US;
    let (days, time_of_day) = (start_us.div_euclid(DAY_US), start_us.rem_euclid(DAY_US));
    let (y, m, d) = civil_from_days(days);
    let months = y * 12 + (m as i64 - 1) + n;
    let (y, m) = (months.div_euclid(12), (months.rem_euclid(12) + 1) as u32);
    let d = d.min(days_in_month(y, m));
    days_from_civil(y, m, d) * DAY_US + time_of_day
}

fn is_leap(y: i64) -> bool {
    y % 4 == 0 && (y % 100 != 0 || y % 400 == 0)
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_match_the_spec_table() {
        let table: Vec<_> = [Plan::Basic, Plan::Pro, Plan::Max]
            .iter()
            .map(|p| (p.price_micros() / 1_000_000, p.included_micros() / 1_000_000, p.concurrency()))
            .collect();
        assert_eq!(table, [(10, 20, 2), (30, 75, 3), (100, 300, 4)]);
        assert_eq!((Plan::Pro.cap_5h(), Plan::Pro.cap_7d()), (18_750_000, 37_500_000));
        assert!(Plan::Basic < Plan::Pro && Plan::Pro < Plan::Max);
    }

    #[test]
    fn months_keep_the_day_and_clamp_short_ones() {
        let day = 24 * HOUR_US;
        let at = |y, m, d| days_from_civil(y, m, d) * day;
        assert_eq!(at(1970, 1, 1), 0);
        let jan31 = at(2026, 1, 31) + 13 * HOUR_US;
        assert_eq!(add_months(jan31, 1), at(2026, 2, 28) + 13 * HOUR_US);
        assert_eq!(add_months(jan31, 2), at(2026, 3, 31) + 13 * HOUR_US, "counted from the start: no drift");
        assert_eq!(add_months(at(2023, 3, 31), 11), at(2024, 2, 29), "leap year");
        assert_eq!(add_months(at(2026, 11, 23), 2), at(2027, 1, 23), "across a year");
        assert_eq!(add_months(jan31, 0), jan31);
    }
}
