//! A simulation of budget leases at a scale this machine cannot run: `control_planes`
//! control planes admitting one organization's `rate` requests a second, on a simulated
//! clock in 1 ms steps, with the control plane's own sizing (`lease::Rate` and
//! `lease::slice`) and an in-memory account in place of the database. Each request
//! holds a random worst case, runs a random time and costs a random part of it; each
//! control plane writes what settled every `flush_ms` (one transaction), renews its
//! lease ahead of need or when a request finds it short. Printed: lease sizes, database
//! transactions a second (renewals, settlement batches, rate-limit token leases, against
//! three a request without leases), and — with a budget that runs out — the overspend
//! (checked zero at every step: nothing is charged beyond what was granted, no account
//! or lease below zero), refusals while credit was left elsewhere, and credit left
//! unspent at the end.

use anyhow::{Result, ensure};
use serde_json::json;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use tessera_control_plane::billing::lease::{Rate, slice};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value_t = 8)]
    control_planes: usize,
    /// Requests a second, all control planes together.
    #[arg(long, default_value_t = 10_000)]
    rate: u64,
    /// Simulated seconds of the steady run.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Milliseconds between one control plane's settlement transactions (measured by
    /// `tessera-bench billing`: about 4 ms on PostgreSQL under load).
    #[arg(long, default_value_t = 4)]
    flush_ms: u64,
    /// Seconds of spend a lease covers (`--budget-lease-secs`).
    #[arg(long, default_value_t = 2.0)]
    lease_secs: f64,
    /// The rate limit's burst (`--rate-limit-burst`): token leases are at most half.
    #[arg(long, default_value_t = 1_000)]
    burst: u64,
}

/// splitmix64: reproducible, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Plane {
    rate: Rate,
    available: i64,
    held: i64,
    settling: i64,
    last_flush: u64,
}

#[derive(Default)]
struct Outcome {
    admitted: u64,
    refused: u64,
    /// Refused while the account and the other control planes' leases together held
    /// enough.
    refused_with_credit_elsewhere: u64,
    /// When the first request was refused: the credit other control planes' leases held,
    /// and when (seconds).
    first_refusal: Option<(i64, f64)>,
    renewals: u64,
    slices: Vec<i64>,
    batches: u64,
    charged: i64,
    /// The account and every lease once all has settled (idle leases return it).
    left: i64,
    last_admission: f64,
    seconds: f64,
}

fn simulate(args: &Args, planes: usize, budget: i64, seconds: u64, seed: u64) -> Result<Outcome> {
    // Requests from one stream, control planes from another: the same requests
    // whatever the number of control planes.
    let (mut rng, mut spread) = (Rng(seed), Rng(seed ^ 0x5eed));
    let mut planes: Vec<Plane> =
        (0..planes).map(|_| Plane { rate: Rate::new(0), available: 0, held: 0, settling: 0, last_flush: 0 }).collect();
    let mut account = budget;
    let mut out = Outcome::default();
    // Requests in flight: (end ms, plane, held, cost).
    let mut running: BinaryHeap<Reverse<(u64, usize, i64, i64)>> = BinaryHeap::new();
    let per_ms = args.rate as f64 / 1000.0;
    let mut due = 0.0;
    for ms in 0..seconds * 1000 {
        let now_us = (ms * 1000) as i64;
        while let Some(Reverse((end, p, held, cost))) = running.peek().copied() {
            if end > ms {
                break;
            }
            running.pop();
            let plane = &mut planes[p];
            plane.held -= held;
            plane.available += held - cost;
            plane.settling += cost;
        }
        for plane in &mut planes {
            if plane.settling > 0 && ms - plane.last_flush >= args.flush_ms {
                out.charged += plane.settling;
                plane.settling = 0;
                plane.last_flush = ms;
                out.batches += 1;
            }
        }
        due += per_ms;
        while due >= 1.0 {
            due -= 1.0;
            let p = spread.below(planes.len() as u64) as usize;
            // A worst case of $0.001 to $0.02; it runs 0.2 to 4 s and costs up to all of it.
            let worst = 1_000 + rng.below(19_000) as i64;
            let run_ms = 200 + rng.below(3_800);
            let cost = worst * rng.below(101) as i64 / 100;
            let plane = &mut planes[p];
            plane.rate.add(now_us, worst);
            let target = (plane.rate.per_sec() * args.lease_secs) as i64;
            if plane.available < worst {
                match slice(account, worst - plane.available, target - plane.available) {
                    Some(take) => {
                        account -= take;
                        plane.available += take;
                        out.renewals += 1;
                        out.slices.push(take);
                    }
                    None => {
                        out.refused += 1;
                        let elsewhere: i64 =
                            planes.iter().enumerate().filter(|(q, _)| *q != p).map(|(_, q)| q.available).sum();
                        if account + planes[p].available + elsewhere >= worst {
                            out.refused_with_credit_elsewhere += 1;
                        }
                        out.first_refusal.get_or_insert((elsewhere, ms as f64 / 1000.0));
                        continue;
                    }
                }
            }
            let plane = &mut planes[p];
            plane.available -= worst;
            plane.held += worst;
            out.admitted += 1;
            out.last_admission = ms as f64 / 1000.0;
            running.push(Reverse((ms + run_ms, p, worst, cost)));
            // Ahead of need, as `Leases::renew_ahead` does.
            if plane.available < target / 2
                && let Some(take) = slice(account, 0, target - plane.available)
                && take > 0
            {
                account -= take;
                plane.available += take;
                out.renewals += 1;
                out.slices.push(take);
            }
        }
        // The books balance at every step, and nothing is below zero.
        let leased: i64 = planes.iter().map(|q| q.available + q.held + q.settling).sum();
        ensure!(account >= 0 && planes.iter().all(|q| q.available >= 0), "a balance below zero at {ms} ms");
        ensure!(account + leased + out.charged == budget, "the books do not balance at {ms} ms");
    }
    // Every request finishes and settles: what is left is the account and the leases.
    while let Some(Reverse((_, p, held, cost))) = running.pop() {
        planes[p].available += held - cost;
        out.charged += cost;
    }
    for plane in &mut planes {
        out.charged += std::mem::take(&mut plane.settling);
    }
    ensure!(out.charged <= budget, "charged {} of {budget}", out.charged);
    out.left = account + planes.iter().map(|q| q.available).sum::<i64>();
    out.seconds = seconds as f64;
    Ok(out)
}

pub fn run(args: Args) -> Result<()> {
    let steady = simulate(&args, args.control_planes, i64::MAX / 4, args.seconds, 1)?;
    // A budget that runs out within seconds at this rate (in-flight worst cases hold
    // most of it), simulated for ten: across the control planes, and as one pool (one
    // control plane: what per-request holds on one account would admit).
    let budget = (args.rate as f64 * 5.0 * 5_250.0) as i64;
    let drained = simulate(&args, args.control_planes, budget, 10, 2)?;
    let pooled = simulate(&args, 1, budget, 10, 2)?;
    let mut slices = steady.slices.clone();
    slices.sort_unstable();
    let pick = |q: f64| slices.get(((slices.len() as f64 - 1.0) * q) as usize).copied().unwrap_or(0);
    // Rate-limit tokens: a control plane leases 50 ms of its arrivals, at most half the
    // burst, so one decision per that many requests.
    let per_plane = args.rate as f64 / args.control_planes as f64;
    let tokens = (per_plane * 0.05).clamp(1.0, (args.burst / 2).max(1) as f64);
    let rate_tx = args.rate as f64 / tokens;
    let renewals = steady.renewals as f64 / steady.seconds;
    let batches = steady.batches as f64 / steady.seconds;
    println!(
        "{}",
        json!({
            "bench": "leases_model",
            "control_planes": args.control_planes,
            "requests_per_s": args.rate,
            "lease_secs": args.lease_secs,
            "flush_ms": args.flush_ms,
            "lease_slice_p50_micros": pick(0.5),
            "lease_slice_p99_micros": pick(0.99),
            "renewals_per_s": crate::round(renewals),
            "settlement_transactions_per_s": crate::round(batches),
            "rate_limit_transactions_per_s": crate::round(rate_tx),
            "database_transactions_per_s": crate::round(renewals + batches + rate_tx),
            "database_transactions_per_s_without_leases": 3 * args.rate,
            "steady_refused": steady.refused,
            "drain_budget_micros": budget,
            "drain_admitted": drained.admitted,
            "drain_refused": drained.refused,
            "drain_admitted_one_pool": pooled.admitted,
            "drain_charged_micros": drained.charged,
            "drain_charged_one_pool_micros": pooled.charged,
            "drain_refused_with_credit_elsewhere": drained.refused_with_credit_elsewhere,
            "drain_first_refusal_s": drained.first_refusal.map(|f| f.1),
            "drain_first_refusal_leased_elsewhere_micros": drained.first_refusal.map(|f| f.0),
            "drain_last_admission_s": drained.last_admission,
            "drain_left_micros": drained.left,
            "overspend_micros": (drained.charged - budget).max(0),
        })
    );
    Ok(())
}
