//! Usage: tokens and cost per UTC day (or hour, for the last 48 hours) and model, as
//! charts, a table and CSV, filtered by key, model and an inclusive range of days
//! kept in the address. All three are drawn from one report summed in SQL
//! (`billing::usage`); the charts read it as JSON from `usage.json`.

use super::authz::{Action, authorize};
use super::page::{Frame, Refusal, Result, render, urlencode, usd};
use super::session::Viewer;
use super::{Console, State};
use crate::accounts::Membership;
use crate::billing::usage::{DAY_US, Filter, Granularity, HOUR_US, Sums, total};
use crate::calendar::{date, parse_date};
use askama::Template;
use axum::Json;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// The longest range of days one report covers.
pub const MAX_DAYS: i64 = 366;
/// The default range, ending today.
const DEFAULT_DAYS: i64 = 30;
const HOURS: i64 = 48;

/// The filters, as the address carries them.
#[derive(Deserialize, Default, Clone)]
#[serde(default)]
pub struct UsageQuery {
    /// First day, `YYYY-MM-DD` (UTC), inclusive.
    from: String,
    /// Last day, inclusive.
    to: String,
    key: String,
    model: String,
    /// `day` (default) or `hour` (the last 48 hours).
    by: String,
}

/// A checked query: what to sum.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub by: Granularity,
    /// `[start, end)` in µs, on bucket bounds.
    pub start: i64,
    pub end: i64,
    pub filter: Filter,
}

impl Report {
    /// Every bucket's start in the range, none outside it.
    pub fn buckets(&self) -> Vec<i64> {
        (self.start..self.end).step_by(self.by.micros() as usize).collect()
    }
}

/// A bucket's label: its day, or its day and hour.
fn bucket_label(us: i64, by: Granularity) -> String {
    match by {
        Granularity::Day => date(us),
        Granularity::Hour => format!("{} {:02}:00", date(us), us.rem_euclid(DAY_US) / HOUR_US),
    }
}

impl UsageQuery {
    /// The report it asks for at `now` (µs), or what is wrong with it.
    pub fn check(&self, now: i64) -> std::result::Result<Report, Refusal> {
        let text = |s: &str| Some(s.trim().to_string()).filter(|s| !s.is_empty());
        let filter = Filter { key_id: text(&self.key), model: text(&self.model), funding: None };
        if filter.model.as_ref().is_some_and(|m| m.len() > 200) {
            return Err("That model name is too long.".into());
        }
        let today = now.div_euclid(DAY_US);
        if self.by == "hour" {
            let end = (now.div_euclid(HOUR_US) + 1) * HOUR_US;
            return Ok(Report { by: Granularity::Hour, start: end - HOURS * HOUR_US, end, filter });
        }
        if !self.by.is_empty() && self.by != "day" {
            return Err("Show usage by day or by hour.".into());
        }
        let day = |s: &str, name: &str, default: i64| match text(s) {
            None => Ok(default),
            Some(s) => parse_date(&s).ok_or(format!("The {name} date must be a real date written YYYY-MM-DD.")),
        };
        let to = day(&self.to, "end", today)?;
        let from = day(&self.from, "start", to - (DEFAULT_DAYS - 1))?;
        if from > to {
            return Err("The start date is after the end date.".into());
        }
        if to - from + 1 > MAX_DAYS {
            return Err(format!("Choose at most {MAX_DAYS} days at a time.").into());
        }
        Ok(Report { by: Granularity::Day, start: from * DAY_US, end: (to + 1) * DAY_US, filter })
    }

    /// The same filters as an address query (for links and downloads).
    fn encoded(&self) -> String {
        let pairs =
            [("from", &self.from), ("to", &self.to), ("key", &self.key), ("model", &self.model), ("by", &self.by)];
        let kept: Vec<String> = pairs
            .iter()
            .filter(|(_, v)| !v.trim().is_empty())
            .map(|(k, v)| format!("{k}={}", urlencode(v.trim())))
            .collect();
        kept.join("&")
    }
}

/// A report's rows as the table, the chart data and the CSV all read them.
async fn sums(console: &Console, org: &str, report: &Report) -> Result<Vec<Sums>> {
    Ok(console.billing.usage().sums(org, report.start, report.end, report.by, &report.filter).await?)
}

/// The filters, checked against the organization (a key must be one of its own), or
/// what is wrong with them.
async fn checked(console: &Console, org: &str, q: &UsageQuery) -> Result<std::result::Result<Report, Refusal>> {
    let report = match q.check(crate::limits::now_us()) {
        Ok(r) => r,
        Err(why) => return Ok(Err(why)),
    };
    if let Some(key) = &report.filter.key_id
        && console.store.key(key).await?.is_none_or(|k| k.org_id != org)
    {
        return Ok(Err("That key is not one of this organization's.".into()));
    }
    Ok(Ok(report))
}

struct TableRow {
    bucket: String,
    model: String,
    sums: Sums,
    cost: String,
}

#[derive(Template)]
#[template(path = "usage.html")]
struct UsagePage {
    frame: Frame,
    membership: Membership,
    query: UsageQuery,
    /// The range as shown: "2026-11-01 – 2026-11-24 (UTC days)".
    range: String,
    hourly: bool,
    keys: Vec<(String, String)>,
    models: Vec<String>,
    rows: Vec<TableRow>,
    total: Sums,
    total_cost: String,
    data_url: String,
    csv_url: String,
    error: Option<String>,
}

pub async fn page(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(q): Query<UsageQuery>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::View).await?;
    let (report, error) = match checked(&console, &org, &q).await? {
        Ok(r) => (Some(r), None),
        Err(why) => (None, Some(why.0)),
    };
    let rows = match &report {
        Some(r) => sums(&console, &org, r).await?,
        None => Vec::new(),
    };
    let keys = console.store.list_keys(&org).await?;
    // The catalog's models, and any other this report or its filter names (models
    // since retired): no scan of every record just for the choices.
    let mut models: Vec<String> = match &console.api {
        Some(app) => app.models.listed().into_iter().map(|m| m.id).collect(),
        None => Vec::new(),
    };
    models.extend(rows.iter().map(|r| r.model.clone()));
    models.extend(report.as_ref().and_then(|r| r.filter.model.clone()));
    models.sort();
    models.dedup();
    let range = match &report {
        Some(r) if r.by == Granularity::Hour => format!(
            "the last {HOURS} hours: {} – {} (UTC hours)",
            bucket_label(r.start, r.by),
            bucket_label(r.end - HOUR_US, r.by)
        ),
        Some(r) => format!("{} – {} (UTC days, both included)", date(r.start), date(r.end - DAY_US)),
        None => String::new(),
    };
    let total = total(&rows);
    let encoded = q.encoded();
    let page = UsagePage {
        frame: viewer.frame(&console, format!("Usage · {}", membership.org.name), Some(&org)).await?,
        hourly: report.as_ref().is_some_and(|r| r.by == Granularity::Hour),
        range,
        keys: keys
            .into_iter()
            .map(|k| {
                let revoked = if k.revoked_at.is_some() { " (revoked)" } else { "" };
                (k.id, format!("{}{revoked}", k.name))
            })
            .collect(),
        models,
        rows: rows
            .into_iter()
            .map(|s| TableRow {
                bucket: bucket_label(s.bucket, report.as_ref().map_or(Granularity::Day, |r| r.by)),
                model: s.model.clone(),
                cost: usd(s.cost_micros),
                sums: s,
            })
            .collect(),
        total_cost: usd(total.cost_micros),
        total,
        data_url: format!("/o/{org}/usage.json?{encoded}"),
        csv_url: format!("/o/{org}/usage.csv?{encoded}"),
        query: q,
        membership,
        error: error.clone(),
    };
    let status = if error.is_some() { StatusCode::BAD_REQUEST } else { StatusCode::OK };
    Ok(render(status, &page))
}

/// The chart data: every bucket of the range (empty ones as zeros), and per metric
/// and model one value per bucket.
#[derive(Serialize)]
pub struct ChartData {
    pub by: Granularity,
    pub time_zone: &'static str,
    /// Bucket starts, seconds since the epoch.
    pub buckets: Vec<i64>,
    pub models: Vec<String>,
    /// metric → model → values, one per bucket.
    pub series: Map<String, Value>,
    pub total: Sums,
}

const METRICS: [&str; 6] =
    ["requests", "input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens", "cost_micros"];

fn metric(s: &Sums, name: &str) -> i64 {
    match name {
        "requests" => s.requests,
        "input_tokens" => s.input_tokens,
        "cached_input_tokens" => s.cached_input_tokens,
        "output_tokens" => s.output_tokens,
        "reasoning_tokens" => s.reasoning_tokens,
        _ => s.cost_micros,
    }
}

pub fn chart_data(report: &Report, rows: &[Sums]) -> ChartData {
    let buckets = report.buckets();
    let mut models: Vec<String> = rows.iter().map(|r| r.model.clone()).collect();
    models.sort();
    models.dedup();
    let step = report.by.micros();
    let mut series = Map::new();
    for name in METRICS {
        let mut per_model = Map::new();
        for model in &models {
            let mut values = vec![0i64; buckets.len()];
            for r in rows.iter().filter(|r| &r.model == model) {
                values[((r.bucket - report.start) / step) as usize] += metric(r, name);
            }
            per_model.insert(model.clone(), json!(values));
        }
        series.insert(name.to_string(), Value::Object(per_model));
    }
    ChartData {
        by: report.by,
        time_zone: "UTC",
        buckets: buckets.iter().map(|b| b / 1_000_000).collect(),
        models,
        series,
        total: total(rows),
    }
}

/// For the chart data and the CSV: the report and its rows, or a query error as their
/// callers read it (a 400 with the reason as JSON).
async fn rows_for(
    console: &Console,
    viewer: &Viewer,
    org: &str,
    q: &UsageQuery,
) -> Result<std::result::Result<(Report, Vec<Sums>), Response>> {
    authorize(console, viewer, org, Action::View).await?;
    let report = match checked(console, org, q).await? {
        Ok(r) => r,
        Err(why) => return Ok(Err((StatusCode::BAD_REQUEST, Json(json!({"error": why.0}))).into_response())),
    };
    let rows = sums(console, org, &report).await?;
    Ok(Ok((report, rows)))
}

pub async fn data(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(q): Query<UsageQuery>,
) -> Result<Response> {
    Ok(match rows_for(&console, &viewer, &org, &q).await? {
        Ok((report, rows)) => Json(chart_data(&report, &rows)).into_response(),
        Err(refused) => refused,
    })
}

/// The table as CSV: one line per bucket and model, cost in dollars to the
/// micro-dollar (exact), times in UTC.
pub async fn csv(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(q): Query<UsageQuery>,
) -> Result<Response> {
    let (report, rows) = match rows_for(&console, &viewer, &org, &q).await? {
        Ok(found) => found,
        Err(refused) => return Ok(refused),
    };
    let mut out = String::from(
        "bucket_start_utc,model,requests,input_tokens,cached_input_tokens,output_tokens,reasoning_tokens,cost_usd\n",
    );
    for r in &rows {
        let cost = crate::billing::cost::usd(r.cost_micros);
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{}\n",
            crate::calendar::rfc3339(r.bucket),
            csv_field(&r.model),
            r.requests,
            r.input_tokens,
            r.cached_input_tokens,
            r.output_tokens,
            r.reasoning_tokens,
            cost.trim_start_matches('$'),
        ));
    }
    let name = format!("usage-{}-{}-{}.csv", org, date(report.start), date(report.end - 1));
    let disposition = format!("attachment; filename=\"{name}\"");
    Ok((
        [(header::CONTENT_TYPE, "text/csv; charset=utf-8".to_string()), (header::CONTENT_DISPOSITION, disposition)],
        out,
    )
        .into_response())
}

/// A CSV field, quoted when it must be, and never read as a formula by a spreadsheet.
fn csv_field(s: &str) -> String {
    let s = if s.starts_with(['=', '+', '-', '@', '\t', '\r']) { format!("'{s}") } else { s.to_string() };
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::days_from_civil;

    fn q(from: &str, to: &str, by: &str) -> UsageQuery {
        UsageQuery { from: from.into(), to: to.into(), by: by.into(), ..Default::default() }
    }

    #[test]
    fn ranges_are_whole_utc_days_both_ends_included_and_nothing_more() {
        let now = (days_from_civil(2026, 11, 24) * 24 + 15) * HOUR_US;
        let r = q("2026-10-30", "2026-11-02", "").check(now).unwrap();
        assert_eq!(r.start, days_from_civil(2026, 10, 30) * DAY_US);
        assert_eq!(r.end, days_from_civil(2026, 11, 3) * DAY_US, "the last day is included, the next is not");
        assert_eq!(r.buckets().len(), 4);
        let d = q("", "", "").check(now).unwrap();
        assert_eq!((date(d.start), date(d.end - 1)), ("2026-10-26".into(), "2026-11-24".into()));
        assert_eq!(d.buckets().len(), 30);
        let h = q("", "", "hour").check(now).unwrap();
        assert_eq!(h.buckets().len(), 48);
        assert_eq!(h.end, (days_from_civil(2026, 11, 24) * 24 + 16) * HOUR_US, "through the current hour");
        for (from, to) in [("2026-11-05", "2026-11-01"), ("2026-02-30", ""), ("yesterday", ""), ("2024-01-01", "")] {
            assert!(q(from, to, "").check(now).is_err(), "{from}..{to}");
        }
        assert!(q("", "", "week").check(now).is_err());
    }

    #[test]
    fn chart_values_sum_into_their_buckets() {
        let r = Report { by: Granularity::Day, start: 0, end: 3 * DAY_US, filter: Filter::default() };
        let row =
            |bucket, model: &str, cost| Sums { bucket, model: model.into(), cost_micros: cost, ..Default::default() };
        let data = chart_data(&r, &[row(0, "b", 5), row(2 * DAY_US, "b", 7), row(2 * DAY_US, "a", 1)]);
        assert_eq!(data.buckets, [0, 86_400, 172_800]);
        assert_eq!(data.series["cost_micros"]["b"], json!([5, 0, 7]));
        assert_eq!(data.series["cost_micros"]["a"], json!([0, 0, 1]));
        assert_eq!(data.total.cost_micros, 13);
    }

    #[test]
    fn csv_fields_cannot_smuggle_formulas_or_columns() {
        assert_eq!(csv_field("vendor-a/model-a"), "vendor-a/model-a");
        assert_eq!(csv_field("=cmd()"), "'=cmd()");
        assert_eq!(csv_field("\t=1"), "'\t=1");
        assert_eq!(csv_field("a,\"b\""), "\"a,\"\"b\"\"\"");
    }
}
