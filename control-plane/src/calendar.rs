//! Dates in the proleptic Gregorian calendar, UTC: what plan renewals (months) and
//! timestamps in API replies (RFC 3339) need, without a date-time dependency.

/// Days since 1970-01-01 of a date (eras of 400 years, March-based years so that the
/// leap day comes last).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of `days_from_civil`: (year, month, day).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
}

/// `us` (µs since the epoch) as an RFC 3339 / ISO 8601 UTC timestamp to the second:
/// `2026-11-23T12:00:00Z`.
pub fn rfc3339(us: i64) -> String {
    let secs = us.div_euclid(1_000_000);
    let (days, s) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", s / 3600, s / 60 % 60, s % 60)
}

/// `YYYY-MM-DD` of the UTC day containing `us` (µs since the epoch).
pub fn date(us: i64) -> String {
    let (y, m, d) = civil_from_days(us.div_euclid(86_400_000_000));
    format!("{y:04}-{m:02}-{d:02}")
}

/// The day number (days since the epoch) of a `YYYY-MM-DD` date that exists.
pub fn parse_date(text: &str) -> Option<i64> {
    let t = text.trim();
    let b = t.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let (y, m, d) = (t[0..4].parse().ok()?, t[5..7].parse().ok()?, t[8..10].parse().ok()?);
    let day = days_from_civil(y, m, d);
    // Out-of-range months and days come back as another date.
    (civil_from_days(day) == (y, m, d)).then_some(day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(civil_from_days(days_from_civil(2024, 2, 29)), (2024, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        let at = (days_from_civil(2026, 11, 23) * 86_400 + 12 * 3600 + 34 * 60 + 56) * 1_000_000 + 999_999;
        assert_eq!(rfc3339(at), "2026-11-23T12:34:56Z");
    }
}
